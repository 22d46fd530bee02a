"""RoundSchedule, Estimates and the fake clock."""

from __future__ import annotations

import asyncio

import pytest

from gradientmail.algorithms.schedule import RoundSchedule
from gradientmail.errors import ConfigError, RemoteProtocolError
from gradientmail.testing import FakeClock
from gradientmail.wire.estimates import Estimates


@pytest.mark.parametrize(("h", "p"), [(1, 1), (7, 3), (500, 4), (30, 30), (10, 4)])
def test_gaps_of_p_consecutive_rounds_add_up_to_h(h: int, p: int) -> None:
    s = RoundSchedule(sync_every=h, fragments=p)
    for start in range(0, 3 * p):
        assert sum(s.gap(r) for r in range(start, start + p)) == h
    assert all(s.gap(r) >= 1 for r in range(50))
    assert [s.fragment_of(r) for r in range(2 * p)] == list(range(p)) * 2


def test_gap_values() -> None:
    s = RoundSchedule(sync_every=10, fragments=4)
    assert [s.gap(r) for r in range(4)] == [2, 3, 2, 3]


def test_ahead_is_bounded_by_overlap() -> None:
    assert RoundSchedule(12, 3, in_flight=2, overlap_steps=None).ahead(0) == 8
    assert RoundSchedule(12, 3, in_flight=2, overlap_steps=5).ahead(0) == 5
    assert RoundSchedule(12, 3, in_flight=2, overlap_steps=0).ahead(0) == 0


def test_schedule_rejects_bad_values_with_the_rule() -> None:
    with pytest.raises(ConfigError) as e:
        RoundSchedule(sync_every=10, fragments=2, in_flight=3)
    assert str(e.value) == (
        "in_flight=3, fragments=2, sync_every=10; need 1 <= in_flight <= fragments <= sync_every"
    )
    with pytest.raises(ConfigError, match="overlap_steps=-1 is negative"):
        RoundSchedule(sync_every=10, fragments=2, overlap_steps=-1)


def test_estimates_takeover_timeout_and_json() -> None:
    e = Estimates(step=0.5, quorum=2.0, sync=4.0)
    assert e.takeover_timeout(poll_interval=1.0) == 12.0
    assert Estimates().takeover_timeout(poll_interval=0.5, floor_polls=10) == 5.0
    assert Estimates.from_json(e.to_json()) == e
    with pytest.raises(RemoteProtocolError, match="exactly step, quorum and sync"):
        Estimates.from_json({"step": 1.0})
    with pytest.raises(RemoteProtocolError, match="estimate sync='x' is not a number"):
        Estimates.from_json({"step": 1.0, "quorum": None, "sync": "x"})
    with pytest.raises(RemoteProtocolError, match="must be a finite number"):
        Estimates.from_json({"step": -1.0, "quorum": None, "sync": None})


def test_fake_clock_jumps_on_sleep() -> None:
    clock = FakeClock(start=10.0)

    async def main() -> float:
        await clock.sleep(5.0)
        await clock.sleep(-1.0)
        return clock.now()

    assert asyncio.run(main()) == 15.0
    clock.advance(1.5)
    assert clock.now() == 16.5
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1)
