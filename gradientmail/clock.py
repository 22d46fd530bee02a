"""Time, injected: core code asks a Clock, never `time` or `asyncio.sleep` directly.

Two kinds of party wait on a clock: asyncio tasks (a learner's communication loops, the
syncer) and plain threads (a learner's training thread, waiting for a commit, its peers or
its publishes). `MonotonicClock` is real time; `gradientmail.testing.FakeClock` is the
virtual time tests drive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Awaitable
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar, runtime_checkable

__all__ = ["Clock", "MonotonicClock", "sleep_unless", "wall_time"]

T = TypeVar("T")


@runtime_checkable
class Clock(Protocol):
    """Seconds on a monotonic scale, and every way the runtimes wait for them to pass.

    In a task: `sleep`, `sleep_unless` (until the seconds pass or an event is set) and
    `idle` (await something with no deadline that another party ends: a job queue, a stop
    event). In a thread, each with a timeout in this clock's seconds (None: none) and the
    outcome of its standard-library counterpart: `pause` (`time.sleep`), `get`
    (`Queue.get`, raising `queue.Empty`), `result` (`Future.result`, raising
    `TimeoutError`) and `join` (`Thread.join`). `busy()` marks the calling thread as
    working while inside it: a fake clock stands still until it waits or leaves.
    """

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    async def sleep_unless(self, seconds: float, event: asyncio.Event) -> None: ...

    async def idle(self, awaitable: Awaitable[T]) -> T: ...

    def pause(self, seconds: float) -> None: ...

    def get(self, q: queue.Queue[T], timeout: float | None) -> T: ...

    def result(self, future: concurrent.futures.Future[T], timeout: float | None) -> T: ...

    def join(self, thread: threading.Thread, timeout: float | None) -> None: ...

    def busy(self) -> AbstractContextManager[None]: ...


class MonotonicClock:
    """The real clock: `time.monotonic`, `asyncio.sleep`, and the blocking calls of the
    standard library with their own timeouts."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0))

    async def sleep_unless(self, seconds: float, event: asyncio.Event) -> None:
        if event.is_set():
            await asyncio.sleep(0)
            return
        sleeper = asyncio.ensure_future(self.sleep(seconds))
        waker = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeper, waker):
                task.cancel()
            await asyncio.gather(sleeper, waker, return_exceptions=True)

    async def idle(self, awaitable: Awaitable[T]) -> T:
        return await awaitable

    def pause(self, seconds: float) -> None:
        time.sleep(max(seconds, 0.0))

    def get(self, q: queue.Queue[T], timeout: float | None) -> T:
        return q.get(timeout=timeout)

    def result(self, future: concurrent.futures.Future[T], timeout: float | None) -> T:
        return future.result(timeout=timeout)

    def join(self, thread: threading.Thread, timeout: float | None) -> None:
        thread.join(timeout=timeout)

    def busy(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()


def wall_time() -> float:
    """Unix seconds on this machine's wall clock: a timestamp for people to read in the
    records (`RoundRecord.committed_at`), never an input to a decision."""
    return time.time()


async def sleep_unless(clock: Clock, seconds: float, event: asyncio.Event | None) -> None:
    """Sleep `seconds` on `clock`, waking early when `event` is set (a SIGTERM must not
    wait out a long poll interval; a learner that starts waiting for a commit must not
    wait out the one its loop began before)."""
    if event is None:
        await clock.sleep(seconds)
    else:
        await clock.sleep_unless(seconds, event)
