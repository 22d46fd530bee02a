"""A closer's side of the roll call: post a call for a round short of its quorum, judge it.

The decisions are the pure functions of `gradientmail.run.rollcall`; this module does the
I/O for a `Syncer` (embedded in a learner, or standalone): one LIST of the round's
contributions and one GET of the call before a call, a lease listing and a PUT to post
it, a lease listing every poll while it is open, and a PUT of the verdict plus a free
DELETE per learner judged gone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from gradientmail.algorithms.rounds import effective_quorum
from gradientmail.errors import RemoteProtocolError
from gradientmail.events import EventSink, LearnersGone, RollCalled
from gradientmail.run.lease import LeaseTracker
from gradientmail.run.protocol import Exchange
from gradientmail.run.rollcall import Call, Judging, next_call, should_post, verdict

__all__ = ["RollCaller"]


class RollCaller:
    """Calls the roll for the open rounds of one closer (`closer_id`), on the leases that
    `tracker` holds; the caller's `refresh_live` lists them into it."""

    def __init__(self, exchange: Exchange, tracker: LeaseTracker, closer_id: str,
                 poll_interval: float, on_event: EventSink) -> None:
        self.exchange = exchange
        self.tracker = tracker
        self.closer_id = closer_id
        self.poll_interval = poll_interval
        self.on_event = on_event
        self._judging: Judging | None = None  # the call this closer posted, still open
        # The calls of the open round: how many (ours or seen in the key), when the
        # latest was posted or closed, and their identities.
        self._round = -1
        self._calls = 0
        self._last: float | None = None
        self._counted: set[tuple[int, str]] = set()

    @property
    def judging(self) -> bool:
        """True while a call of ours is open: list the leases every poll, then `judge`."""
        return self._judging is not None

    def _for_round(self, r: int) -> None:
        if r != self._round:
            self._round, self._calls, self._last = r, 0, None
            self._counted = set()

    async def maybe_call(self, r: int, seen: dict[str, float], quorum_size: int,
                         live: frozenset[str],
                         refresh_live: Callable[[], Awaitable[frozenset[str]]],
                         now: float, held: float | None = None,
                         backup: bool = False) -> None:
        """Call the roll when round `r` has waited long enough: short of its quorum, or,
        for a `backup` closer whose learner waits for the round, unclaimed since it could
        have closed (`held`, when known).

        `seen` maps the round's contributors to when this closer first saw them; a look
        at the round just before calling adds to it.
        """
        self._for_round(r)
        when = next_call(min(seen.values(), default=None), self._calls, self._last,
                         self.poll_interval, held)
        if self._judging is not None or when is None or now < when:
            return
        ex = self.exchange
        full = held is not None
        if not full:
            # This closer's last look at the round may be 30 polls old (a backup's): a
            # learner that is in already must not be called for nothing.
            for learner in await ex.publishers(r):
                seen.setdefault(learner, now)
            full = len(seen) >= effective_quorum(quorum_size, len(live))
            if full and not backup:
                return  # ours to close, at the next poll
        if full and await ex.round_claims(r):
            # A closer is at it (one that dies is superseded by the takeover timeout):
            # look again after the next call's wait.
            self._calls, self._last = self._calls + 1, now
            return
        try:
            call = await ex.read_call()
        except RemoteProtocolError:
            call = None  # damaged, or forged in an authenticated run: ours replaces it
        self._calls, self._last = self._calls + 1, now
        if not should_post(call, r, self._counted):
            assert call is not None  # someone else called this round: it counts
            self._counted.add(call.ident)
            for learner, counter in call.gone or ():
                self.tracker.drop(learner, counter)
            return
        await refresh_live()
        counters = self.tracker.counters()
        # Short of its quorum, the round waits for those not in: a contributor has just
        # proved it is alive, and calling it would only risk its answer (a verdict of
        # another closer may overwrite this call before it reads it). A backup's call
        # of a full round is about its preferred closer, which may have contributed.
        skip = {self.closer_id} if full else {self.closer_id, *seen}
        called = {x: counters[x] for x in self.tracker.live(now)
                  if x not in skip and x in counters}
        if not called:
            return
        mine = Call(r, 0 if call is None else call.number + 1, self.closer_id)
        await ex.post_call(mine)
        self._counted.add(mine.ident)
        # The answer deadline runs from when the call is there to read.
        self._judging = Judging(mine, called, ex.clock.now())
        self.on_event(RollCalled(self.closer_id, r, mine.number, len(called)))

    async def judge(self, now: float, live: frozenset[str]) -> frozenset[str]:
        """Judge our open call on the lease listing just made (`live` its outcome): once
        decided, write the verdict over the call and delete the leases of the learners
        judged gone. Returns the live learners, less those."""
        judging = self._judging
        assert judging is not None
        gone = verdict(judging, self.tracker.counters(), now, self.poll_interval)
        if gone is None:
            return live
        await self.exchange.post_call(judging.call.with_verdict(gone))
        for learner, counter in gone.items():
            await self.exchange.drop_lease(learner, counter)
            self.tracker.drop(learner, counter)
        self._judging = None
        if judging.call.round == self._round:
            self._last = now
        if not gone:
            return live
        self.on_event(LearnersGone(self.closer_id, judging.call.round, tuple(sorted(gone)),
                                   now - judging.posted))
        return self.tracker.live(now)
