"""Syncer decisions with plain numbers for the clock."""

from __future__ import annotations

import dataclasses

import pytest

from gradientmail.algorithms.rounds import effective_quorum, much_slower
from gradientmail.syncer.state import (
    PollDecision,
    PollView,
    RoundWatch,
    awaited,
    close_time,
    completes,
    decide_poll,
    listed,
    lists_claims,
    lists_contributions,
    next_claim_attempt,
    probe_from,
    updated_estimates,
    watch_polls,
)
from gradientmail.wire.estimates import Estimates


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


def test_a_closer_lists_on_schedule_when_newly_preferred_and_when_offered() -> None:
    assert not lists_contributions(4.0, 5.0, True, True, offered=False)
    assert lists_contributions(5.0, 5.0, False, False, offered=False)
    # preferred now and not at the last poll (its predecessor judged gone): at once
    assert lists_contributions(4.0, 5.0, True, False, offered=False)
    assert not lists_contributions(4.0, 5.0, False, True, offered=False)
    # an offer needs a fresh listing: does it complete the set?
    assert lists_contributions(4.0, 5.0, False, False, offered=True)


def _listed(first_seen: dict[str, float], publishers: set[str], *, offered: bool = False,
            preferred: bool = True, idle: int = 0) -> tuple[dict[str, float], int, float, bool]:
    out = listed(first_seen, idle, publishers, 10.0, me="me", offered=offered,
                 preferred=preferred, watch_every=5, backup_every=30, poll_interval=1.0)
    return dict(out.first_seen), out.idle, out.next_listing, out.keeps_offer


def test_a_listing_keeps_first_seen_times_and_schedules_the_next() -> None:
    # a new contribution: seen now, the earlier time kept; look again at the next poll
    assert _listed({"a": 3.0}, {"a", "b"}) == ({"a": 3.0, "b": 10.0}, 0, 10.0, False)
    # nothing new: idle, backing off (2 polls, a hair early)
    assert _listed({"a": 3.0}, {"a"}, idle=0) == ({"a": 3.0}, 1, pytest.approx(10.999), False)
    # a backup looks again after backup_every polls
    assert _listed({}, {"a"}, preferred=False)[2] == pytest.approx(10.0 + 29 * 0.999)


def test_an_offer_counts_as_seen_unless_its_learner_is_listed_already() -> None:
    assert _listed({"a": 3.0}, {"a"}, offered=True) == ({"a": 3.0, "me": 10.0}, 0, 10.0, True)
    # an earlier run of this learner id contributed: the offer is declined
    assert _listed({"a": 3.0}, {"a", "me"}, offered=True) == (
        {"a": 3.0, "me": 10.0}, 0, 10.0, False)
    assert _listed({"me": 2.0}, {"me"}, offered=True)[3] is False


def view(now: float, first_seen: dict[str, float], live: set[str], **kw: object) -> PollView:
    args: dict[str, object] = dict(
        round=4, now=now, me="me", first_seen=first_seen, live=frozenset(live), paces={},
        quorum_size=2, grace=5.0, preferred=True, backup_every=30,
        poll_interval=1.0, calling=True, waiting=False, refreshed=True, relisted=True)
    args.update(kw)
    return PollView(**args)  # type: ignore[arg-type]


def test_a_round_short_of_its_quorum_size_lists_the_leases_before_it_is_due() -> None:
    # quorum_size 3 and two learners live, both in: due, short of 3, so the leases are
    # listed again first (once a poll), then it is decided over the new live set
    v = view(20.0, {"a": 10.0, "b": 11.0}, {"a", "b"}, quorum_size=3, relisted=False)
    assert decide_poll(v) == PollDecision(relist="short", awaited=frozenset({"a", "b"}),
                                          due=11.0)
    d = decide_poll(dataclasses.replace(v, relisted=True))
    assert d.relist is None and d.claim and d.due == 11.0
    # a third learner joined: the round waits for it
    d = decide_poll(dataclasses.replace(v, live=frozenset("abc"), relisted=True))
    assert d.due is None and not d.claim and d.call_roll


