"""The learner's pure decisions, by direct calls: no threads, no mailbox, no clock."""

from __future__ import annotations

import itertools

import pytest

from gradientmail.algorithms.schedule import RoundSchedule
from gradientmail.learner.state import (
    FragmentCounters,
    LearnerState,
    Publish,
    advanced,
    applied,
    due_round,
    initial_state,
    missed,
    overdue,
    publishable,
    published,
    rebase_base,
    retracted,
    scheduled_gap,
)


def run_alone(schedule: RoundSchedule, steps: int, tokens: int = 8) -> list[tuple[int, int]]:
    """One learner whose commits land at once: the (round, local step) of every publish."""
    s = initial_state(schedule.fragments)
    out: list[tuple[int, int]] = []
    for _ in range(steps):
        s = advanced(s, tokens)
        r = due_round(s, schedule, others=0, effective_quorum=1)
        if r is not None:
            s = published(s, r, schedule)
            out.append((r, s.local_step))
            s = applied(s, r, schedule.fragment_of(r), r + 1, took_part=True, mixing=0.0)
    return out


def test_alone_publishes_every_round_on_the_gap_schedule() -> None:
    sch = RoundSchedule(sync_every=10, fragments=4, in_flight=1)
    pubs = run_alone(sch, 40)
    assert [r for r, _ in pubs] == list(range(16))
    # gaps 2,3,2,3: every fragment once every H = 10 steps.
    assert [at for _, at in pubs[:8]] == [2, 5, 7, 10, 12, 15, 17, 20]


@pytest.mark.parametrize(
    ("h", "p", "tau"),
    [(h, p, t) for h in (1, 5, 12) for p in (1, 2, 3) for t in (1, 2, 3) if t <= p <= h],
)
def test_alone_every_schedule_publishes_each_round_once_in_order(h: int, p: int, tau: int) -> None:
    sch = RoundSchedule(sync_every=h, fragments=p, in_flight=tau)
    pubs = run_alone(sch, 5 * h)
    rounds = [r for r, _ in pubs]
    assert rounds == list(range(len(rounds)))
    assert len(rounds) == 5 * p  # every fragment once per H steps
    for (r0, a0), (_r1, a1) in itertools.pairwise(pubs):
        assert a1 - a0 == sch.gap(r0 + 1)


def test_fresh_joiner_has_nothing_to_publish() -> None:
    sch = RoundSchedule(sync_every=4, fragments=2, in_flight=2)
    s = initial_state(2, versions=[3, 3], rounds_seen=5)
    assert publishable(s, sch) is None
    s = advanced(s, 1)
    assert publishable(s, sch) == 6


def test_publishable_stays_within_tau_of_the_newest_commit() -> None:
    sch = RoundSchedule(sync_every=12, fragments=3, in_flight=2)
    s = advanced(initial_state(3), 4)
    for r in (0, 1):
        assert publishable(s, sch) == r
        s = published(s, r, sch)
    assert publishable(s, sch) is None  # round 2 would be 3 ahead of rounds_seen=-1
    s = applied(s, 0, 0, 1, took_part=True, mixing=0.0)
    assert s.fragments[0] == FragmentCounters(steps=0, tokens=0, version=1)
    assert publishable(s, sch) == 2


