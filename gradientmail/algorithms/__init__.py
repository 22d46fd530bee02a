"""Algorithms: the interfaces a learner and a syncer use, and the round's values.

`Algorithm` (a frozen configuration) and `Aggregator` (closes rounds, purely);
`RoundSchedule` and `Estimates` (timing every party shares); `Contribution`,
`FragmentState` and `RoundResult` (what a round is made of). The DiLoCo family lives in
`gradientmail.algorithms.diloco`; `algorithm_from_json` rebuilds any algorithm from the
manifest's record.
"""

from gradientmail.algorithms.base import (
    Aggregator,
    Algorithm,
    Contribution,
    FragmentState,
    RoundResult,
)
from gradientmail.algorithms.registry import algorithm_from_json
from gradientmail.algorithms.schedule import RoundSchedule
from gradientmail.wire.estimates import Estimates

__all__ = [
    "Aggregator",
    "Algorithm",
    "Contribution",
    "Estimates",
    "FragmentState",
    "RoundResult",
    "RoundSchedule",
    "algorithm_from_json",
]
