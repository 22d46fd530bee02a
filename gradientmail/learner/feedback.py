"""Error feedback for sparse deltas: what a learner's payloads did not carry, kept per
fragment and added to that fragment's next delta.

With a sparse `delta_dtype` (`wire.sparse`), the poster encodes `delta + β·residual` and
keeps `delta + β·residual − densify(sent)` as the fragment's new residual, β the run's
`feedback_decay` (None: 1). With β = 1, over rounds the values sent plus the residual left
add up to the deltas trained; β < 1 (SparseLoCo's 0.95) lets what was left out for many
rounds fade instead of piling up into a stale step.

With a `feedback_momentum` μ the learner keeps the outer momentum itself, per fragment, on
its own deltas: m ← μ·m + delta, and compresses the Nesterov step delta + μ·m (plus the
residual) in place of the delta; the closer then takes a plain SGD step (outer_momentum
0). Without compression, and with every learner in every round at the same weight
(standard DiLoCo), that is the Nesterov outer step of the merged deltas exactly (the mean
of the learners' momenta is the momentum of the mean), but what compression leaves
out is no longer amplified 1/(1 − μ)-fold by a momentum downstream of it. A payload that
is not merged (its upload failed, or the commit of its round left it out) carried nothing:
its steps go out again in the fragment's next delta (the anchor did not move for them), so
the residual (and momentum) returns to what it was before that payload. The residual is
a quantity of delta space, independent of θ, so a commit's rebase leaves it as it is.

Held in host memory as float32, one array per tensor of each fragment sent so far (two
with `feedback_momentum`). Not
saved anywhere: a learner that restarts joins afresh and starts with no residual (its
untrained-away residual is lost, as its unsent training is).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from gradientmail.wire.sparse import densify, sparsify
from gradientmail.wire.tensor_bytes import TensorBytes, handed_over

__all__ = ["Residuals"]

_Arrays = dict[str, npt.NDArray[np.float32]]
# A fragment's state: its residual and its momentum (empty without feedback_momentum).
_State = tuple[_Arrays, _Arrays]


class Residuals:
    """Each fragment's residual, and for each round in flight the residual it replaced.

    `encode` runs in the poster's worker thread while `failed` and `recorded` run on the
    communication thread's loop: a lock keeps each call whole."""

    def __init__(self, learner: str) -> None:
        self._learner = learner
        self._kept: dict[int, _State] = {}
        # round -> (fragment, the state before its payload, the one after)
        self._pending: dict[int, tuple[int, _State | None, _State]] = {}
        self._lock = threading.Lock()

    def residual(self, fragment: int) -> Mapping[str, npt.NDArray[np.float32]]:
        """`fragment`'s residual by tensor name (empty before its first sparse payload)."""
        with self._lock:
            return dict(self._kept.get(fragment, ({}, {}))[0])

    def momentum(self, fragment: int) -> Mapping[str, npt.NDArray[np.float32]]:
        """`fragment`'s momentum by tensor name (empty without `feedback_momentum`)."""
        with self._lock:
            return dict(self._kept.get(fragment, ({}, {}))[1])

    def encode(self, round_: int, fragment: int, delta: Mapping[str, TensorBytes],
               density: float, decay: float = 1.0, fmt: str = "TOPK_F8",
               momentum: float = 0.0) -> dict[str, TensorBytes]:
        """The sparse entries (`fmt`) of `delta` (with `momentum` μ > 0: of the Nesterov
        step delta + μ·m, m ← μ·m + delta) plus `decay` × the fragment's residual; the rest
        becomes the fragment's residual, the state before kept until round `round_` is
        settled. SIGN1 is seeded with `round_`, so a round's learners send the same
        elements."""
        with self._lock:
            before = self._kept.get(fragment)
            res, mom = before if before is not None else ({}, {})
            out: dict[str, TensorBytes] = {}
            after: _State = ({}, {})
            mu, beta = np.float32(momentum), np.float32(decay)
            for name, tensor in delta.items():
                x = tensor.to_numpy().reshape(-1).astype(np.float32)
                if momentum:
                    m = x if name not in mom else mu * mom[name] + x
                    after[1][name] = m
                    x = x + mu * m
                if name in res:
                    x += res[name] if decay == 1.0 else beta * res[name]
                entries = sparsify(name, TensorBytes("F32", tensor.shape, handed_over(x)),
                                   density, fmt, seed=round_)
                sent = densify(entries, name, tensor.shape, fmt).to_numpy().reshape(-1)
                after[0][name] = x - sent
                out.update(entries)
            self._kept[fragment] = after
            self._pending[round_] = (fragment, before, after)
            return out

    def failed(self, round_: int) -> None:
        """Round `round_`'s payload was not merged: its fragment's residual returns to the
        one before it (unless a later payload of the fragment replaced it since)."""
        with self._lock:
            entry = self._pending.pop(round_, None)
            if entry is None:
                return
            fragment, before, after = entry
            if self._kept.get(fragment) is not after:
                return
            if before is None:
                del self._kept[fragment]
            else:
                self._kept[fragment] = before

    def recorded(self, round_: int, participants: tuple[str, ...]) -> None:
        """Round `round_` was committed with `participants`: the payload stands if this
        learner is one, else it was dropped (`failed`)."""
        if self._learner in participants:
            with self._lock:
                self._pending.pop(round_, None)
        else:
            self.failed(round_)
