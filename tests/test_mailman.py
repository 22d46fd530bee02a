"""The mailman alone, driven through its messages on a FakeClock with a MemoryMailbox: no
`Learner`, no training thread state. Contributions in, records and commits out, and the
one frozen view of what it observed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from test_learner_clock import Stamped
from test_learner_runtime import make_model, run

from gradientmail import events as ev
from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.learner.mailman import Mailman
from gradientmail.learner.messages import Observed, Outgoing
from gradientmail.learner.options import LearnerOptions
from gradientmail.mailbox import Mailbox, MemoryMailbox
from gradientmail.mailbox.wrappers import FaultPlan, FaultyMailbox
from gradientmail.run.join import JoinResult
from gradientmail.run.protocol import Exchange
from gradientmail.testing import FakeClock
from gradientmail.wire.records import SnapshotRecord
from gradientmail.wire.refs import PayloadRef

ALG = DiLoCo(sync_every=4, fragments=1, in_flight=1, overlap_steps=None, merge=WeightedMean())


def outgoing(round_: int, joined: JoinResult, adapter: TorchAdapter, *, steps: int = 4,
             final: bool = False) -> Outgoing:
    """Round `round_`'s contribution of fragment 0, as a training thread describes it."""
    version, anchor = joined.fragments[0]
    return Outgoing(round=round_, fragment=0, base_version=version, local_step=steps,
                    steps=steps, tokens=10 * steps, final=final, step_seconds=0.5,
                    snapshot=adapter.snapshot(joined.plan[0]), anchor=anchor)


@contextmanager
def mailmen(clock: FakeClock, mailbox: Mailbox, *ids: str,
            **kw: Any) -> Iterator[list[tuple[Mailman, JoinResult, TorchAdapter]]]:
    """Started mailmen, one per id, each with a model of its own; stopped at the end."""
    out = []
    try:
        for i, learner in enumerate(ids):
            adapter = TorchAdapter(make_model(seed=i))
            options = LearnerOptions(sync=kw.get("sync", False),
                                     hold_own=kw.get("hold_own", False))
            m = Mailman(mailbox, adapter, ALG, learner, options, clock=clock,
                        on_event=kw["rec"])
            # No timeout: the join's task may not wait on the clock at all, and time would
            # jump past a deadline while it works (as `Learner.start` waits).
            out.append((m, clock.result(m.start(), None), adapter))
        yield out
    finally:
        for m, _, _ in out:
            m.stop(120)


def until(clock: FakeClock, cond: Callable[[], bool], limit: float = 300.0) -> float:
    """Wait on the clock until `cond()`; the fake seconds it took."""
    t0 = clock.now()
    while not cond():
        assert clock.now() - t0 < limit, f"not within {limit} fake seconds"
        clock.pause(0.05)
    return clock.now() - t0


def test_a_contribution_goes_in_and_its_record_lands_as_described() -> None:
    clock, mailbox = FakeClock(), MemoryMailbox()
    rec = Stamped(clock)
    with clock.busy(), mailmen(clock, mailbox, "solo", rec=rec) as [(m, joined, adapter)]:
        assert m.observed == Observed(live=m.observed.live, received=-1)
        job = outgoing(0, joined, adapter)
        m.post(job)
        until(clock, lambda: m.observed.finished == 1)
        record = run(Exchange(mailbox).contribution(0, "solo"))
        assert record is not None and job.landed_as(record)
        assert (record.local_step, record.steps, record.tokens, record.step_seconds) == (
            4, 4, 40, 0.5)
        [(_, published)] = rec.of(ev.SnapshotPublished)
        assert (published.round, published.steps, published.held) == (0, 4, False)
        assert m.failed_rounds() == []
        assert m.commits.empty()  # nobody closes rounds here (no syncer)


def test_a_lone_mailmans_closer_takes_its_contribution_and_the_commit_comes_out() -> None:
    clock, mailbox = FakeClock(), MemoryMailbox()
    rec = Stamped(clock)
    with clock.busy(), mailmen(clock, mailbox, "solo", rec=rec, sync=True,
                               hold_own=True) as [(m, joined, adapter)]:
        m.post(outgoing(0, joined, adapter))
        commit = clock.get(m.commits, 60)
        assert (commit.record.round, [(p.learner, p.steps, p.held)
                                      for p in commit.record.participants]) == (
            0, [("solo", 4, True)])
        until(clock, lambda: m.observed.finished == 1)
        assert m.observed.received == 0  # the one receive cursor, in the view
        [(_, published)] = rec.of(ev.SnapshotPublished)
        assert published.held and published.bytes == 0
        assert run(Exchange(mailbox).contribution(0, "solo")) is None  # never uploaded


