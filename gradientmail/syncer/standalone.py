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

__all__ = ["Awaiting", "CloserLease", "arrived"]


class CloserLease:
    """A standalone closer's lease under `closers/<closer>/`: beaten every half
    `lease_timeout`, so learners judging it by that timeout never see it lapse while it
    runs, and released when it stops (learners take the rounds back at their next
    listing)."""

    def __init__(self, exchange: Exchange, closer: str, clock: Clock, lease_timeout: float,
                 on_event: EventSink) -> None:
        self._ex = exchange
        self._closer = closer
        self._clock = clock
        self._every = lease_timeout / 2
        self._on_event = on_event
        self._next = -math.inf
        self._held = False

    async def beat(self) -> None:
        """Beat if half a lease timeout passed since the last beat."""
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


async def arrived(exchange: Exchange, aw: Awaiting) -> bool:
    """Whether any of `aw.missing` has a contribution record in the round (one GET each),
    or something the next poll must look at (a record that does not read); False while
    the store fails (the next poll reports it)."""
    for learner in aw.missing:
        try:
            if await exchange.contribution(aw.round, learner) is not None:
                return True
        except RemoteProtocolError:
            return True
        except (GradientmailError, OSError):
            return False
    return False
