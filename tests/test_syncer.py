"""The Syncer on a MemoryMailbox, driven by hand with a FakeClock.

No learner threads: each test writes a run (manifest and Θ⁰) and the contributions itself
through `Exchange`, then calls `syncer.poll(live=...)` at chosen clock times and asserts
on the records, payload bytes and events. Covers quorum, the grace window, the all-live
shortcut, takeover, in-order closing, every reason to drop a contribution, the estimates
the records carry, and sweeping. `Run` and its helpers are shared with
tests/test_syncer_race.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import numpy as np
import pytest

from gradientmail.algorithms.base import Contribution
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.clock import Clock
from gradientmail.events import (
    ClaimSuperseded,
    CommitLost,
    ContributionDropped,
    Event,
    RoundClosed,
    Swept,
)
from gradientmail.mailbox import Mailbox, MemoryMailbox
from gradientmail.mailbox.wrappers import CountingMailbox, FaultPlan, FaultyMailbox
from gradientmail.run.cadence import probe_delay
from gradientmail.run.keyspace import round_key
from gradientmail.run.lease import LeaseTracker
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import state_at
from gradientmail.syncer.hosted import Host
from gradientmail.syncer.runtime import CloserSettings, Syncer
from gradientmail.syncer.state import ESTIMATE_DECAY, head_start
from gradientmail.testing import FakeClock
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.records import Manifest, RoundRecord, SnapshotRecord
from gradientmail.wire.refs import Arrival
from gradientmail.wire.serialization import ParameterSpec, Schema
from gradientmail.wire.tensor_bytes import TensorBytes

T = TypeVar("T")
SCHEMA = Schema((ParameterSpec("w", "F32", (2, 3)), ParameterSpec("b", "F32", (3,))))
OTHER_SCHEMA = Schema((ParameterSpec("w", "F32", (3, 2)), ParameterSpec("b", "F32", (3,))))
START = 100.0


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def init_tensors() -> dict[str, TensorBytes]:
    rng = np.random.default_rng(7)
    return {p.name: TensorBytes.from_numpy(rng.standard_normal(p.shape).astype(np.float32))
            for p in SCHEMA.params}


def delta(r: int, learner: str, names: tuple[str, ...]) -> dict[str, TensorBytes]:
    """A small, deterministic delta for `learner` in round `r`."""
    seed = [r, int.from_bytes(hashlib.sha256(learner.encode()).digest()[:4], "little")]
    rng = np.random.default_rng(seed)
    return {n: TensorBytes.from_numpy(
        (0.01 * rng.standard_normal(SCHEMA[n].shape)).astype(np.float32)) for n in names}


def algorithm(fragments: int = 2, quorum_size: int = 2, **kw: Any) -> DiLoCo:
    kw.setdefault("in_flight", 1)
    kw.setdefault("overlap_steps", None)
    return DiLoCo(4, fragments, quorum_size=quorum_size, merge=WeightedMean(), **kw)


class GateClock:
    """A clock whose `sleep` waits until the test opens the gate: with
    `FaultPlan.delay(..., clock=gate)` it parks a mailbox call mid-flight."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    def now(self) -> float:
        return 0.0

    async def sleep(self, seconds: float) -> None:
        self.waiting.set()
        await self.gate.wait()


class Run:
    """A run written by hand on `mailbox`: `create()`, `contribute(...)`, `syncer(...)`."""

    def __init__(self, mailbox: Mailbox, alg: DiLoCo, clock: Clock | None = None) -> None:
        self.mailbox = mailbox
        self.alg = alg
        self.clock: Clock = clock if clock is not None else FakeClock(START)
        self.ex = Exchange(mailbox, clock=self.clock)
        self.plan = alg.plan(SCHEMA)
        self.schedule = alg.schedule_for(len(self.plan))
        self.events: list[Event] = []

    async def create(self, codec: str = "off") -> Manifest:
        init = init_tensors()
        refs = []
        for p, names in enumerate(self.plan):
            refs.append(await self.ex.put_init(p, {n: init[n] for n in names}, attempt=0))
        manifest = Manifest(SCHEMA, self.plan, self.alg.to_json(), "creator", tuple(refs), codec)
        assert await self.ex.create_manifest(manifest)
        return manifest

    async def contribute(
        self,
        r: int,
        learner: str,
        *,
        base_version: int | None = None,
        fragment: int | None = None,
        tensors: Mapping[str, TensorBytes] | None = None,
        steps: int = 4,
        tokens: int = 64,
        schema_digest: str | None = None,
        final: bool = False,
        step_seconds: float | None = None,
    ) -> SnapshotRecord:
        """Publish `learner`'s contribution to round `r`; by default a well-formed one
        against the version the fragment has when every earlier round committed."""
        fragment = self.schedule.fragment_of(r) if fragment is None else fragment
        if base_version is None:
            base_version = r // len(self.plan)
        if tensors is None:
            tensors = delta(r, learner, self.plan[fragment])
        return await self.ex.publish(
            r, learner, tensors, fragment=fragment, base_version=base_version,
            local_step=(r + 1) * steps, steps=steps, tokens=tokens, final=final,
            schema_digest=SCHEMA.digest() if schema_digest is None else schema_digest,
            delta_format="F32", step_seconds=step_seconds,
        )

    def syncer(self, closer_id: str = "s1", mailbox: Mailbox | None = None, *,
               embedded: bool = False, leases: LeaseTracker | None = None,
               run_key: str | None = None, wall_clock: Callable[[], float] | None = None,
               **settings: Any) -> Syncer:
        """A closer of this run: standalone, or `embedded` in learner `closer_id` (its
        host with `leases`, or a tracker of its own); `settings` are `CloserSettings`'."""
        cs = CloserSettings(**settings)
        host = None if not embedded else Host(
            closer_id, leases if leases is not None else LeaseTracker(cs.lease_timeout), None,
            self.clock)
        ex = Exchange(mailbox if mailbox is not None else self.mailbox, clock=self.clock,
                      run_key=run_key)
        extra = {} if wall_clock is None else {"wall_clock": wall_clock}
        return Syncer(ex, closer_id=closer_id, on_event=self.events.append, settings=cs,
                      host=host, **extra)

    async def records(self) -> list[RoundRecord]:
        return await self.ex.rounds_after(-1)

    def of(self, kind: type[Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def fingerprint(records: list[RoundRecord]) -> list[tuple[Any, ...]]:
    """What must not depend on who closed a round or when: the committed bytes (by their
    SHA-256), the versions, who took part with what weight, who was dropped and why."""
    return [(r.round, r.fragment, r.version, [ref.sha256 for ref in r.payload_refs()],
             r.participants, r.dropped, r.mean_cosine, r.all_final) for r in records]


def fake(run_: Run) -> FakeClock:
    assert isinstance(run_.clock, FakeClock)
    return run_.clock


@pytest.fixture
def mailbox() -> Any:
    name = "syncer-test"
    MemoryMailbox.forget(name)
    yield MemoryMailbox(name)
    MemoryMailbox.forget(name)


# -- quorum, grace window, all-live shortcut -------------------------------------------


def test_a_round_closes_once_the_quorum_is_in_and_merges_exactly_it(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=2, quorum_size=2))
        await r.create()
        s = r.syncer()
        live = frozenset({"a", "b", "c"})
        assert not await s.poll(live=live)  # nothing contributed
        await r.contribute(0, "a")
        assert not await s.poll(live=live)  # 1 of 2
        assert await r.ex.read_round(0) is None
        assert await r.ex.round_claims(0) == []
        await r.contribute(0, "b")
        # The quorum is in; c is live and may still come: round 0 (no step estimate
        # yet) waits 3 polls after its first contribution for it.
        assert not await s.poll(live=live)
        fake(r).advance(3.0)
        assert await s.poll(live=live)
        rec = await r.ex.read_round(0)
        assert rec is not None
        assert [p.learner for p in rec.participants] == ["a", "b"]
        assert (rec.round, rec.fragment, rec.version, rec.closer) == (0, 0, 1, "s1")
        assert rec.arrival == Arrival(window=3.0, latency=3.0, first="a", missed=("c",))
        # The committed bytes are the aggregator's on the same inputs, with c, awaited in
        # vain, in the cohort: the round steps 2/3 of the way.
        theta = (await state_at(r.ex, 0, rec)).theta
        names = r.plan[0]
        before = r.alg.initial_state(0, {n: init_tensors()[n] for n in names})
        agg = r.alg.aggregator()
        want = agg.close_round(before, merged(r, 0, ["a", "b"]), SCHEMA, cohort=3).state.theta
        assert theta == dict(want)
        full = agg.close_round(before, merged(r, 0, ["a", "b"]), SCHEMA).state.theta
        for n in names:
            was = before.theta[n].to_numpy()
            np.testing.assert_allclose(theta[n].to_numpy() - was,
                                       (full[n].to_numpy() - was) * 2 / 3, rtol=1e-4, atol=1e-8)
        closed = r.of(RoundClosed)
        assert [(e.round, e.participants, e.tokens) for e in closed] == [(0, ("a", "b"), 128)]

    run(main())


def merged(r: Run, round_: int, learners: list[str]) -> list[Contribution]:
    """The contributions `Run.contribute` publishes by default, as the aggregator takes them."""
    names = r.plan[r.schedule.fragment_of(round_)]
    return [Contribution(learner, (round_ + 1) * 4, 4, 64, False, delta(round_, learner, names))
            for learner in learners]


def test_the_effective_quorum_shrinks_to_the_live_learners(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=3))
        await r.create()
        s = r.syncer()
        await r.ex.beat("a")
        await r.ex.beat("b")  # the caller's own view below is final, not the leases
        await r.contribute(0, "a")
        assert not await s.poll(live=frozenset({"a", "b"}))
        assert await s.poll(live=frozenset({"a"}))  # only a is live: a run of one closes
        rec = await r.ex.read_round(0)
        assert rec is not None and [p.learner for p in rec.participants] == ["a"]

    run(main())


