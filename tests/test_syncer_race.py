"""Several syncers on one run: racing closers, and closers that die after their claim.

Whatever the interleaving, every round gets exactly one record and the committed bytes are
those of a single syncer closing the same contributions alone. The contributions are
published up front (round r against version r // P of its fragment, what it has when
every earlier round committed), so only the closers race.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from test_syncer import (
    GateClock,
    Run,
    algorithm,
    fake,
    fingerprint,
)

from gradientmail.events import ClaimSuperseded, CommitLost, RoundClosed
from gradientmail.mailbox import Mailbox, MemoryMailbox, S3Mailbox
from gradientmail.mailbox.wrappers import FaultPlan, FaultyMailbox
from gradientmail.run.keyspace import round_key
from gradientmail.syncer.runtime import Syncer

LEARNERS = {"a": 40, "b": 90}  # learner -> tokens per contribution
LIVE = frozenset(LEARNERS)
MEMORY_ROUNDS = 50
# Over moto (in this process, sharing the GIL) a round costs ~0.3 s of requests: 25
# rounds keep the S3 race near 10 s; memory races the full 50.
S3_ROUNDS = 25
NAME = "syncer-race"


@pytest.fixture
def mailbox() -> Iterator[Mailbox]:
    MemoryMailbox.forget(NAME)
    yield MemoryMailbox(NAME)
    MemoryMailbox.forget(NAME)


async def publish_all(r: Run, rounds: int) -> None:
    await r.create()
    for rnd in range(rounds):
        for learner, tokens in LEARNERS.items():
            await r.contribute(rnd, learner, tokens=tokens)


def reference(rounds: int) -> list[tuple[Any, ...]]:
    """The records one syncer alone commits over the same contributions."""

    async def main() -> list[tuple[Any, ...]]:
        r = Run(MemoryMailbox(), algorithm(fragments=2))
        await publish_all(r, rounds)
        s = r.syncer("alone")
        for _ in range(rounds):
            assert await s.poll(live=LIVE)
        assert not await s.poll(live=LIVE)
        return fingerprint(await r.records())

    return asyncio.run(main())


def race(syncers: list[Syncer], rounds: int) -> None:
    """Run each syncer's polls in its own thread and event loop until the last round has
    a record. The fake clock stands still: nobody is ever superseded, claims only race."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(syncers))

    async def loop(s: Syncer) -> None:
        for _ in range(50 * rounds):
            if await s.exchange.read_round(rounds - 1) is not None:
                return
            await s.poll(live=LIVE)
            await asyncio.sleep(0.0005)  # let the other thread in between polls
        raise AssertionError(f"{s.closer_id} saw no record of round {rounds - 1}")

    def work(s: Syncer) -> None:
        try:
            start.wait(timeout=30)
            asyncio.run(loop(s))
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in syncers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a syncer thread hung"
    if errors:
        raise errors[0]


def check_race(r: Run, syncers: list[Syncer], rounds: int) -> None:
    async def records() -> tuple[list[Any], list[str], list[bool]]:
        recs = await r.records()
        keys = await r.mailbox.list("rounds/")
        # The payloads the sweep kept are the bytes their records name.
        latest = await r.ex.latest_commit_per_fragment(len(r.plan))
        fetched = []
        for rec in latest.values():
            for ref in rec.payload_refs():
                fetched.append(await r.ex.store.fetch_payload(ref) is not None)
        return recs, keys, fetched

    recs, keys, fetched = asyncio.run(records())
    assert keys == [round_key(i) for i in range(rounds)]
    assert fingerprint(recs) == reference(rounds)
    assert fetched and all(fetched)
    closed = r.of(RoundClosed)
    assert sorted(e.round for e in closed) == list(range(rounds))  # one closer per round
    assert sum(s.rounds_closed for s in syncers) == rounds
    assert {rec.closer for rec in recs} <= {s.closer_id for s in syncers}


def test_two_syncers_racing_on_memory_commit_what_one_would(mailbox: Mailbox) -> None:
    r = Run(mailbox, algorithm(fragments=2))
    asyncio.run(publish_all(r, MEMORY_ROUNDS))
    syncers = [r.syncer(f"s{i}", mailbox=MemoryMailbox(NAME)) for i in range(2)]
    race(syncers, MEMORY_ROUNDS)
    check_race(r, syncers, MEMORY_ROUNDS)


