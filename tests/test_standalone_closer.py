"""What a standalone closer does that an embedded one does not: it downloads each delta
of its open round as soon as it sees the contribution (`Prefetcher`), so that closing a
round reads only what arrived last, committing byte for byte what a closer that fetched
everything at closing time commits; and it writes commits in the run's codec."""

from __future__ import annotations

import asyncio
from typing import Any

from test_syncer import Run, algorithm, fingerprint

from gradientmail.clock import MonotonicClock
from gradientmail.mailbox import Mailbox, MemoryMailbox
from gradientmail.mailbox.wrappers import FaultPlan, FaultyMailbox
from gradientmail.syncer.runtime import CloserSettings, Syncer
from gradientmail.syncer.standalone import Prefetcher
from gradientmail.syncer.state import preferred_closer

LIVE = frozenset({"a", "b", "c"})


class Logged(FaultyMailbox):
    """Records the key of every full read."""

    def __init__(self, inner: Mailbox, plan: FaultPlan | None = None) -> None:
        super().__init__(inner, plan or FaultPlan())
        self.gets: list[str] = []

    async def get(self, key: str) -> bytes | None:
        self.gets.append(key)
        return await super().get(key)

    def payloads(self) -> list[str]:
        return sorted(k for k in self.gets if k.startswith("payloads/"))


def fresh(name: str) -> MemoryMailbox:
    MemoryMailbox.forget(name)
    return MemoryMailbox(name)


async def started(name: str, *contributors: str, **run: Any) -> Run:
    """A run of one fragment awaiting all three of `LIVE` on a fresh mailbox `name`, in
    which `contributors` published to round 0."""
    r = Run(fresh(name), algorithm(fragments=1, quorum_size=3), **run)
    await r.create()
    for learner in contributors:
        await r.contribute(0, learner)
    return r


async def settle(s: Syncer) -> None:
    """Let the closer's background downloads finish (each is a few awaits on memory)."""
    for _ in range(50):
        await asyncio.sleep(0)


def test_a_standalone_closer_reads_only_the_last_delta_when_it_closes() -> None:
    async def main() -> None:
        runs = [await started("prefetch-early", "a", "b"),
                await started("prefetch-late", "a", "b")]
        logged = Logged(runs[0].mailbox)
        s = runs[0].syncer(mailbox=logged)
        assert not await s.poll(live=LIVE)
        await settle(s)
        assert logged.payloads() == ["payloads/0000000000/a.safetensors",
                                     "payloads/0000000000/b.safetensors"]
        logged.gets.clear()
        await runs[0].contribute(0, "c")
        assert await s.poll(live=LIVE)
        assert logged.payloads() == ["payloads/0000000000/c.safetensors"]

        # The same contributions closed by a closer that saw them all at once.
        await runs[1].contribute(0, "c")
        assert await runs[1].syncer().poll(live=LIVE)
        done = [await r.records() for r in runs]
        assert [p.learner for p in done[0][0].participants] == ["a", "b", "c"]
        assert fingerprint(done[0]) == fingerprint(done[1])

    asyncio.run(main())


def test_a_download_that_failed_early_is_made_again_when_the_round_closes() -> None:
    async def main() -> None:
        r = await started("prefetch-fails", "a", "b")
        logged = Logged(r.mailbox, FaultPlan().fail("get", "payloads/*/b.*", times=1))
        s = r.syncer(mailbox=logged)
        assert not await s.poll(live=LIVE)
        await settle(s)
        await r.contribute(0, "c")
        assert await s.poll(live=LIVE)
        (rec,) = await r.records()
        assert [p.learner for p in rec.participants] == ["a", "b", "c"] and rec.dropped == ()
        assert logged.payloads().count("payloads/0000000000/b.safetensors") == 2

    asyncio.run(main())


