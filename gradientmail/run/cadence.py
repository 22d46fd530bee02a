"""How often a party looks at the store while someone waits on what it looks for.

A learner whose training thread waits for a commit (a barrier) looks for the next record
every `poll_delay`, not every poll interval; a standalone closer looks for the
contributions its open round still awaits every `probe_delay`. Pure: tested with plain
numbers.
"""

from __future__ import annotations

__all__ = ["FREE_WAITING_CAP", "FREE_WAITING_POLL", "WAITING_CAP", "WAITING_POLL", "poll_delay",
           "probe_delay"]

#: Seconds between looks while someone waits (a learner's training thread blocked on a
#: commit: a barrier, or `overlap_steps`; a standalone closer's round awaiting its last
#: contributions), doubling up to WAITING_CAP (or the poll interval, when shorter). A GET
#: of a known key is cheap ($0.40 per million on S3: 20 a second cost $0.029 per hour
#: spent waiting, a few cents a day for a standard DiLoCo learner blocked a few percent of
#: its time), and the wait between the commit and its learners' next look is what a
#: barrier costs on top of the merge. Doubling up to the poll interval (1 s) cost standard
#: DiLoCo ~1 s a round against torchft's 0.35 s; up to 0.16 s, ~80 ms a round on average
#: for the learners that did not close it.
WAITING_POLL = 0.02
WAITING_CAP = 0.05
#: The same on a mailbox whose requests cost nothing (`Mailbox.metered` false: a local
#: directory, memory): a look is a few system calls, so a barrier's closer sees the last
#: contribution, and its learners the commit, within milliseconds, not a poll later.
FREE_WAITING_POLL = 0.002
FREE_WAITING_CAP = 0.01


def poll_delay(poll_interval: float, blocked_polls: int, metered: bool = True) -> float:
    """The sleep before the next look: the poll interval, or, `blocked_polls` polls into a
    wait, WAITING_POLL doubling per poll up to WAITING_CAP (their FREE_ values on an
    unmetered mailbox)."""
    if blocked_polls <= 0:
        return poll_interval
    first, cap = (WAITING_POLL, WAITING_CAP) if metered else (FREE_WAITING_POLL,
                                                              FREE_WAITING_CAP)
    return min(poll_interval, cap, first * (1 << min(blocked_polls - 1, 30)))


def probe_delay(poll_interval: float, metered: bool = True) -> float:
    """The sleep between a standalone closer's looks for its open round's awaited
    contributions: WAITING_POLL throughout (FREE_WAITING_POLL unmetered), never doubling as
    a learner's wait does. There is one such closer a run, not one per learner: 50 GETs a
    second while a round awaits its last contributions cost $0.072 per hour of waiting on
    S3, and the round's claim comes ~15 ms sooner on average than at WAITING_CAP, with
    every learner of a barrier waiting."""
    return min(poll_interval, WAITING_POLL if metered else FREE_WAITING_POLL)
