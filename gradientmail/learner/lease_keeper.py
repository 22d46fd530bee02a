"""A learner's lease and its answers to roll calls: a loop of its own on the
communication thread.

A task apart from the receive loop, so that a receive loop busy for seconds (a large
commit arriving, its closer merging a round) never makes a live learner look gone. The
decisions (who a call drops, whether to beat now) are `gradientmail.run.rollcall`'s.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from gradientmail.clock import Clock
from gradientmail.errors import RemoteProtocolError
from gradientmail.events import EventSink, PollFailed
from gradientmail.run.lease import LeaseTracker
from gradientmail.run.protocol import Exchange
from gradientmail.run.rollcall import READ_EVERY, Call, reply

__all__ = ["LeaseKeeper"]


class LeaseKeeper:
    """Beats learner `learner`'s lease every `lease_every` seconds and answers roll calls
    (the call key is read every `READ_EVERY` polls): an answer beats at once, and the
    learners a verdict judged gone leave `tracker`; `on_drop` is then told the live set
    as of `now`."""

    def __init__(self, exchange: Exchange, learner: str, tracker: LeaseTracker, *,
                 clock: Clock, lease_every: float, poll_interval: float,
                 on_event: EventSink, on_drop: Callable[[float], None]) -> None:
        self._ex = exchange
        self._learner = learner
        self._tracker = tracker
        self._clock = clock
        self._lease_every = lease_every
        self._poll_interval = poll_interval
        self._on_event = on_event
        self._on_drop = on_drop
        self._bad_call: str | None = None  # the last damaged roll call reported

    async def run(self) -> None:
        """Loop until cancelled; a failed pass is reported and tried again a poll later.
        The first beat is a lease period after the start (joining beat already)."""
        next_beat = self._clock.now() + self._lease_every
        next_read = -math.inf
        handled: Call | None = None
        while True:
            now = self._clock.now()
            try:
                beat, answering = now >= next_beat, None
                if now >= next_read:
                    next_read = now + READ_EVERY * self._poll_interval * 0.999
                    call = await self._read_call()
                    if call is not None and call != handled:
                        answer = reply(call, self._learner,
                                       self._ex.lease_counter(self._learner))
                        for learner, counter in answer.drop.items():
                            self._tracker.drop(learner, counter)
                        if answer.drop:
                            self._on_drop(now)
                        beat, answering = beat or answer.beat, call
                if beat:
                    await self._ex.beat(self._learner)
                    next_beat = now + self._lease_every
                if answering is not None:
                    handled = answering  # only once answered: a failed beat answers again
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._on_event(PollFailed(self._learner, repr(exc)))
            await self._clock.sleep(self._poll_interval)

    async def _read_call(self) -> Call | None:
        """The roll call, or None; a damaged (or, in an authenticated run, forged) call
        is reported once and ignored until a closer overwrites it with a call of its own."""
        try:
            return await self._ex.read_call()
        except RemoteProtocolError as exc:
            if str(exc) != self._bad_call:
                self._bad_call = str(exc)
                self._on_event(PollFailed(self._learner, repr(exc)))
            return None