def test_an_early_close_lists_the_leases_once_a_round() -> None:
    # everyone known is in before the window ends: look at the leases once first
    v = view(11.5, {"a": 10.0, "me": 11.0}, {"a", "me"}, refreshed=False)
    assert decide_poll(v).relist == "early"
    d = decide_poll(dataclasses.replace(v, refreshed=True))
    assert d.relist is None and d.claim and d.due == 11.0 and d.quorum_time == 11.0
    # not yet due, or due only at the window's end: no early look
    assert decide_poll(dataclasses.replace(v, now=10.5)).relist is None
    assert decide_poll(view(16.0, {"a": 10.0}, {"a", "b"}, refreshed=False,
                            quorum_size=1)).relist is None


def test_the_preferred_closer_watches_every_poll_while_the_window_is_open() -> None:
    d = decide_poll(view(12.0, {"a": 10.0}, {"a", "b"}, quorum_size=1))
    assert d.due == 15.0 and d.closes and d.watch_next_poll and not d.claim
    assert not d.call_roll and d.held is None
    d = decide_poll(view(15.0, {"a": 10.0}, {"a", "b"}, quorum_size=1))
    assert d.claim and not d.watch_next_poll


def test_a_backup_gives_the_preferred_closer_a_head_start() -> None:
    # not its round, nothing of its own in: backup_every polls past the due time
    d = decide_poll(view(16.0, {"a": 10.0}, {"a", "b"}, quorum_size=1, preferred=False))
    assert (d.held, d.due, d.closes, d.claim, d.watch_next_poll) == (15.0, 45.0, False,
                                                                      False, False)
    # its own contribution in: CONTRIBUTOR_HEAD_START polls
    d = decide_poll(view(16.0, {"a": 10.0, "me": 10.5}, {"a", "b", "me"}, quorum_size=1,
                         preferred=False))
    assert (d.held, d.due) == (15.0, 18.0)
    # its learner waits for the round: the roll is called while the head start runs
    assert not d.call_roll
    waiting = view(16.0, {"a": 10.0, "me": 10.5}, {"a", "b", "me"}, quorum_size=1,
                   preferred=False, waiting=True)
    assert decide_poll(waiting).call_roll
    assert not decide_poll(dataclasses.replace(waiting, calling=False)).call_roll
    assert not decide_poll(dataclasses.replace(waiting, now=18.0)).call_roll


def test_a_backup_whose_contribution_completes_the_set_closes_at_once() -> None:
    d = decide_poll(view(11.0, {"a": 10.0, "me": 11.0}, {"a", "me"}, preferred=False))
    assert d.closes and d.held is None and d.due == 11.0 and d.claim
    # the much slower learner is not awaited: the set is complete without it
    d = decide_poll(view(11.0, {"a": 10.0, "me": 11.0}, {"a", "me", "z"}, preferred=False,
                         paces={"a": 0.2, "me": 0.2, "z": 1.0}))
    assert d.closes and d.awaited == {"a", "me"}


def test_with_a_standalone_closer_live_an_embedded_one_is_only_a_backup() -> None:
    # Completing the set no longer closes the round here: the standalone closer next to
    # the bucket does, and this learner's link carries no other learner's delta.
    d = decide_poll(view(11.0, {"a": 10.0, "me": 11.0}, {"a", "me"}, preferred=False,
                         standalone=True))
    # Its contribution went up like everyone's: it gives the standalone closer the
    # head start of a round it has nothing in (backup_every polls, not 3)...
    assert not d.closes and not d.claim and (d.held, d.due) == (11.0, 41.0)
    # ... and claims once that is over, should nobody have (the standalone died).
    d = decide_poll(view(41.0, {"a": 10.0, "me": 11.0}, {"a", "me"}, preferred=False,
                         standalone=True))
    assert d.claim and not d.closes


def test_claims_are_listed_when_none_is_current() -> None:
    assert lists_claims({}, 0.0, 10.0)
    assert not lists_claims({0: 5.0}, 14.9, 10.0)
    assert lists_claims({0: 5.0}, 15.0, 10.0)
    assert not lists_claims({0: 1.0, 1: 20.0}, 25.0, 10.0)


def test_a_standalone_closer_looks_between_polls_once_contributions_are_due() -> None:
    # Something is in: the rest of the set is on its way, look from then on.
    assert probe_from(100.0, 10, 0.5, first_seen=104.0) == 104.0
    # Nothing yet: from when the learners were due to contribute, `gap` steps after the
    # round opened; with no pace known, only at the polls.
    assert probe_from(100.0, 10, 0.5, first_seen=None) == 105.0
    assert probe_from(100.0, 10, None, first_seen=None) is None
    assert probe_from(100.0, 10, float("nan"), first_seen=None) is None
