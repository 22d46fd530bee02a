"""The syncer's decisions: when a round may close, who may claim it, when to take over.

All times are the observer's own clock (machines share no clock): a contribution's or a
claim's time is when this syncer first saw it. Pure functions over plain values, so quorum,
grace window expiry, the all-live shortcut and takeover are tested without I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Literal

from gradientmail.algorithms.rounds import SLOW_FACTOR, effective_quorum, much_slower
from gradientmail.wire.estimates import Estimates

__all__ = [
    "CONTRIBUTOR_HEAD_START",
    "Listing",
    "PollDecision",
    "PollView",
    "RoundWatch",
    "awaited",
    "close_time",
    "completes",
    "decide_poll",
    "head_start",
    "listed",
    "lists_claims",
    "lists_contributions",
    "next_claim_attempt",
    "preferred_closer",
    "probe_from",
    "updated_estimates",
    "watch_polls",
]

#: Weight of the newest measurement in the estimates each record carries. A single slow
#: round (a closer on a congested link) must not double every learner's timeouts at once.
ESTIMATE_DECAY = 0.3


@dataclasses.dataclass(frozen=True)
class RoundWatch:
    """What a syncer has seen of the open round: when each contribution first appeared."""

    round: int
    first_seen: Mapping[str, float]

    def quorum_time(self, quorum: int) -> float | None:
        """When the quorum-th contribution was first seen, or None while short of it."""
        times = sorted(self.first_seen.values())
        return times[quorum - 1] if len(times) >= quorum else None

    def first_time(self) -> float | None:
        return min(self.first_seen.values(), default=None)

    def first_learner(self) -> str | None:
        """Whose contribution was seen first (ties: the lowest id), or None."""
        return min(self.first_seen, key=lambda x: (self.first_seen[x], x), default=None)


def close_time(
    watch: RoundWatch,
    live: Collection[str],
    quorum_size: int,
    grace: float,
    awaited: Collection[str] | None = None,
) -> float | None:
    """The observer time from which the round may be claimed, or None (quorum not in).

    Once the effective quorum is in, the round waits for the `awaited` learners (default:
    every live one) until `grace` seconds after its *first* contribution, and closes at
    once when every awaited learner is in. The window runs from the first contribution,
    not from the quorum: what it must cover is how far apart learners in phase arrive,
    and with quorum 1 the quorum time says nothing about that (the first arrival closed
    rounds 0 s later, and equal-speed learners fell into two phase groups).
    """
    q = effective_quorum(quorum_size, len(live))
    t_quorum = watch.quorum_time(q)
    if t_quorum is None:
        return None
    waiting = set(live if awaited is None else awaited) - set(watch.first_seen)
    if live and not waiting:
        return t_quorum  # nobody left worth waiting for (no live learner: no knowledge)
    t_first = watch.first_time()
    assert t_first is not None  # the quorum is in, so something was seen
    return max(t_quorum, t_first + max(grace, 0.0))


def completes(watch: RoundWatch, me: str, live: Collection[str], quorum_size: int,
              awaited: Collection[str]) -> bool:
    """Whether the round's set is complete with `me` in it: `me` and the effective quorum
    have contributed, and so has every awaited live learner. A learner whose embedded
    closer sees this closes the round at once, preferred closer or not: the last arrival
    needs no hop to another closer's next look (the claim election keeps it one close)."""
    if me not in watch.first_seen or not live:
        return False
    if watch.quorum_time(effective_quorum(quorum_size, len(live))) is None:
        return False
    return not set(awaited) - set(watch.first_seen)


#: Polls of head start a backup closer gives the preferred one on a round it contributed
#: to (on others: `backup_every`). A live preferred closer watches the round every poll
#: once it is due and claims within one; a dead one (its lease not yet expired, and with
#: quorum 1 no roll call) kept the decoupled survivor's rounds waiting 30 polls each.
CONTRIBUTOR_HEAD_START = 3


def head_start(contributed: bool, backup_every: int) -> int:
    """Polls a backup closer waits past a round's due time before it looks at the claims:
    `CONTRIBUTOR_HEAD_START` on a round with its own contribution, `backup_every` on
    others (where it watches rarely and has nothing of its own to lose)."""
    return min(CONTRIBUTOR_HEAD_START, backup_every) if contributed else backup_every


