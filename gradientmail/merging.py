"""How a round's contributions become its merge: which ones a closer drops and why, and
what the aggregator makes of the rest.

One code path for the two parties that need it: the `Syncer`, which closes rounds, and
`gradientmail.verify`, which re-derives closed rounds from the store and compares bytes.
Everything here is pure but `screen_round`, which gets each delta through the caller's
`fetch` (the closer reads its own from memory; a verifier reads the stored payload).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from gradientmail.algorithms.base import Algorithm, Contribution, FragmentState, RoundResult
from gradientmail.algorithms.diloco import merged_step, outliers, step_format
from gradientmail.backends.base import Backend
from gradientmail.backends.numpy_backend import NumpyBackend
from gradientmail.errors import GradientmailError, NonFiniteError, SchemaMismatch
from gradientmail.quantization import dequantize
from gradientmail.records import SnapshotRecord
from gradientmail.serialization import Schema, TensorBytes

__all__ = [
    "Merged",
    "contribution_of",
    "merge_round",
    "record_problem",
    "screen_round",
    "unchanged",
]

#: `fetch(snapshot)`: the delta entries of a contribution, checked against its record
#: (`protocol.check_delta`), or None when its payload is gone.
Fetch = Callable[[SnapshotRecord], Awaitable[dict[str, TensorBytes] | None]]
#: `drop(learner, key, reason)`: a contribution left out of the round.
Drop = Callable[[str, str, str], None]


def record_problem(snap: SnapshotRecord, fragment: int, state: FragmentState,
                   schema: Schema) -> str | None:
    """Why the contribution `snap` cannot join a round of `fragment` at `state`, judged
    from its record alone (None: it can, if its delta is sound)."""
    if snap.fragment != fragment:
        return f"fragment {snap.fragment}, the round trains fragment {fragment}"
    if snap.schema_digest != schema.digest():
        return (f"another schema digest {snap.schema_digest[:12]}, the run's is "
                f"{schema.digest()[:12]}")
    if snap.base_version != state.version:
        return (f"stale: base version {snap.base_version}, the fragment is at version "
                f"{state.version}")
    if snap.steps < 1:
        return "no steps trained"
    return None


def contribution_of(snap: SnapshotRecord, entries: Mapping[str, TensorBytes],
                    names: Sequence[str]) -> Contribution | str:
    """The contribution of `snap` with its (checked) delta `entries`, dequantized; or the
    reason to drop it (undecodable quantized entries, non-finite values)."""
    try:
        delta = dequantized(entries, names, snap.delta_format)
    except GradientmailError as exc:
        return f"unreadable: {exc}"
    bad = [n for n in names if not finite(delta[n])]
    if bad:
        return f"non-finite values in {bad}"
    return Contribution(snap.learner, snap.local_step, snap.steps, snap.tokens, snap.final, delta)


async def screen_round(
    snaps: Sequence[SnapshotRecord], *, fragment: int, state: FragmentState, schema: Schema,
    names: Sequence[str], fetch: Fetch, drop: Drop,
) -> list[Contribution]:
    """The usable contributions among `snaps`, in learner order; each other one is
    reported to `drop` with its reason, as a closer records it."""
    out: list[Contribution] = []
    for snap in sorted(snaps, key=lambda s: s.learner):
        key = snap.payload.key
        problem = record_problem(snap, fragment, state, schema)
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
        if entries is None:
            drop(snap.learner, key, "payload swept")
            continue
        got = contribution_of(snap, entries, names)
        if isinstance(got, str):
            drop(snap.learner, key, got)
        else:
            out.append(got)
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
                schema: Schema, backend: Backend | None = None) -> Merged:
    """What a closer commits for `contributions` (already screened) on `state`: outliers
    left out under the algorithm's `outlier_factor`, then `close_round`. An outer step
    that overflows leaves every contribution out; with none left, the fragment moves one
    version on unchanged (`unchanged`). Pure: equal inputs give equal bytes."""
    out = _outliers(alg, contributions, backend)
    kept = [c for c in contributions if c.learner not in out]
    overflowed: dict[str, str] = {}
    if kept:
        try:
            result = alg.aggregator(backend).close_round(state, kept, schema)
            return Merged(result, out, overflowed)
        except NonFiniteError as exc:
            # Every closer would fail the same way after each takeover, forever: the round
            # commits with its contributions left out instead.
            overflowed = {c.learner: f"outer step overflowed: {exc}" for c in kept}
    return Merged(unchanged(alg, state), out, overflowed)


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


def dequantized(
    entries: Mapping[str, TensorBytes], names: Sequence[str], fmt: str | None
) -> dict[str, TensorBytes]:
    """The delta's tensors as floats: quantized entries dequantized (to F32)."""
    if fmt is None or (
        fmt in ("F32", "F16", "BF16") and all(entries[n].dtype == fmt for n in names)
    ):
        return {n: entries[n] for n in names}
    return {n: dequantize(entries, n, fmt) for n in names}


def delta_norms(contributions: Sequence[Contribution],
                backend: Backend | None) -> dict[str, float]:
    """Each contribution's delta norm over all its tensors, as one vector."""
    be = NumpyBackend() if backend is None else backend
    return {c.learner: math.sqrt(sum(be.load(t).norm() ** 2 for t in c.delta.values()))
            for c in contributions}


def finite(t: TensorBytes) -> bool:
    """Whether every value of `t` is finite."""
    arr: Any = t.to_numpy()
    return bool(np.isfinite(arr.astype(np.float32)).all()) if arr.size else True
