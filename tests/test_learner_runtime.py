"""The learner runtime in one process: threads, a MemoryMailbox, faults from a plan."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gradientmail import events as ev
from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.errors import GradientmailError, RunConfigMismatch, SchemaMismatch
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import FaultPlan, FaultyMailbox, Mailbox, MemoryMailbox
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import state_at
from gradientmail.syncer.runtime import CloserSettings, Syncer
from gradientmail.testing import FakeClock
from gradientmail.wire.records import RoundRecord

FAST = {"poll_interval": 0.005, "lease_every": 5.0, "lease_timeout": 30.0}


def make_model(seed: int = 0, width: int = 8) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)
    )


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


class Recorder:
    def __init__(self) -> None:
        self.events: list[ev.Event] = []
        self.lock = threading.Lock()

    def __call__(self, event: ev.Event) -> None:
        with self.lock:
            self.events.append(event)

    def of(self, cls: type[Any]) -> list[Any]:
        with self.lock:
            return [e for e in self.events if isinstance(e, cls)]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def all_records(mailbox: Mailbox) -> list[RoundRecord]:
    return list(run(Exchange(mailbox).rounds_after(-1)))


def newest_theta(mailbox: Mailbox, upto: int | None = None) -> dict[str, torch.Tensor]:
    async def go() -> dict[str, torch.Tensor]:
        ex = Exchange(mailbox)
        manifest = await ex.read_manifest()
        assert manifest is not None
        latest = await ex.latest_commit_per_fragment(len(manifest.plan), upto)
        out: dict[str, torch.Tensor] = {}
        for p, names in enumerate(manifest.plan):
            tensors = (await state_at(ex, p, latest.get(p), manifest)).theta
            for n in names:
                out[n] = torch.frombuffer(bytearray(tensors[n].data), dtype=torch.float32).reshape(
                    tensors[n].shape
                )
        return out

    return dict(run(go()))


def in_threads(*targets: Callable[[], None], timeout: float = 120) -> None:
    errors: list[BaseException] = []

    def wrap(f: Callable[[], None]) -> Callable[[], None]:
        def inner() -> None:
            try:
                f()
            except BaseException as exc:  # re-raised below, in the test's thread
                errors.append(exc)

        return inner

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
        assert not t.is_alive(), "a learner thread hung"
    if errors:
        raise errors[0]


def test_decoupled_defaults_three_learners(tmp_path: Any) -> None:
    mailbox = MemoryMailbox()
    alg = DiLoCo(sync_every=12, fragments=3)  # τ=2, no barrier, quorum 1, RDA
    learners: list[Learner] = []
    models: list[torch.nn.Module] = []
    rec = Recorder()
    for w in range(3):
        model = make_model(seed=w)
        models.append(model)
        learners.append(
            Learner(
                TorchAdapter(model),
                alg,
                mailbox,
                f"w{w}",
                on_event=rec,
                options=LearnerOptions(**FAST, keep_versions=1000),
            )
        )

    def work(w: int) -> Callable[[], None]:
        def go() -> None:
            learner, model = learners[w], models[w]
            learner.start()
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            for step in range(120):
                train_step(model, opt, 7919 * w + step)
                learner.step(16)
                time.sleep(0.003)
            learner.close()

        return go

    in_threads(*(work(w) for w in range(3)))
    records = all_records(mailbox)
    assert len(records) >= 10
    assert [r.round for r in records] == list(range(len(records)))
    assert [r.fragment for r in records] == [r.round % 3 for r in records]
    versions: dict[int, int] = {}
    for r in records:
        versions[r.fragment] = versions.get(r.fragment, 0) + 1
        assert r.version == versions[r.fragment]
        assert r.participants, "a decoupled round closes with at least one contribution"
    learners_seen = {p.learner for r in records for p in r.participants}
    assert learners_seen == {"w0", "w1", "w2"}
    for w, learner in enumerate(learners):
        want = newest_theta(mailbox, learner.rounds_seen)
        for name, p in models[w].named_parameters():
            assert torch.equal(p.detach(), want[name]), (w, name)
    # the last learner to close saw every round
    assert max(learner.rounds_seen for learner in learners) == records[-1].round
    assert len(rec.of(ev.Joined)) == 3 and len(rec.of(ev.Closed)) == 3
    assert len(rec.of(ev.LeaseReleased)) == 3
    assert run(Exchange(mailbox).leases()) == {}


def solo(plan: FaultPlan, overlap_steps: int | None
         ) -> tuple[Mailbox, Learner, torch.nn.Module, torch.optim.Optimizer, Recorder]:
    """A started learner alone in a run (H=4, one fragment), its store failing by `plan`.
    It uploads every contribution (`hold_own=False`): alone, its closer would merge each
    from memory, and these tests are about uploads."""
    mailbox = FaultyMailbox(MemoryMailbox(), plan)
    alg = DiLoCo(sync_every=4, fragments=1, in_flight=1, overlap_steps=overlap_steps,
                 merge=WeightedMean())
    rec = Recorder()
    model = make_model()
    learner = Learner(
        TorchAdapter(model),
        alg,
        mailbox,
        "solo",
        on_event=rec,
        options=LearnerOptions(**FAST, hold_own=False),
    )
    learner.start()
    return mailbox, learner, model, torch.optim.SGD(model.parameters(), lr=0.05), rec


def test_failed_publish_is_reported_and_its_steps_go_out_next_round() -> None:
    plan = FaultPlan().fail("create", "payloads/*/solo.*", nth=1, times=1)
    mailbox, learner, model, opt, rec = solo(plan, overlap_steps=None)
    for step in range(4):
        train_step(model, opt, step)
        learner.step(10)
    deadline = time.monotonic() + 20
    while not rec.of(ev.PublishFailed) and time.monotonic() < deadline:
        time.sleep(0.01)
    for step in range(4, 8):
        train_step(model, opt, step)
        learner.step(10)
    learner.close()
    failed = rec.of(ev.PublishFailed)
    assert [f.round for f in failed] == [0]
    assert "MailboxError" in failed[0].error
    first = all_records(mailbox)[0]
    assert first.round == 0
    (part,) = first.participants
    # the failed publish's 4 steps were not lost: round 0 carries all 8
    assert (part.learner, part.steps, part.tokens) == ("solo", 8, 80)


def test_a_publish_that_fails_while_training_waits_for_its_round_goes_out_again() -> None:
    # Standard DiLoCo's barrier (overlap_steps=0): the learner waits for round 0's commit
    # right after handing its contribution over, and the upload fails. The round waits
    # for that contribution; the learner must send it again from within the wait.
    plan = FaultPlan().fail("create", "payloads/*/solo.*", nth=1, times=1)
    mailbox, learner, model, opt, rec = solo(plan, overlap_steps=0)

    def train() -> None:
        for step in range(8):
            train_step(model, opt, step)
            learner.step(10)

    try:
        in_threads(train, timeout=30)
    finally:
        learner.close()
    assert [f.round for f in rec.of(ev.PublishFailed)] == [0]
    assert [(e.round, e.steps) for e in rec.of(ev.SnapshotPublished)] == [(0, 4), (1, 4)]
    first, second = all_records(mailbox)[:2]
    # sent again as it was (the same 4 steps), before any further training
    assert [(p.learner, p.steps, p.tokens) for p in first.participants] == [("solo", 4, 40)]
    assert [(p.learner, p.steps, p.tokens) for p in second.participants] == [("solo", 4, 40)]
    assert rec.of(ev.GaveUp) == []


def test_a_publish_that_landed_though_its_answer_was_lost_counts_once() -> None:
    # The record's create lands but raises (an answer lost after the mailbox's retries):
    # the learner looks before retracting, finds its own record, and counts it as sent.
    plan = FaultPlan().fail("create", "snapshots/*/solo.json", nth=1, times=1, after=True)
    mailbox, learner, model, opt, rec = solo(plan, overlap_steps=0)
    for step in range(8):
        train_step(model, opt, step)
        learner.step(10)
    learner.close()
    assert plan.rules[0].fired == 1
    assert rec.of(ev.PublishFailed) == []
    assert [(e.round, e.steps, e.tokens) for e in rec.of(ev.SnapshotPublished)] == [
        (0, 4, 40), (1, 4, 40)]
    first, second = all_records(mailbox)[:2]
    # each step counted once: round 1 carries only the steps after round 0's snapshot
    assert [(p.learner, p.steps, p.tokens) for p in first.participants] == [("solo", 4, 40)]
    assert [(p.learner, p.steps, p.tokens) for p in second.participants] == [("solo", 4, 40)]
    want = newest_theta(mailbox, learner.rounds_seen)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), want[name]), name


def test_a_round_whose_publish_failed_after_a_later_one_went_out_is_published_again() -> None:
    # b's upload for round 0 fails late, after its round 1 was handed over. Round 0 waits
    # for b (quorum 2, both alive): b must fill that hole, or the run stalls.
    inner = MemoryMailbox()
    plan = (FaultPlan().delay("create", "payloads/0000000000/b.*", 0.3, times=1)
            .fail("create", "payloads/0000000000/b.*"))
    alg = DiLoCo(sync_every=4, fragments=2, quorum_size=2)
    rec = {n: Recorder() for n in "ab"}
    models = {n: make_model(seed=w) for w, n in enumerate("ab")}
    learners = {
        n: Learner(
            TorchAdapter(models[n]),
            alg,
            inner if n == "a" else FaultyMailbox(inner, plan),
            n,
            on_event=rec[n],
            options=LearnerOptions(**FAST, keep_versions=1000, hold_own=n == "a"),
        )
        for n in "ab"
    }

    def work(n: str) -> Callable[[], None]:
        def go() -> None:
            learner, model = learners[n], models[n]
            learner.start()
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            for step in range(100):
                train_step(model, opt, step)
                learner.step(16)
                time.sleep(0.01)
            learner.close()

        return go

    in_threads(work("a"), work("b"), timeout=60)
    assert plan.rules[1].fired == 1
    assert [e.round for e in rec["b"].of(ev.PublishFailed)] == [0]
    published = [e.round for e in rec["b"].of(ev.SnapshotPublished)]
    assert published.index(0) > published.index(1)  # round 0 went out again, after round 1
    records = all_records(inner)
    assert [r.round for r in records] == list(range(len(records))) and len(records) >= 10
    assert {p.learner for p in records[0].participants} == {"a", "b"}
    assert rec["a"].of(ev.GaveUp) == [] and rec["b"].of(ev.GaveUp) == []


class Boom(BaseException):
    """Not an Exception: the loops do not swallow it, so the thread dies."""


def test_the_threads_death_is_raised_from_step() -> None:
    plan = FaultPlan().fail("get", "rounds/*", nth=3, times=None, error=Boom)
    mailbox = FaultyMailbox(MemoryMailbox(), plan)
    model = make_model()
    learner = Learner(
        TorchAdapter(model),
        DiLoCo(sync_every=4, fragments=2),
        mailbox,
        "x",
        on_event=lambda e: None,
        options=LearnerOptions(**FAST),
    )
    learner.start()
    deadline = time.monotonic() + 20
    with pytest.raises(GradientmailError, match="communication thread of learner 'x' died") as e:
        while time.monotonic() < deadline:
            learner.step(1)
            time.sleep(0.01)
    assert isinstance(e.value.__cause__, Boom)
    learner.close()


def test_mismatched_schema_and_config_are_refused_at_join() -> None:
    mailbox = MemoryMailbox()
    alg = DiLoCo(sync_every=4, fragments=2)
    first = Learner(TorchAdapter(make_model()), alg, mailbox, "a", on_event=lambda e: None,
                    options=LearnerOptions(**FAST))
    first.start()
    try:
        other = Learner(
            TorchAdapter(make_model(width=9)), alg, mailbox, "b", on_event=lambda e: None,
                options=LearnerOptions(**FAST)
        )
        with pytest.raises(SchemaMismatch) as e:
            other.start()
        msg = str(e.value)
        assert "'0.weight' is F32[8, 6] in the run, F32[9, 6] here" in msg
        assert "'2.weight' is F32[2, 8] in the run, F32[2, 9] here" in msg
        cfg = Learner(
            TorchAdapter(make_model()),
            DiLoCo(sync_every=6, fragments=2),
            mailbox,
            "c",
            on_event=lambda e: None,
            options=LearnerOptions(**FAST),
        )
        with pytest.raises(RunConfigMismatch, match="sync_every: run has 4, this process 6"):
            cfg.start()
    finally:
        first.close()


def test_a_creator_that_died_before_the_manifest_is_taken_over() -> None:
    mailbox = MemoryMailbox()
    assert run(Exchange(mailbox).claim_creation("ghost", 0))
    rec = Recorder()
    model = make_model()
    learner = Learner(
        TorchAdapter(model),
        DiLoCo(sync_every=4, fragments=2),
        mailbox,
        "heir",
        on_event=rec,
        options=LearnerOptions(**FAST),
    )
    learner.start()
    learner.close()
    assert [e.attempt for e in rec.of(ev.AwaitingCreator)] == [0]
    assert [e.attempt for e in rec.of(ev.TookOverCreation)] == [1]
    manifest = run(Exchange(mailbox).read_manifest())
    assert manifest.creator == "heir"
    assert manifest.init[0].key.startswith("init/000001/")


def test_a_late_joiner_starts_from_the_newest_commits() -> None:
    mailbox = MemoryMailbox()
    alg = DiLoCo(sync_every=4, fragments=2, in_flight=1, overlap_steps=0)
    early_model = make_model(seed=1)
    early = Learner(
        TorchAdapter(early_model), alg, mailbox, "early", on_event=lambda e: None,
            options=LearnerOptions(**FAST)
    )
    early.start()
    opt = torch.optim.SGD(early_model.parameters(), lr=0.05)
    for step in range(12):
        train_step(early_model, opt, step)
        early.step(8)
    assert early.rounds_seen >= 3
    late_model = make_model(seed=2)
    late = Learner(TorchAdapter(late_model), alg, mailbox, "late", on_event=lambda e: None,
                   options=LearnerOptions(**FAST))
    late.start()
    want = newest_theta(mailbox, late.rounds_seen)
    for name, p in late_model.named_parameters():
        assert torch.equal(p.detach(), want[name]), name
    late.close()
    early.close()


def test_leases_renew_on_the_clock_and_are_released_on_close() -> None:
    mailbox = MemoryMailbox()
    clock = FakeClock()
    model = make_model()
    learner = Learner(
        TorchAdapter(model),
        DiLoCo(sync_every=4, fragments=2),
        mailbox,
        "tick",
        clock=clock,
        on_event=lambda e: None,
        options=LearnerOptions(poll_interval=1.0, lease_every=60.0, lease_timeout=120.0),
    )
    ex = Exchange(mailbox)
    with clock.busy():  # fake time moves only while this thread waits on the clock
        learner.start()
        first = run(ex.leases())["tick"]  # the join's beat
        clock.pause(250.0)
        assert clock.now() == 250.0
        assert run(ex.leases())["tick"] == first + 4  # beats at 60, 120, 180 and 240 s
        learner.close()
    assert "tick" not in run(ex.leases())


def train_together(learners: list[Learner], models: list[torch.nn.Module], steps: int,
                   seed_stride: int) -> None:
    """Start the learners in threads, wait until each sees them all live, train `steps`
    SGD steps each (4 samples a step), and close them."""
    ready = threading.Barrier(len(learners))

    def work(w: int) -> Callable[[], None]:
        def go() -> None:
            learners[w].start()
            ready.wait(timeout=30)
            assert wait_for(lambda: len(learners[w].live_learners) == len(learners))
            opt = torch.optim.SGD(models[w].parameters(), lr=0.05)
            for step in range(steps):
                train_step(models[w], opt, seed_stride * w + step)
                learners[w].step(4)
            learners[w].close()

        return go

    in_threads(*(work(w) for w in range(len(learners))))


def wait_for(cond: Callable[[], bool], seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_a_silent_peer_drops_out_of_the_live_set() -> None:
    mailbox = MemoryMailbox()
    clock = FakeClock()
    run(Exchange(mailbox).beat("silent"))  # beats once, then never again
    model = make_model()
    learner = Learner(
        TorchAdapter(model),
        DiLoCo(sync_every=4, fragments=2),
        mailbox,
        "obs",
        clock=clock,
        on_event=lambda e: None,
        options=LearnerOptions(poll_interval=1.0, lease_every=10.0, lease_timeout=40.0),
    )
    with clock.busy():
        learner.start()
        clock.pause(1.0)
        assert learner.live_learners == frozenset({"obs", "silent"})
        clock.pause(38.5)  # 39.5 s: its lease is not yet 40 s old on this learner's clock
        assert learner.live_learners == frozenset({"obs", "silent"})
        clock.pause(1.0)  # 40.5 s
        assert learner.live_learners == frozenset({"obs"})
        learner.close()


def test_global_batch_size_is_split_over_live_learners() -> None:
    mailbox = MemoryMailbox()
    run(Exchange(mailbox).beat("peer-1"))
    run(Exchange(mailbox).beat("peer-2"))
    alg = DiLoCo(sync_every=4, fragments=2, global_batch_size=100)
    learner = Learner(
        TorchAdapter(make_model()), alg, mailbox, "me", on_event=lambda e: None,
            options=LearnerOptions(**FAST)
    )
    assert learner.batch_size == 100
    learner.start()
    deadline = time.monotonic() + 20
    while len(learner.live_learners) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert learner.batch_size == 34
    learner.close()


@pytest.mark.parametrize("checkpoint_every", [1, 20], ids=["published", "replicated"])
@pytest.mark.parametrize("fmt", ["BF16", "F8_E4M3", "F4"])
def test_quantized_deltas_and_commit_updates(fmt: str, checkpoint_every: int) -> None:
    mailbox = MemoryMailbox()
    alg = DiLoCo(
        sync_every=4,
        fragments=2,
        in_flight=1,
        overlap_steps=0,
        quorum_size=2,
        delta_dtype=fmt,
        commit_dtype=fmt,
        checkpoint_every=checkpoint_every,
    )
    rec = Recorder()
    models = [make_model(seed=w, width=64) for w in range(2)]
    learners = [
        Learner(
            TorchAdapter(m),
            alg,
            mailbox,
            f"q{w}",
            on_event=rec,
            options=LearnerOptions(**FAST, compression="zstd", keep_versions=1000),
        )
        for w, m in enumerate(models)
    ]
    train_together(learners, models, 24, seed_stride=31)
    records = all_records(mailbox)
    assert len(records) >= 10
    assert all(len(r.participants) == 2 for r in records)
    aligned = rec.of(ev.FragmentAligned)
    if checkpoint_every == 1:
        assert all(r.update is not None and r.update.format == fmt for r in records)
        published = rec.of(ev.SnapshotPublished)
        theta_bytes = {r.round: r.theta.size for r in records if r.theta}
        update_bytes = {r.round: r.update.payload.size for r in records if r.update}
        # deltas travel quantized: far below the F32 theta of the same fragment
        assert all(e.bytes < 0.6 * theta_bytes[e.round]
                   for e in published if e.round in theta_bytes)
        rebuilt = [e for e in aligned if e.bytes == update_bytes.get(e.round)]
        assert len(rebuilt) >= len(aligned) - 4  # all but each fragment's first per learner
    else:
        # The commits carry the merged Δ in the commit format, and no theta: each learner
        # applies the step to its own state (the closer holds its result already).
        assert all(r.step is not None and r.step.format == fmt and r.update is None
                   and not r.checkpoint for r in records)
        step_bytes = {r.round: r.step.payload.size for r in records if r.step}
        assert all(e.bytes in (0, step_bytes[e.round]) for e in aligned)
        assert sum(e.bytes > 0 for e in aligned) >= len(records) - 4
    for w, learner in enumerate(learners):
        want = newest_theta(mailbox, learner.rounds_seen)
        for name, p in models[w].named_parameters():
            assert torch.equal(p.detach(), want[name]), (w, name)


def test_flush_on_close_publishes_final_snapshots() -> None:
    mailbox = MemoryMailbox()
    alg = DiLoCo(
        sync_every=4,
        fragments=1,
        in_flight=1,
        overlap_steps=0,
        merge=WeightedMean(),
        flush_on_close=True,
    )
    rec = Recorder()
    model = make_model()
    learner = Learner(
        TorchAdapter(model),
        alg,
        mailbox,
        "leaver",
        on_event=rec,
        options=LearnerOptions(**FAST, keep_versions=1000),
    )
    learner.start()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(7):  # the barrier at step 4 waits for round 0's commit
        train_step(model, opt, step)
        learner.step(10)
    learner.close()
    first, last = all_records(mailbox)
    assert not first.all_final and first.participants[0].steps == 4
    assert last.all_final
    (part,) = last.participants
    assert (part.learner, part.steps, part.tokens) == ("leaver", 3, 30)

    # the final round moved the master by Δ alone and kept the momentum
    async def momentum(r: RoundRecord) -> Any:
        return (await state_at(Exchange(mailbox), r.fragment, r)).momentum

    assert run(momentum(first)) == run(momentum(last))
    want = newest_theta(mailbox)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), want[name]), name


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _step_until_aligned(
    learner: Learner, model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int
) -> tuple[dict[str, torch.Tensor], int]:
    """Train and step until a step applies a commit; the parameters just before that
    step() (after its optimizer step) and the learner's local step then."""
    for k in range(5000):  # a hang guard, not a timing assertion
        train_step(model, opt, seed + k)
        before = _params(model)
        if learner.step(16):
            return before, learner.local_step
        time.sleep(0.002)
    raise AssertionError("no commit arrived")