def test_publishable_exhaustive_against_the_rule() -> None:
    """Every small state: the candidate is the lowest open round below the last publish
    that has no own publish (a retracted one), else the round right after both the last
    publish and the newest commit, at most τ past the commit, and its fragment trained."""
    for p, tau in [(1, 1), (2, 1), (2, 2), (3, 2), (3, 3)]:
        sch = RoundSchedule(sync_every=6, fragments=p, in_flight=tau)
        for seen, ahead, trained, holes in itertools.product(
            range(-1, 4), range(-1, tau + 1), range(2**p), range(2**tau)
        ):
            last = seen + ahead if ahead >= 0 else -1
            open_rounds = list(range(seen + 1, last + 1))
            if holes >= 2 ** max(len(open_rounds) - 1, 0):
                continue  # holes only below the last publish, which is never one
            own = [r for i, r in enumerate(open_rounds) if not holes >> i & 1]
            frags = tuple(FragmentCounters(steps=(trained >> i) & 1) for i in range(p))
            s = LearnerState(local_step=9, fragments=frags, rounds_seen=seen, last_published=last,
                             last_publish_step=9,  # just published: nothing due on schedule
                             publishes=tuple(Publish(r, 0, 1, 1) for r in own))
            got = publishable(s, sch)
            missing = [r for r in open_rounds if r not in own]
            cand = missing[0] if missing else max(last, seen) + 1
            if cand - seen > tau or not (trained >> (cand % p)) & 1:
                assert got is None, (p, tau, seen, last, trained, holes)
            else:
                assert got == cand, (p, tau, seen, last, trained, holes)
                assert seen < got <= seen + tau
                assert got > last or got in missing
                # a hole is due at once; the next round waits for its gap
                due = due_round(s, sch, others=0, effective_quorum=2)
                assert (due == got) if missing else (due is None)


def test_due_by_opportunity_when_the_round_is_about_to_close() -> None:
    sch = RoundSchedule(sync_every=100, fragments=1, in_flight=1)
    s = advanced(initial_state(1), 16)
    assert due_round(s, sch, others=0, effective_quorum=3) is None
    assert due_round(s, sch, others=1, effective_quorum=3) is None
    assert due_round(s, sch, others=2, effective_quorum=3) == 0
    # quorum 1: one other publisher already closes it; with nobody else it waits.
    assert due_round(s, sch, others=0, effective_quorum=1) is None
    assert due_round(s, sch, others=1, effective_quorum=1) == 0
    # an untrained fragment is never due, opportunity or not
    assert due_round(initial_state(1), sch, others=5, effective_quorum=2) is None


def test_overdue_barrier_and_overlap() -> None:
    sch = RoundSchedule(sync_every=4, fragments=2, in_flight=2)
    s = published(advanced(advanced(initial_state(2), 1), 1), 0, sch)  # at step 2
    assert overdue(s, 0)  # standard DiLoCo: wait right away
    assert not overdue(s, 1)
    s = advanced(s, 1)
    assert overdue(s, 1) and not overdue(s, 2)
    assert not overdue(s, None)
    s = applied(s, 0, 0, 1, took_part=True, mixing=0.0)
    assert not overdue(s, 0)


def test_mixing_keeps_alpha_of_the_uncounted_steps() -> None:
    sch = RoundSchedule(sync_every=10, fragments=2, in_flight=2)
    s = initial_state(2)
    for _ in range(5):
        s = advanced(s, 10)
    s = published(s, 0, sch)  # counted 5 steps, 50 tokens of fragment 0
    assert s.publishes == (Publish(0, 5, 5, 50),)
    for _ in range(4):
        s = advanced(s, 10)
    took = applied(s, 0, 0, 7, took_part=True, mixing=0.5)
    assert took.fragments[0] == FragmentCounters(steps=2, tokens=20, version=7)
    assert took.fragments[1] == FragmentCounters(steps=9, tokens=90, version=0)
    missed = applied(s, 0, 0, 7, took_part=False, mixing=0.5)
    assert missed.fragments[0] == FragmentCounters(steps=4, tokens=45, version=7)
    plain = applied(s, 0, 0, 7, took_part=True, mixing=0.0)
    assert plain.fragments[0] == FragmentCounters(steps=0, tokens=0, version=7)
    assert plain.rounds_seen == 0 and plain.publishes == ()


def test_step_seconds_ema() -> None:
    s = advanced(initial_state(1), 1, seconds=2.0)
    assert s.step_seconds == 2.0
    s = advanced(s, 1, seconds=1.0)
    assert s.step_seconds == pytest.approx(1.9)
    s = advanced(s, 1)
    assert s.step_seconds == pytest.approx(1.9)