def test_downloads_of_a_round_that_closed_are_dropped() -> None:
    async def main() -> None:
        box = fresh("prefetch-drop")
        r = Run(box, algorithm(fragments=1, quorum_size=2))
        manifest = await r.create()
        snap = await r.contribute(0, "a")
        p = Prefetcher(r.ex)
        p.open(0, manifest.schema, manifest.plan[0])
        p.start("a")
        fetched, delta = await p.take(snap)
        assert fetched and delta is not None and sorted(delta) == sorted(manifest.plan[0])
        p.open(1, manifest.schema, manifest.plan[0])
        assert await p.take(snap) == (False, None)
        # A record that is not the one downloaded is fetched by the closer itself.
        p.open(0, manifest.schema, manifest.plan[0])
        p.start("a")
        other = await r.contribute(1, "a")
        assert await p.take(other) == (False, None)
        p.close()

    asyncio.run(main())


def test_an_embedded_closer_does_not_download_ahead() -> None:
    async def main() -> None:
        r = await started("prefetch-embedded", "b", "c")
        logged = Logged(r.mailbox)
        # The round's preferred closer: it lists the round and sees b and c.
        assert preferred_closer(0, LIVE) == "a"
        s = r.syncer("a", mailbox=logged, embedded=True)
        assert not await s.poll(live=LIVE)
        await settle(s)
        assert s.host is not None and s.host.publishers_seen(0) == {"b", "c"}
        assert logged.payloads() == []

    asyncio.run(main())


def test_a_standalone_closer_writes_commits_in_the_runs_codec() -> None:
    async def main() -> None:
        box = fresh("standalone-codec")
        r = Run(box, algorithm(fragments=1, quorum_size=1, checkpoint_every=1))
        await r.create(codec="zstd")
        await r.contribute(0, "a")
        s = Syncer.open(box, clock=r.clock, closer_id="sync-1")
        assert s.exchange.store.compression == "off"
        assert await s.poll(live=frozenset({"a"}))
        (rec,) = await r.records()
        assert rec.theta is not None and rec.outer is not None
        assert all(ref.key.endswith(".zst") for ref in rec.payload_refs())
        # ... and reads back as the same tensors a closer writing uncompressed gives.
        plain = fresh("standalone-codec-off")
        r2 = Run(plain, algorithm(fragments=1, quorum_size=1, checkpoint_every=1))
        await r2.create()
        await r2.contribute(0, "a")
        assert await Syncer.open(plain, clock=r2.clock, closer_id="sync-1").poll(
            live=frozenset({"a"}))
        (rec2,) = await r2.records()
        assert rec2.theta is not None and not rec2.theta.key.endswith(".zst")
        assert await r.ex.store.fetch_tensors(rec.theta) == await r2.ex.store.fetch_tensors(
            rec2.theta)

    asyncio.run(main())