@pytest.mark.parametrize("rebase", [True, False])
def test_a_commit_keeps_what_was_trained_after_the_snapshot(rebase: bool) -> None:
    mailbox = MemoryMailbox()
    alg = DiLoCo(sync_every=4, fragments=1, in_flight=1, merge=WeightedMean(), rebase=rebase)
    ma, mb = make_model(seed=0), make_model(seed=1)
    a = Learner(
        TorchAdapter(ma),
        alg,
        mailbox,
        "a",
        on_event=lambda e: None,
        options=LearnerOptions(**FAST, keep_versions=1000),
    )
    b = Learner(
        TorchAdapter(mb),
        alg,
        mailbox,
        "b",
        on_event=lambda e: None,
        options=LearnerOptions(**FAST, keep_versions=1000),
    )
    a.start()
    b.start()
    theta0 = _params(mb)  # b joined a's run: it holds Θ⁰
    opt_a = torch.optim.SGD(ma.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(mb.parameters(), lr=0.05)
    train_step(mb, opt_b, 100)
    assert b.step(16) == ()  # one step of b, nothing due
    for k in range(4):
        train_step(ma, opt_a, k)
        snapshot = _params(ma)
        a.step(16)  # the 4th publishes round 0 with this snapshot
    # a trains on: the commit of round 0 lands some steps after its snapshot
    before, at = _step_until_aligned(a, ma, opt_a, 4)
    assert at > 4
    (rec0,) = all_records(mailbox)[:1]
    assert [p.learner for p in rec0.participants] == ["a"]
    theta1 = newest_theta(mailbox, 0)
    for name, p in ma.named_parameters():
        # rebasing: Θ¹ + (θ − snapshot), a's progress since its snapshot kept on top
        want = (before[name] - snapshot[name]) + theta1[name] if rebase else theta1[name]
        assert torch.equal(p.detach(), want), name
    # b took no part in round 0: all of its progress since Θ⁰ stays on top of Θ¹
    before_b, _ = _step_until_aligned(b, mb, opt_b, 200)
    # (a may have published round 1 in the step that aligned it; then b may have applied
    # its commit too, rebasing twice: equal up to float rounding.)
    newest = newest_theta(mailbox, b.rounds_seen)
    for name, p in mb.named_parameters():
        want = (before_b[name] - theta0[name]) + newest[name] if rebase else newest[name]
        if b.rounds_seen == 0:
            assert torch.equal(p.detach(), want), name
        else:
            torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6)
    # Both train on until each has a contribution committed after round 0.
    for k in range(5000):
        later = [p for r in all_records(mailbox)[1:] for p in r.participants]
        if {p.learner for p in later} == {"a", "b"}:
            break
        for learner, model, opt in ((a, ma, opt_a), (b, mb, opt_b)):
            train_step(model, opt, 1000 + k)
            learner.step(16)
        time.sleep(0.002)
    else:
        raise AssertionError("no later contributions from both learners")
    a.close()
    b.close()
    parts = [p for r in all_records(mailbox) for p in r.participants]
    for who in ("a", "b"):
        mine = [p for p in parts if p.learner == who]
        assert all(p.tokens == 16 * p.steps for p in mine)
        if rebase:
            # every step goes out once: each contribution holds the steps since the last
            assert [p.steps for p in mine] == [
                q.local_step - prev for q, prev in zip(
                    mine, [0, *(m.local_step for m in mine[:-1])], strict=True)
            ], who
        else:
            # overwriting threw away what was trained between the snapshot and the commit
            assert sum(p.steps for p in mine) < mine[-1].local_step, who