def test_the_view_counts_the_others_in_the_watched_round_only() -> None:
    clock, mailbox = FakeClock(), MemoryMailbox()
    rec = Stamped(clock)
    with clock.busy(), mailmen(clock, mailbox, "me", "peer", rec=rec) as mm:
        (me, _, _), (peer, joined, adapter) = mm
        peer.post(outgoing(0, joined, adapter))
        until(clock, lambda: peer.observed.finished == 1)
        assert me.observed.watched == -1  # nothing watched: nothing listed
        me.watch(0)
        until(clock, lambda: me.observed.watched == 0)
        assert me.observed.others == 1
        until(clock, lambda: me.observed.live == frozenset({"me", "peer"}), limit=130)
        me.watch(1)
        until(clock, lambda: me.observed.watched == 1)
        assert me.observed.others == 0
        # Replaced whole, never changed in place: a reader holds one moment.
        seen = me.observed
        with pytest.raises(dataclasses.FrozenInstanceError):
            seen.others = 5  # type: ignore[misc]


def test_a_contribution_to_a_round_already_received_is_cancelled() -> None:
    clock, mailbox = FakeClock(), MemoryMailbox()
    rec = Stamped(clock)
    with clock.busy(), mailmen(clock, mailbox, "solo", rec=rec, sync=True) as [
            (m, joined, adapter)]:
        m.post(outgoing(0, joined, adapter))
        clock.get(m.commits, 60)
        until(clock, lambda: m.observed.received == 0 and m.observed.finished == 1)
        m.post(outgoing(0, joined, adapter, steps=8))  # round 0 is closed already
        until(clock, lambda: m.observed.finished == 2)
        [(_, cancelled)] = rec.of(ev.PublishCancelled)
        assert cancelled.round == 0
        assert len(rec.of(ev.SnapshotPublished)) == 1
        assert m.failed_rounds() == []


def test_an_outgoing_is_the_records_description() -> None:
    """Every counter of the record comes from the one description, unchanged."""
    ex = Exchange(MemoryMailbox())
    job = Outgoing(round=3, fragment=1, base_version=2, local_step=40, steps=12, tokens=96,
                   final=True, step_seconds=0.25, snapshot=None, anchor=None)
    draft = job.draft(ex, "w0", "a" * 64, "BF16")
    assert draft == SnapshotRecord(
        learner="w0", round=3, fragment=1, base_version=2, local_step=40, steps=12,
        tokens=96, final=True, schema_digest="a" * 64, delta_format="BF16",
        payload=PayloadRef("payloads/0000000003/w0", 0, "0" * 64), step_seconds=0.25)
    assert job.landed_as(draft)
    assert not job.landed_as(dataclasses.replace(draft, steps=11))  # an earlier run's


def test_a_commits_download_starts_before_the_look_for_the_next_record() -> None:
    """Catching up, the mailman looks for the next record while the commit it found
    downloads, not before: a barrier's learners wait for that download."""
    clock, mailbox = FakeClock(), MemoryMailbox()
    reads: list[str] = []

    class Logged(FaultyMailbox):
        async def get(self, key: str) -> bytes | None:
            reads.append(key)
            return await super().get(key)

    rec = Stamped(clock)
    with clock.busy(), mailmen(clock, mailbox, "solo", rec=rec, sync=True) as [
            (m, joined, adapter)]:
        m.post(outgoing(0, joined, adapter))
        clock.get(m.commits, 60)
        with mailmen(clock, Logged(mailbox, FaultPlan()), "reader", rec=rec) as [
                (reader, _, _)]:
            # It joined at round 0's commit; the next one is round 1's.
            m.post(outgoing(1, joined, adapter, steps=8))
            commit = clock.get(reader.commits, 60)
    assert commit.record.round == 1
    # Round 1's record, then its step (version 2 of fragment 0), then the look at round 2.
    found = max(i for i, k in enumerate(reads) if k == "rounds/0000000001.json")
    assert reads[found + 1:found + 3] == ["steps/0/0000000002-000000.safetensors",
                                 "rounds/0000000002.json"], reads