class Requests(FaultyMailbox):
    """Records (operation, key) of every read, listing and write."""

    def __init__(self, inner: Mailbox) -> None:
        super().__init__(inner, FaultPlan())
        self.log: list[tuple[str, str]] = []

    async def get(self, key: str) -> bytes | None:
        self.log.append(("get", key))
        return await super().get(key)

    async def list(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        self.log.append(("list", prefix))
        return await super().list(prefix, start_after)

    async def create(self, key: str, data: bytes) -> bool:
        self.log.append(("create", key))
        return await super().create(key, data)


def test_a_closer_that_sees_the_last_contribution_claims_without_listing_again() -> None:
    """The look between polls that finds the last awaited contribution is followed by the
    claim itself: no catch-up, lease, contribution or claim listing in between; and the
    round closes on the records its downloads read, without listing or reading them again."""

    async def main() -> list[tuple[str, str]]:
        r = await started("sighting", "a", "b", clock=MonotonicClock())
        for learner in sorted(LIVE):
            await r.ex.beat(learner)
        logged = Requests(r.mailbox)
        s = Syncer.open(logged, closer_id="sync-1",
                        settings=CloserSettings(poll_interval=5.0, lease_timeout=60.0))
        stop = asyncio.Event()
        task = asyncio.create_task(s.run(stop))
        while not logged.log.count(("get", "snapshots/0000000000/c.json")):
            await asyncio.sleep(0.005)  # it looks for c between polls
        mark = len(logged.log)
        await r.contribute(0, "c")
        while await r.ex.read_round(0) is None:
            await asyncio.sleep(0.005)
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        (rec,) = await r.records()
        assert [p.learner for p in rec.participants] == ["a", "b", "c"]
        return logged.log[mark:]

    log = asyncio.run(main())
    # The first look at c's record after it was written found it.
    seen = log.index(("get", "snapshots/0000000000/c.json"))
    claim = log.index(("create", "claims/round/0000000000/000000"))
    assert seen < claim
    between = [op for op in log[seen + 1:claim] if op[0] == "list" or op[1].startswith("rounds/")]
    assert between == [], between
    commit = log.index(("create", "rounds/0000000000.json"))
    closing = [op for op in log[claim + 1:commit] if op[1].startswith("snapshots/")]
    assert closing == [], closing


def test_a_sighted_round_lists_its_records_unless_every_one_was_read_in_its_place() -> None:
    """The records a sighted close takes from the downloads: every one seen, in order;
    None (so the closer lists the round, and drops a bad record with its reason) when one
    was not downloaded, or reads another learner's record than its key's."""

    async def main() -> None:
        r = await started("prefetch-records", "a", "b")
        manifest = await r.ex.read_manifest()
        assert manifest is not None
        p = Prefetcher(r.ex)
        p.open(0, manifest.schema, manifest.plan[0])
        p.start("b")
        p.start("a")
        assert [s.learner for s in await p.records(["a", "b"]) or []] == ["a", "b"]
        assert await p.records(["a", "b", "c"]) is None
        # d's key holds a's record (copied there by a peer, say).
        a_record = await r.mailbox.get("snapshots/0000000000/a.json")
        assert a_record is not None
        await r.mailbox.put("snapshots/0000000000/d.json", a_record)
        p.start("d")
        assert await p.records(["a", "d"]) is None
        p.close()

    asyncio.run(main())


class Deletes(Requests):
    """`Requests`, and every deletion."""

    async def delete(self, key: str) -> None:
        self.log.append(("delete", key))
        await super().delete(key)


def test_a_pipelined_barrier_closes_its_syncs_rounds_back_to_back_and_sweeps_after() -> None:
    """stagger=False: a sync's two rounds are in before the closer starts. It closes the
    second right after the first (polling at once after a commit: with a 60 s poll
    interval it would otherwise look a minute later, past the test's 30 s bound), and
    sweeps only after the sync's last round, not between its rounds (a sweep there is
    time every waiting learner spends)."""

    async def main() -> list[tuple[str, str]]:
        alg = algorithm(fragments=2, quorum_size=3, in_flight=2, overlap_steps=0,
                        stagger=False)
        r = Run(fresh("pipelined"), alg, clock=MonotonicClock())
        await r.create()
        for learner in sorted(LIVE):
            await r.ex.beat(learner)
            for rnd in (0, 1):
                await r.contribute(rnd, learner, base_version=0)
        logged = Deletes(r.mailbox)
        s = Syncer.open(logged, closer_id="sync-1",
                        settings=CloserSettings(poll_interval=60.0, lease_timeout=120.0))
        stop = asyncio.Event()
        task = asyncio.create_task(s.run(stop))

        async def swept() -> None:
            while not any(op == "delete" for op, _ in logged.log):
                await asyncio.sleep(0.005)

        await asyncio.wait_for(swept(), timeout=30)
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        assert [[p.learner for p in rec.participants] for rec in await r.records()] == [
            ["a", "b", "c"], ["a", "b", "c"]]
        return logged.log

    log = asyncio.run(main())
    first = log.index(("create", "rounds/0000000000.json"))
    second = log.index(("create", "rounds/0000000001.json"))
    deletes = [i for i, (op, _) in enumerate(log) if op == "delete"]
    assert deletes and min(deletes) > second, (first, second, deletes)
    assert ("delete", "snapshots/0000000000/a.json") in log