@pytest.mark.parametrize(("dtype", "delta_dtype", "want"), [
    (torch.bfloat16, None, "BF16"),  # the model's own precision by default
    (torch.bfloat16, "F32", "F32"),  # full precision on request
    (torch.float32, None, "F32"),
])
def test_deltas_travel_in_the_models_precision_by_default(
    dtype: torch.dtype, delta_dtype: str | None, want: str
) -> None:
    mailbox = MemoryMailbox()
    alg = DiLoCo(sync_every=4, fragments=1, in_flight=1, overlap_steps=0,
                 delta_dtype=delta_dtype, flush_on_close=False)
    model = make_model(width=64).to(dtype)
    rec = Recorder()
    learner = Learner(
        TorchAdapter(model),
        alg,
        mailbox,
        "solo",
        on_event=rec,
        options=LearnerOptions(**FAST, hold_own=False),
    )
    learner.start()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(8):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
        opt.step()
        learner.step(4)
    learner.close()
    records = all_records(mailbox)
    assert [len(r.participants) for r in records] == [1, 1]
    published = rec.of(ev.SnapshotPublished)
    n = sum(p.numel() for p in model.parameters())
    size = {"BF16": 2, "F32": 4}[want]
    # the payload is the tensors in that format plus a small safetensors header
    assert len(published) == 2
    assert all(size * n < e.bytes < size * n + 1024 for e in published)