def test_a_short_quorum_looks_at_the_leases_again_before_closing(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=2))
        await r.create()
        s = r.syncer()
        await r.contribute(0, "a")
        calls = []

        async def refresh() -> frozenset[str]:
            calls.append(1)
            return frozenset({"a", "b"})  # b joined since the caller's last listing

        assert not await s.poll(live=frozenset({"a"}), refresh_live=refresh)
        assert calls == [1]
        assert await r.ex.read_round(0) is None

    run(main())


def test_without_live_the_syncer_judges_leases_on_its_own_clock(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=2))
        await r.create()
        s = r.syncer(lease_timeout=10.0)
        await r.ex.beat("a")
        await r.ex.beat("b")
        await r.contribute(0, "a")
        assert not await s.poll()  # b holds a lease: wait for it
        fake(r).advance(6.0)
        await r.ex.beat("a")  # a renews, b does not
        assert not await s.poll()
        fake(r).advance(6.0)  # b's counter last changed 12 s ago: dead
        assert await s.poll()
        rec = await r.ex.read_round(0)
        assert rec is not None and [p.learner for p in rec.participants] == ["a"]

    run(main())


async def with_estimates(r: Run, estimates: Estimates) -> None:
    """Close round 0 with a and b, then rewrite its record to carry `estimates` (the
    learners' step time is not measured by a syncer alone)."""
    s = r.syncer("setup", sweep=False)
    await r.contribute(0, "a")
    await r.contribute(0, "b")
    assert await s.poll(live=frozenset({"a", "b"}))
    rec = await r.ex.read_round(0)
    assert rec is not None
    await r.mailbox.put(round_key(0), dataclasses.replace(rec, estimates=estimates).encode())


