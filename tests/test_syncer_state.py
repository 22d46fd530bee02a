"""Syncer decisions with plain numbers for the clock."""

from __future__ import annotations

import pytest

from gradientmail.algorithms.schedule import Estimates
from gradientmail.syncer_state import (
    RoundWatch,
    awaited,
    close_time,
    completes,
    effective_quorum,
    much_slower,
    next_claim_attempt,
    updated_estimates,
    watch_polls,
)


def test_effective_quorum() -> None:
    assert effective_quorum(3, 5) == 3
    assert effective_quorum(3, 2) == 2
    assert effective_quorum(3, 0) == 1
    assert effective_quorum(1, 8) == 1


def test_no_close_before_quorum() -> None:
    w = RoundWatch(4, {"a": 10.0})
    assert close_time(w, live={"a", "b", "c"}, quorum_size=2, grace=5.0) is None


def test_grace_window_runs_from_the_first_contribution() -> None:
    w = RoundWatch(4, {"a": 10.0, "b": 12.5})
    # the window covers how far apart learners arrive: it runs from the first one
    assert close_time(w, live={"a", "b", "c"}, quorum_size=2, grace=5.0) == 15.0
    assert close_time(w, live={"a", "b", "c"}, quorum_size=1, grace=5.0) == 15.0
    # never before the quorum is in
    assert close_time(w, live={"a", "b", "c"}, quorum_size=2, grace=1.0) == 12.5
    assert close_time(w, live={"a", "b", "c"}, quorum_size=2, grace=0.0) == 12.5


def test_the_window_waits_only_for_the_awaited_learners() -> None:
    w = RoundWatch(4, {"a": 10.0, "b": 12.5})
    live = {"a", "b", "c"}
    # c is live but not awaited (much slower): a and b are everyone the round waits for
    assert close_time(w, live, quorum_size=1, grace=5.0, awaited={"a", "b"}) == 10.0
    # with quorum 2 the quorum time still comes first
    assert close_time(w, live, quorum_size=2, grace=5.0, awaited={"a", "b"}) == 12.5
    # an awaited learner that is not in keeps the round open for the window
    assert close_time(w, live, quorum_size=1, grace=5.0, awaited={"a", "c"}) == 15.0


def test_the_contribution_that_completes_the_set_closes() -> None:
    live = {"a", "b", "c"}
    w = RoundWatch(0, {"a": 1.0, "b": 2.0})
    assert not completes(w, "b", live, 2, live)  # c is awaited and not in
    assert completes(w, "b", live, 2, {"a", "b"})  # c is too slow to be awaited
    assert not completes(w, "c", live, 2, {"a", "b"})  # c has not contributed
    w = RoundWatch(0, {"a": 1.0, "b": 2.0, "c": 3.0})
    assert completes(w, "a", live, 3, live) and completes(w, "c", live, 3, live)
    assert not completes(RoundWatch(0, {"a": 1.0}), "a", {"a", "b"}, 2, {"a"})  # no quorum
    assert not completes(RoundWatch(0, {"a": 1.0}), "a", set(), 1, set())  # nobody live


def test_much_slower_is_over_one_and_a_half_times_the_pace_and_never_unknown() -> None:
    assert much_slower(0.31, 0.2) and not much_slower(0.3, 0.2)
    assert not much_slower(None, 0.2) and not much_slower(5.0, None)
    assert not much_slower(0.0, 0.2) and not much_slower(5.0, 0.0)
    assert much_slower(0.25, 0.2, slow_factor=1.2)


def test_awaited_leaves_out_much_slower_learners_only() -> None:
    live = {"a", "b", "c", "d"}
    paces = {"a": 0.20, "b": 0.21, "c": 0.22, "d": 0.45}
    assert awaited(live, paces) == {"a", "b", "c"}
    # within 1.5x of the run's pace (the lower median) is waited for
    assert awaited(live, {**paces, "d": 0.30}) == live
    # a learner of unknown pace (a joiner) is waited for
    assert awaited(live | {"e"}, paces) == {"a", "b", "c", "e"}
    # of two learners, the faster sets the pace: the slow one is not waited for
    assert awaited({"a", "d"}, paces) == {"a"}
    # nothing known: everyone; a learner not live is never awaited
    assert awaited({"a", "b"}, {}) == {"a", "b"}
    assert awaited({"a"}, paces) == {"a"}


def test_every_live_learner_in_skips_the_grace_window() -> None:
    w = RoundWatch(4, {"a": 10.0, "b": 12.5})
    assert close_time(w, live={"a", "b"}, quorum_size=1, grace=60.0) == 10.0
    # a contribution from a learner whose lease expired still counts toward quorum
    w = RoundWatch(4, {"a": 10.0, "z": 11.0})
    assert close_time(w, live={"a"}, quorum_size=2, grace=60.0) == 10.0


def test_quorum_shrinks_with_the_live_learners() -> None:
    w = RoundWatch(0, {"a": 3.0})
    assert close_time(w, live={"a", "b"}, quorum_size=4, grace=1.0) is None
    assert close_time(w, live={"a", "b", "c"}, quorum_size=1, grace=1.0) == 4.0
    # nobody live (every lease lapsed): one contribution is a quorum, after the grace
    assert close_time(w, live=set(), quorum_size=4, grace=1.0) == 4.0


def test_claim_attempts_and_takeover() -> None:
    assert next_claim_attempt({}, now=0.0, takeover_timeout=10.0) == 0
    assert next_claim_attempt({0: 5.0}, now=14.9, takeover_timeout=10.0) is None
    assert next_claim_attempt({0: 5.0}, now=15.0, takeover_timeout=10.0) == 1
    assert next_claim_attempt({0: 1.0, 1: 20.0}, now=25.0, takeover_timeout=10.0) is None
    assert next_claim_attempt({0: 1.0, 1: 20.0}, now=30.0, takeover_timeout=10.0) == 2


def test_estimates_fold_in() -> None:
    e = updated_estimates(Estimates(), [0.5, 0.1, 9.0], quorum_seconds=2.0, sync_seconds=None)
    assert e == Estimates(step=0.5, quorum=2.0, sync=None)
    e = updated_estimates(e, [0.4, 0.2], quorum_seconds=4.0, sync_seconds=1.0)
    assert e.step == 0.2  # the lower median: of two learners the faster sets the pace
    assert updated_estimates(e, [0.3, 0.1, 0.2, 0.9], None, None).step == 0.2
    assert e.quorum == pytest.approx(0.7 * 2.0 + 0.3 * 4.0)
    assert e.sync == 1.0
    same = updated_estimates(e, [float("nan")], quorum_seconds=float("inf"), sync_seconds=-1)
    assert same == e


def test_the_preferred_closer_watches_an_active_round_every_poll_then_backs_off() -> None:
    # nothing in yet: every watch_every polls; a backup: every backup_every polls
    assert watch_polls(True, seen=0, idle=0, watch_every=5, backup_every=30) == 5
    assert watch_polls(False, seen=3, idle=0, watch_every=5, backup_every=30) == 30
    # a contribution came in: look again at the next poll, backing off while idle
    assert [watch_polls(True, 1, idle, 5, 30) for idle in range(5)] == [1, 2, 4, 5, 5]
    assert watch_polls(True, 1, 1000, 5, 30) == 5
    assert watch_polls(True, 2, 0, 1, 30) == 1  # a standalone syncer looks every poll
