"""The syncer's decisions: when a round may close, who may claim it, when to take over.

All times are the observer's own clock (machines share no clock): a contribution's or a
claim's time is when this syncer first saw it. Pure functions over plain values, so quorum,
grace window expiry, the all-live shortcut and takeover are tested without I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping

from gradientmail.algorithms.schedule import Estimates

__all__ = [
    "CONTRIBUTOR_HEAD_START",
    "SLOW_FACTOR",
    "RoundWatch",
    "awaited",
    "close_time",
    "completes",
    "effective_quorum",
    "head_start",
    "much_slower",
    "next_claim_attempt",
    "preferred_closer",
    "updated_estimates",
    "watch_polls",
]

#: Weight of the newest measurement in the estimates each record carries. A single slow
#: round (a closer on a congested link) must not double every learner's timeouts at once.
ESTIMATE_DECAY = 0.3


def effective_quorum(quorum_size: int, live: int) -> int:
    """min(quorum_size, live learners), never under 1: a run of one learner still closes."""
    return max(1, min(quorum_size, live))


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


#: A live learner whose step time exceeds this many times the run's pace is not waited
#: for: its contributions join whichever round is open when they arrive.
SLOW_FACTOR = 1.5


def much_slower(step_seconds: float | None, pace: float | None,
                slow_factor: float = SLOW_FACTOR) -> bool:
    """Whether a learner stepping `step_seconds` is much slower than the run's `pace`
    (over `slow_factor` times): rounds do not wait for it, and it counts its gap at the
    run's pace. False while either is unknown: a learner of unknown pace is waited for."""
    if not step_seconds or not pace:
        return False
    return step_seconds > slow_factor * pace


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