def test_the_grace_window_waits_for_stragglers_after_quorum(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        await r.create()
        # window = min(gap·ξ_step, max(5·ξ_step, 3 polls)) = min(4·1, max(5, 3)) = 4 s
        await with_estimates(r, Estimates(step=1.0, quorum=1.0, sync=1.0))
        s = r.syncer()
        live = frozenset({"a", "b"})
        await r.contribute(1, "a")
        assert not await s.poll(live=live)  # quorum (1) in at t=100, due at t=104
        fake(r).advance(3.5)
        assert not await s.poll(live=live)
        fake(r).advance(0.5)
        assert await s.poll(live=live)
        rec = await r.ex.read_round(1)
        assert rec is not None and [p.learner for p in rec.participants] == ["a"]
        assert rec.version == 2

    run(main())


def test_a_straggler_inside_the_grace_window_is_merged(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        await r.create()
        await with_estimates(r, Estimates(step=1.0, quorum=1.0, sync=1.0))  # window 4 s
        s = r.syncer()
        live = frozenset({"a", "b", "c"})
        await r.contribute(1, "a")
        assert not await s.poll(live=live)
        fake(r).advance(2.0)
        await r.contribute(1, "b")
        assert not await s.poll(live=live)  # c is live and may still come
        fake(r).advance(2.0)
        assert await s.poll(live=live)
        rec = await r.ex.read_round(1)
        assert rec is not None and [p.learner for p in rec.participants] == ["a", "b"]

    run(main())


def test_when_every_live_learner_contributed_the_round_closes_at_once(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        await r.create()
        await with_estimates(r, Estimates(step=2.0, quorum=1.0, sync=1.0))
        s = r.syncer()
        live = frozenset({"a", "b"})
        await r.contribute(1, "a")
        assert not await s.poll(live=live)
        fake(r).advance(1.0)
        await r.contribute(1, "b")
        assert await s.poll(live=live)  # 1 s into an 8 s window: nobody left to wait for
        rec = await r.ex.read_round(1)
        assert rec is not None and [p.learner for p in rec.participants] == ["a", "b"]

    run(main())


def test_a_much_slower_learner_is_not_waited_for(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        await r.create()
        s = r.syncer()
        live = frozenset({"a", "b", "slow"})
        # Round 0: every pace unknown, everyone awaited; the record reports the paces.
        for who, pace in (("a", 1.0), ("b", 1.1), ("slow", 2.0)):
            await r.contribute(0, who, step_seconds=pace)
        assert await s.poll(live=live)
        rec = await r.ex.read_round(0)
        assert rec is not None
        assert [(p.learner, p.step_seconds) for p in rec.participants] == [
            ("a", 1.0), ("b", 1.1), ("slow", 2.0)]
        # Round 1: "slow" steps twice the run's pace (> 1.5x): a and b are everyone the
        # round waits for, and it closes as soon as they are in.
        await r.contribute(1, "a", step_seconds=1.0)
        assert not await s.poll(live=live)
        fake(r).advance(1.0)
        await r.contribute(1, "b", step_seconds=1.2)
        assert await s.poll(live=live)
        rec = await r.ex.read_round(1)
        assert rec is not None and [p.learner for p in rec.participants] == ["a", "b"]
        assert rec.arrival is not None and rec.arrival.missed == ()
        # A learner of the run's pace that is not in keeps the round open for the window.
        await r.contribute(2, "a", step_seconds=1.0)
        assert not await s.poll(live=live | {"c"})
        rec2 = None
        for _ in range(5):
            fake(r).advance(1.0)
            if await s.poll(live=live | {"c"}):
                rec2 = await r.ex.read_round(2)
                break
        assert rec2 is not None and rec2.arrival is not None
        assert rec2.arrival.missed == ("b", "c")
        # ξ_step = 1.0 s (the lower median pace of round 1, of two the faster): window
        # min(gap 4, 5 steps)·1.0 s, closed at the first poll that finds it over
        assert (rec2.arrival.window, rec2.arrival.latency) == (pytest.approx(4.0), 4.0)

    run(main())


def test_an_early_close_looks_at_the_leases_once_for_joiners(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        await r.create()
        s = r.syncer()
        calls = []

        async def refresh() -> frozenset[str]:
            calls.append(1)
            return frozenset({"a", "joiner"})  # joined since the caller's last listing

        await r.contribute(0, "a")
        # Every learner the caller knows of is in: before closing ahead of the window,
        # the leases are listed again, and the joiner is waited for.
        assert not await s.poll(live=frozenset({"a"}), refresh_live=refresh)
        assert calls == [1]
        # (the caller's view is refreshed with it, as a learner's is)
        assert not await s.poll(live=frozenset({"a", "joiner"}), refresh_live=refresh)
        assert calls == [1]  # once a round
        fake(r).advance(3.0)
        assert await s.poll(live=frozenset({"a", "joiner"}), refresh_live=refresh)
        rec = await r.ex.read_round(0)
        assert rec is not None and rec.arrival is not None
        assert rec.arrival.missed == ("joiner",)

    run(main())


def test_the_contribution_that_completes_a_round_is_closed_at_the_next_poll(
    mailbox: Mailbox,
) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=2))
        await r.create()
        s = r.syncer("a", embedded=True)  # round 0's preferred closer among a, b
        live = frozenset({"a", "b"})
        assert not await s.poll(live=live)  # t=100: listed, nothing in
        await r.contribute(0, "a")
        for _ in range(5):  # an embedded closer looks every 5 polls while nothing is in
            fake(r).advance(1.0)
            assert not await s.poll(live=live)
        await r.contribute(0, "b")  # completes the round
        fake(r).advance(1.0)
        assert await s.poll(live=live)  # seen and closed at the very next poll
        rec = await r.ex.read_round(0)
        assert rec is not None and [p.learner for p in rec.participants] == ["a", "b"]
        # a was first seen at t=104 (the listing 4 polls after t=100), b at t=106
        assert rec.arrival is not None and rec.arrival.latency == 2.0

    run(main())


def test_a_backup_that_contributed_closes_soon_after_a_silent_preferred_closer(
    mailbox: Mailbox,
) -> None:
    # Decoupled (quorum 1): "a" is round 0's preferred closer, live by its lease but
    # silent (killed); "b" contributed. Its window is 3 polls; then it gives "a" a head
    # start of 3 polls (on a round without its own contribution: 30) and closes.
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        await r.create()
        s = r.syncer("b", embedded=True)
        live = frozenset({"a", "b"})
        await r.contribute(0, "b")
        s.host.note(0)
        t0 = fake(r).now()
        while not await s.poll(live=live):
            assert fake(r).now() - t0 <= 10.0, "the backup gave a silent closer 30 polls"
            fake(r).advance(1.0)
        assert fake(r).now() - t0 == 6.0  # the window (3 polls), then 3 polls of head start
        rec = await r.ex.read_round(0)
        assert rec is not None and rec.closer == "b"
        assert [p.learner for p in rec.participants] == ["b"]
        assert head_start(False, 30) == 30 and head_start(True, 30) == 3
        assert head_start(True, 2) == 2

    run(main())


# -- order, claims, takeover -----------------------------------------------------------


def test_rounds_close_strictly_in_order(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=2, quorum_size=1))
        await r.create()
        s = r.syncer()
        live = frozenset({"a"})
        await r.contribute(1, "a")
        await r.contribute(2, "a")
        assert not await s.poll(live=live)  # round 0 has nothing: 1 and 2 wait
        assert await r.ex.round_claims(1) == []
        await r.contribute(0, "a")
        assert [await s.poll(live=live) for _ in range(4)] == [True, True, True, False]
        recs = await r.records()
        assert [(x.round, x.fragment, x.version) for x in recs] == [(0, 0, 1), (1, 1, 1),
                                                                    (2, 0, 2)]

    run(main())


def test_a_claim_without_a_record_is_taken_over_after_the_timeout(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        await r.create()
        await r.contribute(0, "a")
        assert await r.ex.claim_round(0, 0, "ghost")  # a closer that died after claiming
        s = r.syncer(poll_interval=0.5)  # takeover after max(10 polls, 3·ξ_sync) = 5 s
        live = frozenset({"a"})
        assert not await s.poll(live=live)
        fake(r).advance(4.9)
        assert not await s.poll(live=live)
        assert r.of(ClaimSuperseded) == []
        fake(r).advance(0.1)
        assert await s.poll(live=live)
        [event] = r.of(ClaimSuperseded)
        assert (event.closer, event.round, event.attempt, event.waited) == ("s1", 0, 1, 5.0)
        rec = await r.ex.read_round(0)
        assert rec is not None and rec.closer == "s1"
        assert rec.payload_refs()
        assert all(ref.key.endswith("-000001.safetensors") for ref in rec.payload_refs())
        claim = await r.ex.read_round_claim(0, 0)
        assert claim is None  # swept with the round

    run(main())


def test_the_takeover_timeout_follows_the_estimates_in_the_records(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        await r.create()
        await with_estimates(r, Estimates(step=None, quorum=None, sync=5.0))
        await r.contribute(1, "a")
        assert await r.ex.claim_round(1, 0, "ghost")
        s = r.syncer(poll_interval=1.0)  # a fresh syncer: 3·ξ_sync = 15 s > 10 polls
        live = frozenset({"a"})
        assert not await s.poll(live=live)
        fake(r).advance(14.0)
        assert not await s.poll(live=live)
        fake(r).advance(1.0)
        assert await s.poll(live=live)

    run(main())


def test_a_lost_claim_waits_for_the_winners_record(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        await r.create()
        await r.contribute(0, "a")
        s1, s2 = r.syncer("s1"), r.syncer("s2")
        live = frozenset({"a"})
        assert await s1.poll(live=live)
        assert not await s2.poll(live=live)  # catches up with s1's record first
        await r.contribute(1, "a")
        assert await r.ex.claim_round(1, 0, "s1")  # s1 holds round 1 (and is working)
        assert not await s2.poll(live=live)
        assert await r.ex.read_round(1) is None
        assert r.of(CommitLost) == []

    run(main())


def test_a_claim_slot_freed_by_the_sweep_is_not_a_license_to_close(mailbox: Mailbox) -> None:
    """s2 lists the open round's claims just after s1 committed it and swept its claims
    and contributions: s2 wins claim attempt 0 again, on a closed round. It must not
    upload under that attempt: the record references s1's payloads at those keys."""

    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        await r.create()
        await r.contribute(0, "a")
        gate = GateClock()
        parked = FaultyMailbox(mailbox, FaultPlan().delay("list", "claims/round/*", 1.0,
                                                          gate, times=1))
        s1, s2 = r.syncer("s1"), r.syncer("s2", mailbox=parked)
        live = frozenset({"a"})
        task = asyncio.create_task(s2.poll(live=live))
        await gate.waiting.wait()  # s2 saw the contribution and is listing the claims
        assert await s1.poll(live=live)
        gate.gate.set()
        assert not await task
        rec = await r.ex.read_round(0)
        assert rec is not None and rec.closer == "s1"
        for ref in rec.payload_refs():
            assert await r.ex.store.fetch_tensors(ref) is not None  # bytes match the record
        assert r.of(CommitLost) == []
        assert s2.rounds_closed == 0

    run(main())


# -- dropped contributions -------------------------------------------------------------


async def publish_bad(r: Run, round_: int) -> dict[str, str]:
    """One contribution of each kind a closer must leave out; learner -> reason start."""
    frag = r.schedule.fragment_of(round_)
    names = r.plan[frag]
    await r.contribute(round_, "stale", base_version=1)
    await r.contribute(round_, "other-schema", schema_digest=OTHER_SCHEMA.digest())
    await r.contribute(round_, "other-fragment", fragment=1 - frag)
    shaped = {n: TensorBytes.from_numpy(np.zeros((3, 2) if n == "w" else (4,), np.float32))
              for n in names}
    await r.contribute(round_, "mis-shaped", tensors=shaped)
    nan = delta(round_, "nan", names)
    nan[names[0]] = TensorBytes.from_numpy(np.full(SCHEMA[names[0]].shape, np.nan, np.float32))
    await r.contribute(round_, "non-finite", tensors=nan)
    snap = await r.contribute(round_, "corrupt")
    blob = await r.mailbox.get(snap.payload.key)
    assert blob is not None
    await r.mailbox.put(snap.payload.key, blob[:-4] + b"\xff\xff\xff\xff")
    return {
        "stale": "stale: base version 1, the fragment is at version 0",
        "other-schema": f"another schema digest {OTHER_SCHEMA.digest()[:12]}",
        "other-fragment": f"fragment {1 - frag}, the round trains fragment {frag}",
        "mis-shaped": "mis-shaped: ",
        "non-finite": f"non-finite values in ['{names[0]}']",
        "corrupt": "unreadable: payload",
    }


def test_bad_contributions_are_dropped_with_an_event_and_a_record_entry(
    mailbox: Mailbox,
) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=2, quorum_size=1))
        await r.create()
        expected = await publish_bad(r, 0)
        await r.contribute(0, "good")
        s = r.syncer()
        assert await s.poll(live=frozenset({*expected, "good"}))
        rec = await r.ex.read_round(0)
        assert rec is not None
        assert [p.learner for p in rec.participants] == ["good"]
        reasons = {d.learner: d.reason for d in rec.dropped}
        assert sorted(reasons) == sorted(expected)
        for learner, start in expected.items():
            assert reasons[learner].startswith(start), (learner, reasons[learner])
        assert "SHA-256" in reasons["corrupt"]
        assert "'w' has shape [3, 2], the schema says [2, 3]" in reasons["mis-shaped"]
        events = {e.learner: e for e in r.of(ContributionDropped)}
        assert sorted(events) == sorted(expected)
        for learner, e in events.items():
            assert e.round == 0
            assert e.key == f"payloads/0000000000/{learner}.safetensors"
            assert e.reason.startswith(reasons[learner][:40])
        # The good contribution alone moved the fragment.
        theta = (await state_at(r.ex, rec.fragment, rec)).theta
        init = init_tensors()
        assert theta is not None and theta["w"] != init["w"]

    run(main())


def test_a_round_whose_contributions_are_all_dropped_still_commits(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=2, quorum_size=1))
        manifest = await r.create()
        expected = await publish_bad(r, 0)
        s = r.syncer()
        assert await s.poll(live=frozenset(expected))
        rec = await r.ex.read_round(0)
        assert rec is not None
        assert (rec.version, rec.participants, rec.mean_cosine, rec.update) == (1, (), None, None)
        assert sorted(d.learner for d in rec.dropped) == sorted(expected)
        theta = (await state_at(r.ex, 0, rec)).theta
        init = await r.ex.store.fetch_tensors(manifest.init[0])
        assert init is not None
        assert theta == init  # the same theta, one version on
        # The learners can go on: round 1 (the other fragment) and round 2 (version 1 of
        # fragment 0) close normally.
        await r.contribute(1, "a")
        await r.contribute(2, "a")
        live = frozenset({"a"})
        assert await s.poll(live=live) and await s.poll(live=live)
        recs = await r.records()
        assert [(x.round, x.version, len(x.participants)) for x in recs] == [
            (0, 1, 0), (1, 1, 1), (2, 2, 1)]

    run(main())


def test_an_unparseable_contribution_record_is_dropped_by_name(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        await r.create()
        await mailbox.put("snapshots/0000000000/junk.json", b"{not json")
        await r.contribute(0, "a")
        s = r.syncer()
        assert await s.poll(live=frozenset({"a", "junk"}))
        rec = await r.ex.read_round(0)
        assert rec is not None
        assert [p.learner for p in rec.participants] == ["a"]
        [dropped] = rec.dropped
        assert dropped.learner == "junk" and "is not valid JSON" in dropped.reason

    run(main())


# -- estimates and sweeping ------------------------------------------------------------


def test_records_carry_the_measured_quorum_and_sync_seconds(mailbox: Mailbox) -> None:
    async def main() -> None:
        clock = FakeClock(START)
        # Uploading the step takes 1.5 s on the fake clock: that is the close time measured.
        slow = FaultyMailbox(mailbox, FaultPlan().delay("put", "steps/*", 1.5, clock))
        r = Run(mailbox, algorithm(fragments=1, quorum_size=2), clock)
        await r.create()
        s = r.syncer(mailbox=slow)
        live = frozenset({"a", "b"})
        await r.contribute(0, "a")
        assert not await s.poll(live=live)
        clock.advance(4.0)
        await r.contribute(0, "b")
        assert await s.poll(live=live)
        rec0 = await r.ex.read_round(0)
        assert rec0 is not None
        assert rec0.estimates == Estimates(step=None, quorum=4.0, sync=1.5)
        await r.contribute(1, "a")
        await r.contribute(1, "b")
        assert await s.poll(live=live)  # both seen at once: ξ_quorum observed as 0
        rec1 = await r.ex.read_round(1)
        assert rec1 is not None
        d = ESTIMATE_DECAY
        assert rec1.estimates.step is None
        assert rec1.estimates.quorum == pytest.approx((1 - d) * 4.0, rel=1e-12)
        assert rec1.estimates.sync == pytest.approx(1.5, rel=1e-12)

    run(main())


def test_the_sweep_keeps_the_newest_versions_and_open_rounds(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1, checkpoint_every=1))
        manifest = await r.create()
        s = r.syncer(keep_versions=2)
        live = frozenset({"a"})
        for rnd in range(5):
            await r.contribute(rnd, "a")
        await r.contribute(6, "a")  # a round far ahead: not closed, never swept
        for _ in range(5):
            assert await s.poll(live=live)
        recs = await r.records()
        assert [x.version for x in recs] == [1, 2, 3, 4, 5]
        keys = await mailbox.list("")
        theta = [k for k in keys if k.startswith("theta/")]
        outer = [k for k in keys if k.startswith("outer/")]
        assert theta == [recs[3].theta.key, recs[4].theta.key]
        assert outer == [recs[3].outer.key, recs[4].outer.key]
        assert [k for k in keys if k.startswith(("payloads/", "snapshots/"))] == [
            "payloads/0000000006/a.safetensors", "snapshots/0000000006/a.json"]
        assert [k for k in keys if k.startswith("claims/round/")] == []
        assert [k for k in keys if k.startswith("rounds/")] == [round_key(i) for i in range(5)]
        assert {ref.key for ref in manifest.init} <= set(keys)  # Θ⁰ is never swept
        assert sum(e.deleted for e in r.of(Swept)) > 0

    run(main())


def test_a_syncer_that_does_not_sweep_leaves_everything(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1, checkpoint_every=1))
        await r.create()
        s = r.syncer(sweep=False)
        for rnd in range(3):
            await r.contribute(rnd, "a")
            assert await s.poll(live=frozenset({"a"}))
        keys = await mailbox.list("")
        assert len([k for k in keys if k.startswith("theta/")]) == 3
        assert len([k for k in keys if k.startswith("payloads/")]) == 3
        assert r.of(Swept) == []
        # A later sweep with keep_versions=1 leaves only the newest version.
        doomed = await r.ex.sweep(1)
        assert len(doomed) == 3 * 3 + 2 * 2  # payloads+snapshots+claims, old theta+outer
        keys = await mailbox.list("")
        assert [k for k in keys if k.startswith("theta/")] == [
            "theta/0/0000000003-000000.safetensors"]

    run(main())


def test_a_syncer_on_an_empty_mailbox_waits_for_the_run(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        s = r.syncer()
        assert not await s.poll(live=frozenset({"a"}))
        await r.create()
        await r.contribute(0, "a")
        assert await s.poll(live=frozenset({"a"}))

    run(main())


@pytest.mark.parametrize("checkpoint_every", [1, 20], ids=["published", "replicated"])
def test_a_syncer_started_late_continues_from_the_stored_outer_state(
    mailbox: Mailbox, checkpoint_every: int
) -> None:
    """Closing rounds 0-3 with one syncer, or 0-1 with one and 2-3 with a fresh one (which
    must load momentum from the mailbox: the stored outer state, or Θ⁰ and the steps
    since), commits the same bytes."""

    async def close(r: Run, switch_at: int) -> list[tuple[Any, ...]]:
        await r.create()
        live = frozenset({"a", "b"})
        s = r.syncer("first")
        for rnd in range(4):
            if rnd == switch_at:
                s = r.syncer("second")
            await r.contribute(rnd, "a", tokens=40)
            await r.contribute(rnd, "b", tokens=90)
            assert await s.poll(live=live)
        return fingerprint(await r.records())

    async def main() -> None:
        alg = algorithm(fragments=2, checkpoint_every=checkpoint_every)
        one = await close(Run(MemoryMailbox(), alg), switch_at=-1)
        two = await close(Run(mailbox, alg), switch_at=2)
        assert one == two
        assert one[2][2] == 2 and one[2][4][0].weight == 40 * 40 / 4

    run(main())


def test_run_stops_when_told_without_waiting_out_the_poll_interval(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        await r.create()
        await r.ex.beat("a")
        await r.contribute(0, "a")
        s = Syncer.open(mailbox, closer_id="looper",  # the real clock
                        settings=CloserSettings(poll_interval=3600.0))
        stop = asyncio.Event()
        task = asyncio.create_task(s.run(stop))
        while await r.ex.read_round(0) is None:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, timeout=60)  # not 3600 s
        assert s.rounds_closed == 1

    run(main())


def test_an_outer_step_that_overflows_drops_the_round_instead_of_retrying_forever(
    mailbox: Mailbox,
) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        manifest = await r.create()
        huge = {n: TensorBytes.from_numpy(np.full(SCHEMA[n].shape, 3e38, np.float32))
                for n in r.plan[0]}
        await r.contribute(0, "a", tensors=huge)
        s = r.syncer()
        assert await s.poll(live=frozenset({"a"}))
        rec = await r.ex.read_round(0)
        assert rec is not None and rec.participants == () and rec.version == 1
        (dropped,) = rec.dropped
        assert dropped.learner == "a" and "outer step overflowed" in dropped.reason
        theta = (await state_at(r.ex, 0, rec)).theta
        assert theta == await r.ex.store.fetch_tensors(manifest.init[0])

    run(main())


def test_an_embedded_closer_merges_its_own_delta_from_memory(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=2))
        await r.create()
        mine = await r.contribute(0, "a")
        await r.contribute(0, "b")
        gets: list[str] = []

        class Logged(CountingMailbox):
            async def get(self, key: str) -> bytes | None:
                gets.append(key)
                return await super().get(key)

        s = r.syncer("a", mailbox=Logged(mailbox), embedded=True)
        s.host.note(0, mine.payload, delta(0, "a", r.plan[0]))
        assert await s.poll(live=frozenset({"a", "b"}))
        # Its own delta is not downloaded; b's is.
        assert [k for k in gets if k.startswith("payloads/")] == [
            "payloads/0000000000/b.safetensors"]
        rec = await r.ex.read_round(0)
        assert rec is not None and [p.learner for p in rec.participants] == ["a", "b"]
        # The same bytes as a closer that downloaded both.
        other = Run(MemoryMailbox(), algorithm(fragments=1, quorum_size=2))
        await other.create()
        await other.contribute(0, "a")
        await other.contribute(0, "b")
        assert await other.syncer("a").poll(live=frozenset({"a", "b"}))
        assert fingerprint([rec]) == fingerprint(await other.records())

    run(main())


def _draft(r: Run, round_: int, learner: str) -> SnapshotRecord:
    """`learner`'s contribution to `round_` as `Run.contribute` would publish it."""
    return r.ex.draft(round_, learner, fragment=0, base_version=round_, local_step=4 * round_ + 4,
                      steps=4, tokens=64, final=False, schema_digest=SCHEMA.digest(),
                      delta_format="F32")


def test_a_contribution_that_completes_its_set_is_merged_from_memory_never_uploaded(
        mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=2))
        await r.create()
        await r.contribute(0, "b")
        s = r.syncer("a", embedded=True, sweep=False)
        taken = s.host.offer(_draft(r, 0, "a"), delta(0, "a", r.plan[0]))
        assert not taken.done()  # decided by the next poll
        assert await s.poll(live=frozenset({"a", "b"}))
        assert taken.result() is True
        rec = await r.ex.read_round(0)
        assert rec is not None and rec.closer == "a"
        assert [(p.learner, p.held) for p in rec.participants] == [("a", True), ("b", False)]
        assert '"held": true' in json.dumps(rec.to_json())
        keys = await mailbox.list("")
        assert [k for k in keys if k.startswith(("payloads/", "snapshots/"))] == [
            "payloads/0000000000/b.safetensors", "snapshots/0000000000/b.json"]
        # The same step as a closer that downloaded both uploaded contributions.
        other = Run(MemoryMailbox(), algorithm(fragments=1, quorum_size=2))
        await other.create()
        await other.contribute(0, "a")
        await other.contribute(0, "b")
        assert await other.syncer("a").poll(live=frozenset({"a", "b"}))
        # (Only who uploaded differs: `held`, and the payload sizes of uploads.)
        def uploads_aside(rec: RoundRecord) -> RoundRecord:
            return dataclasses.replace(rec, participants=tuple(
                dataclasses.replace(p, held=False, payload_size=None)
                for p in rec.participants))

        assert fingerprint([uploads_aside(rec)]) == fingerprint(
            [uploads_aside(x) for x in await other.records()])

    run(main())


