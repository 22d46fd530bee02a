"""Liveness in seconds: the roll call on a fake clock, for a syncer and for learners.

A syncer (tests/test_syncer.py's `Run`, on a FakeClock moved by hand) and learners (real
threads on a FakeClock that jumps when every loop and training thread waits) are driven
with the library's defaults: poll 1 s, leases 60 s / 120 s.
A SIGKILLed learner is one whose loops stop where they are, its lease left behind.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from test_learner_runtime import make_model, train_step
from test_syncer import GateClock, Run, algorithm, fake

from gradientmail import events as ev
from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import Mailbox, MemoryMailbox
from gradientmail.mailbox.wrappers import FaultPlan, FaultyMailbox
from gradientmail.run.lease import LeaseTracker
from gradientmail.run.protocol import Exchange
from gradientmail.run.rollcall import Call, reply
from gradientmail.testing import FakeClock

# -- a syncer, learners simulated by hand ----------------------------------------------


class Peer:
    """A learner as far as liveness goes: its lease, and its lease loop's answer to a
    roll call (what `LeaseKeeper.run` does when it reads the call)."""

    def __init__(self, mailbox: Mailbox, learner: str) -> None:
        self.ex = Exchange(mailbox)
        self.id = learner
        self.handled: Call | None = None

    async def beat(self) -> None:
        await self.ex.beat(self.id)

    async def answer(self) -> None:
        call = await self.ex.read_call()
        if call is None or call == self.handled:
            return
        if reply(call, self.id, self.ex.lease_counter(self.id)).beat:
            await self.ex.beat(self.id)
        self.handled = call


@pytest.fixture
def mailbox() -> Any:
    name = "liveness-test"
    MemoryMailbox.forget(name)
    yield MemoryMailbox(name)
    MemoryMailbox.forget(name)


async def started(mailbox: Mailbox, *ids: str, alg: Any = None) -> tuple[Run, list[Peer]]:
    """A run (standard DiLoCo for two by default) and a peer for each id, each beaten
    once: every one holds a lease before the syncer first lists them."""
    r = Run(mailbox, DiLoCo.standard(4, 2) if alg is None else alg)
    await r.create()
    peers = [Peer(mailbox, x) for x in ids]
    for peer in peers:
        await peer.beat()
    return r, peers


async def tick(r: Run, syncer: Any, peers: list[Peer], seconds: float = 1.0) -> bool:
    """One poll interval: the live peers answer the call, the syncer polls."""
    fake(r).advance(seconds)
    for peer in peers:
        await peer.answer()
    return bool(await syncer.poll())


def test_a_dead_learner_is_judged_gone_and_the_barrier_closes_without_it(
        mailbox: Mailbox) -> None:
    async def main() -> None:
        r, (a, _) = await started(mailbox, "a", "dead")  # then "dead" is SIGKILLed
        s = r.syncer()  # a standalone syncer: it lists the leases every poll
        assert not await s.poll()
        await r.contribute(0, "a")
        t0 = fake(r).now()
        while not await tick(r, s, [a]):
            assert fake(r).now() - t0 <= 10.0, "the barrier still waits for the dead"
        # Seen at the next poll, called 2 s later, judged 5 s after that, closed at once.
        assert fake(r).now() - t0 == 8.0
        rec = await r.ex.read_round(0)
        assert rec is not None and [p.learner for p in rec.participants] == ["a"]
        [called] = r.of(ev.RollCalled)
        # Only "dead" is called: "a" proved it is alive with its contribution.
        assert (called.closer, called.round, called.number, called.called) == ("s1", 0, 0, 1)
        [gone] = r.of(ev.LearnersGone)
        assert (gone.round, gone.learners, gone.seconds) == (0, ("dead",), 5.0)
        assert await r.ex.read_call() == Call(0, 0, "s1", (("dead", 0),))
        assert await r.ex.leases() == {"a": 1}  # its lease deleted; a answered once
        # Round 1: the quorum of 2 is out of reach while "dead" is gone; a closes alone.
        await r.contribute(1, "a")
        assert await tick(r, s, [a])
        # A judged-gone learner that comes back (a restart is a join: it beats) is waited
        # for again.
        back = Peer(mailbox, "dead")
        await back.beat()
        await r.contribute(2, "a")
        for _ in range(3):
            assert not await tick(r, s, [a, back])  # both answer the calls
        await r.contribute(2, "dead")
        assert await tick(r, s, [a, back])
        rec = await r.ex.read_round(2)
        assert rec is not None and [p.learner for p in rec.participants] == ["a", "dead"]
        assert len(r.of(ev.LearnersGone)) == 1

    asyncio.run(main())


def test_a_slow_learner_answers_the_call_and_is_waited_for(mailbox: Mailbox) -> None:
    async def main() -> None:
        r, (a, slow) = await started(mailbox, "a", "slow")
        s = r.syncer()
        assert not await s.poll()
        await r.contribute(0, "a")
        for _ in range(30):
            assert not await tick(r, s, [a, slow])
        # Calls at 2 s, then 4, 8 and 16 s after each verdict: everyone answered within
        # a poll, nobody is gone, and the round still waits.
        assert [c.number for c in r.of(ev.RollCalled)] == [0, 1, 2]
        assert r.of(ev.LearnersGone) == []
        assert (await r.ex.leases())["slow"] == 3
        await r.contribute(0, "slow")
        assert await tick(r, s, [a, slow])
        rec = await r.ex.read_round(0)
        assert rec is not None and [p.learner for p in rec.participants] == ["a", "slow"]

    asyncio.run(main())


@pytest.mark.parametrize("last", ["a", "b"])
def test_a_dead_preferred_closer_of_a_full_round_leaves_it_to_a_contributor(
        mailbox: Mailbox, last: str) -> None:
    # Round 0's preferred closer is "a" (live learners take turns in id order). It
    # contributed, then died before closing; "b", whose learner waits at the barrier, is
    # a backup with a 30-poll head start to give. Its own contribution is in and the set
    # is complete: it closes at its first look, whoever arrived last, with no roll call.
    async def main() -> None:
        r, _ = await started(mailbox, "a")
        tracker = LeaseTracker(120.0)
        await r.ex.beat("b")
        s = r.syncer("b", embedded=True, leases=tracker)

        async def refresh() -> frozenset[str]:
            return await r.ex.observe_leases(tracker)

        await refresh()
        for x in sorted(["a", "b"], key=lambda x: x == last):
            await r.contribute(0, x)
        s.host.note(0)
        t0 = fake(r).now()
        fake(r).advance(1.0)
        assert await s.poll(live=tracker.live(fake(r).now()), refresh_live=refresh,
                            waiting=True)
        assert fake(r).now() - t0 == 1.0
        rec = await r.ex.read_round(0)
        assert rec is not None and rec.closer == "b"
        assert [p.learner for p in rec.participants] == ["a", "b"]
        assert r.of(ev.RollCalled) == [] and r.of(ev.LearnersGone) == []

    asyncio.run(main())


def test_a_learner_wrongly_judged_gone_is_merged_and_live_again_once_it_beats(
        mailbox: Mailbox) -> None:
    async def main() -> None:
        r, (a, mute) = await started(mailbox, "a", "mute")  # mute: deaf to calls a while
        s = r.syncer()
        assert not await s.poll()
        await r.contribute(0, "a")
        while not await tick(r, s, [a]):
            pass
        assert [g.learners for g in r.of(ev.LearnersGone)] == [("mute",)]
        # Its contribution counts like any other: round 1 merges it.
        await r.contribute(1, "mute")
        await r.contribute(1, "a")
        assert await tick(r, s, [a])
        rec = await r.ex.read_round(1)
        assert rec is not None and [p.learner for p in rec.participants] == ["a", "mute"]
        # It reads the verdict naming it and beats at once: live again, waited for again.
        await mute.answer()
        await r.contribute(2, "a")
        for _ in range(3):
            assert not await tick(r, s, [a, mute])
        await r.contribute(2, "mute")
        assert await tick(r, s, [a, mute])

    asyncio.run(main())


def test_a_round_with_its_quorum_is_never_called(mailbox: Mailbox) -> None:
    # Decoupled: quorum 1, the grace window bounds the wait for a missing live learner.
    async def main() -> None:
        r, (a, b) = await started(mailbox, "a", "b", alg=algorithm(fragments=2, quorum_size=1))
        s = r.syncer()
        for round_ in range(3):
            await r.contribute(round_, "a")
            while not await tick(r, s, [a, b]):
                pass
        assert r.of(ev.RollCalled) == []
        assert await r.ex.read_call() is None

    asyncio.run(main())


def test_a_call_someone_else_posted_counts_and_an_abandoned_one_is_taken_over(
        mailbox: Mailbox) -> None:
    async def main() -> None:
        r, (a, _) = await started(mailbox, "a", "dead")
        s = r.syncer()
        assert not await s.poll()
        await r.contribute(0, "a")
        await tick(r, s, [a])  # seen at 101
        theirs = Call(0, 4, "other")  # another closer called, then died
        await r.ex.post_call(theirs)
        await tick(r, s, [a])
        await tick(r, s, [a])  # 103: the round is due a call, but one is open
        assert await r.ex.read_call() == theirs and r.of(ev.RollCalled) == []
        while not r.of(ev.RollCalled):
            await tick(r, s, [a])
        # Its turn came 4 s after the call it counted: number 5, and it judges.
        assert fake(r).now() == 107.0
        assert (await r.ex.read_call()) == Call(0, 5, "s1")
        while not await tick(r, s, [a]):
            pass
        assert [g.learners for g in r.of(ev.LearnersGone)] == [("dead",)]

    asyncio.run(main())


# -- learners in threads on the fake clock ------------------------------------------------


class Stamped:
    """Events with the fake time they happened at."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.events: list[tuple[float, ev.Event]] = []
        self.changed = threading.Condition()

    def __call__(self, event: ev.Event) -> None:
        with self.changed:
            self.events.append((self.clock.now(), event))
            self.changed.notify_all()

    def of(self, cls: type[Any]) -> list[tuple[float, Any]]:
        with self.changed:
            return [(t, e) for t, e in self.events if isinstance(e, cls)]

    def wait_for(self, cond: Callable[[], bool]) -> None:
        """Block (real time, a hang guard of 20 s) until `cond()` holds of the events."""
        with self.changed:
            assert self.changed.wait_for(cond, timeout=20.0), "the event never came"


