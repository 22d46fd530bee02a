"""What a standalone closer (`gradientmail sync`) does that an embedded one does not: it
holds a lease under `closers/`, which tells the learners to leave it the rounds, and it
looks for its open round's missing contributions between polls.

Why both: between sites, a learner's link is the slowest hop a round crosses, and the
learner that closes a round pulls every other contribution down through it (20 Mbit/s, two
learners: a standard round's barrier 5.4 s against 2.0 s for torchft's allreduce on the
same links). A closer next to the bucket takes that off every learner's link; looking
for the last arrivals every 20-50 ms (a GET each) closes a round within moments of them,
not a poll interval later.
"""

from __future__ import annotations

import dataclasses
import math

from gradientmail.clock import Clock
from gradientmail.errors import GradientmailError, RemoteProtocolError
from gradientmail.events import EventSink, PollFailed
from gradientmail.run.lease import CLOSERS
from gradientmail.run.protocol import Exchange

__all__ = ["BEAT_EVERY", "JUDGED_AFTER", "Awaiting", "CloserLease", "arrived", "closer_timeout"]

#: Seconds between a standalone closer's beats (at most: half its lease timeout when that
#: is shorter). Learners judge it by their own lease timeout, which it does not know: the
#: tiny recipe's learners (lease timeout 30 s) judged a closer beating every 60 s gone,
#: and took 4 of 10 rounds back. A beat is a PUT and a DELETE: 10 s of them cost $0.004
#: a day on S3.
BEAT_EVERY = 10.0
#: Beats a learner waits through, at the least, before it judges a standalone closer gone.
JUDGED_AFTER = 3


def closer_timeout(lease_timeout: float) -> float:
    """The timeout a learner whose own is `lease_timeout` judges standalone closers by:
    never under `JUDGED_AFTER` beats."""
    return max(lease_timeout, JUDGED_AFTER * BEAT_EVERY)


class CloserLease:
    """A standalone closer's lease under `closers/<closer>/`: beaten every `BEAT_EVERY`
    seconds (or half `lease_timeout`, when shorter), so learners judging it by
    `closer_timeout` never see it lapse while it runs, and released when it stops
    (learners take the rounds back at their next listing)."""

    def __init__(self, exchange: Exchange, closer: str, clock: Clock, lease_timeout: float,
                 on_event: EventSink) -> None:
        self._ex = exchange
        self._closer = closer
        self._clock = clock
        self._every = min(BEAT_EVERY, lease_timeout / 2)
        self._on_event = on_event
        self._next = -math.inf
        self._held = False

    async def beat(self) -> None:
        """Beat if a beat period passed since the last beat."""
        now = self._clock.now()
        if now < self._next:
            return
        await self._ex.beat(self._closer, CLOSERS)
        self._held = True
        self._next = now + self._every

    async def release(self) -> None:
        """Delete the lease; a store that fails here only delays the learners' taking the
        rounds back until the lease times out."""
        if not self._held:
            return
        try:
            await self._ex.release(self._closer, CLOSERS)
        except (GradientmailError, OSError) as exc:
            self._on_event(PollFailed(self._closer, repr(exc)))


@dataclasses.dataclass(frozen=True)
class Awaiting:
    """The open round `round` awaits `missing`: from `since` (observer time) on, the
    closer looks for their records between polls (`syncer.state.probe_from`)."""

    round: int
    missing: tuple[str, ...]
    since: float


async def arrived(exchange: Exchange, round_: int, learner: str) -> bool:
    """Whether `learner` has a contribution record in `round_` (one GET), or something the
    next poll must look at (a record that does not read); False while the store fails
    (the next poll reports it)."""
    try:
        return await exchange.contribution(round_, learner) is not None
    except RemoteProtocolError:
        return True
    except (GradientmailError, OSError):
        return False