def test_a_declined_offer_does_not_count_while_its_upload_is_on_the_way(
        mailbox: Mailbox) -> None:
    """Standard DiLoCo, a quorum of both. b's offer would complete the set, but another
    closer's claim is current, so the offer is declined and b uploads (at 20 Mbit/s that
    takes seconds). Once that claim is superseded, b's closer must not close the round
    on the memory of its offer with a's contribution alone: it waits for its upload."""
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=2))
        await r.create()
        await r.contribute(0, "a")
        assert await r.ex.claim_round(0, 0, "ghost")
        s = r.syncer("b", embedded=True, sweep=False)
        live = frozenset({"a", "b"})
        taken = s.host.offer(_draft(r, 0, "b"), delta(0, "b", r.plan[0]))
        assert not await s.poll(live=live)
        assert taken.result() is False  # declined: b uploads
        for _ in range(40):  # well past the ghost's takeover timeout
            fake(r).advance(1.0)
            assert not await s.poll(live=live), "closed without b's own contribution"
        assert await r.ex.read_round(0) is None
        await r.contribute(0, "b")  # the upload lands
        s.host.note(0)
        assert await s.poll(live=live)
        rec = await r.ex.read_round(0)
        assert rec is not None and [p.learner for p in rec.participants] == ["a", "b"]

    run(main())