def test_only_the_last_tau_publishes_are_kept() -> None:
    sch = RoundSchedule(sync_every=9, fragments=3, in_flight=2)
    s = advanced(initial_state(3), 1)
    for r in range(3):
        s = published(s, r, sch)
    assert [p.round for p in s.publishes] == [1, 2]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="tokens=-1 is negative"):
        advanced(initial_state(1), -1)
    with pytest.raises(ValueError, match="2 versions given for 3 fragments"):
        initial_state(3, versions=[0, 0])


def test_a_failed_publish_is_retracted_and_its_steps_go_out_next() -> None:
    sch = RoundSchedule(sync_every=4, fragments=2, in_flight=2)
    s = advanced(advanced(initial_state(2), 3), 3)
    s = published(s, 0, sch)
    assert publishable(s, sch) == 1
    s = retracted(s, 0)
    assert s.publishes == () and s.last_published == -1
    assert publishable(s, sch) == 0
    assert not overdue(s, 0)
    s = advanced(s, 3)
    s = published(s, 0, sch)
    assert s.publishes == (Publish(0, 3, 3, 9),)  # all three steps counted
    # retracting an older publish keeps the newer one
    s = published(s, 1, sch)
    t = retracted(s, 0)
    assert t.last_published == 1 and [p.round for p in t.publishes] == [1]
    assert retracted(t, 7) is t
    # round 0 is open and waits for this learner: it goes out next, at once, before round 2
    assert publishable(t, sch) == 0
    assert due_round(t, sch, others=0, effective_quorum=2) == 0
    u = published(t, 0, sch)
    assert u.last_published == 1 and [p.round for p in u.publishes] == [1, 0]
    assert publishable(u, sch) is None  # round 2 is τ past the newest commit


def test_no_opportunity_when_the_round_waits_for_this_learner_alone() -> None:
    sch = RoundSchedule(sync_every=100, fragments=1, in_flight=1)
    s = advanced(initial_state(1), 16)
    # standard DiLoCo, 2 learners: the other is in, the round cannot close without us
    assert due_round(s, sch, others=1, effective_quorum=2, live=2) is None
    # 3 live, quorum 2: the third learner could close it: publish now
    assert due_round(s, sch, others=1, effective_quorum=2, live=3) == 0
    # quorum already in: the round closes after its grace window, with us or without
    assert due_round(s, sch, others=2, effective_quorum=2, live=3) == 0
    assert due_round(s, sch, others=1, effective_quorum=1, live=2) == 0
    # still due on schedule
    for _ in range(100):
        s = advanced(s, 1)
    assert due_round(s, sch, others=0, effective_quorum=2, live=2) == 0


def test_rebase_keeps_exactly_the_uncounted_steps_and_tokens() -> None:
    sch = RoundSchedule(sync_every=10, fragments=2, in_flight=2)
    for before, after, tokens, took_part, publish in itertools.product(
        range(4), range(4), (0, 1, 7), (True, False), (True, False)
    ):
        s = initial_state(2, versions=[3, 5])
        for _ in range(before):
            s = advanced(s, tokens)
        if publish:
            s = published(s, 0, sch)
        for _ in range(after):
            s = advanced(s, tokens)
        out = applied(s, 0, 0, 4, took_part=took_part, mixing=0.0, rebase=True)
        counted = before if publish and took_part else 0
        want = FragmentCounters(before + after - counted, (before + after - counted) * tokens, 4)
        assert out.fragments[0] == want, (before, after, tokens, took_part, publish)
        assert out.fragments[1] == s.fragments[1]  # the other fragment is untouched
        assert out.rounds_seen == 0 and out.publishes == ()
        # Without rebasing the commit overwrites, and the counters with it.
        plain = applied(s, 0, 0, 4, took_part=took_part, mixing=0.0)
        assert plain.fragments[0] == FragmentCounters(0, 0, 4)


