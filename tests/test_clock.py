"""The clocks: the real one keeps the standard library's behaviour, the fake one jumps to
the earliest deadline once every party (task or thread) waits on it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time

import pytest

from gradientmail.clock import Clock, MonotonicClock, sleep_unless
from gradientmail.testing import FakeClock


def in_thread(target: object) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


def test_both_clocks_are_clocks() -> None:
    assert isinstance(MonotonicClock(), Clock) and isinstance(FakeClock(), Clock)


def test_concurrent_sleeps_overlap_instead_of_adding_up() -> None:
    clock = FakeClock(start=100.0)
    woke: list[tuple[str, float]] = []

    async def loop(name: str, period: float, times: int) -> None:
        for _ in range(times):
            await clock.sleep(period)
            woke.append((name, clock.now()))

    async def main() -> None:
        await asyncio.gather(loop("slow", 1.0, 3), loop("fast", 0.4, 5))

    real = time.monotonic()
    asyncio.run(main())
    assert clock.now() == 103.0  # not 3 + 2 s: both loops slept at once
    assert [name for name, _ in woke] == ["fast", "fast", "slow", "fast", "fast", "slow",
                                          "fast", "slow"]
    assert [t for _, t in woke] == pytest.approx([100.4, 100.8, 101, 101.2, 101.6, 102, 102,
                                                  103])
    assert time.monotonic() - real < 5.0


def test_a_thread_waiting_on_a_queue_times_out_in_fake_seconds_or_takes_an_item() -> None:
    clock = FakeClock()
    q: queue.Queue[str] = queue.Queue()
    with pytest.raises(queue.Empty):
        clock.get(q, 30.0)
    assert clock.now() == 30.0
    got: list[tuple[str, float]] = []

    def consumer() -> None:
        got.append((clock.get(q, 60.0), clock.now()))

    with clock.busy():  # time moves only while this thread waits
        thread = in_thread(consumer)
        clock.pause(5.0)
        q.put("commit")
    thread.join(timeout=10)
    assert got == [("commit", 35.0)]  # not at its 60 s deadline


def test_time_stands_still_while_a_busy_thread_works() -> None:
    clock = FakeClock()
    ticks: list[float] = []
    working = threading.Event()
    finish = threading.Event()

    async def poller() -> None:
        for _ in range(3):
            await clock.sleep(1.0)
            ticks.append(clock.now())

    def trainer() -> None:
        with clock.busy():
            working.set()
            assert finish.wait(timeout=10)  # real work that takes a while
            assert clock.now() == 0.0
            clock.pause(2.5)  # waiting on the clock: now time moves
            assert clock.now() == 2.5

    thread = in_thread(trainer)
    assert working.wait(timeout=10)

    async def main() -> None:
        task = asyncio.create_task(poller())
        await asyncio.sleep(0.05)  # real time passes; fake time does not
        assert ticks == []
        finish.set()
        await task

    asyncio.run(main())
    thread.join(timeout=10)
    assert ticks == [1.0, 2.0, 3.0]


def test_a_task_idle_on_a_queue_is_woken_by_a_thread_before_time_moves() -> None:
    # A publish loop waits for jobs with no deadline; a training thread hands one over
    # and waits on the clock. The job runs at once: time does not jump past it.
    clock = FakeClock()
    done: list[float] = []
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    jobs: asyncio.Queue[float] = asyncio.Queue()

    async def publisher() -> None:
        ready.set()
        while True:
            seconds = await clock.idle(jobs.get())
            await clock.sleep(seconds)
            done.append(clock.now())

    async def ticker() -> None:
        while True:
            await clock.sleep(1.0)

    def run_loop() -> None:
        asyncio.set_event_loop(loop)
        with contextlib.suppress(RuntimeError):  # stopped by the test
            loop.run_until_complete(asyncio.gather(ticker(), publisher()))

    in_thread(run_loop)
    assert ready.wait(timeout=10)
    try:
        with clock.busy():
            for k in range(1, 4):
                t0 = clock.now()
                loop.call_soon_threadsafe(jobs.put_nowait, 0.25)
                clock.pause(0.5)
                assert done[-1] == t0 + 0.25, (k, done)
                assert clock.now() == t0 + 0.5
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_sleep_unless_wakes_when_the_event_is_set() -> None:
    async def main(clock: Clock, after: float) -> float:
        event = asyncio.Event()

        async def setter() -> None:
            await clock.sleep(after)
            event.set()

        t0 = clock.now()
        task = asyncio.create_task(setter())
        await sleep_unless(clock, 3600.0, event)
        await task
        return clock.now() - t0

    assert asyncio.run(main(FakeClock(), 5.0)) == 5.0  # not its 3600 s
    assert asyncio.run(main(MonotonicClock(), 0.01)) < 5.0


def test_result_and_join_time_out_in_fake_seconds() -> None:
    clock = FakeClock()
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    with pytest.raises(TimeoutError):
        clock.result(future, 120.0)
    assert clock.now() == 120.0
    future.set_result(7)
    assert clock.result(future, 1.0) == 7 and clock.now() == 120.0
    hold = threading.Event()

    def sleeper() -> None:
        clock.pause(50.0)
        assert hold.wait(timeout=10)

    with clock.busy():  # the sleeper must not jump alone before the join waits
        thread = in_thread(sleeper)
        clock.join(thread, 10.0)  # it sleeps 50 s on the clock: the join gives up first
        assert thread.is_alive() and clock.now() == 130.0
        hold.set()
        clock.join(thread, None)  # a thread that works counts as working: no jump past it
        assert not thread.is_alive() and clock.now() == 170.0


def test_advance_wakes_the_sleepers_it_makes_due() -> None:
    clock = FakeClock()

    async def main() -> float:
        sleeper = asyncio.create_task(clock.sleep(10.0))
        await asyncio.sleep(0)
        clock.advance(10.0)
        await sleeper
        return clock.now()

    assert asyncio.run(main()) == 10.0
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1.0)


def test_the_real_clock_keeps_the_standard_librarys_behaviour() -> None:
    clock = MonotonicClock()
    q: queue.Queue[int] = queue.Queue()
    q.put(1)
    assert clock.get(q, 0.01) == 1
    with pytest.raises(queue.Empty):
        clock.get(q, 0.01)
    with pytest.raises(TimeoutError):
        clock.result(concurrent.futures.Future(), 0.01)
    with clock.busy():
        t0 = clock.now()
        clock.pause(0.01)
        assert clock.now() - t0 >= 0.01