def test_an_offer_the_round_cannot_close_on_is_declined_for_upload(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=2))
        await r.create()
        s = r.syncer("a", embedded=True)
        live = frozenset({"a", "b"})
        # b is not in: the round waits for it, so a's contribution must go up.
        taken = s.host.offer(_draft(r, 0, "a"), delta(0, "a", r.plan[0]))
        assert not await s.poll(live=live)
        assert taken.result() is False and await r.ex.read_round(0) is None
        # An offer for a round that is not the open one: declined at the next poll.
        later = s.host.offer(_draft(r, 1, "a"), delta(1, "a", r.plan[0]))
        assert not await s.poll(live=live)
        assert later.result() is False
        # A record of this learner id is in the round already (an earlier run of it):
        # declined, so that the upload meets AlreadyContributed rather than merging twice.
        await r.contribute(0, "a")
        await r.contribute(0, "b")
        again = s.host.offer(_draft(r, 0, "a"), delta(0, "a", r.plan[0]))
        assert await s.poll(live=live)
        assert again.result() is False
        rec = await r.ex.read_round(0)
        assert rec is not None and not any(p.held for p in rec.participants)
        # An offer for a closed round, or by another learner id, is declined at once.
        assert s.host.offer(_draft(r, 0, "a"), delta(0, "a", r.plan[0])).result() is False
        assert s.host.offer(_draft(r, 1, "b"), delta(1, "b", r.plan[0])).result() is False

    run(main())


