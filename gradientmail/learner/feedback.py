"""Error feedback for sparse deltas: what a learner's payloads did not carry, kept per
fragment and added to that fragment's next delta.

With a sparse `delta_dtype` (`wire.sparse`), the poster encodes x = delta + β·residual
(`carried`) and keeps x − sent (`left`) as the fragment's new residual, β the run's
`feedback_decay` (None: 1). With β = 1, over rounds the values sent plus the residual left
add up to the deltas trained; β < 1 (SparseLoCo's 0.95) lets what was left out for many
rounds fade instead of piling up into a stale step. The arithmetic is those two functions
and nothing else.

With a `feedback_momentum` μ the learner keeps the outer momentum itself, per fragment, on
its own deltas: m ← μ·m + delta, and compresses the Nesterov step delta + μ·m (plus the
residual) in place of the delta; the closer then takes a plain SGD step (outer_momentum
0). Without compression, and with every learner in every round at the same weight
(standard DiLoCo), that is the Nesterov outer step of the merged deltas exactly (the mean
of the learners' momenta is the momentum of the mean), but what compression leaves out is
no longer amplified 1/(1 − μ)-fold by a momentum downstream of it. The momentum is kept
beside the residual, under `MOMENTUM` + the tensor's name, and settled with it: a payload
that fails takes its share of both back out (exactly when it is its fragment's newest; to
float rounding when a later payload was encoded from it, the momentum then only to first
order, as its update is not additive).

A payload that is not merged (its upload failed, or the commit of its round left it
out) carried nothing: its steps go out again in the fragment's next delta (the anchor
did not move for them), so its own share of the residual, after − before, is taken back
out (`failed`). Taking back a share, rather than restoring the residual from before the
payload, is what keeps the sum right whatever the order: when a later payload of the
fragment was encoded before this one failed, the later payload's share stays and this
one's goes, and the residual is the one the fragment would have had without this payload.

The residual is a quantity of delta space, independent of θ: a commit's rebase leaves it
as it is, and so does a learner that rejoins the run at a newer commit with the residual
of a checkpoint (`load_state_dict`). Where the delta comes from a torch adapter
(`TorchAdapter.delta_tensors`), the residuals are float32 tensors on the parameters'
device, the arithmetic and the encoding (`wire.sparse_torch`) run there, and only the
payload's bytes cross to the host; from any other adapter (host bytes), they are float32
numpy arrays and `wire.sparse` encodes them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import numpy as np

from gradientmail.errors import ConfigError, GradientmailError
from gradientmail.wire.signs import shifted_seed
from gradientmail.wire.sparse import densify, sparsify, sparsify_sent
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["MOMENTUM", "STATE_VERSION", "ErrorFeedback", "Residuals", "carried", "join_states",
           "left", "split_state"]

#: The version of `Residuals.state_dict`'s layout.
STATE_VERSION = 1
#: The prefix of a fragment's momentum entries (`feedback_momentum`) beside its residual's.
MOMENTUM = "momentum/"

# A residual: a flat float32 numpy array, or a flat float32 torch tensor on the device.
_Arrays = dict[str, Any]
_A = TypeVar("_A")


def carried(delta: _A, residual: _A, decay: float = 1.0) -> _A:
    """What a payload encodes: `delta` plus `decay` × the `residual` carried in, added
    into `delta` (a flat float32 array the caller owns) and returned."""
    delta += residual if decay == 1.0 else decay * residual  # type: ignore[operator,assignment]
    return delta


def left(x: _A, positions: Any, sent: Any) -> _A:
    """What stays behind: `x` minus what the payload carries (`sent`, the values it
    decodes to at the flat `positions`), subtracted in `x` and returned."""
    x[positions] -= sent  # type: ignore[index]
    return x


class ErrorFeedback(Protocol):
    """What a learner's mailman, poster and runtime ask of its error feedback:
    `Residuals`, or for a sharded learner the view of its ranks' residuals that rank 0
    holds (`integration.sharded.RankResiduals`)."""

    def in_flight(self) -> dict[int, int]: ...

    def encode(self, round_: int, fragment: int, delta: Mapping[str, Any], density: float,
               decay: float = 1.0, fmt: str = "TOPK_F8", momentum: float = 0.0,
               offsets: Mapping[str, int] | None = None) -> dict[str, TensorBytes]: ...

    def failed(self, round_: int) -> None: ...

    def recorded(self, round_: int, participants: tuple[str, ...]) -> None: ...

    def swept(self, fragment: int, through: int, took_part: bool) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any], sizes: Mapping[str, int],
                        place: Callable[[str, Any], Any]) -> None: ...

    def check_fragments(self, plan: tuple[tuple[str, ...], ...]) -> None: ...


class Residuals:
    """Each fragment's residual, and for each round in flight the residual it replaced
    and the one it left.

    `encode` runs in the poster's worker thread (one at a time) while `failed` and
    `recorded` run on the communication thread's loop and `state_dict` on the training
    thread: a lock keeps each change whole, and `encode` holds it only to read and to
    store, not while it encodes. A residual array is never written once stored (every
    change makes new arrays), so `residual` and `state_dict` hand out the arrays
    themselves."""

    def __init__(self, learner: str) -> None:
        self._learner = learner
        self._kept: dict[int, _Arrays] = {}
        # round -> (fragment, the residual before its payload, the one after)
        self._pending: dict[int, tuple[int, _Arrays | None, _Arrays]] = {}
        self._lock = threading.Lock()

    def residual(self, fragment: int) -> Mapping[str, Any]:
        """`fragment`'s residual by tensor name, flat float32 (empty before its first
        sparse payload): numpy arrays, or torch tensors on the parameters' device."""
        with self._lock:
            kept = self._kept.get(fragment, {})
            return {n: a for n, a in kept.items() if not n.startswith(MOMENTUM)}

    def momentum(self, fragment: int) -> Mapping[str, Any]:
        """`fragment`'s momentum by tensor name (empty without `feedback_momentum`)."""
        with self._lock:
            kept = self._kept.get(fragment, {})
            return {n[len(MOMENTUM):]: a for n, a in kept.items() if n.startswith(MOMENTUM)}

    def in_flight(self) -> dict[int, int]:
        """The rounds whose payload is not settled yet, with their fragments."""
        with self._lock:
            return {r: f for r, (f, _, _) in self._pending.items()}

    def encode(self, round_: int, fragment: int, delta: Mapping[str, Any],
               density: float, decay: float = 1.0, fmt: str = "TOPK_F8",
               momentum: float = 0.0, offsets: Mapping[str, int] | None = None
               ) -> dict[str, TensorBytes]:
        """The sparse entries (`fmt`) of `delta` (with `momentum` μ > 0: of the Nesterov
        step delta + μ·m, m ← μ·m + delta) plus `decay` × the fragment's residual; the rest
        becomes the fragment's residual, the state before kept until round `round_` is
        settled. SIGN1 is seeded with `round_`, so a round's learners send the same
        elements; `offsets` (a sharded learner's rank: the flat element of the full
        tensor its rows of each name start at) shifts the seed by it
        (`signs.shifted_seed`), so its rows select the same elements as a whole tensor's.

        `delta` maps names to F32 `TensorBytes` (host), or to float32 torch tensors that
        `encode` may write (new ones: `TorchAdapter.delta_tensors`), which it encodes on
        their device. A round encoded again (after its earlier attempt failed to upload)
        first settles the earlier attempt as failed."""
        with self._lock:
            if round_ in self._pending:
                self._fail(round_)
            before = self._kept.get(fragment)
        # Encoded without the lock: `recorded` runs on the communication thread's loop,
        # which must not wait for a fragment's encoding (a second or more on a CPU).
        out: dict[str, TensorBytes] = {}
        after: _Arrays = {}
        for name, value in delta.items():
            x = _flat(value, fmt)
            if momentum:
                m_prev = None if before is None else before.get(MOMENTUM + name)
                m = x if m_prev is None else momentum * _like(m_prev, x) + x
                after[MOMENTUM + name] = m
                x = x + momentum * m
            if before is not None and name in before:
                x = carried(x, _like(before[name], x), decay)
            seed = round_ if not offsets else shifted_seed(round_, offsets.get(name, 0))
            entries, positions, sent = _sparsify(name, x, density, fmt, seed)
            after[name] = left(x, positions, sent)
            out.update(entries)
        with self._lock:
            now = self._kept.get(fragment)
            if now is not before:
                # An earlier payload of the fragment was settled meanwhile (a failure took
                # its share out): this payload's share goes on top of what is kept now.
                after = {n: a - _like(before[n], a) if before is not None and n in before
                         else a for n, a in after.items()}
                if now is not None:
                    after = {n: a + _like(now[n], a) if n in now else a
                             for n, a in after.items()}
                before = now
            self._kept[fragment] = after
            self._pending[round_] = (fragment, before, after)
        return out

    def failed(self, round_: int) -> None:
        """Round `round_`'s payload was not merged: its share of its fragment's residual
        (the residual after it minus the one before it) is taken back out. Unknown or
        settled rounds change nothing."""
        with self._lock:
            self._fail(round_)

    def recorded(self, round_: int, participants: tuple[str, ...]) -> None:
        """Round `round_` was committed with `participants`: the payload stands if this
        learner is one, else it was dropped (`failed`)."""
        with self._lock:
            if self._learner in participants:
                self._pending.pop(round_, None)
            else:
                self._fail(round_)

    def swept(self, fragment: int, through: int, took_part: bool) -> None:
        """The records of `fragment`'s rounds up to `through` are gone before this learner
        read them (a newer commit replaced them, and the sweep deleted them): its rounds
        of the fragment still in flight up to there are settled as the training thread's
        rebase treats their steps when it applies the fragment's commit `through`: in
        that commit when the learner took part in it (`took_part`), sent again when
        not."""
        with self._lock:
            for r in sorted(r for r, (f, _, _) in self._pending.items()
                            if f == fragment and r <= through):
                if took_part:
                    del self._pending[r]
                else:
                    self._fail(r)

    def _fail(self, round_: int) -> None:
        entry = self._pending.pop(round_, None)
        if entry is None:
            return
        fragment, before, after = entry
        kept = self._kept.get(fragment)
        if kept is after:  # the newest payload of its fragment: exactly the one before
            if before is None:
                del self._kept[fragment]
            else:
                self._kept[fragment] = before
            return
        assert kept is not None  # a later payload of the fragment kept its residual
        # A later payload was encoded since (from this one's residual): take this one's
        # share back out of the newest residual.
        self._kept[fragment] = {
            n: v - _like(after[n], v) + _like(before[n], v) if before is not None and n in before
            else v - _like(after[n], v)
            for n, v in kept.items()
        }

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What survives a checkpoint, as plain containers of the residual arrays
        themselves (torch tensors on their device, or numpy arrays; not copied, never
        written): ``{"version": 1, "residuals": {fragment: {name: array}},
        "in_flight": {round: {"fragment": f, "before": {name: array} | None,
        "after": {name: array}}}}``. A round in flight is settled after a resume by its
        record (`recorded`), as it would have been without the restart."""
        with self._lock:
            return {
                "version": STATE_VERSION,
                "residuals": {f: dict(arrays) for f, arrays in self._kept.items()},
                "in_flight": {
                    r: {"fragment": f, "before": None if b is None else dict(b),
                        "after": dict(a)}
                    for r, (f, b, a) in self._pending.items()
                },
            }

    def load_state_dict(self, state: Mapping[str, Any], sizes: Mapping[str, int],
                        place: Callable[[str, Any], Any]) -> None:
        """Replace the residuals with those of `state` (from `state_dict`), each checked
        against `sizes` (elements by tensor name: the model's) and moved where this
        learner keeps them by `place(name, array)`. `ConfigError` naming the mismatch and
        the fix; nothing is replaced then.

        Valid in a learner that rejoined the run at a newer commit than the one it
        checkpointed at: a residual is a quantity of delta space, not of θ (what it holds
        was trained and not yet sent, whatever the commits since)."""
        if not isinstance(state, Mapping) or set(state) != {"version", "residuals",
                                                            "in_flight"}:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ConfigError(
                f"not a Residuals state: keys {got}, expected ['in_flight', 'residuals', "
                "'version']; pass what Residuals.state_dict() (Learner.state_dict()"
                "['error_feedback']) returned")
        if state["version"] != STATE_VERSION:
            raise ConfigError(
                f"error feedback state version {state['version']!r} is not "
                f"{STATE_VERSION}: written by another gradientmail version; resume with "
                "that version, or start without the checkpoint's error feedback")

        # Arrays saved once and referenced twice (a residual and the `after` of the round
        # that left it) come back as one object: placed once, so kept once.
        placed: dict[int, Any] = {}

        def arrays(where: str, values: Any) -> _Arrays:
            if not isinstance(values, Mapping):
                raise ConfigError(f"{where} is {type(values).__name__}, not a mapping of "
                                  "tensor names to arrays")
            out: _Arrays = {}
            for name, value in values.items():
                tensor = name[len(MOMENTUM):] if name.startswith(MOMENTUM) else name
                if tensor not in sizes:
                    raise ConfigError(
                        f"{where} has a residual for {name!r}, which is not a synced "
                        "parameter of this model; resume with the model the checkpoint "
                        "was written with, or start without its error feedback")
                got = int(np.prod(getattr(value, "shape", (-1,))))
                if got != sizes[tensor]:
                    raise ConfigError(
                        f"{where}: the residual of {name!r} has {got} elements, the "
                        f"parameter {sizes[tensor]}; resume with the model the checkpoint "
                        "was written with, or start without its error feedback")
                if id(value) not in placed:
                    placed[id(value)] = place(tensor, value)
                out[name] = placed[id(value)]
            return out

        kept = {int(f): arrays(f"the residuals of fragment {f}", v)
                for f, v in state["residuals"].items()}
        pending: dict[int, tuple[int, _Arrays | None, _Arrays]] = {}
        for r, entry in state["in_flight"].items():
            if not isinstance(entry, Mapping) or set(entry) != {"fragment", "before", "after"}:
                raise ConfigError(f"round {r} in flight: expected keys ['after', 'before', "
                                  "'fragment']")
            f = int(entry["fragment"])
            after = arrays(f"round {r}'s residual", entry["after"])
            # The newest payload's `after` is its fragment's residual: the same mapping,
            # so that its failure restores `before` exactly (`_fail`).
            mine = kept.get(f)
            if mine is not None and mine.keys() == after.keys() \
                    and all(mine[n] is after[n] for n in after):
                after = mine
            before = (None if entry["before"] is None
                      else arrays(f"round {r}'s residual before", entry["before"]))
            pending[int(r)] = (f, before, after)
        with self._lock:
            self._kept, self._pending = kept, pending

    def check_fragments(self, plan: tuple[tuple[str, ...], ...]) -> None:
        """`ConfigError` unless every residual belongs to the fragment it is kept for in
        `plan` (the run's fragments, known once joined)."""
        with self._lock:
            for f, arrays in sorted(self._kept.items()):
                if not 0 <= f < len(plan):
                    raise ConfigError(
                        f"the checkpoint holds residuals of fragment {f}; this run has "
                        f"{len(plan)} fragments. Resume into the run (and fragments=) the "
                        "checkpoint was written for, or start without its error feedback")
                extra = sorted({n[len(MOMENTUM):] if n.startswith(MOMENTUM) else n
                                for n in arrays} - set(plan[f]))
                if extra:
                    raise ConfigError(
                        f"the checkpoint holds residuals of {extra} in fragment {f}, which "
                        f"this run puts elsewhere; resume into the run the checkpoint was "
                        "written for, or start without its error feedback")


def _map_arrays(state: Mapping[str, Any], fn: Callable[[str, Any], Any]) -> dict[str, Any]:
    """`state` (`Residuals.state_dict`'s layout) with every array replaced by
    fn(name, array), None dropping the entry; an array referenced twice (a residual and
    the `after` of the round that left it) maps once, so it stays one."""
    done: dict[int, Any] = {}

    def arrays(values: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for name, value in values.items():
            if id(value) not in done:
                done[id(value)] = fn(name[len(MOMENTUM):] if name.startswith(MOMENTUM)
                                     else name, value)
            if done[id(value)] is not None:
                out[name] = done[id(value)]
        return out

    return {
        "version": state["version"],
        "residuals": {f: arrays(v) for f, v in state["residuals"].items()},
        "in_flight": {r: {"fragment": e["fragment"],
                          "before": None if e["before"] is None else arrays(e["before"]),
                          "after": arrays(e["after"])}
                      for r, e in state["in_flight"].items()},
    }


def split_state(state: Mapping[str, Any], spans: Mapping[str, tuple[int, int]],
                place: Callable[[str, Any], Any]) -> dict[str, Any]:
    """One rank's share of a full error feedback state (`Residuals.state_dict`'s layout,
    checked): each array cut to the flat elements [start, stop) `spans` gives its tensor
    (the rank's owned rows) and placed by `place(name, piece)`; tensors without a span
    (a 0-d parameter another rank mails) left out."""
    def cut(name: str, value: Any) -> Any:
        if name not in spans:
            return None
        a, b = spans[name]
        return place(name, _host(value)[a:b])

    return _map_arrays(state, cut)


def join_states(states: list[tuple[Mapping[str, tuple[int, int]], Mapping[str, Any]]],
                sizes: Mapping[str, int]) -> dict[str, Any]:
    """The full error feedback state of a learner whose ranks each keep their own rows:
    `states` holds each rank's (spans, `Residuals.state_dict()`), spans the flat elements
    [start, stop) of each tensor its arrays hold; every array becomes a flat float32 numpy
    array of the whole tensor (`sizes` elements), its rows joined in span order. The
    layout is an unsharded learner's, so it resumes at any world size (`split_state`).
    `GradientmailError` when the ranks disagree on the fragments or rounds they hold or
    their rows do not tile a tensor: they apply the same settlements in the same order,
    so that is a bug, not a peer's doing."""
    if not states:
        return {"version": STATE_VERSION, "residuals": {}, "in_flight": {}}
    keys = {(tuple(sorted(s["residuals"])), tuple(sorted(s["in_flight"]))) for _, s in states}
    if len(keys) != 1:
        raise GradientmailError(f"the ranks' error feedback disagrees: fragments and rounds "
                                f"{sorted(keys)}")
    joined: dict[tuple[int, ...], Any] = {}

    def join(where: str, per_rank: list[tuple[Mapping[str, tuple[int, int]], Any]]) -> Any:
        memo = tuple(id(v) for _, v in per_rank)
        if memo not in joined:
            name = where[len(MOMENTUM):] if where.startswith(MOMENTUM) else where
            cuts = sorted(((spans[name], _host(v)) for spans, v in per_rank),
                          key=lambda c: c[0])
            at = 0
            for (a, b), v in cuts:
                if a != at or v.size != b - a:
                    raise GradientmailError(f"the ranks' residuals of {where!r} do not tile "
                                            f"it: spans {[c[0] for c in cuts]}")
                at = b
            if at != sizes[name]:
                raise GradientmailError(f"the ranks' residuals of {where!r} hold {at} of its "
                                        f"{sizes[name]} elements")
            joined[memo] = np.concatenate([v for _, v in cuts]) if cuts else np.zeros(0, _F32)
        return joined[memo]

    def arrays(got: list[tuple[Mapping[str, tuple[int, int]], Mapping[str, Any] | None]]
               ) -> dict[str, Any] | None:
        if all(g is None for _, g in got):
            return None
        names = sorted({n for _, g in got if g is not None for n in g})
        return {n: join(n, [(spans, g[n]) for spans, g in got if g is not None and n in g])
                for n in names}

    first = states[0][1]
    return {
        "version": STATE_VERSION,
        "residuals": {f: arrays([(sp, s["residuals"][f]) for sp, s in states])
                      for f in first["residuals"]},
        "in_flight": {r: {"fragment": first["in_flight"][r]["fragment"],
                          "before": arrays([(sp, s["in_flight"][r]["before"])
                                            for sp, s in states]),
                          "after": arrays([(sp, s["in_flight"][r]["after"])
                                           for sp, s in states])}
                      for r in first["in_flight"]},
    }


_F32 = np.float32


def _host(value: Any) -> Any:
    """A residual as a flat float32 numpy array (a torch tensor copied to the host)."""
    if isinstance(value, np.ndarray):
        return value.reshape(-1).astype(_F32, copy=False)
    import torch

    return value.detach().reshape(-1).to("cpu", dtype=torch.float32).numpy()


def _like(value: Any, ref: Any) -> Any:
    """`value` (a residual) where `ref` is: a numpy array for a numpy `ref`, else a tensor
    on `ref`'s device. A restored residual is a tensor on the model's device
    (`Learner.load_state_dict`), while TOPK_Q2 and SIGN1 encode on the host: mixing the
    two in one expression would fail (numpy and torch do not add) or land on the wrong
    device."""
    if isinstance(ref, np.ndarray):
        return value if isinstance(value, np.ndarray) else _host(value)
    import torch

    if isinstance(value, np.ndarray):
        return torch.from_numpy(value).to(ref.device)
    return value if value.device == ref.device else value.to(ref.device)


def _flat(value: Any, fmt: str = "TOPK_F8") -> Any:
    """A delta as a flat float32 array the residual arithmetic may write: on the tensor's
    device for TOPK_F8 (which has a torch encoder), on the host for the other formats."""
    if isinstance(value, TensorBytes):
        return value.to_numpy().reshape(-1).astype(np.float32)  # a copy
    import torch

    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"a delta is TensorBytes or a torch tensor, not {type(value).__name__}")
    flat = value.detach().reshape(-1).to(torch.float32)
    return flat if fmt == "TOPK_F8" else flat.cpu().numpy()


def _sparsify(name: str, x: Any, density: float, fmt: str = "TOPK_F8",
              seed: int = 0) -> tuple[dict[str, TensorBytes], Any, Any]:
    """`fmt`'s entries of the flat float32 `x`, the positions they carry and the values
    there. TOPK_F8: `sparsify_sent`, on `x`'s device (a torch tensor on a GPU) or the host
    (numpy, also for a torch tensor on the CPU: a view, no copy). The other formats
    (numpy `x`): their entries decoded again, every position."""
    if fmt != "TOPK_F8":
        view = x.view()
        view.flags.writeable = False
        entries = sparsify(name, TensorBytes("F32", (x.size,), view), density, fmt, seed=seed)
        sent = densify(entries, name, (x.size,), fmt).to_numpy().reshape(-1)
        return entries, slice(None), sent
    if isinstance(x, np.ndarray):
        view = x.view()
        view.flags.writeable = False  # read by the entries' builder only
        return sparsify_sent(name, TensorBytes("F32", (x.size,), view), density)
    if x.device.type == "cpu":  # numpy's encoder beats torch's on a CPU (benchmarks/codec.py)
        import torch

        entries, positions, sent = _sparsify(name, x.numpy(), density)
        return entries, torch.from_numpy(positions), torch.from_numpy(sent)
    from gradientmail.wire.sparse_torch import sparsify_tensor

    return sparsify_tensor(name, x, density)
