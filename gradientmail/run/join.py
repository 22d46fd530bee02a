"""Joining a run: the creation election, adoption checks, and the newest commits.

The first creation claim elects the creator, which uploads Θ⁰ (one payload per fragment,
or, from a learner whose ranks each hold a shard, one part per rank) and writes the
manifest;
the others wait, and claim the next attempt when no manifest lands for max(30 polls,
largest fragment at 1 MiB/s). Adopting requires the same schema, the same algorithm
JSON and the same run key (the manifest names its fingerprint; `Exchange.read_manifest`
refuses another). A restart is a join: every fragment's newest commit is loaded.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from gradientmail.adapters.base import Adapter
from gradientmail.algorithms.base import Algorithm
from gradientmail.algorithms.registry import algorithm_from_json
from gradientmail.errors import RunConfigMismatch, SchemaMismatch
from gradientmail.events import (
    AwaitingCreator,
    CreatingRun,
    EventSink,
    Joined,
    TookOverCreation,
)
from gradientmail.mailbox.selftest import verify_conditional_writes
from gradientmail.run.keyspace import current_attempt
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import Replica
from gradientmail.wire.records import Manifest, RoundRecord
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.serialization import Schema
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = [
    "InitUploader",
    "JoinResult",
    "Loader",
    "config_differences",
    "creation_timeout",
    "join_run",
    "schema_differences",
]

#: Another way to read a fragment's parameters at a commit (see `join_run`).
Loader = Callable[[Manifest, int, RoundRecord | None], Awaitable[Any]]

#: Another way to upload Θ⁰ of a fragment when creating the run (see `join_run`):
#: (fragment, its names, creation attempt) -> the parts' refs, in k order.
InitUploader = Callable[[int, tuple[str, ...], int], Awaitable[Sequence[PayloadRef]]]

#: The bandwidth a creator is assumed to have at least, to size the takeover timeout.
CREATOR_BYTES_PER_SECOND = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class JoinResult:
    plan: tuple[tuple[str, ...], ...]
    rounds_seen: int
    fragments: tuple[tuple[int, Any], ...]  # (version, loaded values) per fragment
    thetas: tuple[dict[str, TensorBytes], ...]  # host bytes of the same, per fragment
    created: bool
    manifest: Manifest
    replica: Replica  # each fragment's state as of the join (shared with the closer)


def schema_differences(run: Schema, mine: Schema) -> list[str]:
    """Every parameter that differs between the run's schema and this model's."""
    out = []
    theirs = {p.name: p for p in run.params}
    ours = {p.name: p for p in mine.params}
    for name in theirs.keys() - ours.keys():
        out.append(f"{name!r} is in the run but not in this model")
    for name in ours.keys() - theirs.keys():
        out.append(f"{name!r} is in this model but not in the run")
    for name in theirs.keys() & ours.keys():
        a, b = theirs[name], ours[name]
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            out.append(
                f"{name!r} is {a.dtype}{list(a.shape)} in the run, {b.dtype}{list(b.shape)} here"
            )
    if not out and [p.name for p in run.params] != [p.name for p in mine.params]:
        out.append("the parameters are the same but in another order")
    return sorted(out)


def config_differences(run: Mapping[str, Any], mine: Mapping[str, Any]) -> list[str]:
    """Every algorithm field whose value differs between the run and this process."""
    out = []
    for key in sorted(set(run) | set(mine)):
        a, b = run.get(key, "<absent>"), mine.get(key, "<absent>")
        if a != b:
            out.append(f"{key}: run has {a!r}, this process {b!r}")
    return out


def creation_timeout(schema: Schema, plan: tuple[tuple[str, ...], ...], poll: float) -> float:
    """How long a waiter gives a creator before taking over."""
    largest = max((sum(schema.nbytes(n) for n in names) for names in plan), default=0)
    return max(30 * poll, largest / CREATOR_BYTES_PER_SECOND)


async def join_run(
    ex: Exchange,
    adapter: Adapter,
    algorithm: Algorithm,
    learner: str,
    *,
    poll_interval: float,
    on_event: EventSink,
    load: Loader | None = None,
    upload_init: InitUploader | None = None,
) -> JoinResult:
    """Join (or create) the run in `ex`, returning each fragment's newest parameters.

    `load` reads a fragment's parameters as a commit left them (Θ⁰ for None) another
    way than through this process's `Replica` (a learner whose ranks each read their own
    rows); its results' host bytes are not kept (`JoinResult.thetas` holds empty ones).
    `upload_init`, when this learner creates the run, uploads each fragment's Θ⁰ as
    parts (a learner whose ranks each upload their own rows), instead of the adapter's
    `read` uploaded as one payload."""
    await verify_conditional_writes(ex.mailbox, prefix=ex.prefix + "selftest/")
    manifest, created = await _manifest(ex, adapter, algorithm, learner, poll_interval,
                                        on_event, upload_init)
    _check_fits_run(ex, manifest, adapter, algorithm)
    replica = Replica(ex, manifest, algorithm_from_json(dict(manifest.algorithm)))
    while True:
        newest = await ex.newest_round()
        fragments = await _newest_fragments(ex, manifest, adapter, replica, newest, load)
        if fragments is None:
            continue  # swept while we read: a newer commit exists, look again
        # Beat before training starts, so every observer counts this learner from its
        # next lease listing on.
        await ex.beat(learner)
        on_event(Joined(learner, newest, tuple(v for v, _, _ in fragments), created))
        return JoinResult(manifest.plan, newest, tuple((v, x) for v, x, _ in fragments),
                          tuple(t for _, _, t in fragments), created, manifest, replica)


async def _manifest(
    ex: Exchange, adapter: Adapter, algorithm: Algorithm, learner: str, poll_interval: float,
    on_event: EventSink, upload_init: InitUploader | None,
) -> tuple[Manifest, bool]:
    """The run's manifest, and whether this learner created it: read, or, while there is
    none, created by whoever wins the creation claim (a stale claim is taken over after
    `creation_timeout`)."""
    schema = adapter.schema
    plan = algorithm.plan(schema)
    manifest = await ex.read_manifest()
    seen: dict[int, float] = {}
    waited_for: int | None = None
    while manifest is None:
        attempt = current_attempt(await ex.creation_claims())
        now = ex.clock.now()
        mine: int | None = None
        if attempt is None:
            if await ex.claim_creation(learner, 0):
                mine = 0
        else:
            seen.setdefault(attempt, now)
            if now - seen[attempt] >= creation_timeout(schema, plan, poll_interval):
                if await ex.claim_creation(learner, attempt + 1):
                    mine = attempt + 1
                    on_event(TookOverCreation(learner, mine))
            elif waited_for != attempt:
                waited_for = attempt
                on_event(AwaitingCreator(learner, attempt))
        if mine is not None:
            on_event(CreatingRun(learner, mine))
            made = await _create(ex, adapter, algorithm, learner, plan, mine, upload_init)
            return made, made.creator == learner
        await ex.clock.sleep(poll_interval)
        manifest = await ex.read_manifest()
    return manifest, False


def _check_fits_run(ex: Exchange, manifest: Manifest, adapter: Adapter,
                    algorithm: Algorithm) -> None:
    """`SchemaMismatch` or `RunConfigMismatch` naming every difference between this
    learner's model or configuration and the run's."""
    diffs = schema_differences(manifest.schema, adapter.schema)
    if diffs:
        raise SchemaMismatch(
            f"this model does not match the run in {ex.mailbox.url} "
            f"(created by {manifest.creator!r}): "
            + "; ".join(diffs)
            + ". Use the same model definition, or another mailbox/prefix for a new run"
        )
    diffs = config_differences(manifest.algorithm, algorithm.to_json())
    if diffs:
        raise RunConfigMismatch(
            f"this algorithm configuration differs from the run in {ex.mailbox.url}: "
            + "; ".join(diffs)
            + ". Use the run's configuration, or another mailbox/prefix for a new run"
        )


async def _newest_fragments(
    ex: Exchange, manifest: Manifest, adapter: Adapter, replica: Replica, newest: int,
    load: Loader | None,
) -> list[tuple[int, Any, dict[str, TensorBytes]]] | None:
    """Each fragment's (version, loaded parameters, host bytes) as of round `newest`; None
    when a payload was swept while being read."""
    latest = await ex.latest_commit_per_fragment(len(manifest.plan), newest)
    out: list[tuple[int, Any, dict[str, TensorBytes]]] = []
    for p, names in enumerate(manifest.plan):
        rec = latest.get(p)
        version = rec.version if rec is not None else 0
        if load is not None:
            loaded = await load(manifest, p, rec)
            if loaded is None:
                return None
            out.append((version, loaded, {}))
            continue
        state = await replica.at(p, rec)
        if state is None:
            return None
        values = {n: state.theta[n] for n in names}
        out.append((version, await asyncio.to_thread(adapter.load, values), values))
    return out


async def _create(
    ex: Exchange,
    adapter: Adapter,
    algorithm: Algorithm,
    learner: str,
    plan: tuple[tuple[str, ...], ...],
    attempt: int,
    upload_init: InitUploader | None,
) -> Manifest:
    refs: list[PayloadRef | None] = []
    parts: list[tuple[PayloadRef, ...]] = []
    for p, names in enumerate(plan):
        if upload_init is not None:
            # No process holds the fragment whole: each rank uploads its own rows.
            refs.append(None)
            parts.append(tuple(await upload_init(p, names, attempt)))
            continue
        values = adapter.read(list(names))
        refs.append(await ex.put_init(p, values, attempt=attempt))
        del values
    manifest = Manifest(
        schema=adapter.schema,
        plan=plan,
        algorithm=algorithm.to_json(),
        creator=learner,
        init=tuple(refs),
        codec=ex.store.compression,
        key_fingerprint=ex.store.seal.fingerprint,
        init_parts=tuple(parts),
    )
    if await ex.create_manifest(manifest):
        return manifest
    # A superseded creator finished first after all: adopt its manifest.
    other = await ex.read_manifest()
    assert other is not None
    return other
