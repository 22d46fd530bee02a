"""The Exchange: the run's records and payloads on a Mailbox.

Key layout under the run's prefix (numbers zero-padded so that lexical order is numeric
order)::

    manifest.json                              the run (create-if-absent, written once)
    claims/create/<attempt>                    creation election
    init/<attempt>/<fragment><ext>             Θ⁰ of each fragment, by creation attempt
    init/<attempt>/<fragment>/<k>-of-<n><ext>  or Θ⁰ of a fragment in parts, one per rank
    leases/<learner>/<counter>                 liveness: one key per learner, bumped
    closers/<closer>/<counter>                 a standalone closer's liveness, the same way
    rollcall.json                              the roll call: the open call, or its verdict
                                               (overwritten by each; see gradientmail.run.rollcall)
    snapshots/<round>/<learner>.json           a contribution record
    payloads/<round>/<learner><ext>            its delta
    parts/<round>/<learner>/<k>-of-<n><ext>    or its delta in parts, one per rank
    claims/round/<round>/<attempt>             closer election
    rounds/<round>.json                        the commit record: the single source of truth
    theta|outer|updates/<fragment>/<version>-<attempt><ext>   a commit's payloads

Written payloads carry the claim attempt that wrote them, so a superseded creator or
closer that wakes up late can never overwrite what the winner's record references.

Decisions (which keys to sweep, which contributions a round may use, which claim is
current) are pure functions in `gradientmail.run.keyspace`; `Exchange` only does I/O: the
protocol's steps, kept in its `store`, a `gradientmail.run.store.RunStore` (sealed records,
verified payloads), where readers fetch payloads too.
Every record passes through a `Seal`: `PlainSeal` stores canonical JSON as is; with a run
key, `gradientmail.wire.auth.HmacSeal` seals and checks every record.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from gradientmail.clock import Clock, MonotonicClock
from gradientmail.errors import (
    AlreadyContributed,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from gradientmail.mailbox.base import Mailbox
from gradientmail.run.bounds import check_delta, delta_bound, payload_bound
from gradientmail.run.keyspace import (
    ARTIFACT_KINDS,
    CALL_KEY,
    MANIFEST_KEY,
    ROUND_AREAS,
    ROUND_LIMIT,
    Contributions,
    Rejected,
    artifact_key,
    attempts_in,
    check_number,
    delta_keys_problem,
    init_key,
    init_part_key,
    part_key,
    plan_sweep,
    round_dir,
    round_key,
)
from gradientmail.run.lease import (
    LEARNERS,
    LeaseArea,
    LeaseTracker,
    lease_counters,
    lease_key,
)
from gradientmail.run.rollcall import Call
from gradientmail.run.store import RunStore
from gradientmail.wire import compression as codec
from gradientmail.wire.auth import Seal, open_manifest
from gradientmail.wire.record_json import CODECS, check_learner_id
from gradientmail.wire.records import (
    CreationClaim,
    Manifest,
    RoundClaim,
    RoundRecord,
    SnapshotRecord,
)
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.serialization import Schema
from gradientmail.wire.sharded_parts import assemble, part_metadata, pieces_of
from gradientmail.wire.sharded_pieces import DeltaTensor
from gradientmail.wire.tensor_bytes import TensorBytes

#: Contribution records a closer reads at once (`Exchange.contributions`).
READS_AT_ONCE = 16

__all__ = ["READS_AT_ONCE", "Exchange", "contribution_key", "misfiled"]


def contribution_key(round_: int, learner: str) -> str:
    """The key (under the run's prefix) of `learner`'s contribution record in `round_`."""
    return f"{round_dir('snapshots/', round_)}{learner}.json"


def misfiled(record: SnapshotRecord, key: str, round_: int, learner: str) -> str | None:
    """Why the contribution record read at `key` (learner `learner`'s in `round_`) must not
    be merged — it names another learner, round or payload key than its own key — or None."""
    problem = delta_keys_problem(record, round_, learner,
                                 [codec.extension(c) for c in CODECS])
    if record.learner == learner and record.round == round_ and problem is None:
        return None
    says, wants = ("", "") if problem is None else (f", {problem[0]}", f", {problem[1]}")
    return (f"record {key!r} says learner {record.learner!r}, round {record.round}{says}; "
            f"its key says learner {learner!r}, round {round_}{wants}")


class Exchange:
    """The run's protocol on `mailbox`, under `prefix`: records and payloads go through
    `store` (`compression`, `seal` and `run_key` are `RunStore`'s); `clock` timestamps
    lease listings. No I/O happens in the constructor.
    """

    def __init__(
        self,
        mailbox: Mailbox,
        *,
        clock: Clock | None = None,
        compression: str = "off",
        prefix: str = "",
        seal: Seal | None = None,
        run_key: str | bytes | None = None,
    ) -> None:
        self.store = RunStore(mailbox, compression=compression, prefix=prefix, seal=seal,
                              run_key=run_key)
        # The store's own, for the keys the protocol reads and writes raw (leases, the
        # roll call, existence checks and the sweep's deletes).
        self.mailbox: Mailbox = self.store.mailbox
        self.prefix: str = self.store.prefix
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self._lease_counter: dict[str, int] = {}  # the lease keys this process bumped

    def __repr__(self) -> str:
        return f"Exchange({self.mailbox!r}, prefix={self.prefix!r})"

    @property
    def where(self) -> str:
        """The run's place, for messages: the mailbox URL and the prefix, if any."""
        return self.store.where

    # -- creation --------------------------------------------------------------------

    async def claim_creation(self, learner: str, attempt: int) -> bool:
        """Bid to create the run with `attempt`; True if this call holds that attempt."""
        claim = CreationClaim(check_number("attempt", attempt, 10**6), check_learner_id(learner))
        return await self.store.write_record(f"claims/create/{attempt:06d}", claim)

    async def creation_claims(self) -> list[int]:
        """The creation attempts claimed so far, ascending (one LIST)."""
        return attempts_in(await self.store.keys("claims/create/"), "claims/create/")

    async def read_creation_claim(self, attempt: int) -> CreationClaim | None:
        return await self.store.read_record(f"claims/create/{attempt:06d}", CreationClaim)

    async def put_init(self, fragment: int, tensors: Mapping[str, TensorBytes],
                       *, attempt: int) -> PayloadRef:
        """Upload Θ⁰ of `fragment` for creation `attempt`; its ref goes into the manifest."""
        ref = await self.store.put_payload(init_key(attempt, fragment), tensors)
        assert ref is not None
        return ref

    async def put_init_part(self, fragment: int, k: int, n: int,
                            tensors: Mapping[str, TensorBytes],
                            rows: Mapping[str, tuple[int, int]], *, attempt: int) -> PayloadRef:
        """Upload part `k` of `n` of Θ⁰ of `fragment` for creation `attempt`: `tensors`
        hold rows `rows[name]` of each tensor, in its storage dtype (the format of a
        contribution's part, `wire.sharded_parts`). Overwritten, as `put_init`: only the holder
        of the attempt's claim writes under it. Its ref goes into `Manifest.init_parts`."""
        ref = await self.store.put_payload(init_part_key(attempt, fragment, k, n), tensors,
                                     metadata=part_metadata(rows))
        assert ref is not None
        return ref

    async def fetch_init(self, manifest: Manifest, fragment: int
                         ) -> dict[str, TensorBytes] | None:
        """Θ⁰ of `fragment`, whole: its payload, or its parts checked (`wire.sharded_parts`: each
        tensor's rows tile it once, in the schema's dtypes) and joined. Each payload is
        verified against its ref and bounded by the fragment's size; None if one is gone."""
        names = manifest.plan[fragment]
        bound = payload_bound(manifest.schema, names, "theta")
        ref = manifest.init[fragment]
        if ref is not None:
            return await self.store.fetch_tensors(ref, bound)
        parts = await self.store.fetch_parts(manifest.init_parts[fragment], bound)
        return None if parts is None else assemble(parts, manifest.schema, names, None)

    async def create_manifest(self, manifest: Manifest) -> bool:
        """Write the manifest if there is none; False when another creator won."""
        return await self.store.write_record(MANIFEST_KEY, manifest)

    async def read_manifest(self) -> Manifest | None:
        """The manifest, checked to name this Exchange's run key (`AuthenticationError`
        naming both fingerprints otherwise); None while the run does not exist."""
        data = await self.mailbox.get(self.prefix + MANIFEST_KEY)
        return None if data is None else open_manifest(self.store.seal, data, MANIFEST_KEY,
                                                       self.where)

    # -- leases ----------------------------------------------------------------------

    async def beat(self, learner: str, area: LeaseArea = LEARNERS) -> int:
        """Bump `learner`'s lease counter (a standalone closer's under `area="closers"`):
        create the next key, then delete the previous, so a listing never misses a live
        holder. Returns the new counter."""
        check_learner_id(learner)
        counter = self._lease_counter.get(_holder(area, learner))
        if counter is None:
            # A restarted learner continues after its old counter (still listed until
            # deleted): counting from 0 again would look like no change to observers.
            stale = await self.store.keys(f"{area}/{learner}/")
            counter = lease_counters(stale, area).get(learner, -1)
        else:
            stale = [lease_key(learner, counter, area)]
        await self.mailbox.put(self.prefix + lease_key(learner, counter + 1, area), b"")
        # Counted before the deletes: a beat cancelled between them (a learner closing)
        # leaves `release` both keys to delete, never the new one behind.
        self._lease_counter[_holder(area, learner)] = counter + 1
        for key in stale:
            await self.mailbox.delete(self.prefix + key)
        return counter + 1

    async def leases(self, area: LeaseArea = LEARNERS) -> dict[str, int]:
        """Every learner's lease counter, or every standalone closer's with
        `area="closers"` (one LIST per 1,000)."""
        return lease_counters(await self.store.keys(f"{area}/"), area)

    async def observe_leases(self, tracker: LeaseTracker,
                             area: LeaseArea = LEARNERS) -> frozenset[str]:
        """List the leases of `area`, feed `tracker` at this Exchange's clock time; the
        live holders."""
        counters = await self.leases(area)
        now = self.clock.now()
        tracker.observe(counters, now)
        return tracker.live(now)

    def lease_counter(self, learner: str) -> int | None:
        """`learner`'s lease counter as this Exchange last beat it (None: never)."""
        return self._lease_counter.get(_holder(LEARNERS, learner))

    async def drop_lease(self, learner: str, counter: int) -> None:
        """Delete the lease key of `learner` at `counter`, judged gone by a roll call:
        exactly that key, so a beat that landed since (counter + 1) stays."""
        await self.mailbox.delete(self.prefix + lease_key(learner, counter))

    async def read_call(self) -> Call | None:
        """The roll call in `rollcall.json` (open, or closed with its verdict); None when
        no call was ever made (one GET)."""
        data = await self.mailbox.get(self.prefix + CALL_KEY)
        if data is None:
            return None
        return Call.decode(self.store.seal.open(CALL_KEY, data), CALL_KEY)

    async def post_call(self, call: Call) -> None:
        """Write `call` (a new call, or the verdict of one) over `rollcall.json`."""
        sealed = self.store.seal.seal(CALL_KEY, call.encode())
        await self.mailbox.put(self.prefix + CALL_KEY, sealed)

    async def release(self, learner: str, area: LeaseArea = LEARNERS) -> None:
        """Delete `learner`'s lease: observers stop counting it at their next listing."""
        check_learner_id(learner)
        counter = self._lease_counter.pop(_holder(area, learner), None)
        if counter is not None:
            # Its predecessor too, in case a beat was cancelled before deleting it.
            keys = [lease_key(learner, c, area) for c in (counter, counter - 1) if c >= 0]
        else:
            keys = await self.store.keys(f"{area}/{learner}/")
        for key in keys:
            await self.mailbox.delete(self.prefix + key)

    # -- contributions ---------------------------------------------------------------

    async def publish(
        self, round_: int, learner: str, tensors: Mapping[str, TensorBytes], **fields: Any
    ) -> SnapshotRecord:
        """Upload a delta, then the record that references it (both create-if-absent):
        `publish_draft` of `draft(round_, learner, **fields)`.

        Raises `AlreadyContributed` if `learner` has contributed to `round_` already (one
        contribution per learner and round; its steps can go out with a later round).
        """
        return await self.publish_draft(self.draft(round_, learner, **fields), tensors)

    @staticmethod
    def draft(
        round_: int,
        learner: str,
        *,
        fragment: int,
        base_version: int,
        local_step: int,
        steps: int,
        tokens: int,
        final: bool,
        schema_digest: str,
        delta_format: str,
        step_seconds: float | None = None,
        loss: float | None = None,
    ) -> SnapshotRecord:
        """The record of a contribution before its upload: its payload ref names the key
        stem, with size 0 and a zero digest (bad fields fail here, before any upload). An
        embedded closer merges a held contribution from this draft and its tensors."""
        check_learner_id(learner)
        return SnapshotRecord(
            learner=learner, round=round_, fragment=fragment, base_version=base_version,
            local_step=local_step, steps=steps, tokens=tokens, final=final,
            schema_digest=schema_digest, delta_format=delta_format,
            payload=PayloadRef(f"{round_dir('payloads/', round_)}{learner}", 0, "0" * 64),
            step_seconds=step_seconds, loss=loss,
        )

    async def publish_draft(
        self, draft: SnapshotRecord, tensors: Mapping[str, TensorBytes]
    ) -> SnapshotRecord:
        """`publish` of a `draft`: the payload, then the record with the payload's ref."""
        if draft.payload is None:
            raise LocalProtocolError("publish_draft takes a draft of one payload; a delta "
                                     "made of parts goes out by put_part and publish_parts")
        round_, learner, stem = draft.round, draft.learner, draft.payload.key
        ref = await self.store.put_payload(stem, tensors, create=True)
        key = contribution_key(round_, learner)
        if ref is None and await self.mailbox.get(self.prefix + key) is None:
            # Our own payload without its record: an earlier publish of this round failed
            # between the two writes. No record references those bytes, so replace them.
            ref = await self.store.put_payload(stem, tensors)
        if ref is not None:
            record = dataclasses.replace(draft, payload=ref)
            if await self.store.write_record(key, record):
                return record
        raise AlreadyContributed(
            f"learner {learner!r} has already contributed to round {round_} ({key!r} or its "
            "payload exists); a learner contributes once per round: publish the steps with "
            "a later round"
        )

    async def put_part(self, round_: int, learner: str, k: int, n: int,
                       tensors: Mapping[str, TensorBytes],
                       rows: Mapping[str, tuple[int, int]]) -> PayloadRef:
        """Upload part `k` of `n` of `learner`'s contribution to `round_`: `tensors` hold
        rows `rows[name]` of each tensor (plus `<name>.scale` entries of quantized
        formats). Create-if-absent; an own part no record references yet (an earlier
        attempt that failed) is replaced. `AlreadyContributed` once the record exists."""
        check_learner_id(learner)
        stem = part_key(round_, learner, k, n)
        meta = part_metadata(rows)
        ref = await self.store.put_payload(stem, tensors, create=True, metadata=meta)
        if ref is None:
            if await self.contribution(round_, learner) is not None:
                raise AlreadyContributed(
                    f"learner {learner!r} has already contributed to round {round_}; part "
                    f"{stem!r} belongs to its record")
            ref = await self.store.put_payload(stem, tensors, metadata=meta)
        assert ref is not None
        return ref

    async def publish_parts(self, draft: SnapshotRecord,
                            parts: Iterable[PayloadRef]) -> SnapshotRecord:
        """The record of `draft` (`Exchange.draft`) with its delta as `parts` (in k order,
        each uploaded by `put_part`). `AlreadyContributed` as `publish`."""
        record = dataclasses.replace(draft, payload=None, parts=tuple(parts))
        problem = delta_keys_problem(record, draft.round, draft.learner,
                                     [codec.extension(c) for c in CODECS])
        if problem is not None:
            raise LocalProtocolError(f"cannot publish {draft.learner!r}'s parts: "
                                     f"{problem[0]}; need {problem[1]}")
        key = contribution_key(draft.round, draft.learner)
        if await self.store.write_record(key, record):
            return record
        raise AlreadyContributed(
            f"learner {draft.learner!r} has already contributed to round {draft.round} "
            f"({key!r} exists); a learner contributes once per round")

    async def contribution(self, round_: int, learner: str) -> SnapshotRecord | None:
        """`learner`'s record for `round_`, or None when it has not contributed (one GET)."""
        check_learner_id(learner)
        return await self.store.read_record(
            contribution_key(round_, learner), SnapshotRecord
        )

    async def publishers(self, round_: int) -> frozenset[str]:
        """Learners whose record for `round_` exists (one LIST, no GET)."""
        prefix = round_dir("snapshots/", round_)
        out = set()
        for key in await self.store.keys(prefix):
            name = key[len(prefix):]
            if name.endswith(".json"):
                try:
                    out.add(check_learner_id(name[:-5]))
                except LocalProtocolError:
                    continue
        return frozenset(out)

    async def contributions(self, round_: int) -> Contributions:
        """Every contribution record of `round_` (one LIST, one GET each).

        A record that fails to parse, or whose learner, round or payload key disagree with
        its own key, is returned in `rejected` with the reason, never raised: one bad peer
        must not stop a round from closing. Records deleted meanwhile are skipped.
        """
        prefix = round_dir("snapshots/", round_)
        records: list[SnapshotRecord] = []
        rejected: list[Rejected] = []
        named: list[tuple[str, str]] = []
        for key in await self.store.keys(prefix):
            name = key[len(prefix):]
            try:
                named.append((key, check_learner_id(name[:-5] if name.endswith(".json")
                                                    else None)))
            except LocalProtocolError:
                rejected.append(Rejected(key, None, f"{key!r} does not name a learner"))
        # Read at once, READS_AT_ONCE at a time: a closer reads these after its claim,
        # with every learner of a barrier waiting, so M reads in a row cost M latencies.
        gate = asyncio.Semaphore(READS_AT_ONCE)

        async def read(key: str) -> SnapshotRecord | None:
            async with gate:
                return await self.store.read_record(key, SnapshotRecord)

        reads = await asyncio.gather(*(read(k) for k, _ in named), return_exceptions=True)
        for (key, learner), got in zip(named, reads, strict=True):
            if isinstance(got, ProtocolError):
                rejected.append(Rejected(key, learner, str(got)))
                continue
            if isinstance(got, BaseException):
                raise got
            record = got
            if record is None:
                continue
            problem = misfiled(record, key, round_, learner)
            if problem is not None:
                rejected.append(Rejected(key, learner, problem))
                continue
            records.append(record)
        return Contributions(tuple(records), tuple(rejected))

    async def fetch_delta(
        self, snapshot: SnapshotRecord, schema: Schema, names: Iterable[str]
    ) -> dict[str, DeltaTensor] | None:
        """A contribution's delta: verified, decoded, and checked to hold exactly `names` in
        the record's `delta_format` (plus `<name>.scale` entries of quantized formats).
        A delta made of parts is each part checked, its rows left where they lie, never
        joined (`wire.sharded_parts.pieces_of`: `RowPieces`; quantized parts come back in F32).

        None if the payload was swept. `CorruptPayload` for bad bytes; `SchemaMismatch`
        naming every missing, extra or mis-shaped tensor.
        """
        names = list(names)
        bound = delta_bound(schema, names)
        if snapshot.payload is not None:
            tensors = await self.store.fetch_tensors(snapshot.payload, bound)
            return None if tensors is None else dict(check_delta(tensors, snapshot, schema,
                                                                 names))
        parts = await self.store.fetch_parts(snapshot.parts, bound)
        return None if parts is None else pieces_of(parts, schema, names, snapshot.delta_format)

    # -- closing rounds --------------------------------------------------------------

    async def claim_round(self, round_: int, attempt: int, closer: str) -> bool:
        """Bid to close `round_` with `attempt`; True if this call holds that attempt."""
        claim = RoundClaim(round_, check_number("attempt", attempt, 10**6),
                           check_learner_id(closer))
        return await self.store.write_record(f"{round_dir('claims/round/', round_)}{attempt:06d}",
                                        claim)

    async def round_claims(self, round_: int) -> list[int]:
        """The closer attempts claimed for `round_`, ascending (one LIST)."""
        prefix = round_dir("claims/round/", round_)
        return attempts_in(await self.store.keys(prefix), prefix)

    async def read_round_claim(self, round_: int, attempt: int) -> RoundClaim | None:
        return await self.store.read_record(
            f"{round_dir('claims/round/', round_)}{attempt:06d}", RoundClaim)

    async def _put_artifact(self, kind: str, fragment: int, version: int, attempt: int,
                            tensors: Mapping[str, TensorBytes]) -> PayloadRef:
        key = artifact_key(kind, fragment, version, attempt, "")
        ref = await self.store.put_payload(key, tensors)
        assert ref is not None
        return ref

    async def put_theta(self, fragment: int, version: int, tensors: Mapping[str, TensorBytes],
                        *, attempt: int) -> PayloadRef:
        """Upload a commit's parameters (before the record that references them)."""
        return await self._put_artifact("theta", fragment, version, attempt, tensors)

    async def put_outer(self, fragment: int, version: int, tensors: Mapping[str, TensorBytes],
                        *, attempt: int) -> PayloadRef:
        """Upload a commit's outer state (momentum, fp32 master)."""
        return await self._put_artifact("outer", fragment, version, attempt, tensors)

    async def put_update(self, fragment: int, version: int,
                         tensors: Mapping[str, TensorBytes], *, attempt: int) -> PayloadRef:
        """Upload a commit's quantized Θ_new − Θ_old."""
        return await self._put_artifact("updates", fragment, version, attempt, tensors)

    async def put_step(self, fragment: int, version: int,
                       tensors: Mapping[str, TensorBytes], *, attempt: int) -> PayloadRef:
        """Upload a replicated commit's merged Δ."""
        return await self._put_artifact("steps", fragment, version, attempt, tensors)

    async def commit(self, record: RoundRecord) -> bool:
        """Create `rounds/<round>.json`; False if another closer committed the round first.

        Rounds are gap-free: committing round r needs round r−1's record
        (`LocalProtocolError` otherwise), which is what lets readers poll by GET.
        """
        if record.round > 0 and await self.mailbox.get(
                self.prefix + round_key(record.round - 1)) is None:
            raise LocalProtocolError(
                f"cannot commit round {record.round}: round {record.round - 1} has no record; "
                "rounds are committed strictly in order"
            )
        return await self.store.write_record(round_key(record.round), record)

    async def read_round(self, round_: int) -> RoundRecord | None:
        """Round `round_`'s record, or None while it is not committed."""
        key = round_key(round_)
        record = await self.store.read_record(key, RoundRecord)
        if record is not None and record.round != round_:
            raise RemoteProtocolError(f"record {key!r} says round {record.round}; its key says "
                                      f"round {round_}")
        return record

    async def rounds_after(self, cursor: int, limit: int | None = None) -> list[RoundRecord]:
        """The records of rounds cursor+1, cursor+2, ... in order, up to the first missing.

        Rounds are gap-free, so this GETs known keys and never LISTs: a poll that finds
        nothing new costs one GET. `cursor` = −1 starts from round 0.
        """
        out: list[RoundRecord] = []
        r = cursor + 1
        while limit is None or len(out) < limit:
            record = await self.read_round(r)
            if record is None:
                break
            out.append(record)
            r += 1
        return out

    async def _exists(self, round_: int) -> bool:
        return await self.mailbox.get(self.prefix + round_key(round_)) is not None

    async def newest_round(self, hint: int = -1) -> int:
        """The newest committed round (−1 if none), found with O(log n) GETs by galloping
        forward from `hint` (a round known to be committed) and bisecting."""
        lo, step = max(hint, -1), 1
        while lo + step < ROUND_LIMIT and await self._exists(lo + step):
            lo, step = lo + step, step * 2
        hi = min(lo + step, ROUND_LIMIT)  # not committed (or past the last round number)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if await self._exists(mid):
                lo = mid
            else:
                hi = mid
        return lo

    async def latest_commit_per_fragment(
        self, fragments: int, newest: int | None = None
    ) -> dict[int, RoundRecord]:
        """Each fragment's newest record (fragments never committed are absent), reading
        back from the newest round until every fragment is found (P GETs when round r
        trains fragment r mod P)."""
        if newest is None:
            newest = await self.newest_round()
        out: dict[int, RoundRecord] = {}
        r = newest
        while r >= 0 and len(out) < fragments:
            record = await self.read_round(r)
            if record is not None and record.fragment not in out:
                out[record.fragment] = record
            r -= 1
        return out

    async def sweep(
        self, keep_versions: int = 2, *, latest: Mapping[int, RoundRecord] | None = None,
        checkpoint_every: int | None = None, keep_rounds: int | None = None,
        fragments: int | None = None,
    ) -> list[str]:
        """Delete what `plan_sweep` says is no longer needed; returns the deleted keys.

        `latest` (each fragment's newest record), and the run's `checkpoint_every`,
        `keep_rounds` and number of `fragments`, are looked up when `latest` or
        `checkpoint_every` is not given.
        """
        if latest is None or checkpoint_every is None:
            manifest = await self.read_manifest()
            if manifest is None:
                return []
            fragments = len(manifest.plan)
            if latest is None:
                latest = await self.latest_commit_per_fragment(fragments)
            checkpoint_every = int(manifest.algorithm.get("checkpoint_every", 1))
            kept = manifest.algorithm.get("keep_rounds")
            keep_rounds = kept if isinstance(kept, int) else None
        keys: list[str] = []
        for area in (*ROUND_AREAS, *(f"{k}/" for k in ARTIFACT_KINDS)):
            keys.extend(await self.store.keys(area))
        doomed = plan_sweep(keys, latest, keep_versions, checkpoint_every, keep_rounds,
                            fragments)
        for key in doomed:
            await self.mailbox.delete(self.prefix + key)
        return doomed


def _holder(area: LeaseArea, holder: str) -> str:
    """The key of `holder`'s counter in `_lease_counter`: a learner and a standalone closer
    may share an id, never a counter."""
    return holder if area == LEARNERS else f"{area}/{holder}"
