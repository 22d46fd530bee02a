"""How a round's contributions become its merge: which ones a closer drops and why, and
what the aggregator makes of the rest.

One code path for the two parties that need it: the `Syncer`, which closes rounds, and
`gradientmail.app.verify`, which re-derives closed rounds from the store and compares bytes.
Everything here is pure but `screen_round`, which gets each delta through the caller's
`fetch` (the closer reads its own from memory; a verifier reads the stored payload);
`round_record` builds the commit a closer writes from what it merged and uploaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Collection, Sequence

from gradientmail.algorithms.base import Algorithm, Contribution, FragmentState, RoundResult
from gradientmail.algorithms.outer import merged_step, step_format
from gradientmail.algorithms.rounds import outliers
from gradientmail.backends.base import Backend
from gradientmail.errors import GradientmailError, NonFiniteError, SchemaMismatch
from gradientmail.run.keyspace import screen_snapshot
from gradientmail.syncer.screening import delta_norms, screen_delta
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.records import Dropped, RoundRecord, SnapshotRecord
from gradientmail.wire.refs import Arrival, PayloadRef, StepRef, UpdateRef
from gradientmail.wire.serialization import Schema
from gradientmail.wire.sharded_pieces import DeltaTensor
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = [
    "CommitRefs",
    "Merged",
    "cohort_of",
    "merge_round",
    "round_record",
    "screen_round",
    "unchanged",
]

#: `fetch(snapshot)`: the delta entries of a contribution, checked against its record
#: (`protocol.check_delta`), or None when its payload is gone.
Fetch = Callable[[SnapshotRecord], Awaitable[dict[str, DeltaTensor] | None]]
#: `drop(learner, key, reason)`: a contribution left out of the round.
Drop = Callable[[str, str, str], None]


async def screen_round(
    snaps: Sequence[SnapshotRecord], *, fragment: int, state: FragmentState, schema: Schema,
    names: Sequence[str], fetch: Fetch, drop: Drop,
) -> list[Contribution]:
    """The usable contributions among `snaps`, in learner order; each other one is
    reported to `drop` with its reason, as a closer records it: the record's
    (`keyspace.screen_snapshot`), the payload's fetch, then its values
    (`screening.screen_delta`)."""
    out: list[Contribution] = []
    digest = schema.digest()
    for snap in sorted(snaps, key=lambda s: s.learner):
        key = snap.payload_key
        problem = screen_snapshot(snap, fragment=fragment, version=state.version,
                                  schema_digest=digest)
        if problem is not None:
            drop(snap.learner, key, problem)
            continue
        try:
            entries = await fetch(snap)
        except SchemaMismatch as exc:
            drop(snap.learner, key, f"mis-shaped: {exc}")
            continue
        except GradientmailError as exc:
            drop(snap.learner, key, f"unreadable: {exc}")
            continue
        delta = screen_delta(entries, names, snap.delta_format)
        if isinstance(delta, str):
            drop(snap.learner, key, delta)
        else:
            out.append(Contribution(snap.learner, snap.local_step, snap.steps, snap.tokens,
                                    snap.final, delta))
    return out


@dataclasses.dataclass(frozen=True)
class Merged:
    """A round's merge: the result, and the contributions it left out (learner -> reason):
    `outliers` before merging, `overflowed` when the outer step overflowed (then the
    result is the fragment unchanged)."""

    result: RoundResult
    outliers: dict[str, str]
    overflowed: dict[str, str]


def merge_round(alg: Algorithm, state: FragmentState, contributions: Sequence[Contribution],
                schema: Schema, backend: Backend | None = None,
                previous: RoundRecord | None = None,
                missed: Collection[str] | None = None,
                screened: Collection[str] = ()) -> Merged:
    """What a closer commits for `contributions` (already screened) on `state`: outliers
    left out under the algorithm's `outlier_factor`, then `close_round`, whose cohort is
    the merged learners and `cohort_of(previous, missed)` (the fragment's previous record,
    the learners the round awaited in vain; `missed` None: no cohort) less the learners
    whose contributions it left out (`screened` out, and the outliers): their progress
    comes in no later round, so the round is the mean of the others, as in standard
    DiLoCo. An outer step that overflows leaves every contribution out; with none left,
    the fragment moves one version on unchanged (`unchanged`). Pure: equal inputs give
    equal bytes."""
    out = _outliers(alg, contributions, backend)
    kept = [c for c in contributions if c.learner not in out]
    overflowed: dict[str, str] = {}
    if kept:
        cohort = None if missed is None else len(
            ({c.learner for c in kept} | cohort_of(previous, missed)) - set(screened) - set(out))
        try:
            result = alg.aggregator(backend).close_round(state, kept, schema, cohort)
            return Merged(result, out, overflowed)
        except NonFiniteError as exc:
            # Every closer would fail the same way after each takeover, forever: the round
            # commits with its contributions left out instead.
            overflowed = {c.learner: f"outer step overflowed: {exc}" for c in kept}
    return Merged(unchanged(alg, state), out, overflowed)


def cohort_of(previous: RoundRecord | None, missed: Collection[str]) -> frozenset[str]:
    """The learners of a round's cohort besides those it merges: the participants of its
    fragment's previous round (`previous`; None: the first) and the learners the closer
    awaited that `missed` it. Both are in the records, so a verifier finds the same."""
    before = () if previous is None else (p.learner for p in previous.participants)
    return frozenset(before) | frozenset(missed)


def unchanged(alg: Algorithm, state: FragmentState) -> RoundResult:
    """A round with nothing to merge: the fragment one version on, unchanged (with a
    replicated outer step, a zero Δ averaged in, which every party applies alike)."""
    if not alg.replicated:
        return RoundResult(dataclasses.replace(state, version=state.version + 1), None, (),
                           None, False)
    fmt = step_format(alg.commit_dtype, [state.theta[n].dtype for n in state.names])
    step: dict[str, TensorBytes] = {}
    for name, t in state.theta.items():
        step.update(merged_step(name, TensorBytes("F32", t.shape, bytes(4 * t.numel)), fmt))
    return RoundResult(alg.apply_step(state, step, fmt, "average"), None, (), None, False,
                       step=step, step_format=fmt, rule="average")


def _outliers(alg: Algorithm, contributions: Sequence[Contribution],
              backend: Backend | None) -> dict[str, str]:
    factor = getattr(alg, "outlier_factor", None)
    if factor is None or len(contributions) < 3:
        return {}
    return outliers(delta_norms(contributions, backend), factor)


@dataclasses.dataclass(frozen=True)
class CommitRefs:
    """What a commit's payloads were uploaded as (None: not written for this commit)."""

    theta: PayloadRef | None = None
    outer: PayloadRef | None = None
    update: UpdateRef | None = None
    step: StepRef | None = None


