"""Learners that start together: how many a learner waits for at train start.

Standard DiLoCo's rounds wait for every learner (its quorum is their number). A learner
that starts training before the others are in closes its rounds alone, with the quorum
lowered to the one live learner, and the run never trains as one: two learners started
seconds apart by `Trainer.fit` each ran all their rounds alone. So the integrations wait
at train start, by default, for the learners a barrier needs, and say so while they
wait. Pure; the wait itself is `Learner.wait_for_learners`.
"""

from __future__ import annotations

from gradientmail.algorithms.base import Algorithm
from gradientmail.learner.options import LearnerOptions

__all__ = ["check_wait", "learners_to_await"]


def check_wait(wait_for_learners: int | None, wait_timeout: float) -> None:
    """Refuse settings no wait can honour, naming the value and the fix (the rules of
    `LearnerOptions`, which holds these settings)."""
    LearnerOptions(wait_for_learners=wait_for_learners, wait_timeout=wait_timeout)


def learners_to_await(wait_for_learners: int | None, algorithm: Algorithm) -> int:
    """The learners (this one included) to wait for at train start: the setting, or by
    default those a barrier needs — the quorum size when training waits for every commit
    (`overlap_steps=0`, standard DiLoCo), else 1: a learner that never waits has nobody
    to wait for, and Decoupled learners come and go."""
    if wait_for_learners is not None:
        return wait_for_learners
    return algorithm.quorum_size if algorithm.overlap_steps == 0 else 1