def test_while_a_standalone_closer_is_live_an_embedded_one_leaves_it_the_rounds(
        mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=2))
        await r.create()
        await r.contribute(0, "b")
        s = r.syncer("a", embedded=True, sweep=False)
        live = frozenset({"a", "b"})
        # The offer that would complete the set is declined at once: it goes up, so the
        # standalone closer can merge it; the embedded closer does not close the round.
        taken = s.host.offer(_draft(r, 0, "a"), delta(0, "a", r.plan[0]))
        assert not await s.poll(live=live, standalone=frozenset({"sync-1"}))
        await r.contribute(0, "a")
        s.host.note(0)
        assert not await s.poll(live=live, standalone=frozenset({"sync-1"}))
        assert taken.done() and taken.result() is False
        assert await r.ex.read_round(0) is None
        standalone = r.syncer("sync-1", sweep=False)
        assert await standalone.poll(live=live)
        rec = await r.ex.read_round(0)
        assert rec is not None and rec.closer == "sync-1"
        assert [(p.learner, p.held) for p in rec.participants] == [("a", False), ("b", False)]
        # With no standalone closer live, the same learner closes the next round itself.
        await r.contribute(1, "b")
        assert await s.poll(live=live) is False  # its own contribution is not in yet
        taken = s.host.offer(_draft(r, 1, "a"), delta(1, "a", r.plan[0]))
        assert await s.poll(live=live)
        assert taken.result() is True
        rec = await r.ex.read_round(1)
        assert rec is not None and rec.closer == "a"

    run(main())