def round_record(
    r: int, fragment: int, result: RoundResult, snaps: Sequence[SnapshotRecord],
    merged: Collection[str], refs: CommitRefs, closer: str, *, held: SnapshotRecord | None,
    estimates: Estimates, arrival: Arrival, dropped: Sequence[Dropped],
    committed_at: float,
) -> RoundRecord:
    """The commit of round `r`: `result` of merging the contributions of `merged` among
    `snaps`, written as `refs` by `closer`. What the run's history needs of each merged
    contribution is copied from its record (the contributions are swept once the round
    commits): its step-time EMA, loss and payload size; `held` is the closer's own
    contribution merged from memory (marked `held`, no payload size)."""
    kept = [s for s in snaps if s.learner in merged]
    paces = {s.learner: s.step_seconds for s in kept if s.step_seconds is not None}
    losses = {s.learner: s.loss for s in kept}
    sizes = {s.learner: s.payload_size for s in kept if s is not held}
    return RoundRecord(
        round=r,
        fragment=fragment,
        version=result.state.version,
        theta=refs.theta,
        outer=refs.outer,
        update=refs.update,
        participants=tuple(
            dataclasses.replace(p, step_seconds=paces.get(p.learner),
                                held=held is not None and p.learner == held.learner,
                                loss=losses.get(p.learner), payload_size=sizes.get(p.learner))
            for p in result.participants
        ),
        estimates=estimates,
        mean_cosine=result.mean_cosine,
        dropped=tuple(dropped),
        closer=closer,
        all_final=result.all_final,
        arrival=arrival,
        step=refs.step,
        committed_at=committed_at,
    )