def test_a_learner_whose_run_vanished_stops_with_an_error_naming_it(tmp_path: Any) -> None:
    import shutil

    from gradientmail.errors import RunVanished

    box = tmp_path / "run"
    model = make_model()
    learner = Learner(TorchAdapter(model), DiLoCo(sync_every=4, fragments=2), str(box),
                      "orphan", options=LearnerOptions(**FAST))
    learner.start()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        train_step(model, opt, step)
        learner.step(4)
    # The run directory removed mid-run (renamed away first: the learner's writes would
    # race a recursive delete).
    box.rename(tmp_path / "gone")
    shutil.rmtree(tmp_path / "gone")
    deadline = time.monotonic() + 20
    with pytest.raises(GradientmailError, match="communication thread") as info:
        while time.monotonic() < deadline:
            train_step(model, opt, 0)
            learner.step(4)
            time.sleep(0.01)
    assert isinstance(info.value.__cause__, RunVanished)
    assert "the run learner 'orphan' joined is gone" in str(info.value.__cause__)
    assert "'manifest.json' is missing from" in str(info.value.__cause__)
    learner.close()  # never raises for the store's failure


def test_a_blocked_learner_looks_for_its_commit_sooner_backing_off() -> None:
    from gradientmail.run.cadence import poll_delay

    assert poll_delay(1.0, 0) == 1.0  # training: the poll interval
    # Doubling up to 0.05 s: a barrier's learner sees its commit within 0.05 s.
    assert [poll_delay(1.0, k) for k in range(1, 8)] == [0.02, 0.04, 0.05, 0.05, 0.05, 0.05,
                                                         0.05]
    assert poll_delay(0.005, 3) == 0.005  # never slower than the poll interval
    # On a store whose requests cost nothing (a local directory), within milliseconds.
    assert [poll_delay(1.0, k, metered=False) for k in range(1, 6)] == [0.002, 0.004, 0.008,
                                                                        0.01, 0.01]