def test_a_round_commits_the_same_bytes_wherever_it_is_closed() -> None:
    """Standalone beside the bucket, or embedded in a learner that merges its own delta
    from memory: the same contributions commit the same step, theta and record."""
    async def close(closer: str, embedded: bool) -> list[RoundRecord]:
        r = Run(MemoryMailbox(), algorithm(fragments=1, quorum_size=2))
        await r.create()
        await r.contribute(0, "b")
        s = r.syncer(closer, embedded=embedded, sweep=False)
        live = frozenset({"a", "b"})
        if embedded:
            taken = s.host.offer(_draft(r, 0, "a"), delta(0, "a", r.plan[0]))
            assert await s.poll(live=live) and taken.result() is True
        else:
            await r.contribute(0, "a")
            assert await s.poll(live=live)
        return [dataclasses.replace(rec, participants=tuple(
            dataclasses.replace(p, held=False, payload_size=None) for p in rec.participants))
            for rec in await r.records()]

    beside, inside = run(close("sync-1", False)), run(close("a", True))
    assert (beside[0].closer, inside[0].closer) == ("sync-1", "a")
    assert fingerprint(beside) == fingerprint(inside)
    assert beside[0].step == inside[0].step


def test_an_embedded_backup_takes_over_from_a_standalone_closer_that_died_mid_round(
        mailbox: Mailbox) -> None:
    """The standalone closer claimed round 0 and died before its record, its lease still
    fresh: the learner's closer gives it a backup's head start, then supersedes its claim
    after the takeover timeout, as for any closer."""
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=2))
        await r.create()
        await r.contribute(0, "a")
        await r.contribute(0, "b")
        assert await r.ex.claim_round(0, 0, "sync-1")
        s = r.syncer("a", embedded=True)
        live, standalone = frozenset({"a", "b"}), frozenset({"sync-1"})
        s.host.note(0)
        t0 = fake(r).now()
        while not await s.poll(live=live, standalone=standalone):
            assert fake(r).now() - t0 <= 60.0, "the round was never taken over"
            fake(r).advance(1.0)
        # 30 polls of head start; then it sees the claim, and supersedes it once it has
        # seen it for the takeover timeout (10 polls: the observer's own clock).
        assert fake(r).now() - t0 == 40.0
        [event] = r.of(ClaimSuperseded)
        assert (event.closer, event.round, event.attempt) == ("a", 0, 1)
        rec = await r.ex.read_round(0)
        assert rec is not None and rec.closer == "a"
        assert [p.learner for p in rec.participants] == ["a", "b"]

    run(main())


def test_a_standalone_closer_killed_mid_sync_of_a_pipelined_barrier_is_taken_over() -> None:
    """stagger=False, two fragments: the standalone closer committed the sync's first
    round, claimed its second and died. The learner's closer takes the second over as for
    any round (head start, takeover), and the sync commits what a closer that lived
    commits: the same bytes, participants and weights."""
    alg = algorithm(fragments=2, quorum_size=2, in_flight=2, overlap_steps=0, stagger=False)
    live, standalone = frozenset({"a", "b"}), frozenset({"sync-1"})

    async def sync(dies: bool) -> list[RoundRecord]:
        r = Run(MemoryMailbox(), alg)
        await r.create()
        for rnd in (0, 1):
            for learner in ("a", "b"):
                await r.contribute(rnd, learner, base_version=0)
        closer = r.syncer("sync-1", sweep=False)
        assert await closer.poll(live=live)
        if not dies:
            assert await closer.poll(live=live)
            return await r.records()
        assert await r.ex.claim_round(1, 0, "sync-1")  # its claim, then SIGKILL
        s = r.syncer("a", embedded=True, sweep=False)
        s.host.note(1)
        t0 = fake(r).now()
        while not await s.poll(live=live, standalone=standalone):
            assert fake(r).now() - t0 <= 60.0, "the round was never taken over"
            fake(r).advance(1.0)
        [event] = r.of(ClaimSuperseded)
        assert (event.closer, event.round, event.attempt) == ("a", 1, 1)
        records = await r.records()
        assert [rec.closer for rec in records] == ["sync-1", "a"]
        return records

    lived, died = run(sync(False)), run(sync(True))
    assert [[p.learner for p in rec.participants] for rec in died] == [["a", "b"]] * 2
    assert [rec.version for rec in died] == [1, 1]
    assert fingerprint(died) == fingerprint(lived)


def test_a_standalone_closer_gone_without_a_word_costs_a_round_a_backups_head_start(
        mailbox: Mailbox) -> None:
    """Its lease not yet timed out, nobody claims: the learner's closer closes the round
    once its head start (backup_every polls) is over."""
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=2))
        await r.create()
        await r.contribute(0, "a")
        await r.contribute(0, "b")
        s = r.syncer("b", embedded=True)
        s.host.note(0)
        t0 = fake(r).now()
        while not await s.poll(live=frozenset({"a", "b"}), standalone=frozenset({"sync-1"})):
            assert fake(r).now() - t0 <= 60.0, "the round never closed"
            fake(r).advance(1.0)
        assert fake(r).now() - t0 == 30.0
        rec = await r.ex.read_round(0)
        assert rec is not None and rec.closer == "b"

    run(main())


