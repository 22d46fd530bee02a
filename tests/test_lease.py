"""LeaseTracker: liveness judged on the observer's own clock, tested with plain floats."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.errors import ConfigError, LocalProtocolError
from gradientmail.run.lease import LeaseTracker, lease_counters, lease_key


def test_first_seen_is_live_until_timeout() -> None:
    t = LeaseTracker(timeout=120.0)
    t.observe({"a": 5}, now=1000.0)
    assert t.live(1000.0) == {"a"}
    assert t.live(1119.9) == {"a"}
    assert t.live(1120.0) == frozenset()  # a stale lease found by a new observer


def test_changed_counter_keeps_it_live() -> None:
    t = LeaseTracker(timeout=120.0)
    t.observe({"a": 1, "b": 7}, now=0.0)
    t.observe({"a": 2, "b": 7}, now=60.0)
    t.observe({"a": 3, "b": 7}, now=120.0)
    assert t.live(120.0) == {"a"}  # b has not beaten since first seen at 0
    assert t.last_change("a") == 120.0
    assert t.last_change("b") == 0.0
    assert t.live(239.0) == {"a"}
    assert t.live(240.0) == frozenset()


def test_unchanged_listing_does_not_refresh() -> None:
    t = LeaseTracker(timeout=10.0)
    t.observe({"a": 1}, now=0.0)
    for now in (3.0, 6.0, 9.0, 12.0):
        t.observe({"a": 1}, now=now)
    assert t.live(12.0) == frozenset()


def test_released_lease_is_not_live_and_return_counts_as_new() -> None:
    t = LeaseTracker(timeout=100.0)
    t.observe({"a": 1, "b": 1}, now=0.0)
    t.observe({"b": 2}, now=10.0)
    assert t.live(10.0) == {"b"}
    assert t.last_change("a") is None
    t.observe({"a": 1, "b": 2}, now=20.0)  # a is back (same counter): first seen again
    assert t.live(20.0) == {"a", "b"}
    assert t.last_change("a") == 20.0


def test_counter_going_backwards_is_a_change() -> None:
    t = LeaseTracker(timeout=50.0)
    t.observe({"a": 9}, now=0.0)
    t.observe({"a": 0}, now=40.0)  # a restarted learner that counted from scratch
    assert t.live(80.0) == {"a"}


def test_counters_copy_and_repr() -> None:
    t = LeaseTracker(timeout=5)
    t.observe({"x": 3}, now=0.0)
    c = t.counters()
    c["x"] = 99
    assert t.counters() == {"x": 3}
    assert repr(t) == "LeaseTracker(timeout=5.0, learners=1)"


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "120"])
def test_bad_timeout(bad: object) -> None:
    with pytest.raises(ConfigError, match=f"lease timeout={bad!r} must be a finite number"):
        LeaseTracker(timeout=bad)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 50), st.dictionaries(
    st.sampled_from("abcd"), st.integers(0, 3))), max_size=12),
    st.floats(1, 100))
def test_live_matches_a_reference_model(
    observations: list[tuple[float, dict[str, int]]], timeout: float
) -> None:
    t = LeaseTracker(timeout)
    now = 0.0
    changed: dict[str, float] = {}
    last: dict[str, int] = {}
    for dt, counters in observations:
        now += dt
        t.observe(counters, now)
        for learner in list(last):
            if learner not in counters:
                del last[learner], changed[learner]
        for learner, c in counters.items():
            if last.get(learner) != c:
                last[learner], changed[learner] = c, now
        probe = now + dt / 2
        assert t.live(probe) == {n for n, s in changed.items() if probe - s < timeout}
        assert t.live(probe) <= set(counters)


def test_lease_counters_takes_highest_and_ignores_strays() -> None:
    keys = ["leases/a/000000000003", "leases/a/000000000004", "leases/b/000000000000",
            "leases/c/12", "leases/-bad/000000000001", "leases/d", "leases/e/000000000001/x"]
    assert lease_counters(keys) == {"a": 4, "b": 0}
    assert lease_key("a", 4) == "leases/a/000000000004"
    with pytest.raises(LocalProtocolError, match=r"lease counter=-1 must be an integer"):
        lease_key("a", -1)