def test_a_standalone_closer_looks_for_the_last_contributions_at_one_pace() -> None:
    from gradientmail.run.cadence import probe_delay

    # One closer a run, not one per learner: every 20 ms on a billed store, never doubling.
    assert probe_delay(1.0) == 0.02 and probe_delay(0.01) == 0.01
    assert probe_delay(1.0, metered=False) == 0.002


def test_mailboxes_say_whether_their_requests_are_billed(tmp_path: Any) -> None:
    from gradientmail.mailbox import LocalMailbox, S3Mailbox

    assert not LocalMailbox(tmp_path).metered and not MemoryMailbox().metered
    assert S3Mailbox.metered
    assert not CountingMailbox(FaultyMailbox(MemoryMailbox(), FaultPlan())).metered
    assert CountingMailbox(S3Mailbox.__new__(S3Mailbox)).metered


class KeyLog(CountingMailbox):
    """Counts like CountingMailbox and logs (operation, key, bytes) of every payload."""

    def __init__(self, inner: Mailbox) -> None:
        super().__init__(inner)
        self.log: list[tuple[str, str, int]] = []

    async def get(self, key: str) -> bytes | None:
        data = await super().get(key)
        if data is not None:
            self.log.append(("get", key, len(data)))
        return data

    async def put(self, key: str, data: bytes) -> None:
        self.log.append(("put", key, len(data)))
        await super().put(key, data)

    async def create(self, key: str, data: bytes) -> bool:
        self.log.append(("create", key, len(data)))
        return await super().create(key, data)