def test_a_commit_is_rebased_on_the_own_snapshot_or_the_anchor_or_overwrites() -> None:
    # A contributor subtracts its own snapshot of the round (its progress up to it is in
    # the commit); a learner with no part in the commit subtracts the commit it last
    # aligned with (none of its progress is in).
    assert rebase_base(True, 3, 4, contributed=True, kept=True) == "snapshot"
    assert rebase_base(True, 3, 4, contributed=False, kept=True) == "anchor"
    assert rebase_base(True, 3, 4, contributed=False, kept=False) == "anchor"
    # Its snapshot not kept (a final flush): overwrite, never the anchor (the commit
    # holds part of its progress, which the anchor would count twice).
    assert rebase_base(True, 3, 4, contributed=True, kept=False) is None
    # Commits skipped (or a version not past the held one): overwrite.
    for version in (2, 3, 5, 9):
        assert rebase_base(True, 3, version, contributed=True, kept=True) is None
        assert rebase_base(True, 3, version, contributed=False, kept=True) is None
    # An algorithm that does not rebase always overwrites.
    for contributed, kept in itertools.product((True, False), repeat=2):
        assert rebase_base(False, 3, 4, contributed=contributed, kept=kept) is None


def test_rebase_and_mixing_exclude_each_other() -> None:
    s = advanced(initial_state(1), 3)
    with pytest.raises(ValueError, match=r"rebase=True and mixing=0\.5 exclude each other"):
        applied(s, 0, 0, 1, took_part=False, mixing=0.5, rebase=True)


@pytest.mark.parametrize(("h", "p", "tau"), [(4, 1, 1), (6, 2, 2), (6, 3, 2), (9, 3, 3)])
def test_with_rebase_every_token_is_counted_once(h: int, p: int, tau: int) -> None:
    """A learner whose commits land `delay` steps after each publish, some of its
    contributions left out of their rounds: the tokens of the contributions that made it
    in, plus what the counters still hold, are exactly the tokens trained, per fragment."""
    sch = RoundSchedule(sync_every=h, fragments=p, in_flight=tau)
    for delay, left_out in itertools.product(range(5), ((), (0,), (1, 2), (0, 3, 4))):
        s = initial_state(p)
        arriving: list[tuple[int, int]] = []  # (step it lands at, round)
        counted = [0] * p
        trained = 0
        next_round = 0
        for step in range(1, 40):
            s = advanced(s, step)  # tokens vary with the step
            trained += step
            while arriving and arriving[0][0] <= step:
                _, r = arriving.pop(0)
                f = sch.fragment_of(r)
                took = r not in left_out
                own = next(x for x in s.publishes if x.round == r)
                if took:
                    counted[f] += own.tokens
                s = applied(s, r, f, s.fragments[f].version + 1, took, 0.0, rebase=True)
            r = due_round(s, sch, others=0, effective_quorum=1)
            if r is not None:
                assert r == next_round
                s = published(s, r, sch)
                arriving.append((step + delay, r))
                next_round += 1
        assert next_round >= 4, "the schedule must have published a few rounds"
        for f in range(p):
            assert counted[f] + s.fragments[f].tokens == trained, (delay, left_out, f)


# -- phase: a learner that missed a round aligns with the run's rounds --------------------