def background(*targets: Callable[[], None]) -> Callable[[], bool]:
    """Start `targets` in threads; returns whether all of them finished."""
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    return lambda: not any(t.is_alive() for t in threads)


def run_until(clock: FakeClock, done: Callable[[], bool], limit: float) -> float:
    """Let fake time pass (0.1 s at a time, as the test's own wait) until `done()`; the
    fake time then. Fails past `limit` fake seconds."""
    t0 = clock.now()
    while not done():
        assert clock.now() - t0 <= limit, f"not done after {limit} fake seconds"
        clock.pause(0.1)
    return clock.now()


def train(clock: FakeClock, learner: Learner, model: torch.nn.Module, steps: int,
          seed: int) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def go() -> None:
        # A step takes no fake time: the clock moves while the learner waits.
        with clock.busy():
            for i in range(steps):
                train_step(model, opt, seed + i)
                learner.step(8)

    return go


def pair(clock: FakeClock, rec: Stamped, ids: tuple[str, ...], fragments: int = 1,
         boxes: Mapping[str, Callable[[Mailbox], Mailbox]] | None = None,
         ) -> tuple[MemoryMailbox, list[Learner], list[torch.nn.Module]]:
    """Learners of standard DiLoCo (H=4; with `fragments` > 1 a pipelined barrier),
    library defaults, joined and through the first sync's barrier together, as
    `wait_for_learners` starts them. `boxes` wraps a learner's view of the mailbox."""
    mailbox = MemoryMailbox()
    alg = DiLoCo.standard(4, len(ids), fragments=fragments, stagger=fragments == 1)
    models = [make_model(seed=w) for w in range(len(ids))]
    wrap = boxes or {}
    learners = [Learner(TorchAdapter(m), alg, wrap.get(x, lambda b: b)(mailbox), x,
                        clock=clock, on_event=rec)
                for m, x in zip(models, ids, strict=True)]
    for learner in learners:
        learner.start()
    run_until(clock, background(*(lambda x=x: x.wait_for_learners(len(ids), timeout=60)
                                  for x in learners)), limit=30)
    run_until(clock, background(*(train(clock, x, m, 4, 0)
                                  for x, m in zip(learners, models, strict=True))), limit=30)
    return mailbox, learners, models