def test_rounds_move_no_outer_state_but_their_checkpoints() -> None:
    """Standard DiLoCo, two learners, a checkpoint every 5 versions: theta and the outer
    state are written at versions 5 and 10 only and read by no one (both hold the state
    from Θ⁰ on); each learner downloads the step of every round it did not close, and
    its delta goes up once per round unless its contribution completed the round's set and
    its own closer merged it from memory (`held`). Both end on the committed model."""
    mailbox = MemoryMailbox()
    alg = DiLoCo.standard(4, 2, checkpoint_every=5)
    logs = [KeyLog(mailbox) for _ in range(2)]
    models = [make_model(seed=w) for w in range(2)]
    learners = [Learner(
        TorchAdapter(m),
        alg,
        logs[w],
        f"r{w}",
        options=LearnerOptions(**FAST, keep_versions=1000),
    )
                for w, m in enumerate(models)]
    train_together(learners, models, 44, seed_stride=17)
    records = all_records(mailbox)
    assert [r.version for r in records] == list(range(1, len(records) + 1))
    assert len(records) >= 10 and all(len(r.participants) == 2 for r in records)
    assert [r.version for r in records if r.checkpoint] == [v for v in (5, 10)
                                                            if v <= len(records)]
    written = sorted(key for log in logs for op, key, _ in log.log
                     if op != "get" and key.startswith(("theta/", "outer/")))
    assert written == sorted(f"{kind}/0/{v:010d}-000000.safetensors"
                             for kind in ("theta", "outer") for v in (5, 10)
                             if v <= len(records))
    for w, log in enumerate(logs):
        got = [key for op, key, _ in log.log if op == "get"]
        assert not [k for k in got if k.startswith(("theta/", "outer/", "updates/"))]
        others = {f"steps/0/{r.version:010d}-000000.safetensors" for r in records
                  if r.closer != f"r{w}"}
        assert {k for k in got if k.startswith("steps/")} == others
        assert len([k for k in got if k.startswith("steps/")]) == len(others)  # once each
        mine = [k for op, k, _ in log.log if op != "get" and k.startswith("payloads/")]
        # the learner's delta, once a round, but for the rounds it held
        assert sorted(mine) == [f"payloads/{r.round:010d}/r{w}.safetensors" for r in records
                                if not any(p.held for p in r.participants
                                           if p.learner == f"r{w}")]
    # a held contribution is the closer's own
    held = [(r.closer, p.learner) for r in records for p in r.participants if p.held]
    assert all(closer == learner for closer, learner in held)
    want = newest_theta(mailbox)
    for model in models:
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), want[name]), name