def test_a_learner_that_missed_a_round_publishes_the_next_one_a_gap_after_its_first() -> None:
    # H = 20, P = 2: gap 10. Learner late by 3 steps: others published round 0 at its
    # step 7 and the commit (latency 2 of its steps) arrived at its step 9.
    sch = RoundSchedule(sync_every=20, fragments=2, in_flight=2, overlap_steps=None)
    s = initial_state(2)
    for _ in range(9):
        s = advanced(s, 8)
    assert due_round(s, sch, 0, 1) is None  # on its own schedule round 0 was due at 10
    s = applied(s, 0, 0, 1, took_part=False, mixing=0.0, rebase=True, lag_steps=2)
    assert s.phase_step == 7  # the first contributor's publish, in its steps
    # Before: round 1 went out at step 10, 7 steps before the others'; now it is due
    # one gap after the first contribution of round 0, with them.
    due = []
    for _ in range(10):
        s = advanced(s, 8)
        due.append(due_round(s, sch, 0, 1))
    assert due == [None] * 7 + [1, 1, 1]
    # Without a latency (a record from an older closer) the schedule is left as it was.
    t = initial_state(2)
    for _ in range(9):
        t = advanced(t, 8)
    t = applied(t, 0, 0, 1, took_part=False, mixing=0.0, rebase=True, lag_steps=None)
    assert t.phase_step is None and t.last_publish_step == 0


def test_a_participant_or_a_learner_with_a_later_round_in_flight_keeps_its_schedule() -> None:
    sch = RoundSchedule(sync_every=20, fragments=2, in_flight=2, overlap_steps=None)
    s = initial_state(2)
    for _ in range(10):
        s = advanced(s, 8)
    s = published(s, 0, sch)
    for _ in range(4):
        s = advanced(s, 8)
    # It led the round (its contribution came first): its schedule stands.
    took = applied(s, 0, 0, 1, took_part=True, mixing=0.0, rebase=True, lag_steps=12,
                   led=True)
    assert took.phase_step is None and took.last_publish_step == 10
    # It took part after another learner, who published 12 of its steps ago (step 2,
    # before its own at 10): it moves back to that one's phase.
    behind = applied(s, 0, 0, 1, took_part=True, mixing=0.0, rebase=True, lag_steps=12)
    assert behind.phase_step == 2
    # ... but never later than its own publish (the lag estimate is a poll coarse).
    ahead = applied(s, 0, 0, 1, took_part=True, mixing=0.0, rebase=True, lag_steps=2)
    assert ahead.phase_step is None
    # Its publish of round 0 went out but the round closed without it: it missed.
    assert missed(s, 0, took_part=False)
    late = applied(s, 0, 0, 1, took_part=False, mixing=0.0, rebase=True, lag_steps=12)
    assert late.phase_step == 2
    # A commit of an earlier round while round 1 is in flight moves nothing.
    for _ in range(6):
        s = advanced(s, 8)
    s = published(s, 1, sch)
    assert not missed(s, 0, took_part=False)
    assert applied(s, 0, 0, 1, took_part=False, mixing=0.0, rebase=True,
                   lag_steps=3).phase_step is None
    # A publish counts the schedule from itself again.
    assert published(late, 1, sch).phase_step is None


def test_no_opportunity_when_the_round_will_wait_for_this_learner() -> None:
    sch = RoundSchedule(sync_every=20, fragments=2, in_flight=2, overlap_steps=None)  # gap 10
    s = initial_state(2)
    for _ in range(6):
        s = advanced(s, 8)
    # Another learner published round 0 (quorum 1, 4 live): without a window, due now.
    assert due_round(s, sch, others=1, effective_quorum=1, live=4) == 0
    # The round waits 5 of this learner's steps: due in 4, it keeps its schedule ...
    assert due_round(s, sch, others=1, effective_quorum=1, live=4, wait_steps=5) is None
    # ... due in 4 but waited for only 3: it would miss the round, so it publishes now.
    assert due_round(s, sch, others=1, effective_quorum=1, live=4, wait_steps=3) == 0
    for _ in range(4):
        s = advanced(s, 8)
    assert due_round(s, sch, others=0, effective_quorum=1, live=4, wait_steps=5) == 0


