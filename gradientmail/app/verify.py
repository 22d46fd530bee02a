"""`gradientmail verify`: re-derive every commit whose inputs are still stored, and compare.

For each round r from `start` on, the verifier reads the commit record (checking its seal
when the run is authenticated), takes the fragment's state before r (its own result for
the previous round of the fragment, or the run's newest checkpoint before it and the
steps since, as any reader does), and runs the closer's own code path
(`gradientmail.syncer.merging`) on the round's recorded contributions: the participants and the
dropped learners, read from the store with their records' seals and their payloads'
digests checked. What it derives is compared with what was committed: the participants
and their weights, the drops and their reasons, the mean cosine, `all_final`, the merged
step (format, rule, every entry's bytes) and the theta digest it gives, and at checkpoints
the theta and outer state, and any quantized update — byte for byte, tensor by tensor.

A round is *verified*, *failed* (each `Mismatch` names the round, the fragment, what
differs and the tensor), *swept* (a contribution it merged, or the state before it, is
gone: a run keeps them only with `DiLoCo.keep_rounds`) or *held* (a participant's delta
was merged by its own closer from memory and never uploaded: nothing to re-derive from).
Drops for reasons of the moment (a payload unreadable or swept when the round closed)
are taken on trust, and counted.

A swept or held round's merge cannot be re-derived, but its commit can still be checked
against the chain every reader walks (`run.replica.Replica`, what `load_committed` uses):
its payloads' digests against its record, and its step applied to the fragment's state
before it (from the newest checkpoint and the steps since) against the theta digest the
closer recorded, and at a checkpoint the stored theta and outer state against that chain.
Its verdict's `chain` says "checked", or "swept" when its payloads are gone too (a round
before the fragment's newest checkpoint, in a run that sweeps); a broken chain fails the
round. `compare_round`, `compare_chain` and `first_difference` are pure; `verify_run`
does the reading; what it found is a `gradientmail.app.verify_report.Report`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gradientmail.algorithms.base import Algorithm, FragmentState, RoundResult
from gradientmail.algorithms.registry import algorithm_from_json
from gradientmail.app.verify_report import (
    CHECKED,
    FAILED,
    HELD,
    SWEPT,
    VERIFIED,
    Mismatch,
    Report,
    RoundVerdict,
)
from gradientmail.backends.base import Backend
from gradientmail.backends.numpy_backend import NumpyBackend
from gradientmail.errors import (
    CorruptPayload,
    GradientmailError,
    LocalProtocolError,
    ProtocolError,
)
from gradientmail.run.bounds import check_delta, delta_bound, payload_bound
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import Replica, require_manifest, theta_digest
from gradientmail.syncer.merging import merge_round, screen_round
from gradientmail.wire import compression as codec
from gradientmail.wire.records import Dropped, Manifest, RoundRecord, SnapshotRecord
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.serialization import Schema
from gradientmail.wire.sharded_blocks import ranged_problem
from gradientmail.wire.sharded_parts import Part, pieces_of, rows_in
from gradientmail.wire.sharded_pieces import DeltaTensor
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = [
    "TRUSTED_DROPS",
    "Derived",
    "Verifier",
    "compare_chain",
    "compare_round",
    "first_difference",
    "verify_run",
]

#: Drop reasons that depend on the moment a round closed (a store error, a payload gone),
#: not on the stored inputs: a verifier cannot re-derive them and takes them on trust.
TRUSTED_DROPS = ("unreadable:", "payload swept")

# -- the comparison (pure) --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Derived:
    """A round as its inputs give it: the merge, and the drops (learner -> reason) of the
    learners `judged`: those whose stored contribution the merge or drop was re-derived
    from (a drop taken on trust, or of a contribution swept since, is not judged)."""

    result: RoundResult
    dropped: Mapping[str, str]
    judged: frozenset[str]
    names: tuple[str, ...]


def first_difference(
    stored: Mapping[str, TensorBytes], derived: Mapping[str, TensorBytes]
) -> tuple[str, str] | None:
    """The first entry (in `derived`'s order) where `stored` differs, and how; None when
    both hold the same entries with the same dtype, shape and bytes."""
    for name, want in derived.items():
        got = stored.get(name)
        if got is None:
            return name, "missing from the stored payload"
        if (got.dtype, got.shape) != (want.dtype, want.shape):
            return name, (f"stored {got.dtype}{list(got.shape)}, re-derived "
                          f"{want.dtype}{list(want.shape)}")
        a, b = _codes(got), _codes(want)
        if not np.array_equal(a, b):
            diff = np.flatnonzero(a != b)
            i = int(diff[0])
            at = list(np.unravel_index(i, want.shape)) if want.shape else []
            return name, (f"{diff.size} of {a.size} elements differ; the first, "
                          f"[{', '.join(str(int(k)) for k in at)}], is stored "
                          f"{_value(got, i)}, re-derived {_value(want, i)}")
    extra = sorted(set(stored) - set(derived))
    if extra:
        return extra[0], "in the stored payload, not in the re-derived one"
    return None


def _codes(t: TensorBytes) -> np.ndarray[Any, Any]:
    """Each element's bit pattern, as unsigned integers (F4: one code per element)."""
    arr = t.to_numpy().reshape(-1)
    return arr.view(f"u{arr.dtype.itemsize}")


def _value(t: TensorBytes, i: int) -> str:
    arr = t.to_numpy().reshape(-1)
    code = int(arr.view(f"u{arr.dtype.itemsize}")[i])
    try:
        return f"{float(arr[i]):.9g} (0x{code:0{2 * arr.dtype.itemsize}x})"
    except (TypeError, ValueError):
        return f"0x{code:x}"


@dataclasses.dataclass(frozen=True)
class Stored:
    """A commit's payloads as read back: entries by kind ("step", "theta", "outer",
    "update"; absent when the record has none or they are unreadable), what was
    wrong with reading each (a digest that differs from the record, undecodable bytes,
    gone), and the kinds that are `gone` (swept)."""

    entries: Mapping[str, Mapping[str, TensorBytes]]
    problems: Mapping[str, str]
    gone: frozenset[str] = frozenset()


def compare_round(rec: RoundRecord, alg: Algorithm, derived: Derived,
                  stored: Stored) -> list[Mismatch]:
    """Every way `rec` and its stored payloads differ from what the inputs give."""
    out: list[Mismatch] = []
    r, p = rec.round, rec.fragment

    def miss(what: str, detail: str, tensor: str | None = None) -> None:
        out.append(Mismatch(r, p, what, tensor, detail))

    res = derived.result
    want = [(q.learner, q.local_step, q.steps, q.tokens, q.weight) for q in res.participants]
    got = [(q.learner, q.local_step, q.steps, q.tokens, q.weight) for q in rec.participants]
    if want != got:
        miss("participants", _participants_diff(got, want))
    recorded = {d.learner: d.reason for d in rec.dropped}
    for learner in sorted(derived.judged):
        a, b = recorded.get(learner), derived.dropped.get(learner)
        if a != b:
            miss("dropped", f"learner {learner!r}: recorded "
                 f"{'merged' if a is None else repr(a)}, re-derived "
                 f"{'merged' if b is None else repr(b)}")
    if rec.mean_cosine != res.mean_cosine:
        miss("mean_cosine", f"recorded {rec.mean_cosine!r}, re-derived {res.mean_cosine!r}")
    if rec.all_final != res.all_final:
        miss("all_final", f"recorded {rec.all_final}, re-derived {res.all_final}")
    state = res.state
    if rec.version != state.version:
        miss("version", f"recorded {rec.version}, re-derived {state.version}")
    # The re-derived theta's digest, which a step and an update both record (one SHA-256).
    digest = theta_digest(state.theta, derived.names) if rec.step or rec.update else ""
    if (rec.step is None) != (res.step is None):
        miss("step", f"the record {'has no' if rec.step is None else 'has a'} step; the run's "
             f"algorithm {'replicates' if alg.replicated else 'does not replicate'} the "
             "outer step")
    elif rec.step is not None and res.step is not None:
        if (rec.step.format, rec.step.rule) != (res.step_format, res.rule):
            miss("step", f"recorded format {rec.step.format} rule {rec.step.rule}, re-derived "
                 f"format {res.step_format} rule {res.rule}")
        _payload(miss, "step", stored, res.step)
        if digest != rec.step.theta_sha256:
            miss("theta digest", f"recorded {rec.step.theta_sha256[:16]}…, the re-derived "
                 f"theta gives {digest[:16]}…")
    checkpoint = not alg.replicated or alg.checkpoint_at(state.version)
    if rec.checkpoint != checkpoint:
        miss("checkpoint", f"version {state.version} {'is' if checkpoint else 'is not'} a "
             f"checkpoint of the run, and the record {'has' if rec.checkpoint else 'has no'} "
             "theta and outer state")
    elif rec.checkpoint:
        _payload(miss, "theta", stored, state.theta)
        _payload(miss, "outer", stored, state.outer())
    if (rec.update is None) != (res.update is None):
        miss("update", f"the record {'has no' if rec.update is None else 'has an'} update; "
             f"the re-derived commit {'has none' if res.update is None else 'has one'}")
    elif rec.update is not None and res.update is not None:
        if rec.update.format != alg.commit_dtype:
            miss("update", f"recorded format {rec.update.format}, the run's commit_dtype is "
                 f"{alg.commit_dtype}")
        _payload(miss, "update", stored, res.update)
        if digest != rec.update.theta_sha256:
            miss("update", f"its theta digest is {rec.update.theta_sha256[:16]}…, the "
                 f"re-derived theta gives {digest[:16]}…")
    return out


def compare_chain(rec: RoundRecord, state: FragmentState | None, stored: Stored,
                  names: Sequence[str]) -> list[Mismatch]:
    """Every way a commit whose merge cannot be re-derived differs from what its record
    and the chain before it say: a stored payload (not swept) whose bytes are not its
    record's, and, given the `state` the chain of steps reaches at its version (None when
    not reached), a theta whose digest is not the one its step or update records, or a
    checkpoint's theta and outer state that are not the chain's."""
    out: list[Mismatch] = []
    r, p = rec.round, rec.fragment

    def miss(what: str, detail: str, tensor: str | None = None) -> None:
        out.append(Mismatch(r, p, what, tensor, detail))

    for kind, problem in sorted(stored.problems.items()):
        if kind not in stored.gone:
            miss(kind, problem)
    if state is None or out:
        return out
    digest = theta_digest(state.theta, names)
    if rec.step is not None and digest != rec.step.theta_sha256:
        miss("theta digest", f"recorded {rec.step.theta_sha256[:16]}…, the chain's theta "
             f"at version {state.version} gives {digest[:16]}…")
    if rec.update is not None and digest != rec.update.theta_sha256:
        miss("update", f"its theta digest is {rec.update.theta_sha256[:16]}…, the chain's "
             f"theta at version {state.version} gives {digest[:16]}…")
    if rec.checkpoint:
        for kind, want in (("theta", state.theta), ("outer", state.outer())):
            if kind in stored.entries:
                _payload(miss, kind, Stored({kind: stored.entries[kind]}, {}), want)
    return out


def _participants_diff(got: list[tuple[Any, ...]], want: list[tuple[Any, ...]]) -> str:
    fields = ("local_step", "steps", "tokens", "weight")
    if [g[0] for g in got] != [w[0] for w in want]:
        return (f"recorded {[g[0] for g in got]}, re-derived {[w[0] for w in want]}")
    for g, w in zip(got, want, strict=True):
        for i, field in enumerate(fields, 1):
            if g[i] != w[i]:
                return f"learner {g[0]!r}: recorded {field} {g[i]!r}, re-derived {w[i]!r}"
    return "differ"  # pragma: no cover - unreachable: the lists differ somewhere above


def _payload(miss: Any, kind: str, stored: Stored, derived: Mapping[str, TensorBytes]) -> None:
    problem = stored.problems.get(kind)
    entries = stored.entries.get(kind)
    diff = None if entries is None else first_difference(entries, derived)
    if problem is None and diff is None:
        return
    if diff is None:
        miss(kind, str(problem))
    else:
        tensor, how = diff
        miss(kind, how if problem is None else f"{problem}; {how}", tensor)


# -- reading the run ---------------------------------------------------------------------


class _Swept(Exception):
    """A merged contribution's payload is gone (not a GradientmailError: the shared
    screening must not turn it into a drop)."""


async def _read(ex: Exchange, ref: PayloadRef,
                bound: int) -> tuple[dict[str, TensorBytes] | None, str | None, int]:
    """A payload decoded even when its bytes differ from the record's digest (so the
    comparison can name the tensor): (entries or None when gone, what is wrong with it,
    bytes read). `CorruptPayload` when it cannot be decoded."""
    tensors, _, problem, n = await _read_with_metadata(ex, ref, bound)
    return tensors, problem, n


async def _read_with_metadata(
    ex: Exchange, ref: PayloadRef, bound: int
) -> tuple[dict[str, TensorBytes] | None, dict[str, str], str | None, int]:
    """`_read`, with the payload's metadata (a part's rows)."""
    if ref.size > bound:
        raise CorruptPayload(f"payload {ref.key!r} is declared {ref.size} bytes, over the "
                             f"bound of {bound} bytes for what it should hold")
    blob = await ex.mailbox.get(ex.prefix + ref.key)
    if blob is None:
        return None, {}, None, 0
    problem = None
    digest = await asyncio.to_thread(lambda: hashlib.sha256(blob).hexdigest())
    if len(blob) != ref.size or digest != ref.sha256:
        problem = (f"payload {ref.key!r} is {len(blob)} bytes with SHA-256 {digest[:16]}…, "
                   f"its record says {ref.size} bytes, {ref.sha256[:16]}…: it was changed "
                   "after the record was written")
    elif ref.header_sha256 is not None:
        # The bytes are the record's; would a sharded learner's ranged reads accept them?
        problem = await asyncio.to_thread(ranged_problem, blob, key=ref.key,
                                          header_sha256=ref.header_sha256)
    tensors, meta = codec.decode_with_metadata(blob, codec.compression_of(ref.key),
                                               key=ref.key, max_bytes=max(bound, len(blob)))
    return tensors, meta, problem, len(blob)


async def _read_parts(
    ex: Exchange, snap: SnapshotRecord, schema: Schema, names: list[str], bound: int
) -> tuple[dict[str, DeltaTensor] | None, str | None, int]:
    """`_read` of a delta made of parts: each part read, its problems joined, the rows
    left in their pieces as a closer leaves them (`parts.pieces_of`)."""
    parts: list[Part] = []
    problems, total = [], 0
    for ref in snap.parts:
        tensors, meta, problem, n = await _read_with_metadata(ex, ref, bound)
        total += n
        if tensors is None:
            return None, None, total
        if problem is not None:
            problems.append(problem)
        parts.append((ref.key, tensors, rows_in(meta, ref.key)))
    return pieces_of(parts, schema, names, snap.delta_format), "; ".join(problems) or None, total


class Verifier:
    """Verifies the rounds of one run in order, holding each fragment's state from one
    round to its next (`round(r)`), so a run can be audited while it trains: call it for
    each new record. `verify_run` is the whole run at once."""

    def __init__(self, ex: Exchange, manifest: Manifest,
                 backend: Backend | None = None) -> None:
        self.ex = ex
        self.manifest = manifest
        self.alg = algorithm_from_json(dict(manifest.algorithm))
        self.schedule = self.alg.schedule_for(len(manifest.plan))
        self.backend = backend if backend is not None else NumpyBackend()
        # Each fragment's state as the run has it: from the newest checkpoint and the
        # steps since, then round by round from this verifier's own results.
        self.replica = Replica(ex, manifest, self.alg)
        self.records: dict[int, RoundRecord] = {}

    async def previous(self, r: int) -> RoundRecord | None:
        """The record of the fragment's round before `r` (None: Θ⁰)."""
        q = r - len(self.manifest.plan)
        if q < 0:
            return None
        rec = self.records.get(q)
        if rec is None:
            rec = await self.ex.read_round(q)
            if rec is None:
                raise ProtocolError(f"round {q} has no record, though round {r} does")
        return rec

    async def round(self, r: int) -> RoundVerdict:
        """The verdict on round `r` (committed: its record exists)."""
        t0 = time.perf_counter()
        p = self.schedule.fragment_of(r)
        try:
            rec = await self.ex.read_round(r)
        except ProtocolError as exc:
            return RoundVerdict(r, p, FAILED, (Mismatch(r, p, "record", None, str(exc)),))
        if rec is None:
            raise LocalProtocolError(f"round {r} has no record yet: verify committed rounds")
        self.records = {k: v for k, v in self.records.items()
                        if k >= r - len(self.manifest.plan)}
        self.records[r] = rec
        if rec.fragment != p:
            return RoundVerdict(r, p, FAILED, (Mismatch(
                r, p, "record", None, f"the record says fragment {rec.fragment}; round {r} "
                f"trains fragment {p}"),))
        held = [q.learner for q in rec.participants if q.held]
        if held:
            return await self.chain(rec, RoundVerdict(r, p, HELD, note=(
                f"{', '.join(held)} merged {'its' if len(held) == 1 else 'their'} own delta "
                "from memory and never uploaded it (a run that must be auditable sets "
                "keep_rounds, and its learners upload every contribution)")), t0)
        verdict, derived = await self.derive(rec, t0)
        if verdict.status == VERIFIED:
            assert derived is not None
            self.replica.hold(derived)
        elif verdict.status == FAILED:
            await self.follow(rec, derived)
        else:
            return await self.chain(rec, verdict, t0)
        return verdict

    async def chain(self, rec: RoundRecord, verdict: RoundVerdict, t0: float) -> RoundVerdict:
        """`verdict` (swept or held) with what can still be checked of `rec`'s commit: its
        stored payloads' digests, and the fragment's state at its version reached as every
        reader reaches it (`Replica.at`: the held state and this commit's step, or the
        newest checkpoint and the steps since), against the theta digest it records and
        its checkpoint. Failed, naming the round, when one does not hold."""
        r, p = rec.round, rec.fragment
        names = self.manifest.plan[p]
        # With the state before it held, `Replica.at` applies this commit's step, fetching
        # it with its digest checked: reading it here too would download it twice.
        held = self.replica.held(p)
        applied = rec.step is not None and held is not None and held.version == rec.version - 1
        stored, nbytes = await self.stored(rec, names, skip=("step",) if applied else ())
        mismatches = compare_chain(rec, None, stored, names)
        state = None
        # What a reader needs of this commit (its step, or a checkpoint's theta) is gone:
        # the commit is older than the fragment's newest checkpoint, and so is every
        # payload walking back to one (what `Replica.at` would find out the long way).
        needed = "step" if rec.step is not None else "theta"
        if not mismatches and needed not in stored.gone:
            before = self.replica.bytes_down
            try:
                state = await self.replica.at(p, rec)
                nbytes += self.replica.bytes_down - before
            except GradientmailError as exc:
                mismatches.append(Mismatch(r, p, "chain", None, f"version {rec.version} "
                                           f"cannot be reached as readers reach it: {exc}"))
            else:
                mismatches = await asyncio.to_thread(compare_chain, rec, state, stored, names)
        seconds = time.perf_counter() - t0
        if mismatches:
            # Readers cannot go on from this commit: the fragment's next round starts over
            # from the stored checkpoints.
            self.replica.states.pop(p, None)
            return RoundVerdict(r, p, FAILED, tuple(mismatches), note=verdict.note,
                                bytes=nbytes, seconds=seconds)
        if state is None:
            self.replica.states.pop(p, None)
            return dataclasses.replace(verdict, chain=SWEPT)
        return dataclasses.replace(verdict, chain=CHECKED, bytes=nbytes, seconds=seconds)

    async def follow(self, rec: RoundRecord, derived: FragmentState | None) -> None:
        """Hold the fragment's state after `rec` for its next round: as the run has it
        (the stored step applied, or the stored checkpoint), when the state before is
        held and that can be read; else the `derived` one (the commit's payloads were
        altered after it: its closer and the learners went on from the derived state);
        else none (the next round starts from the stored checkpoints)."""
        p = rec.fragment
        held = self.replica.held(p)
        if held is not None and held.version == rec.version - 1:
            try:
                if await self.replica.at(p, rec) is not None:
                    return
            except GradientmailError:
                pass
        self.replica.states.pop(p, None)
        if derived is not None:
            self.replica.hold(derived)

    async def derive(self, rec: RoundRecord,
                     t0: float) -> tuple[RoundVerdict, FragmentState | None]:
        """The verdict on `rec` and the state its inputs give (None when not derived)."""
        r, p = rec.round, rec.fragment
        schema, names = self.manifest.schema, self.manifest.plan[p]
        merged = {q.learner for q in rec.participants}
        wanted = merged | {d.learner for d in rec.dropped
                           if not d.reason.startswith(TRUSTED_DROPS)}
        trusted = [d for d in rec.dropped if d.reason.startswith(TRUSTED_DROPS)
                   and d.learner not in merged]
        found = await self.ex.contributions(r) if wanted else None
        snaps = [] if found is None else [s for s in found.records if s.learner in wanted]
        present = {s.learner for s in snaps} | (
            set() if found is None else {b.learner for b in found.rejected if b.learner})
        gone = sorted(merged - present)
        if gone:
            return RoundVerdict(r, p, SWEPT, note=f"the contributions of {gone} are swept"), None
        try:
            before = await self.replica.at(p, await self.previous(r))
        except GradientmailError as exc:
            return RoundVerdict(r, p, FAILED, (Mismatch(
                r, p, "state before", None, f"version {rec.version - 1} cannot be reached "
                f"from the stored checkpoints and steps: {exc}"),)), None
        if before is None:
            return RoundVerdict(r, p, SWEPT, note=f"the state before (version "
                                f"{rec.version - 1}) is swept"), None
        nbytes = 0
        problems: dict[str, str] = {}

        async def fetch(snap: SnapshotRecord) -> dict[str, DeltaTensor] | None:
            nonlocal nbytes
            bound = delta_bound(schema, names)
            whole: dict[str, TensorBytes] | None = None
            if snap.payload is not None:
                whole, problem, n = await _read(self.ex, snap.payload, bound)
                tensors: dict[str, DeltaTensor] | None = None if whole is None else dict(whole)
            else:
                tensors, problem, n = await _read_parts(self.ex, snap, schema, list(names),
                                                        bound)
            nbytes += n
            if tensors is None:
                if snap.learner in merged:
                    raise _Swept(snap.learner)
                return None
            if problem is not None:
                problems[snap.learner] = problem
            if whole is None:
                return tensors  # checked part by part as its pieces were read
            return dict(check_delta(whole, snap, schema, names))

        dropped: dict[str, str] = {}

        def drop(learner: str, key: str, reason: str) -> None:
            dropped.setdefault(learner, Dropped(learner, reason[:500]).reason)

        if found is not None:
            for bad in found.rejected:
                if bad.learner in wanted:
                    drop(bad.learner, bad.key, bad.reason)
        try:
            contributions = await screen_round(snaps, fragment=p, state=before, schema=schema,
                                               names=names, fetch=fetch, drop=drop)
        except _Swept as exc:
            return RoundVerdict(r, p, SWEPT, note=f"the payload of {exc} is swept"), None
        missed = () if rec.arrival is None else rec.arrival.missed
        merge = await asyncio.to_thread(merge_round, self.alg, before, contributions, schema,
                                        self.backend, await self.previous(r), missed,
                                        list(dropped))
        for learner, reason in (*merge.outliers.items(), *merge.overflowed.items()):
            drop(learner, "", reason)
        stored, n = await self.stored(rec, names)
        nbytes += n
        derived = Derived(merge.result, dropped, frozenset(present & wanted), tuple(names))
        mismatches = await asyncio.to_thread(compare_round, rec, self.alg, derived, stored)
        mismatches = _blame(r, p, problems, mismatches) + mismatches
        seconds = time.perf_counter() - t0
        state = merge.result.state
        if mismatches:
            return RoundVerdict(r, p, FAILED, tuple(mismatches), bytes=nbytes,
                                seconds=seconds), state
        note = "" if not trusted else "drops taken on trust: " + ", ".join(
            f"{d.learner} ({d.reason[:60]})" for d in trusted)
        return RoundVerdict(r, p, VERIFIED, note=note, bytes=nbytes, seconds=seconds), state

    async def stored(self, rec: RoundRecord, names: Sequence[str],
                     skip: Sequence[str] = ()) -> tuple[Stored, int]:
        """`rec`'s payloads as read back (but the kinds in `skip`), and the bytes read."""
        schema = self.manifest.schema
        refs = {"step": (rec.step.payload if rec.step and "step" not in skip else None,
                         "steps"),
                "theta": (rec.theta, "theta"), "outer": (rec.outer, "outer"),
                "update": (rec.update.payload if rec.update else None, "updates")}
        entries: dict[str, Mapping[str, TensorBytes]] = {}
        problems: dict[str, str] = {}
        gone: set[str] = set()
        nbytes = 0
        for kind, (ref, bound_kind) in refs.items():
            if ref is None:
                continue
            try:
                tensors, problem, n = await _read(self.ex, ref,
                                                  payload_bound(schema, names, bound_kind))
            except GradientmailError as exc:
                problems[kind] = f"unreadable: {exc}"
                continue
            nbytes += n
            if tensors is None:
                problems[kind] = f"payload {ref.key!r} is gone"
                gone.add(kind)
                continue
            if problem is not None:
                problems[kind] = problem
            entries[kind] = tensors
        return Stored(entries, problems, frozenset(gone)), nbytes


def _blame(r: int, p: int, problems: Mapping[str, str],
           mismatches: Sequence[Mismatch]) -> list[Mismatch]:
    """A mismatch for each contribution whose stored bytes differ from its record,
    naming the tensor of the commit its bytes change (the first one that differs), so
    the first mismatch reported says where the altered bytes went."""
    tensor = next((m.tensor for m in mismatches if m.tensor is not None), None)
    effect = ("" if tensor is None else
              f"; merged as stored, they change tensor {tensor!r} of the commit")
    return [Mismatch(r, p, f"contribution of {learner}", tensor, problem + effect)
            for learner, problem in sorted(problems.items())]


async def verify_run(ex: Exchange, url: str, *, start: int = 0, stop: int | None = None,
                     backend: Backend | None = None) -> Report:
    """Verify the rounds `start`..`stop` (default: the newest committed) of the run on
    `ex` (its seal decides whether records' seals are checked). Raises only for a run
    that cannot be read at all (no manifest, a manifest failing authentication)."""
    manifest = await require_manifest(ex, url)
    newest = await ex.newest_round()
    stop = newest if stop is None else min(stop, newest)
    verifier = Verifier(ex, manifest, backend)
    verdicts = []
    for r in range(max(start, 0), stop + 1):
        verdicts.append(await verifier.round(r))
    return Report(url, max(start, 0), stop, manifest.key_fingerprint is not None,
                  tuple(verdicts))
