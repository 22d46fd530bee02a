"""Exchange: key layout, pure decisions, and full flows on real mailboxes."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest

from gradientmail.errors import (
    AlreadyContributed,
    ConfigError,
    CorruptPayload,
    LocalProtocolError,
    RemoteProtocolError,
    SchemaMismatch,
)
from gradientmail.mailbox import Mailbox, MemoryMailbox
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.run.keyspace import (
    artifact_key,
    current_attempt,
    plan_sweep,
    round_key,
    screen_snapshot,
)
from gradientmail.run.lease import LeaseTracker
from gradientmail.run.protocol import Exchange
from gradientmail.testing import FakeClock
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.records import Manifest, Participant, RoundRecord, SnapshotRecord
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.serialization import ParameterSpec, Schema
from gradientmail.wire.tensor_bytes import TensorBytes

T = TypeVar("T")
SCHEMA = Schema((ParameterSpec("w", "F32", (2, 3)), ParameterSpec("b", "F32", (3,))))
DIGEST = SCHEMA.digest()
PLAN = (("w",), ("b",))


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def tensors(fragment: int, value: float) -> dict[str, TensorBytes]:
    names = PLAN[fragment]
    return {n: TensorBytes.from_numpy(np.full(SCHEMA[n].shape, value, np.float32))
            for n in names}


def record(round_: int, version: int, theta: PayloadRef, outer: PayloadRef,
           closer: str = "closer") -> RoundRecord:
    return RoundRecord(
        round=round_, fragment=round_ % 2, version=version, theta=theta, outer=outer,
        update=None, participants=(Participant("a", 10 * round_, 10, 100, 1000.0),),
        estimates=Estimates(0.5, None, None), mean_cosine=None, dropped=(), closer=closer,
        all_final=False,
    )


async def commit_round(ex: Exchange, round_: int, attempt: int = 0) -> RoundRecord:
    fragment, version = round_ % 2, round_ // 2 + 1
    theta = await ex.put_theta(fragment, version, tensors(fragment, round_), attempt=attempt)
    outer = await ex.put_outer(fragment, version, tensors(fragment, -round_), attempt=attempt)
    rec = record(round_, version, theta, outer)
    assert await ex.commit(rec)
    return rec


# -- pure functions --------------------------------------------------------------------

def test_key_layout() -> None:
    assert round_key(42) == "rounds/0000000042.json"
    assert artifact_key("theta", 3, 17, 2, ".safetensors.zst") == \
        "theta/3/0000000017-000002.safetensors.zst"
    with pytest.raises(LocalProtocolError, match=r"round=-1 must be an integer in \[0, "):
        round_key(-1)
    with pytest.raises(LocalProtocolError, match="round=10000000000 must be"):
        round_key(10**10)
    with pytest.raises(LocalProtocolError, match="artifact kind 'model' must be one of"):
        artifact_key("model", 0, 1, 0, "")


def test_current_attempt() -> None:
    assert current_attempt([]) is None
    assert current_attempt([0, 2, 1]) == 2


def snap(learner: str, fragment: int = 1, base: int = 3, digest: str = DIGEST) -> SnapshotRecord:
    return SnapshotRecord(learner, 7, fragment, base, 100, 10, 1000, False, digest, "F32",
                          PayloadRef(f"payloads/0000000007/{learner}.safetensors", 1, "0" * 64))


def test_screen_snapshot_names_what_each_contribution_breaks() -> None:
    def screen(s: SnapshotRecord) -> str | None:
        return screen_snapshot(s, fragment=1, version=3, schema_digest=DIGEST)

    assert [screen(s) for s in (snap("a"), snap("b", base=2), snap("c", fragment=0),
                                snap("d", digest="f" * 64))] == [
        None,
        "stale: base version 2, the fragment is at version 3",
        "fragment 0, the round trains fragment 1",
        f"another schema digest ffffffffffff, the run's is {DIGEST[:12]}",
    ]


def test_screen_snapshot_reports_the_first_rule_broken_in_one_order() -> None:
    def screen(s: SnapshotRecord) -> str | None:
        return screen_snapshot(s, fragment=1, version=3, schema_digest=DIGEST)

    assert screen(snap("a")) is None
    # Every rule broken at once: the fragment is reported, then the digest, then staleness.
    assert screen(snap("a", fragment=0, base=2, digest="f" * 64)) == (
        "fragment 0, the round trains fragment 1")
    assert screen(snap("a", base=2, digest="f" * 64)) == (
        f"another schema digest ffffffffffff, the run's is {DIGEST[:12]}")
    assert screen(snap("a", base=4)) == "stale: base version 4, the fragment is at version 3"
    idle = dataclasses.replace(snap("a"), steps=0, tokens=0)
    assert screen(idle) == "no steps trained"
    assert screen(dataclasses.replace(idle, base_version=2)) == (
        "stale: base version 2, the fragment is at version 3")


def _ref(key: str) -> PayloadRef:
    return PayloadRef(key, 1, "0" * 64)


def test_plan_sweep() -> None:
    latest = {
        0: record(6, 4, _ref("theta/0/0000000004-000001.safetensors"),
                  _ref("outer/0/0000000004-000001.safetensors")),
        1: record(5, 3, _ref("theta/1/0000000003-000000.safetensors"),
                  _ref("outer/1/0000000003-000000.safetensors")),
    }
    keys = [
        "payloads/0000000005/a.safetensors", "payloads/0000000006/a.safetensors",
        "payloads/0000000007/a.safetensors",  # round 7 is still open
        "snapshots/0000000006/a.json", "snapshots/0000000007/b.json",
        "claims/round/0000000006/000000", "claims/round/0000000007/000000",
        "claims/create/000000", "manifest.json", "rounds/0000000006.json",
        "init/000000/0.safetensors",
        "theta/0/0000000002-000000.safetensors",  # version 2 of 4: gone with K=2
        "theta/0/0000000003-000000.safetensors",  # kept (newest 2 = 3, 4)
        "theta/0/0000000004-000000.safetensors",  # a superseded closer's upload of v4
        "theta/0/0000000004-000001.safetensors",  # referenced
        "theta/0/0000000005-000000.safetensors",  # being uploaded for round 8
        "outer/0/0000000002-000000.safetensors", "outer/0/0000000004-000001.safetensors",
        "updates/0/0000000001-000000.safetensors",
        "theta/1/0000000001-000000.safetensors", "theta/1/0000000003-000000.safetensors",
        "theta/2/0000000001-000000.safetensors",  # no record for fragment 2: kept
        "theta/0/junk", "payloads/junk/a", "payloads/00000000012/x",
    ]
    assert plan_sweep(keys, latest, keep_versions=2) == [
        "payloads/0000000005/a.safetensors", "payloads/0000000006/a.safetensors",
        "snapshots/0000000006/a.json", "claims/round/0000000006/000000",
        "theta/0/0000000002-000000.safetensors", "theta/0/0000000004-000000.safetensors",
        "outer/0/0000000002-000000.safetensors", "updates/0/0000000001-000000.safetensors",
        "theta/1/0000000001-000000.safetensors",
    ]
    assert plan_sweep(keys, {}, 2) == []
    keep_one = plan_sweep(keys, latest, keep_versions=1)
    assert "theta/0/0000000003-000000.safetensors" in keep_one
    assert "theta/0/0000000004-000001.safetensors" not in keep_one
    with pytest.raises(ConfigError, match="keep_versions=0 must be an integer >= 1"):
        plan_sweep(keys, latest, keep_versions=0)


def test_exchange_constructor_checks() -> None:
    with pytest.raises(ConfigError, match="compression='lz4' must be one of"):
        Exchange(MemoryMailbox(), compression="lz4")
    with pytest.raises(ConfigError, match="prefix='run' must be empty or end with '/'"):
        Exchange(MemoryMailbox(), prefix="run")


# -- flows -----------------------------------------------------------------------------

def manifest(creator: str, init: tuple[PayloadRef, ...]) -> Manifest:
    return Manifest(SCHEMA, PLAN, {"name": "diloco"}, creator, init, "off")


def test_creation_election_and_manifest_once() -> None:
    async def main() -> None:
        box = MemoryMailbox()
        a, b = Exchange(box), Exchange(box)
        assert await a.read_manifest() is None
        assert await a.creation_claims() == []
        assert await a.claim_creation("a", 0)
        assert not await b.claim_creation("b", 0)
        assert await b.creation_claims() == [0]
        claim = await b.read_creation_claim(0)
        assert claim is not None and claim.learner == "a"
        # b takes over with the next attempt; its init payloads never collide with a's.
        assert await b.claim_creation("b", 1)
        assert await a.creation_claims() == [0, 1]
        init_b = tuple([await b.put_init(p, tensors(p, 1.0), attempt=1) for p in (0, 1)])
        init_a = tuple([await a.put_init(p, tensors(p, 2.0), attempt=0) for p in (0, 1)])
        assert init_b[0].key == "init/000001/0.safetensors"
        assert await b.create_manifest(manifest("b", init_b))
        assert not await a.create_manifest(manifest("a", init_a))
        m = await a.read_manifest()
        assert m == manifest("b", init_b)
        got = await a.store.fetch_tensors(m.init[0])
        assert got == tensors(0, 1.0)
        with pytest.raises(LocalProtocolError, match="learner id 'a b' is invalid"):
            await a.claim_creation("a b", 2)

    run(main())


def test_leases_beat_list_release_with_tracker() -> None:
    async def main() -> None:
        box = CountingMailbox(MemoryMailbox())
        clock = FakeClock(1000.0)
        a, b, observer = Exchange(box, clock=clock), Exchange(box), Exchange(box, clock=clock)
        tracker = LeaseTracker(timeout=120.0)
        assert await a.beat("a") == 0
        assert await b.beat("b") == 0
        assert await a.beat("a") == 1
        assert await box.list("leases/") == ["leases/a/000000000001", "leases/b/000000000000"]
        assert await observer.observe_leases(tracker) == {"a", "b"}
        clock.advance(60.0)
        await a.beat("a")
        assert await observer.observe_leases(tracker) == {"a", "b"}
        clock.advance(70.0)  # b last changed 130 s ago on the observer's clock
        box.reset()
        assert await observer.observe_leases(tracker) == {"a"}
        assert box.snapshot().list == 1 and box.snapshot().get == 0
        await a.release("a")
        assert await observer.leases() == {"b": 0}
        assert await observer.observe_leases(tracker) == frozenset()
        # A restarted b (a fresh Exchange) continues after its old counter.
        assert await Exchange(box).beat("b") == 1
        assert await box.list("leases/b/") == ["leases/b/000000000001"]
        await Exchange(box).release("b")  # releasing without having beaten: list + delete
        assert await observer.leases() == {}

    run(main())


def test_publish_contributions_and_fetch() -> None:
    async def main() -> None:
        box = MemoryMailbox()
        ex = Exchange(box)
        fields: dict[str, Any] = dict(fragment=1, base_version=0, local_step=20, steps=20,
                                      tokens=4096, final=False, schema_digest=DIGEST,
                                      delta_format="F32")
        assert await ex.publishers(3) == frozenset()
        rec = await ex.publish(3, "a", tensors(1, 0.5), **fields)
        assert rec.payload.key == "payloads/0000000003/a.safetensors"
        await ex.publish(3, "b", tensors(1, 0.25), **fields)
        assert await ex.publishers(3) == {"a", "b"}
        got = await ex.contributions(3)
        assert [r.learner for r in got.records] == ["a", "b"] and got.rejected == ()
        assert got.records[0] == rec
        assert await ex.fetch_delta(rec, SCHEMA, ["b"]) == tensors(1, 0.5)
        with pytest.raises(AlreadyContributed, match="learner 'a' has already contributed "
                                                     "to round 3"):
            await ex.publish(3, "a", tensors(1, 0.5), **fields)
        with pytest.raises(LocalProtocolError, match="base_version=-1 must be"):
            await ex.publish(4, "a", tensors(1, 0.5), **{**fields, "base_version": -1})
        assert await box.list("payloads/0000000004/") == []  # nothing uploaded

        key = rec.payload.key
        blob = await box.get(key)
        assert blob is not None
        await box.put(key, blob[:-1] + bytes([blob[-1] ^ 1]))
        with pytest.raises(CorruptPayload, match=f"payload '{key}' has SHA-256"):
            await ex.fetch_delta(rec, SCHEMA, ["b"])
        await box.put(key, blob[:-4])
        with pytest.raises(CorruptPayload, match=f"payload '{key}' is {len(blob) - 4} bytes "
                                                 f"but its record says {len(blob)}"):
            await ex.store.fetch_payload(rec.payload)
        await box.delete(key)
        assert await ex.fetch_delta(rec, SCHEMA, ["b"]) is None  # swept
        huge = dataclasses.replace(rec, payload=dataclasses.replace(rec.payload, size=10**9))
        with pytest.raises(CorruptPayload, match="is declared 1000000000 bytes, over the bound"):
            await ex.fetch_delta(huge, SCHEMA, ["b"])

    run(main())


def test_fetch_delta_checks_names_and_format() -> None:
    async def main() -> None:
        ex = Exchange(MemoryMailbox())
        fields: dict[str, Any] = dict(fragment=0, base_version=0, local_step=1, steps=1,
                                      tokens=1, final=True, schema_digest=DIGEST)
        rec = await ex.publish(0, "a", tensors(0, 1.0), delta_format="BF16", **fields)
        with pytest.raises(SchemaMismatch, match="'w' has dtype F32, expected BF16"):
            await ex.fetch_delta(rec, SCHEMA, ["w"])
        rec = await ex.publish(0, "b", {**tensors(0, 1.0), "x": tensors(1, 0.0)["b"]},
                               delta_format="F32", **fields)
        with pytest.raises(SchemaMismatch, match=r"extra \['x'\]"):
            await ex.fetch_delta(rec, SCHEMA, ["w"])
        scale = TensorBytes.from_numpy(np.ones((), np.float32))
        rec = await ex.publish(0, "c", {**tensors(0, 1.0), "w.scale": scale},
                               delta_format="F32", **fields)
        got = await ex.fetch_delta(rec, SCHEMA, ["w"])
        assert got is not None and set(got) == {"w", "w.scale"}

    run(main())


def test_contributions_reports_bad_records() -> None:
    async def main() -> None:
        box = MemoryMailbox()
        ex = Exchange(box)
        good = await ex.publish(2, "a", tensors(0, 1.0), fragment=0, base_version=0,
                                local_step=1, steps=1, tokens=1, final=False,
                                schema_digest=DIGEST, delta_format="F32")
        await box.put("snapshots/0000000002/b.json", b"{not json")
        liar = dataclasses.replace(good, learner="a")  # a's record stored under c's name
        await box.put("snapshots/0000000002/c.json", liar.encode())
        await box.put("snapshots/0000000002/d.json", dataclasses.replace(good, learner="d",
                                                                          round=5).encode())
        await box.put("snapshots/0000000002/=x.json", b"{}")
        thief = dataclasses.replace(good, learner="e")  # claims a's delta as its own
        await box.put("snapshots/0000000002/e.json", thief.encode())
        got = await ex.contributions(2)
        assert got.records == (good,)
        by_key = {r.key: r for r in got.rejected}
        assert set(by_key) == {"snapshots/0000000002/b.json", "snapshots/0000000002/c.json",
                               "snapshots/0000000002/d.json", "snapshots/0000000002/=x.json",
                               "snapshots/0000000002/e.json"}
        assert "payload 'payloads/0000000002/a.safetensors'; its key says learner 'e'" in \
            by_key["snapshots/0000000002/e.json"].reason
        assert by_key["snapshots/0000000002/=x.json"].learner is None
        assert "does not name a learner" in by_key["snapshots/0000000002/=x.json"].reason
        assert by_key["snapshots/0000000002/b.json"].learner == "b"
        assert "'snapshots/0000000002/b.json' is not valid JSON" in \
            by_key["snapshots/0000000002/b.json"].reason
        assert "says learner 'a', round 2" in by_key["snapshots/0000000002/c.json"].reason
        assert "its key says learner 'c', round 2" in \
            by_key["snapshots/0000000002/c.json"].reason
        assert "round 5" in by_key["snapshots/0000000002/d.json"].reason
        # publishers() is a LIST only: it names whoever has a record key, parsed or not.
        assert await ex.publishers(2) == {"a", "b", "c", "d", "e"}

    run(main())


def test_round_claims_commit_and_rounds_after() -> None:
    async def main() -> None:
        box = CountingMailbox(MemoryMailbox())
        ex = Exchange(box)
        assert await ex.round_claims(0) == []
        assert await ex.claim_round(0, 0, "a")
        assert not await ex.claim_round(0, 0, "b")
        assert await ex.claim_round(0, 1, "b")
        assert await ex.round_claims(0) == [0, 1]
        claim = await ex.read_round_claim(0, 1)
        assert claim is not None and claim.closer == "b"

        theta = await ex.put_theta(0, 1, tensors(0, 1.0), attempt=1)
        outer = await ex.put_outer(0, 1, tensors(0, 0.0), attempt=1)
        assert theta.key == "theta/0/0000000001-000001.safetensors"
        with pytest.raises(LocalProtocolError, match="cannot commit round 1: round 0 has "
                                                     "no record"):
            await ex.commit(record(1, 1, theta, outer))
        r0 = record(0, 1, theta, outer, closer="b")
        assert await ex.commit(r0)
        assert not await ex.commit(dataclasses.replace(r0, closer="a"))
        assert await ex.read_round(0) == r0
        records = [r0] + [await commit_round(ex, r) for r in range(1, 6)]
        assert await ex.rounds_after(-1) == records
        assert await ex.rounds_after(2) == records[3:]
        assert await ex.rounds_after(0, limit=2) == records[1:3]
        assert await ex.rounds_after(5) == []
        box.reset()
        assert await ex.rounds_after(5) == []  # an idle poll: one GET, no LIST
        assert (box.snapshot().get, box.snapshot().list) == (1, 0)
        got = await ex.store.fetch_tensors(records[4].theta)
        assert got == tensors(0, 4.0)

        await box.put(round_key(6), records[5].encode())  # round 5's record at round 6's key
        with pytest.raises(RemoteProtocolError, match=r"'rounds/0000000006.json' says round 5"):
            await ex.rounds_after(5)

    run(main())


@pytest.mark.parametrize("committed", [0, 1, 2, 5, 37])
def test_newest_round_and_latest_commits(committed: int) -> None:
    async def main() -> None:
        box = CountingMailbox(MemoryMailbox())
        ex = Exchange(box)
        records = [await commit_round(ex, r) for r in range(committed)]
        box.reset()
        newest = await ex.newest_round()
        assert newest == committed - 1
        assert box.snapshot().get <= 2 * max(committed, 1).bit_length() + 2
        assert box.snapshot().list == 0
        if committed:
            assert await ex.newest_round(hint=committed // 2) == committed - 1
        latest = await ex.latest_commit_per_fragment(2)
        want = {}
        for rec in records[-2:]:
            want[rec.fragment] = rec
        assert latest == want

    run(main())


def test_sweep_keeps_newest_versions() -> None:
    async def main() -> None:
        box = MemoryMailbox()
        ex = Exchange(box)
        init = tuple([await ex.put_init(p, tensors(p, 0.0), attempt=0) for p in (0, 1)])
        assert await ex.create_manifest(manifest("a", init))
        for r in range(8):
            await ex.publish(r, "a", tensors(r % 2, 1.0), fragment=r % 2,
                             base_version=r // 2, local_step=r, steps=1, tokens=1,
                             final=False, schema_digest=DIGEST, delta_format="F32")
            await ex.claim_round(r, 0, "a")
            if r == 7:  # a superseded closer's upload, then the winner's
                await ex.put_theta(1, 4, tensors(1, 9.0), attempt=0)
                await commit_round(ex, r, attempt=1)
            else:
                await commit_round(ex, r)
        await ex.publish(8, "a", tensors(0, 1.0), fragment=0, base_version=4, local_step=8,
                         steps=1, tokens=1, final=False, schema_digest=DIGEST,
                         delta_format="F32")
        await ex.put_theta(0, 5, tensors(0, 1.0), attempt=0)  # round 8 closing right now
        deleted = await ex.sweep(keep_versions=2)
        assert "payloads/0000000007/a.safetensors" in deleted
        left = await box.list("")
        assert [k for k in left if k.startswith(("payloads/", "snapshots/", "claims/"))] == [
            "payloads/0000000008/a.safetensors",
            "snapshots/0000000008/a.json",
        ]
        assert [k for k in left if k.startswith("theta/")] == [
            "theta/0/0000000003-000000.safetensors", "theta/0/0000000004-000000.safetensors",
            "theta/0/0000000005-000000.safetensors",
            "theta/1/0000000003-000000.safetensors", "theta/1/0000000004-000001.safetensors",
        ]
        assert [k for k in left if k.startswith("outer/")] == [
            "outer/0/0000000003-000000.safetensors", "outer/0/0000000004-000000.safetensors",
            "outer/1/0000000003-000000.safetensors", "outer/1/0000000004-000001.safetensors",
        ]
        assert len([k for k in left if k.startswith("rounds/")]) == 8
        assert [k for k in left if k.startswith("init/")] == [r.key for r in init]
        # A reader holding an old record finds its payload gone and starts over.
        old = await ex.read_round(1)
        assert old is not None and await ex.store.fetch_tensors(old.theta) is None
        assert await ex.sweep() == []  # nothing more to do

    run(main())


class PrefixSeal:
    """A toy seal: records are stored behind a tag, and refused without it."""

    fingerprint: str | None = None

    def seal(self, key: str, data: bytes) -> bytes:
        return b"SEALED:" + data

    def open(self, key: str, data: bytes) -> bytes:
        if not data.startswith(b"SEALED:"):
            raise RemoteProtocolError(f"record {key!r} is not sealed")
        return data[7:]


def test_prefix_and_seal() -> None:
    async def main() -> None:
        box = MemoryMailbox()
        ex = Exchange(box, prefix="runs/r1/", seal=PrefixSeal())
        assert await ex.claim_creation("a", 0)
        init = tuple([await ex.put_init(p, tensors(p, 0.0), attempt=0) for p in (0, 1)])
        assert init[0].key == "init/000000/0.safetensors"  # refs are relative to the prefix
        await ex.create_manifest(manifest("a", init))
        stored = await box.get("runs/r1/manifest.json")
        assert stored is not None and stored.startswith(b"SEALED:{")
        assert await ex.read_manifest() == manifest("a", init)
        assert await ex.creation_claims() == [0]
        await ex.beat("a")
        assert await ex.leases() == {"a": 0}
        await box.put("runs/r1/rounds/0000000000.json", b"{}")
        with pytest.raises(RemoteProtocolError, match=r"'rounds/0000000000.json' is not sealed"):
            await ex.read_round(0)
        assert await Exchange(box).read_manifest() is None  # another prefix, another run

    run(main())


def test_full_flow_on_every_mailbox(any_mailbox: Mailbox) -> None:
    async def main() -> None:
        ex = Exchange(any_mailbox, clock=FakeClock(), prefix="run/")
        assert await ex.claim_creation("a", 0)
        init = tuple([await ex.put_init(p, tensors(p, 0.0), attempt=0) for p in (0, 1)])
        assert await ex.create_manifest(manifest("a", init))
        assert not await ex.create_manifest(manifest("b", init))
        await ex.beat("a")
        await ex.beat("b")
        assert set(await ex.leases()) == {"a", "b"}
        for r in range(3):
            for learner in ("a", "b"):
                await ex.publish(r, learner, tensors(r % 2, float(r)), fragment=r % 2,
                                 base_version=r // 2, local_step=r, steps=1, tokens=8,
                                 final=False, schema_digest=DIGEST, delta_format="F32")
            assert await ex.publishers(r) == {"a", "b"}
            got = await ex.contributions(r)
            assert len(got.records) == 2 and not got.rejected
            delta = await ex.fetch_delta(got.records[0], SCHEMA, PLAN[r % 2])
            assert delta == tensors(r % 2, float(r))
            assert await ex.claim_round(r, 0, "a")
            assert not await ex.claim_round(r, 0, "b")
            await commit_round(ex, r)
        assert [rec.round for rec in await ex.rounds_after(-1)] == [0, 1, 2]
        assert await ex.newest_round() == 2
        deleted = await ex.sweep(keep_versions=1)
        assert "theta/0/0000000001-000000.safetensors" in deleted
        assert await any_mailbox.list("run/payloads/") == []
        await ex.release("a")
        assert set(await ex.leases()) == {"b"}

    run(main())


def test_zstd_codec_is_named_by_the_key() -> None:
    async def main() -> None:
        box = MemoryMailbox()
        writer, reader = Exchange(box, compression="zstd"), Exchange(box)
        rec = await writer.publish(0, "a", tensors(0, 3.0), fragment=0, base_version=0,
                                   local_step=1, steps=1, tokens=1, final=False,
                                   schema_digest=DIGEST, delta_format="F32")
        assert rec.payload.key == "payloads/0000000000/a.safetensors.zst"
        stored = await box.get(rec.payload.key)
        assert stored is not None and stored[:4] == b"\x28\xb5\x2f\xfd"  # a zstd frame
        got = await reader.contributions(0)
        assert got.records == (rec,)
        assert await reader.fetch_delta(rec, SCHEMA, ["w"]) == tensors(0, 3.0)
        theta = await writer.put_theta(1, 1, tensors(1, 2.0), attempt=0)
        assert theta.key == "theta/1/0000000001-000000.safetensors.zst"
        assert await reader.store.fetch_tensors(theta) == tensors(1, 2.0)

    run(main())


def test_hostile_records_in_the_mailbox_name_their_key() -> None:
    async def main() -> None:
        box = MemoryMailbox()
        ex = Exchange(box)
        await box.put("manifest.json", b'{"v":2}')
        with pytest.raises(RemoteProtocolError, match=r"record 'manifest.json': field 'v' is 2"):
            await ex.read_manifest()
        await box.put("rounds/0000000000.json", b'{"round":0}')
        with pytest.raises(RemoteProtocolError, match=r"record 'rounds/0000000000.json': the "
                                                      r"record must have exactly the fields"):
            await ex.rounds_after(-1)
        await box.put("claims/round/0000000000/000000", b"\x00" * 10)
        with pytest.raises(RemoteProtocolError, match="'claims/round/0000000000/000000' is "
                                                      "not valid JSON"):
            await ex.read_round_claim(0, 0)

    run(main())
