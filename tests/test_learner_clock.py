"""The learner's own waits on its injected clock: close() giving up, flushing, waiting for
peers. Minutes of fake time in a fraction of a second, and the fake times are exact."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from test_learner_runtime import all_records, make_model, newest_theta, train_step

from gradientmail import events as ev
from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.errors import GradientmailError
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import FaultPlan, FaultyMailbox, Mailbox, MemoryMailbox
from gradientmail.testing import FakeClock


class Stamped:
    """Events with the fake time they happened at."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.events: list[tuple[float, ev.Event]] = []
        self.lock = threading.Lock()

    def __call__(self, event: ev.Event) -> None:
        with self.lock:
            self.events.append((self.clock.now(), event))

    def of(self, cls: type[Any]) -> list[tuple[float, Any]]:
        with self.lock:
            return [(t, e) for t, e in self.events if isinstance(e, cls)]


def alone(clock: FakeClock, rec: Stamped, mailbox: Mailbox, *, sync: bool,
          flush: bool = False) -> tuple[Learner, torch.nn.Module]:
    """A started learner alone in a run (H=4, one fragment, no barrier), library defaults
    for the poll interval and leases (1 s, 60 s / 120 s). It uploads every contribution
    (`hold_own=False`): these tests time uploads."""
    alg = DiLoCo(sync_every=4, fragments=1, in_flight=1, overlap_steps=None,
                 merge=WeightedMean(), flush_on_close=flush)
    model = make_model()
    learner = Learner(
        TorchAdapter(model),
        alg,
        mailbox,
        "solo",
        clock=clock,
        on_event=rec,
        options=LearnerOptions(sync=sync, keep_versions=1000, hold_own=False),
    )
    learner.start()
    return learner, model


def train(learner: Learner, model: torch.nn.Module, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        train_step(model, opt, step)
        learner.step(10)


def test_close_gives_up_on_a_commit_that_never_comes_after_lease_timeout_and_a_takeover(
        ) -> None:
    # Nobody closes rounds (no syncer anywhere): round 0's commit never comes.
    clock = FakeClock()
    rec = Stamped(clock)
    real = time.monotonic()
    with clock.busy():
        learner, model = alone(clock, rec, MemoryMailbox(), sync=False)
        theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
        train(learner, model, 4)  # publishes round 0
        learner.close()
    [(t0, closing)] = rec.of(ev.Closing)
    [(t1, gave_up)] = rec.of(ev.GaveUp)
    assert closing.in_flight == (0,)
    assert (gave_up.rounds, gave_up.seconds) == ((0,), 130.0)  # 120 s + 10 polls of 1 s
    # The training thread looks every 0.05 s: it gives up at its first look past 130 s.
    assert 130.0 < t1 - t0 <= 130.05 + 1e-9
    assert [e.round for _, e in rec.of(ev.SnapshotPublished)] == [0]
    assert rec.of(ev.Closed)
    assert time.monotonic() - real < 20.0  # a hang guard; it takes a fraction of a second
    # Nothing was committed: the model ends on Θ⁰, as every other learner sees the run.
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), theta0[name]), name


def test_flushing_waits_out_a_slow_store_on_the_clock() -> None:
    # The final snapshot's upload takes 90 s (a slow store, on the fake clock): close()
    # waits for it and for its commit, well within its limits, and gives up nothing.
    clock = FakeClock()
    rec = Stamped(clock)
    inner = MemoryMailbox()
    plan = FaultPlan().delay("create", "payloads/0000000001/*", 90.0, clock)
    with clock.busy():
        learner, model = alone(clock, rec, FaultyMailbox(inner, plan), sync=True, flush=True)
        train(learner, model, 7)  # round 0 goes out at step 4; 3 steps left to flush
        clock.pause(5.0)  # round 0 commits meanwhile
        assert len(all_records(inner)) == 1
        learner.close()
    assert plan.rules[0].fired == 1
    [(t0, closing)] = rec.of(ev.Closing)
    assert closing.flush
    [(t1, published)] = [(t, e) for t, e in rec.of(ev.SnapshotPublished) if e.round == 1]
    assert (published.steps, published.tokens) == (3, 30)
    assert published.seconds >= 90.0 and t1 - t0 >= 90.0
    [(t2, _)] = rec.of(ev.Closed)
    assert t2 - t0 < 100.0
    assert rec.of(ev.GaveUp) == []
    first, last = all_records(inner)
    assert not first.all_final and last.all_final
    assert [(p.learner, p.steps) for p in last.participants] == [("solo", 3)]
    want = newest_theta(inner)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), want[name]), name


def test_wait_for_learners_times_out_on_the_clock() -> None:
    clock = FakeClock()
    rec = Stamped(clock)
    with clock.busy():
        MemoryMailbox.forget("waiting")
        learner, _ = alone(clock, rec, MemoryMailbox("waiting"), sync=False)
        t0 = clock.now()
        try:
            learner.wait_for_learners(2, timeout=75.0)
        except GradientmailError as exc:
            assert str(exc) == (
                "learner 'solo' waited 75s for 2 learners of the run in memory://waiting "
                "to start; 1 hold a lease (solo), 1 more never did. "
                "Start the other 1 (the same mailbox and prefix), or set wait_for_learners "
                "lower (0 starts at once) or wait_timeout longer")
        else:
            raise AssertionError("a second learner never came")
        assert 75.0 <= clock.now() - t0 <= 75.01 + 1e-9
        # Said when the wait began, then every 30 s while nobody came.
        waits = [(round(t - t0), e.live, e.wanted, round(e.waited))
                 for t, e in rec.of(ev.AwaitingLearners)]
        assert waits == [(0, ("solo",), 2, 0), (30, ("solo",), 2, 30), (60, ("solo",), 2, 60)]
        learner.close()