@pytest.fixture
def s3_mailboxes(mailbox_factory: Any, moto_endpoint: str) -> Iterator[list[S3Mailbox]]:
    first = mailbox_factory("s3")
    assert isinstance(first, S3Mailbox)
    others = [S3Mailbox(first.bucket, first.prefix, endpoint_url=moto_endpoint)
              for _ in range(2)]
    yield [first, *others]
    for mb in others:
        asyncio.run(mb.close())


def test_two_syncers_racing_on_s3_commit_what_one_would(s3_mailboxes: list[S3Mailbox]) -> None:
    writer, *closers = s3_mailboxes
    r = Run(writer, algorithm(fragments=2))
    asyncio.run(publish_all(r, S3_ROUNDS))
    syncers = [r.syncer(f"s{i}", mailbox=mb) for i, mb in enumerate(closers)]
    race(syncers, S3_ROUNDS)
    check_race(r, syncers, S3_ROUNDS)


def test_a_closer_cancelled_after_its_claim_is_taken_over(mailbox: Mailbox) -> None:
    """`a` claims round 3 and is cancelled while uploading its step; `b` supersedes the
    claim once the takeover timeout has passed on the fake clock, and the run goes on
    with the same bytes as an uninterrupted one."""
    rounds = 6

    async def main() -> list[tuple[Any, ...]]:
        r = Run(mailbox, algorithm(fragments=2))
        await publish_all(r, rounds)
        gate = GateClock()  # never opened: the upload hangs until cancelled
        stuck = FaultyMailbox(mailbox, FaultPlan().delay(
            "put", "steps/1/0000000002-*", 1.0, gate))  # round 3: fragment 1, version 2
        a, b = r.syncer("a-closer", mailbox=stuck), r.syncer("b-closer")
        for _ in range(3):
            assert await a.poll(live=LIVE)
        task = asyncio.create_task(a.poll(live=LIVE))
        await gate.waiting.wait()
        assert await r.ex.round_claims(3) == [0]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not await b.poll(live=LIVE)  # a's claim is current: b waits
        fake(r).advance(9.5)  # the timeout is 10 polls of 1 s (ξ_sync is 0 here)
        assert not await b.poll(live=LIVE)
        assert r.of(ClaimSuperseded) == []
        fake(r).advance(0.5)
        assert await b.poll(live=LIVE)
        [superseded] = r.of(ClaimSuperseded)
        assert (superseded.closer, superseded.round, superseded.attempt) == ("b-closer", 3, 1)
        rec3 = await r.ex.read_round(3)
        assert rec3 is not None and rec3.closer == "b-closer"
        assert rec3.step is not None
        assert rec3.step.payload.key == "steps/1/0000000002-000001.safetensors"
        # Both go on: a (its cache of fragment 1 is stale) closes round 4, b round 5.
        assert await a.poll(live=LIVE)
        assert await b.poll(live=LIVE)
        recs = await r.records()
        assert [x.closer for x in recs] == ["a-closer"] * 3 + ["b-closer", "a-closer",
                                                                "b-closer"]
        return fingerprint(recs)

    assert asyncio.run(main()) == reference(rounds)


@pytest.mark.parametrize("after", [False, True], ids=["commit-failed", "answer-lost"])
def test_a_closer_whose_commit_fails_leaves_the_round_to_be_closed(
    mailbox: Mailbox, after: bool
) -> None:
    """The record's create fails (or lands, but its answer is lost): the closer's poll
    raises, and the run still ends up with the bytes of an uninterrupted one."""
    rounds = 4

    async def main() -> list[tuple[Any, ...]]:
        r = Run(mailbox, algorithm(fragments=2))
        await publish_all(r, rounds)
        plan = FaultPlan().fail("create", round_key(1), after=after)
        a, b = r.syncer("a-closer", mailbox=FaultyMailbox(mailbox, plan)), r.syncer("b-closer")
        assert await a.poll(live=LIVE)
        with pytest.raises(Exception, match="injected fault: create of 'rounds/0000000001"):
            await a.poll(live=LIVE)
        landed = await r.ex.read_round(1)
        assert (landed is not None) == after
        if not after:
            fake(r).advance(10.0)  # a's claim times out; b takes over
        for _ in range(rounds - 1):
            await b.poll(live=LIVE)
            await a.poll(live=LIVE)
        assert r.of(CommitLost) == []
        return fingerprint(await r.records())

    assert asyncio.run(main()) == reference(rounds)