def test_a_slower_learner_keeps_the_runs_rhythm_in_wall_clock_time() -> None:
    sch = RoundSchedule(sync_every=20, fragments=2, in_flight=2, overlap_steps=None)  # gap 10
    assert scheduled_gap(sch, 0, step_seconds=0.2, run_step=0.1) == 5
    assert scheduled_gap(sch, 0, step_seconds=0.1, run_step=0.1) == 10
    assert scheduled_gap(sch, 0, step_seconds=0.05, run_step=0.1) == 10  # faster: plain gap
    assert scheduled_gap(sch, 0, step_seconds=None, run_step=0.1) == 10
    assert scheduled_gap(sch, 0, step_seconds=0.3, run_step=None) == 10
    assert scheduled_gap(sch, 0, step_seconds=5.0, run_step=0.1) == 1
    t = initial_state(2)
    for _ in range(4):
        t = advanced(t, 8, seconds=0.2)
    # On its own schedule too a gap at the run's pace when rounds do not wait for it
    # (over 1.5x the run's pace): 5 of its steps, not 10, so a learner 2x slower
    # publishes every round (both fragments), not every second one.
    assert due_round(t, sch, 0, 1, run_step=0.1) is None
    t = advanced(t, 8, seconds=0.2)
    assert due_round(t, sch, 0, 1, run_step=0.1) == 0
    assert due_round(t, sch, 0, 1, run_step=0.14) is None  # 1.43x: waited for, plain gap
    assert due_round(t, sch, 0, 1) is None  # the run's pace unknown: the plain gap
    t = published(t, 0, sch)
    for _ in range(5):
        t = advanced(t, 8, seconds=0.2)
    assert due_round(t, sch, 0, 1, run_step=0.1) == 1  # the other fragment's round
    # Behind a barrier a contribution carries the whole gap, however slow the learner.
    barrier = RoundSchedule(sync_every=10, fragments=1, in_flight=1, overlap_steps=0)
    b = initial_state(1)
    for _ in range(9):
        b = advanced(b, 8, seconds=0.2)
    assert due_round(b, barrier, 0, 2, run_step=0.1) is None
    b = advanced(b, 8, seconds=0.2)
    assert due_round(b, barrier, 0, 2, run_step=0.1) == 0
    s = initial_state(2)
    for _ in range(5):
        s = advanced(s, 8, seconds=0.2)
    # Out of phase (it missed round 0, whose first contribution was 1 step ago): a gap at
    # the run's pace, 5 of its steps, from there.
    s = applied(s, 0, 0, 1, took_part=False, mixing=0.0, rebase=True, lag_steps=1)
    assert s.phase_step == 4
    for _ in range(3):
        s = advanced(s, 8, seconds=0.2)
    assert due_round(s, sch, 0, 1) is None  # the pace unknown: the plain gap
    assert due_round(s, sch, 0, 1, run_step=0.12) is None  # 8 of its steps
    assert due_round(s, sch, 0, 1, run_step=0.1) is None  # 5 of its steps, 4 trained
    s = advanced(s, 8, seconds=0.2)
    assert due_round(s, sch, 0, 1, run_step=0.1) == 1


def test_a_schedule_moved_into_phase_never_postpones_a_publish_past_two_gaps() -> None:
    # A slow learner: every commit arrives before it is due and moves its phase to now.
    sch = RoundSchedule(sync_every=20, fragments=2, in_flight=2, overlap_steps=None)  # gap 10
    s = initial_state(2)
    published_at = []
    for step in range(1, 41):
        s = advanced(s, 8)
        if step % 6 == 0:  # a round closes without it every 6 of its steps
            r = s.rounds_seen + 1
            s = applied(s, r, sch.fragment_of(r), r // 2 + 1, took_part=False, mixing=0.0,
                        rebase=True, lag_steps=0)
        due = due_round(s, sch, 0, 1)
        if due is not None:
            s = published(s, due, sch)
            published_at.append(s.local_step)
    assert published_at == [20, 40]  # MAX_GAPS = 2 gaps of its own steps