def test_a_lone_learner_closes_on_its_own_contribution_without_uploading_it() -> None:
    """Alone in a run its contribution completes every round's set: its closer merges the
    delta from memory and nothing of it goes up (`hold_own=False`: uploaded as before).
    The committed model is the same either way."""
    thetas = []
    for hold in (True, False):
        log = KeyLog(MemoryMailbox())
        rec = Recorder()
        model = make_model()
        learner = Learner(
            TorchAdapter(model),
            DiLoCo.standard(4, 1),
            log,
            "solo",
            on_event=rec,
            options=LearnerOptions(**FAST, hold_own=hold, keep_versions=1000),
        )
        learner.start()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(8):
            train_step(model, opt, step)
            learner.step(10)
        learner.close()
        records = all_records(log.inner)
        assert [(r.round, [(p.learner, p.steps, p.held) for p in r.participants])
                for r in records] == [(0, [("solo", 4, hold)]), (1, [("solo", 4, hold)])]
        uploads = [k for op, k, _ in log.log if op != "get" and k.startswith("payloads/")]
        published = rec.of(ev.SnapshotPublished)
        assert [(e.round, e.held, e.bytes == 0) for e in published] == [
            (0, hold, hold), (1, hold, hold)]
        assert uploads == ([] if hold else ["payloads/0000000000/solo.safetensors",
                                            "payloads/0000000001/solo.safetensors"])
        want = newest_theta(log.inner)
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), want[name]), name
        thetas.append(want)
    assert all(torch.equal(thetas[0][n], thetas[1][n]) for n in thetas[0])