def shut(clock: FakeClock, *learners: Learner) -> None:
    """Close the learners (no flush); never raises, so that a failed test reports its own
    failure."""
    done = background(*(lambda x=x: x.close(flush=False) for x in learners))
    t0 = clock.now()
    while not done() and clock.now() - t0 < 300:
        clock.pause(1.0)


def kill(learner: Learner) -> None:
    """SIGKILL, as far as the run can tell: the learner's loops stop where they are, and
    its lease stays behind."""
    mailman = learner._mailman
    loop = mailman._loop
    assert loop is not None

    async def cancel() -> None:
        for task in mailman._tasks:
            task.cancel()
        await asyncio.gather(*mailman._tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(cancel(), loop).result(timeout=10)


@pytest.mark.parametrize("ids", [("a-survivor", "b-victim"), ("b-survivor", "a-victim")],
                         ids=["victim-preferred", "survivor-preferred"])
def test_a_killed_learner_holds_its_peer_for_seconds(ids: tuple[str, str]) -> None:
    clock, survivor_id, victim_id = FakeClock(), *ids
    rec = Stamped(clock)
    mailbox, (survivor, victim), (model, _) = pair(clock, rec, ids)
    try:
        assert survivor.rounds_seen == 0 and victim.rounds_seen == 0
        kill(victim)
        # Round 1's preferred closer (the second id in order) is the victim or the survivor.
        run_until(clock, background(train(clock, survivor, model, 4, 100)), limit=30)
        [(t0, _)] = [(t, e) for t, e in rec.of(ev.SnapshotPublished)
                     if e.learner == survivor_id and e.round == 1]
        [(t1, closed)] = [(t, e) for t, e in rec.of(ev.RoundClosed) if e.round == 1]
        assert closed.participants == (survivor_id,)
        assert t1 - t0 <= 10.0, f"the round closed {t1 - t0:.1f} fake s after its contribution"
        [(_, gone)] = rec.of(ev.LearnersGone)
        assert gone.learners == (victim_id,) and gone.closer == survivor_id
        assert victim_id not in survivor.live_learners
        assert victim_id not in asyncio.run(Exchange(mailbox).leases())
        # The survivor goes on alone: round 2 waits for no one.
        run_until(clock, background(train(clock, survivor, model, 4, 200)), limit=10)
        assert survivor.rounds_seen == 2
    finally:
        shut(clock, survivor, victim)


def test_a_healthy_barrier_costs_a_fraction_of_a_poll() -> None:
    # Standard DiLoCo, both learners healthy, the default poll interval of 1 s: from the
    # last contribution of a round to both learners training on its commit. The learner
    # whose contribution completes the set closes at once (its loop woken by its own
    # publish), and the other, woken when its training started to wait, looks every
    # 0.16 s at most: neither waits out a poll interval.
    clock = FakeClock()
    rec = Stamped(clock)
    _, (a, b), (model_a, model_b) = pair(clock, rec, ("a", "b"))
    try:
        for k in (1, 2, 3):
            run_until(clock, background(train(clock, a, model_a, 4, 100 * k),
                                        train(clock, b, model_b, 4, 100 * k + 50)), limit=30)
            last = max(t for t, e in rec.of(ev.SnapshotPublished) if e.round == k)
            aligned = [t for t, e in rec.of(ev.FragmentAligned) if e.round == k]
            assert len(aligned) == 2
            assert max(aligned) - last <= 0.5, (
                f"round {k}: trained on {max(aligned) - last:.2f} fake s after its last "
                "contribution")
    finally:
        shut(clock, a, b)


def test_a_slow_learner_answers_and_is_not_dropped() -> None:
    clock = FakeClock()
    rec = Stamped(clock)
    _, (fast, slow), (fast_model, slow_model) = pair(clock, rec, ("fast", "slow"))
    try:
        fast_done = background(train(clock, fast, fast_model, 4, 100))
        run_until(clock, lambda: bool(rec.of(ev.SnapshotPublished)[2:]), limit=10)
        clock.pause(40.0)  # the slow learner takes 40 s more for its H steps
        assert not fast_done() and fast.rounds_seen == 0
        assert rec.of(ev.RollCalled) and not rec.of(ev.LearnersGone)
        assert fast.live_learners == {"fast", "slow"}
        slow_done = background(train(clock, slow, slow_model, 4, 300))
        run_until(clock, lambda: fast_done() and slow_done(), limit=10)
        [(_, closed)] = [(t, e) for t, e in rec.of(ev.RoundClosed) if e.round == 1]
        assert closed.participants == ("fast", "slow")
        assert not rec.of(ev.LearnersGone)
    finally:
        shut(clock, fast, slow)


def test_the_verdict_reaches_the_learners_that_did_not_judge() -> None:
    # Three learners: one survivor calls and judges; the other learns the verdict from
    # the call key, so that both drop the victim and whichever is preferred closes.
    clock = FakeClock()
    rec = Stamped(clock)
    mailbox, (a, b, victim), (model_a, model_b, _) = pair(clock, rec, ("a", "b", "c"))
    try:
        kill(victim)  # "c": round 1's preferred closer is "b", round 2's is "c"
        for round_, seed in ((1, 100), (2, 200)):
            done = background(train(clock, a, model_a, 4, seed),
                              train(clock, b, model_b, 4, seed + 50))
            run_until(clock, done, limit=30)
            t0 = max(t for t, e in rec.of(ev.SnapshotPublished) if e.round == round_)
            [(t1, closed)] = [(t, e) for t, e in rec.of(ev.RoundClosed) if e.round == round_]
            assert closed.participants == ("a", "b")
            assert t1 - t0 <= 10.0, (round_, t1 - t0)
        # Both survivors may call and judge at once (a read, then a write: there is no
        # conditional overwrite); their verdicts agree.
        verdicts = [(e.closer, e.learners) for _, e in rec.of(ev.LearnersGone)]
        assert verdicts and {learners for _, learners in verdicts} == {("c",)}
        assert len({closer for closer, _ in verdicts}) == len(verdicts) <= 2
        assert a.live_learners == b.live_learners == {"a", "b"}
        assert asyncio.run(Exchange(mailbox).leases()).keys() == {"a", "b"}
    finally:
        shut(clock, a, b, victim)


def test_a_preferred_closer_killed_after_its_contribution_holds_its_peer_for_seconds(
        ) -> None:
    # Round 1's preferred closer, "b-victim", contributes and dies before it closes the
    # round: the survivor, a backup waiting at the barrier, does not give a dead closer
    # its 30-poll head start: its own contribution completed the set, so it closes at its
    # next look, with no roll call (the victim is judged gone once a round waits for it).
    clock = FakeClock()
    rec = Stamped(clock)
    _, (survivor, victim), (model_s, model_v) = pair(
        clock, rec, ("a-survivor", "b-victim"))
    try:
        # The victim's training thread blocks at the barrier once it published; this
        # thread works meanwhile, so time stands still and its loops never list the round.
        with clock.busy():
            background(train(clock, victim, model_v, 4, 100))
            rec.wait_for(lambda: any(e.round == 1 for _, e in rec.events
                                     if isinstance(e, ev.SnapshotPublished)))
            kill(victim)
        run_until(clock, background(train(clock, survivor, model_s, 4, 100)), limit=30)
        t0 = max(t for t, e in rec.of(ev.SnapshotPublished) if e.round == 1)
        [(t1, closed)] = [(t, e) for t, e in rec.of(ev.RoundClosed) if e.round == 1]
        assert closed.closer == "a-survivor"
        assert closed.participants == ("a-survivor", "b-victim")  # its contribution merged
        assert t1 - t0 <= 2.0, f"the round closed {t1 - t0:.1f} fake s after its quorum"
        assert [e for _, e in rec.of(ev.RollCalled) if e.round == 1] == []
    finally:
        shut(clock, survivor, victim)


def test_a_learner_killed_between_the_rounds_of_a_pipelined_sync_holds_its_peer_seconds(
        ) -> None:
    # stagger=False, two fragments: the victim's first round of the sync (2) is in, and
    # its second (3) hangs mid-upload when it dies. Round 2 closes with both; round 3
    # waits for it, calls the roll, judges it gone and closes with the survivor alone,
    # seconds after the survivor's contribution; the survivor's next sync waits for no one.
    clock = FakeClock()
    rec = Stamped(clock)
    stuck = GateClock()  # never opened: the upload of the victim's round 3 never ends
    hang = FaultPlan().delay("create", "payloads/0000000003/*", 1.0, clock=stuck)
    _, (survivor, victim), (model_s, model_v) = pair(
        clock, rec, ("a-survivor", "b-victim"), fragments=2,
        boxes={"b-victim": lambda box: FaultyMailbox(box, hang)})
    try:
        assert survivor.rounds_seen == victim.rounds_seen == 1
        with clock.busy():
            background(train(clock, victim, model_v, 4, 100))
            rec.wait_for(lambda: any(e.round == 2 and e.learner == "b-victim" for _, e in
                                     rec.events if isinstance(e, ev.SnapshotPublished)))
            kill(victim)
        run_until(clock, background(train(clock, survivor, model_s, 4, 200)), limit=60)
        closed = {e.round: (t, e) for t, e in rec.of(ev.RoundClosed)}
        assert closed[2][1].participants == ("a-survivor", "b-victim")
        assert closed[3][1].participants == ("a-survivor",)
        t0 = max(t for t, e in rec.of(ev.SnapshotPublished) if e.round == 3)
        assert closed[3][0] - t0 <= 10.0, f"closed {closed[3][0] - t0:.1f} fake s after"
        [(_, gone)] = rec.of(ev.LearnersGone)
        assert gone.learners == ("b-victim",)
        run_until(clock, background(train(clock, survivor, model_s, 4, 300)), limit=10)
        assert survivor.rounds_seen == 5
    finally:
        shut(clock, survivor, victim)


def test_learners_started_apart_leave_wait_for_learners_together() -> None:
    """The second learner's lease is seen within milliseconds, not a poll interval (1 s by
    default) later: a barrier's first round does not pay for the difference."""
    clock = FakeClock()
    rec = Stamped(clock)
    mailbox = MemoryMailbox()
    alg = DiLoCo.standard(4, 2)
    learners = [Learner(TorchAdapter(make_model(seed=w)), alg, mailbox, x, clock=clock,
                        on_event=rec) for w, x in enumerate(("a", "b"))]
    left: dict[str, float] = {}

    def wait(learner: Learner, start: bool = False) -> Callable[[], None]:
        def go() -> None:
            # One busy() from b's start into its wait: fake time must not move between
            # them (a jumped a poll interval there, 1 run in 5 on a loaded machine).
            with clock.busy():
                if start:
                    learner.start()
                    left["b-started"] = clock.now()
                learner.wait_for_learners(2, timeout=60)
            left[learner.learner_id] = clock.now()
        return go

    with clock.busy():
        learners[0].start()
    done_a = background(wait(learners[0]))
    clock.pause(0.7)  # "a" waits alone, its receive loop well into a wait
    run_until(clock, background(wait(learners[1], start=True)), limit=30)
    run_until(clock, done_a, limit=30)
    try:
        assert abs(left["a"] - left["b"]) <= 0.02, left
    finally:
        shut(clock, *learners)
