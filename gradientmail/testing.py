"""Test doubles for code built on gradientmail.

`FakeClock` is virtual time that jumps to the earliest deadline once every party waiting
on it is blocked (trio's `MockClock` with autojump), so timeouts, leases and grace windows
are tested in milliseconds and measure the same fake seconds on a fast machine and a
loaded one. It satisfies `gradientmail.clock.Clock`. The other shipped fakes live beside
the contract they fake: `MemoryMailbox` and `FaultyMailbox` in `gradientmail.mailbox`,
`ThreadRanks` in `gradientmail.integration`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar

__all__ = ["FakeClock"]

T = TypeVar("T")

#: Rounds of its ready callbacks each loop with a waiting task runs before time jumps, so
#: that a task another thread woke (a job queued or an event set with
#: `call_soon_threadsafe`: the callback, then the task's wake-up) is seen working rather
#: than jumped past. An event a task waits for is seen set after the first.
_SETTLE_HOPS = 3
#: Real seconds to wait for a loop that does not run its callbacks (stopped, not closed).
_SETTLE_LIMIT = 1.0
#: Real seconds between looks at readiness nobody announces (a queue another thread
#: filled while every party waited).
_RECHECK = 0.002
#: Real seconds the driver thread lingers with no party before it ends.
_LINGER = 0.5


class _Party:
    """A thread or task known to the clock: waiting (until `deadline`, or until `ready()`)
    or working (woken, or inside `busy()`, and not waiting yet)."""

    __slots__ = ("busy", "deadline", "loop", "ready", "thread", "waiting", "wake")

    def __init__(self) -> None:
        self.waiting = False
        self.deadline = math.inf
        self.ready: Callable[[], bool] | None = None
        self.wake: Callable[[], None] | None = None  # how a task is woken (threads: notify)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.busy = 0  # nested busy() of a thread
        self.thread: threading.Thread | None = None  # the thread a task's loop runs in


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _call_soon(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    loop.call_soon_threadsafe(_resolve, future)


class FakeClock:
    """Virtual time that moves only when every party waiting on it is blocked, or when
    `advance` is called; then it jumps to the earliest deadline (trio's `MockClock` with
    autojump).

    A party is a task or a thread inside one of the clock's waits; a task that a wait of
    this clock woke keeps counting as working until it waits again or ends, and so does a
    thread inside `busy()`. While any party works, time stands still: a merge in a worker
    thread, an upload or a training step takes no fake time, and fake durations do not
    depend on how fast the machine runs. A thread that is not inside `busy()` (a training
    loop that only calls into the learner) is no party between waits: time may move while
    it computes, as it may while a task that never waited on this clock works. A thread
    being `join`ed counts as working while it lives and waits on nothing of this clock.
    The last party to wait makes the jump, or a background daemon thread (started by the
    first wait). Safe to use from several threads and event loops; `busy()` must not wrap
    the running of an event loop whose tasks wait on this clock (they could never wake).
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._cond = threading.Condition()
        self._parties: dict[object, _Party] = {}
        self._version = 0  # bumped at every change of a party
        self._jumping = False  # a caller of _jump lets the loops settle
        self._joined: dict[threading.Thread, int] = {}  # threads being joined
        self._driver: threading.Thread | None = None

    def now(self) -> float:
        with self._cond:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward by hand, waking whoever that makes due."""
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards (seconds={seconds})")
        with self._cond:
            self._now += seconds
            self._wake_due()

    # -- in a task ------------------------------------------------------------------------

    async def sleep(self, seconds: float) -> None:
        future = self._enter_task(seconds, None)
        if future is None:
            await asyncio.sleep(0)
            return
        try:
            await future
        finally:
            self._leave_task()

    async def sleep_unless(self, seconds: float, event: asyncio.Event) -> None:
        future = None if event.is_set() else self._enter_task(seconds, event.is_set)
        if future is None:
            await asyncio.sleep(0)
            return
        waker = asyncio.ensure_future(event.wait())
        either: list[asyncio.Future[Any]] = [future, waker]
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._leave_task()
            waker.cancel()
            await asyncio.gather(waker, return_exceptions=True)

    async def idle(self, awaitable: Awaitable[T]) -> T:
        self._enter_task(None, None)
        try:
            return await awaitable
        finally:
            self._leave_task()

    def _enter_task(self, seconds: float | None,
                    ready: Callable[[], bool] | None) -> asyncio.Future[None] | None:
        """Mark the current task waiting (for `seconds`, None: no deadline); the future a
        jump resolves, or None when the deadline is due already."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("FakeClock's async waits must run in an asyncio task")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._cond:
            deadline = math.inf if seconds is None else self._now + max(seconds, 0.0)
            if deadline <= self._now:
                return None
            party = self._parties.get(task)
            if party is None:
                party = self._parties[task] = _Party()
                task.add_done_callback(self._forget)
            party.waiting, party.deadline, party.ready, party.loop = True, deadline, ready, loop
            party.thread = threading.current_thread()
            party.wake = lambda: _call_soon(loop, future)
            self._changed()
        return future

    def _leave_task(self) -> None:
        task = asyncio.current_task()
        with self._cond:
            party = self._parties.get(task)
            if party is not None:
                party.waiting, party.ready, party.wake = False, None, None
                self._changed()

    def _forget(self, task: object) -> None:
        with self._cond:
            if self._parties.pop(task, None) is not None:
                self._changed()

    # -- in a thread ----------------------------------------------------------------------

    def pause(self, seconds: float) -> None:
        self._block(None, seconds)

    def get(self, q: queue.Queue[T], timeout: float | None) -> T:
        if self._block(lambda: not q.empty(), timeout):
            return q.get_nowait()
        raise queue.Empty

    def result(self, future: concurrent.futures.Future[T], timeout: float | None) -> T:
        if not self._block(future.done, timeout):
            raise TimeoutError(f"no result within {timeout} fake seconds")
        return future.result(timeout=0)

    def join(self, thread: threading.Thread, timeout: float | None) -> None:
        # The thread joined counts as working while it lives and waits on nothing of this
        # clock: a learner's loop thread winding down after its tasks ended must not let
        # the join time out in a jump.
        with self._cond:
            self._joined[thread] = self._joined.get(thread, 0) + 1
        try:
            self._block(lambda: not thread.is_alive(), timeout)
        finally:
            with self._cond:
                self._joined[thread] -= 1
                if not self._joined[thread]:
                    del self._joined[thread]

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        me = threading.current_thread()
        with self._cond:
            party = self._parties.setdefault(me, _Party())
            party.busy += 1
            self._changed()
        try:
            yield
        finally:
            with self._cond:
                party.busy -= 1
                if not party.busy and not party.waiting:
                    self._parties.pop(me, None)
                self._changed()

    def busy(self) -> AbstractContextManager[None]:
        return self._busy()

    def _block(self, ready: Callable[[], bool] | None, seconds: float | None) -> bool:
        """Block the calling thread until `ready()` (True) or `seconds` of fake time pass
        (False; None: never)."""
        me = threading.current_thread()
        with self._cond:
            if ready is not None and ready():
                return True
            deadline = math.inf if seconds is None else self._now + max(seconds, 0.0)
            if deadline <= self._now:
                return False
            party = self._parties.setdefault(me, _Party())
            party.waiting, party.deadline, party.ready, party.loop = True, deadline, ready, None
            self._changed()
            try:
                while party.waiting:
                    # The last party to wait jumps itself, sparing a hand-over to the driver.
                    if not self._jump():
                        self._cond.wait(_RECHECK)
                return ready is not None and ready()
            finally:
                party.waiting, party.ready = False, None
                if not party.busy:
                    self._parties.pop(me, None)
                self._changed()

    # -- the jumps ------------------------------------------------------------------------

    def _changed(self) -> None:
        """Note a change of the parties (the lock held) and let the driver look."""
        self._version += 1
        self._cond.notify_all()
        if self._driver is None:
            self._driver = threading.Thread(target=self._drive, name="gradientmail-fakeclock",
                                            daemon=True)
            self._driver.start()

    def _wake(self, key: object, party: _Party) -> None:
        party.waiting = False
        if party.wake is not None:
            try:
                party.wake()
            except RuntimeError:  # its loop is closed: the task will never run again
                del self._parties[key]

    def _wake_due(self) -> None:
        for key, party in list(self._parties.items()):
            if party.waiting and party.deadline <= self._now:
                self._wake(key, party)
        self._changed()

    def _due(self) -> tuple[int, set[asyncio.AbstractEventLoop]] | None:
        """With the lock held: wake the waiting parties that are ready; when every party
        waits and one has a deadline, the version to check before jumping and the loops
        to settle first; else None."""
        woke = False
        for key, party in list(self._parties.items()):
            gone = (party.loop.is_closed() if party.loop is not None
                    else isinstance(key, threading.Thread) and not key.is_alive())
            if gone:
                del self._parties[key]
                woke = True
            elif party.waiting and party.ready is not None and party.ready():
                self._wake(key, party)
                woke = True
        if woke:
            self._changed()
            return None
        parties = self._parties.values()
        if any(not p.waiting for p in parties) or any(
            t.is_alive() and not any(p.waiting and (key is t or p.thread is t)
                                     for key, p in self._parties.items())
            for t in self._joined
        ) or min(
                (p.deadline for p in parties), default=math.inf) == math.inf:
            return None
        return self._version, {p.loop for p in parties if p.loop is not None}

    def _jump(self) -> bool:
        """With the lock held: when every party waits, let their loops settle and jump to
        the earliest deadline; whether time moved. One caller at a time settles."""
        due = None if self._jumping else self._due()
        if due is None:
            return False
        version, loops = due
        self._jumping = True
        self._cond.release()
        try:
            for loop in loops:
                _settle(loop)
        finally:
            self._cond.acquire()
            self._jumping = False
        if self._version != version or self._due() is None:
            return False
        self._now = max(self._now, min(p.deadline for p in self._parties.values()))
        self._wake_due()
        return True

    def _drive(self) -> None:
        lonely = 0.0
        with self._cond:
            while True:
                if not self._parties:
                    if lonely >= _LINGER:
                        self._driver = None
                        return
                    self._cond.wait(_RECHECK * 10)
                    lonely += _RECHECK * 10
                    continue
                lonely = 0.0
                if not self._jump():
                    self._cond.wait(_RECHECK)


def _settle(loop: asyncio.AbstractEventLoop) -> None:
    """Let `loop` run _SETTLE_HOPS rounds of its ready callbacks (a real-time wait)."""
    done = threading.Event()

    def hop(left: int) -> None:
        if left:
            loop.call_soon(hop, left - 1)
        else:
            done.set()

    try:
        loop.call_soon_threadsafe(hop, _SETTLE_HOPS)
    except RuntimeError:  # closed meanwhile
        return
    # A loop that stops or closes meanwhile (a learner's, as it shuts down) runs nothing
    # more that could wake its tasks.
    deadline = time.monotonic() + _SETTLE_LIMIT
    while not done.wait(_RECHECK) and loop.is_running() and time.monotonic() < deadline:
        pass