def test_a_run_of_a_model_with_embeddings_names_them_in_its_merge() -> None:
    """The creator's adapter names GPT-2's `wte` and `wpe` (embedding modules): the run's
    algorithm carries them, so every closer averages them by weight; a learner of the same
    model joins (its configuration resolves alike)."""
    from gradientmail.integration.textdata import tiny_gpt2

    mailbox = MemoryMailbox()
    learners = []
    for who in ("a", "b"):
        gpt2 = tiny_gpt2(64, n_layer=1, n_embd=16, n_head=2, n_positions=8, seed=0)
        learner = Learner(
            TorchAdapter(gpt2),
            DiLoCo(sync_every=4, fragments=2),
            mailbox,
            who,
            options=LearnerOptions(**FAST, sync=False),
        )
        learner.start()
        learners.append(learner)
    manifest = run(Exchange(mailbox).read_manifest())
    assert manifest is not None
    assert manifest.algorithm["merge"] == {
        "type": "rda", "direct_pattern": "embed",
        "direct_names": ["transformer.wpe.weight", "transformer.wte.weight"], "min_deltas": 3}
    for learner in learners:
        learner.close(flush=False)


def test_learners_leave_their_rounds_to_a_live_standalone_closer() -> None:
    """With `gradientmail sync` running beside the bucket, no round is closed by a learner
    (whose link would carry every other delta down): each contribution goes up, the
    standalone closer merges them, and both learners end on its commits."""
    mailbox = MemoryMailbox()
    ex = Exchange(mailbox)
    closer = Syncer.open(mailbox, closer_id="sync-beside",
                         settings=CloserSettings(poll_interval=0.005, lease_timeout=30.0))
    stop = threading.Event()

    def close_rounds() -> None:
        async def go() -> None:
            done = asyncio.Event()
            task = asyncio.create_task(closer.run(done))
            while not stop.is_set():
                await asyncio.sleep(0.005)
            done.set()
            await task

        run(go())

    thread = threading.Thread(target=close_rounds)
    thread.start()
    try:
        assert wait_for(lambda: run(ex.leases("closers")) == {"sync-beside": 0})
        models = [make_model(seed=0), make_model(seed=0)]
        # Their backups wait 30 polls (3 s) past a round's due time; the standalone
        # closer polls every 5 ms: a round of theirs here would be a bug, not a race.
        learners = [Learner(
            TorchAdapter(m),
            DiLoCo.standard(4, 2),
            mailbox,
            f"l{w}",
            options=LearnerOptions(**{**FAST, "poll_interval": 0.1}, keep_versions=1000),
        )
                    for w, m in enumerate(models)]
        train_together(learners, models, steps=12, seed_stride=100)
    finally:
        stop.set()
        thread.join(timeout=60)
    records = all_records(mailbox)
    assert [(r.round, r.closer, [(p.learner, p.held) for p in r.participants])
            for r in records] == [
        (k, "sync-beside", [("l0", False), ("l1", False)]) for k in range(3)]
    want = newest_theta(mailbox)
    for m in models:
        for name, p in m.named_parameters():
            assert torch.equal(p.detach(), want[name]), name
    assert run(ex.leases("closers")) == {}  # released when it stopped