def awaited(
    live: Collection[str], paces: Mapping[str, float], slow_factor: float = SLOW_FACTOR
) -> frozenset[str]:
    """The live learners a round waits for: all but those known to be much slower.

    `paces` holds each learner's step seconds as the records last reported them. The
    run's pace is the lower median of the live learners' known paces (of two learners,
    the faster: otherwise one learner twice as slow would set half the pace it is judged
    by). A learner with no known pace (a joiner) is waited for.
    """
    known = sorted(paces[x] for x in live if x in paces)
    if not known:
        return frozenset(live)
    pace = known[(len(known) - 1) // 2]
    return frozenset(x for x in live if not much_slower(paces.get(x), pace, slow_factor))


def next_claim_attempt(
    claims: Mapping[int, float], now: float, takeover_timeout: float
) -> int | None:
    """The claim attempt this syncer should try now, or None (someone else's is current).

    `claims` maps each attempt seen to when it was first seen. No claim: attempt 0. The
    newest claim whose record has not appeared within the takeover timeout is superseded
    by the next attempt; a crashed closer costs one timeout, never the run.
    """
    if not claims:
        return 0
    newest = max(claims)
    if now - claims[newest] >= takeover_timeout:
        return newest + 1
    return None


def watch_polls(
    preferred: bool, seen: int, idle: int, watch_every: int, backup_every: int
) -> int:
    """Polls until a closer lists the open round's contributions again.

    A backup closer looks every `backup_every` polls. The preferred one looks every
    `watch_every` polls until a contribution is in; then at the next poll, backing off
    (1, 2, 4, ... polls, up to `watch_every`) while `idle` listings in a row find nothing
    new: the contribution that completes a round is seen within a poll or two, not up to
    `watch_every` later, and a round stalled on a slow learner costs no LIST a poll.
    """
    if not preferred:
        return backup_every
    if seen == 0:
        return watch_every
    return max(1, min(1 << min(idle, 30), watch_every))


def lists_contributions(now: float, next_listing: float, preferred: bool,
                        was_preferred: bool, offered: bool) -> bool:
    """Whether a closer lists the open round's contributions at this poll: from
    `next_listing` on (`listed`), and at once when it has just become the round's
    preferred closer (its predecessor judged gone, say) or its learner offers a
    contribution (whether that completes the set takes a fresh listing)."""
    return now >= next_listing or (preferred and not was_preferred) or offered


@dataclasses.dataclass(frozen=True)
class Listing:
    """The open round after a listing of its contributions: when each was first seen,
    listings in a row that found none new, when to list next, and whether the
    embedding learner's offer still stands."""

    first_seen: Mapping[str, float]
    idle: int
    next_listing: float
    keeps_offer: bool


def listed(
    first_seen: Mapping[str, float],
    idle: int,
    publishers: Collection[str],
    now: float,
    *,
    me: str,
    offered: bool,
    preferred: bool,
    watch_every: int,
    backup_every: int,
    poll_interval: float,
) -> Listing:
    """What a listing that found `publishers` at `now` makes of the open round.

    An offer (`Host.offer`) by `me` counts as seen, as if uploaded, unless `me` is
    listed already: an earlier run of this learner id contributed, and a round takes one
    contribution a learner. The next listing is `watch_polls` polls on, a hair early so
    that a poll loop's jitter does not push it one poll further.
    """
    seen = dict(first_seen)
    for learner in publishers:
        seen.setdefault(learner, now)
    keeps = offered and me not in publishers
    if keeps:
        seen.setdefault(me, now)
    idle = 0 if len(seen) > len(first_seen) else idle + 1
    polls = watch_polls(preferred, len(seen), idle, watch_every, backup_every)
    return Listing(seen, idle, now + (polls - 1) * poll_interval * 0.999, keeps)


#: Why a closer lists the leases again before it decides (`PollDecision.relist`).
Relist = Literal["short", "early"]


@dataclasses.dataclass(frozen=True)
class PollView:
    """What a closer knows at one poll of the open round (observer-clock times).

    `preferred`: it is the round's preferred closer (a standalone syncer always is).
    `standalone`: a standalone closer (`gradientmail sync`) holds a lease, so this
    embedded one is only a backup: it closes no round on completing its set.
    `calling`: it lists the leases itself, so it may call the roll. `waiting`: its
    learner's training waits for a commit. `refreshed`: it listed the leases before an
    early close of this round already; `relisted`: it listed them again at this poll
    because the round was due short of `quorum_size`.
    """

    round: int
    now: float
    me: str
    first_seen: Mapping[str, float]
    live: frozenset[str]
    paces: Mapping[str, float]
    quorum_size: int
    grace: float
    preferred: bool
    backup_every: int
    poll_interval: float
    calling: bool = False
    waiting: bool = False
    refreshed: bool = False
    relisted: bool = False
    standalone: bool = False


@dataclasses.dataclass(frozen=True)
class PollDecision:
    """What a closer does at one poll. With `relist` set, nothing else yet: it lists
    the leases, and decides again over the new live set with the reason noted in the view
    (`relisted` for "short", `refreshed` for "early").

    `due`: from when this closer may claim the round (a backup's includes its head
    start; None: the quorum is not in), and `held` the due time the head start was added
    to. `closes`: it closes at `due` without a head start. `watch_next_poll`: list the
    round's contributions at the next poll. `call_roll`: ask the roll caller whether to
    call the roll. `claim`: the round is due now. `quorum_time`: when the effective
    quorum came in.
    """

    relist: Relist | None = None
    awaited: frozenset[str] = frozenset()
    due: float | None = None
    held: float | None = None
    closes: bool = False
    watch_next_poll: bool = False
    call_roll: bool = False
    claim: bool = False
    quorum_time: float | None = None


def decide_poll(view: PollView) -> PollDecision:
    """Whether the open round is due at this poll, for whom, and what to look at first.

    The round is due at `close_time` over the learners it awaits. Before it closes short
    of `quorum_size`, and once a round before its window ends because everyone known is
    in, the closer lists the leases again (`relist`): the live set is up to a lease
    period old, and a learner that joined since must not be left out (in phase with the
    others, it would lose every later round to them by a fraction of a second). A backup
    closer adds its `head_start`, unless its own contribution completed the set (and no
    standalone closer is live); the
    preferred one watches every poll while the window is open. With no quorum, or while
    a backup's head start runs and its learner waits, it asks about a roll call.
    """
    watch = RoundWatch(view.round, view.first_seen)
    expected = awaited(view.live, view.paces)
    due = close_time(watch, view.live, view.quorum_size, view.grace, expected)
    if due is not None and len(view.first_seen) < view.quorum_size and not view.relisted:
        return PollDecision(relist="short", awaited=expected, due=due)
    first = watch.first_time()
    if (due is not None and view.now >= due and first is not None
            and due < first + view.grace and not view.refreshed):
        return PollDecision(relist="early", awaited=expected, due=due)
    # The last arrival closes its round itself, unless a standalone closer next to the
    # bucket is live: closing pulls every other contribution through this learner's link,
    # which between sites is the slowest one a round crosses (20 Mbit/s, M = 2: a standard
    # round's barrier 5.4 s, against 2.0 s for torchft's allreduce on the same links).
    closes = view.preferred or (
        due is not None and not view.standalone
        and completes(watch, view.me, view.live, view.quorum_size, expected))
    held = None
    if due is not None and not closes:
        # Beside a live standalone closer, its own contribution went up like everyone's:
        # it has nothing of its own to lose, and the round is the standalone's to close.
        polls = head_start(view.me in view.first_seen and not view.standalone,
                           view.backup_every)
        held, due = due, due + polls * view.poll_interval
    return PollDecision(
        awaited=expected,
        due=due,
        held=held,
        closes=closes,
        watch_next_poll=due is not None and view.preferred and view.now < due,
        call_roll=view.calling and (due is None or (
            view.waiting and held is not None and view.now < due)),
        claim=due is not None and view.now >= due,
        quorum_time=watch.quorum_time(effective_quorum(view.quorum_size, len(view.live))),
    )


def probe_from(opened: float, gap: int, step_seconds: float | None,
               first_seen: float | None) -> float | None:
    """From when (observer time) a standalone closer looks for its open round's missing
    contributions every `cadence.poll_delay` instead of every poll interval, or None
    (not before its next listing).

    From the first contribution it saw: the rest of a barrier's set is on its way, and
    every moment between the last arrival and the closer's next look is a moment every
    learner waits. Before any: from when the learners' contributions are expected, `gap`
    steps of `step_seconds` after the round opened (when this closer saw the record
    before it) — equal learners arrive together, and a closer that first lists them up to
    a poll interval late costs each round that much. Unknown pace: its listings only.
    """
    if first_seen is not None:
        return first_seen
    if step_seconds is None or not math.isfinite(step_seconds) or step_seconds < 0:
        return None
    return opened + gap * step_seconds


def lists_claims(claims: Mapping[int, float], now: float, takeover_timeout: float) -> bool:
    """Whether a closer of a due round lists its claims now: with none seen, or once the
    newest it saw is a takeover timeout old. A claim seen is current for that long, so a
    backup past its head start waits out a preferred closer's long merge at no LIST a
    poll."""
    return not claims or now >= max(claims.values()) + takeover_timeout


def preferred_closer(round_: int, live: Collection[str]) -> str | None:
    """The live learner expected to watch round `round_` closely: live learners take turns
    in id order. Only it lists the round's contributions every few polls; the others look
    rarely and close the round only if it is late. Every closer may still close any round
    (claims elect one), so a view of `live` that differs between learners costs a little
    watching, never a round."""
    ordered = sorted(live)
    return ordered[round_ % len(ordered)] if ordered else None


def updated_estimates(
    previous: Estimates,
    step_seconds: Collection[float],
    quorum_seconds: float | None,
    sync_seconds: float | None,
) -> Estimates:
    """Fold one round's measurements into the estimates the next record carries.

    ξ_step is the lower median of the participants' own step-time EMAs, as `awaited`
    judges the run's pace (of two learners the faster: the mean of a learner and one twice
    as slow set a pace 1.5x the run's, and the slow one, scheduling its publishes at that
    pace, kept missing every second round); ξ_quorum and ξ_sync are EMAs of the observed
    seconds.
    """
    finite = sorted(s for s in step_seconds if math.isfinite(s) and s >= 0)
    step = previous.step
    if finite:
        step = finite[(len(finite) - 1) // 2]
    return Estimates(
        step=step,
        quorum=_ema(previous.quorum, quorum_seconds),
        sync=_ema(previous.sync, sync_seconds),
    )


def _ema(old: float | None, new: float | None) -> float | None:
    if new is None or not math.isfinite(new) or new < 0:
        return old
    if old is None:
        return new
    return (1 - ESTIMATE_DECAY) * old + ESTIMATE_DECAY * new