def test_a_standalone_closers_lease_outlives_any_learners_judgement(mailbox: Mailbox) -> None:
    """It beats every 10 s whatever its own lease timeout, and learners judge it over at
    least 3 beats: a learner with a 30 s lease timeout (the tiny recipe's) never sees a
    live standalone closer lapse, and one with 120 s judges it by 120 s."""
    from gradientmail.syncer.standalone import BEAT_EVERY, CloserLease, closer_timeout

    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        lease = CloserLease(r.ex, "sync-1", fake(r), lease_timeout=120.0, on_event=print)
        counters = []
        for _ in range(7):
            await lease.beat()
            counters.append((await r.ex.leases("closers"))["sync-1"])
            fake(r).advance(5.0)
        assert counters == [0, 0, 1, 1, 2, 2, 3]  # a beat every 10 s, not every 60 s
        await lease.release()
        assert await r.ex.leases("closers") == {}
        assert BEAT_EVERY == 10.0
        assert closer_timeout(30.0) == 30.0 and closer_timeout(5.0) == 30.0
        assert closer_timeout(120.0) == 120.0

    run(main())


def test_a_standalone_syncer_holds_a_closer_lease_while_it_runs(mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1))
        s = Syncer.open(mailbox, closer_id="sync-1",
                        settings=CloserSettings(poll_interval=0.01, lease_timeout=120.0))
        stop = asyncio.Event()
        task = asyncio.create_task(s.run(stop))
        # From the start, before the run exists: learners that join see it at once.
        while not await r.ex.leases("closers"):
            await asyncio.sleep(0.01)
        assert await r.ex.leases("closers") == {"sync-1": 0}
        await r.create()
        assert await r.ex.leases() == {}  # no learner: it never counts toward a quorum
        stop.set()
        await asyncio.wait_for(task, timeout=60)
        assert await r.ex.leases("closers") == {}  # released on the way out
        assert not [k for k in await mailbox.list("") if k.startswith("closers/")]

    run(main())


def test_a_standalone_syncer_closes_within_moments_of_the_last_arrival(
        mailbox: Mailbox) -> None:
    """Between polls (10 s apart here) it GETs the records of the learners its round still
    awaits, so the round closes ~50 ms after the last one lands, not at the next poll."""
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=2))
        clock = fake(r)
        await r.create()
        await r.ex.beat("a")
        await r.ex.beat("b")
        counting = CountingMailbox(mailbox)
        s = r.syncer("sync-1", mailbox=counting, poll_interval=10.0, sweep=False)
        stop = asyncio.Event()
        task = asyncio.create_task(s.run(stop))
        await clock.sleep(1.0)
        await r.contribute(0, "a")
        await clock.sleep(12.0)  # one poll has seen a's contribution
        assert await r.ex.read_round(0) is None
        before = counting.snapshot()
        arrived = clock.now()
        await r.contribute(0, "b")
        while await r.ex.read_round(0) is None:
            await clock.sleep(0.01)
        assert clock.now() - arrived <= 0.1  # not the 10 s poll interval
        # Looked for b alone, one GET at a time; not a LIST every look.
        # (The poll that closed it lists the leases twice, the contributions, the claims:
        # the one LIST a look would have cost is not there.)
        assert counting.snapshot().list - before.list <= 5
        stop.set()
        await task

    run(main())


def test_a_standalone_syncer_looks_for_one_missing_learner_at_a_time(
        mailbox: Mailbox) -> None:
    """Three learners missing cost the store what one does: one GET a look, in turn (the
    round waits for all of them; only the last arrival must be seen at once)."""
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=4))
        clock = fake(r)
        await r.create()
        for who in "abcd":
            await r.ex.beat(who)
        counting = CountingMailbox(mailbox)
        s = r.syncer("sync-1", mailbox=counting, poll_interval=10.0, sweep=False)
        stop = asyncio.Event()
        task = asyncio.create_task(s.run(stop))
        await clock.sleep(1.0)
        await r.contribute(0, "a")
        await clock.sleep(12.0)  # one poll has seen a's contribution; b, c, d awaited
        before = counting.snapshot()
        await clock.sleep(5.0)  # no poll in between: looks only
        gets = counting.snapshot().get - before.get
        # A look every probe_delay (20 ms; 2 ms on a free store) for 5 s, one GET each,
        # where a GET per missing learner and look would be three times as many.
        every = probe_delay(10.0, counting.metered)
        assert 0.9 * 5 / every <= gets <= 1.1 * 5 / every, (gets, every)
        arrived = clock.now()
        for who in "bcd":
            await r.contribute(0, who)
        while await r.ex.read_round(0) is None:
            await clock.sleep(0.01)
        assert clock.now() - arrived <= 0.1
        assert [p.learner for p in (await r.ex.read_round(0)).participants] == list("abcd")
        stop.set()
        await task

    run(main())


def test_the_sweep_keeps_the_newest_checkpoint_and_the_steps_after_it(
        mailbox: Mailbox) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=1, checkpoint_every=3))
        await r.create()
        s = r.syncer(keep_versions=2)
        live = frozenset({"a"})
        for rnd in range(5):
            await r.contribute(rnd, "a")
            assert await s.poll(live=live)
        recs = await r.records()
        assert [x.version for x in recs] == [1, 2, 3, 4, 5]
        # Version 3 is the checkpoint: theta and outer state uploaded, and every version
        # carries its step.
        assert [x.checkpoint for x in recs] == [False, False, True, False, False]
        assert all(x.step is not None for x in recs)
        keys = await mailbox.list("")
        assert [k for k in keys if k.startswith(("theta/", "outer/"))] == [
            recs[2].outer.key, recs[2].theta.key]  # type: ignore[union-attr]
        steps = [k for k in keys if k.startswith("steps/")]
        assert steps == [x.step.payload.key for x in recs[2:]]  # type: ignore[union-attr]
        # A reader with no state starts from the checkpoint and replays: the closer's bytes.
        closer_state = await s._fragment_state(0)
        fresh = await state_at(r.ex, 0, recs[4])
        assert fresh.version == 5
        assert (fresh.theta, fresh.momentum) == (closer_state.theta, closer_state.momentum)

    run(main())


def test_records_carry_the_median_step_seconds_of_the_merged_snapshots(
    mailbox: Mailbox,
) -> None:
    async def main() -> None:
        r = Run(mailbox, algorithm(fragments=1, quorum_size=3))
        await r.create()
        for learner, seconds in (("a", 0.5), ("b", 2.0), ("c", 0.75)):
            await r.ex.publish(0, learner, delta(0, learner, r.plan[0]), fragment=0,
                               base_version=0, local_step=4, steps=4, tokens=64, final=False,
                               schema_digest=SCHEMA.digest(), delta_format="F32",
                               step_seconds=seconds)
        assert await r.syncer().poll(live=frozenset({"a", "b", "c"}))
        rec = await r.ex.read_round(0)
        assert rec is not None and rec.estimates.step == 0.75
        # with ξ_step known, the next round's grace window opens
        sch = r.schedule
        assert r.alg.grace_window(rec.estimates, sch, 1) > 0

    run(main())
