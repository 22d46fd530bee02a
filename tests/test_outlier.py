"""The outlier guard: the pure rule (`outliers`) and a syncer that drops an outlier."""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_syncer import Run, algorithm, delta

from gradientmail.algorithms.rounds import outliers
from gradientmail.events import ContributionDropped
from gradientmail.mailbox import MemoryMailbox
from gradientmail.wire.records import RoundRecord
from gradientmail.wire.tensor_bytes import TensorBytes


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- the rule ----------------------------------------------------------------------------


def test_a_norm_over_k_times_the_median_is_an_outlier_and_the_reason_names_the_norms() -> None:
    assert outliers({"a": 1.0, "b": 1.2, "c": 10.0}, 3.0) == {
        "c": "outlier: delta norm 10 exceeds outlier_factor 3 x the round's median delta "
             "norm 1.2 (3 contributions)"
    }
    # Even counts take the mean of the two middle norms: here 2.5, so the limit is 7.5.
    assert list(outliers({"a": 1.0, "b": 2.0, "c": 3.0, "d": 7.6}, 3.0)) == ["d"]
    assert outliers({"a": 1.0, "b": 2.0, "c": 3.0, "d": 7.5}, 3.0) == {}  # not over: kept
    assert sorted(outliers({"a": 1.0, "b": 1.0, "c": 1.0, "x": 50.0, "y": 60.0}, 2.5)) == [
        "x", "y"]


def test_nothing_is_judged_off_with_few_contributions_or_a_zero_median() -> None:
    assert outliers({"a": 1.0, "b": 1.0, "c": 1e9}, None) == {}  # off (the default)
    assert outliers({"a": 1.0, "b": 1e9}, 2.0) == {}  # of two, neither is the odd one out
    assert outliers({}, 2.0) == {}
    assert outliers({"a": 0.0, "b": 0.0, "c": 5.0}, 2.0) == {}  # no scale to judge by


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.text("abcdef", min_size=1, max_size=3),
                    st.floats(0, 1e6, allow_nan=False), min_size=3, max_size=12),
    st.floats(1.0001, 100),
)
def test_the_outliers_are_exactly_those_over_the_limit_and_never_half(
    norms: dict[str, float], k: float
) -> None:
    out = outliers(norms, k)
    ordered = sorted(norms.values())
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    want = {x for x, v in norms.items() if median > 0 and v > k * median}
    assert set(out) == want
    assert len(out) <= n // 2
    assert all(r.startswith("outlier: delta norm ") for r in out.values())


# -- the syncer --------------------------------------------------------------------------


def scaled(r: int, learner: str, names: tuple[str, ...], factor: float) -> dict[str, TensorBytes]:
    return {n: TensorBytes.from_numpy(t.to_numpy() * np.float32(factor))
            for n, t in delta(r, learner, names).items()}


def norm_of(tensors: dict[str, TensorBytes]) -> float:
    return math.sqrt(sum(float(np.sum(t.to_numpy().astype(np.float64) ** 2))
                         for t in tensors.values()))


async def close_round_0(learners: dict[str, float], outlier_factor: float | None,
                        ) -> tuple[Run, RoundRecord]:
    """A run whose round 0 gets one contribution per learner, its delta scaled by the
    learner's factor; the syncer closes it once every one is in."""
    mailbox = MemoryMailbox()
    r = Run(mailbox, algorithm(fragments=1, quorum_size=1, outlier_factor=outlier_factor))
    await r.create()
    for learner, factor in learners.items():
        await r.contribute(0, learner, tensors=scaled(0, learner, r.plan[0], factor))
    assert await r.syncer().poll(live=frozenset(learners))
    rec = await r.ex.read_round(0)
    assert rec is not None
    return r, rec


def test_the_syncer_drops_an_outlier_with_an_event_and_a_record_entry() -> None:
    async def main() -> None:
        honest = {"a": 1.0, "b": 1.0, "c": 1.0}
        r, rec = await close_round_0({**honest, "big": 100.0}, outlier_factor=4.0)
        assert [p.learner for p in rec.participants] == ["a", "b", "c"]
        [dropped] = rec.dropped
        assert dropped.learner == "big"
        m = re.fullmatch(r"outlier: delta norm (\S+) exceeds outlier_factor 4 x the round's "
                         r"median delta norm (\S+) \(4 contributions\)", dropped.reason)
        assert m is not None, dropped.reason
        norms = {x: norm_of(scaled(0, x, r.plan[0], f))
                 for x, f in {**honest, "big": 100.0}.items()}
        assert float(m.group(1)) == pytest.approx(norms["big"], rel=1e-5)
        middle = sorted(norms.values())[1:3]
        assert float(m.group(2)) == pytest.approx(sum(middle) / 2, rel=1e-5)
        [event] = r.of(ContributionDropped)
        assert (event.round, event.learner, event.key, event.reason) == (
            0, "big", "payloads/0000000000/big.safetensors", dropped.reason)
        # The commit is exactly what the honest three alone make.
        _, alone = await close_round_0(honest, outlier_factor=None)
        assert [x.sha256 for x in rec.payload_refs()] == [
            x.sha256 for x in alone.payload_refs()]

    run(main())


def test_the_guard_is_off_by_default_and_needs_three_contributions() -> None:
    async def main() -> None:
        _, rec = await close_round_0({"a": 1.0, "b": 1.0, "c": 1.0, "big": 100.0}, None)
        assert [p.learner for p in rec.participants] == ["a", "b", "big", "c"]
        assert rec.dropped == ()
        _, rec = await close_round_0({"a": 1.0, "big": 100.0}, outlier_factor=2.0)
        assert [p.learner for p in rec.participants] == ["a", "big"]
        assert rec.dropped == ()

    run(main())
