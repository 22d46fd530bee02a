"""Time, injected: core code asks a Clock, never `time` or `asyncio.sleep` directly."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "FakeClock", "MonotonicClock", "sleep_unless", "wall_time"]


@runtime_checkable
class Clock(Protocol):
    """Seconds on a monotonic scale, and a way to wait for them to pass."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The real clock: `time.monotonic` and `asyncio.sleep`."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0))


def wall_time() -> float:
    """Unix seconds on this machine's wall clock: a timestamp for people to read in the
    records (`RoundRecord.committed_at`), never an input to a decision."""
    return time.time()


class FakeClock:
    """A clock that moves only when told to, or when someone sleeps on it.

    `sleep` jumps time forward at once (like trio's autojump clock), yielding to the event
    loop first, so timeouts, leases and grace windows are tested in milliseconds. `advance`
    moves time from a test. Safe to read from several threads.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards (seconds={seconds})")
        with self._lock:
            self._now += seconds

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)
        self.advance(max(seconds, 0.0))


async def sleep_unless(clock: Clock, seconds: float, event: asyncio.Event | None) -> None:
    """Sleep `seconds` on `clock`, waking early when `event` is set (a SIGTERM must not
    wait out a long poll interval; a learner that starts waiting for a commit must not
    wait out the one its loop began before)."""
    if event is None:
        await clock.sleep(seconds)
        return
    if event.is_set():
        await asyncio.sleep(0)
        return
    own = getattr(clock, "sleep_unless", None)
    if own is not None:
        # A clock that knows how (a simulated one that tracks its sleepers by task):
        # the caller's own task sleeps, not a helper task.
        await own(seconds, event)
        return
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    waker = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sleeper, waker):
            task.cancel()
        await asyncio.gather(sleeper, waker, return_exceptions=True)
