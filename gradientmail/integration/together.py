"""Learners that start together: how many a learner waits for at train start.

Standard DiLoCo's rounds wait for every learner (its quorum is their number). A learner
that starts training before the others are in closes its rounds alone, with the quorum
lowered to the one live learner, and the run never trains as one: two learners started
seconds apart by `Trainer.fit` each ran all their rounds alone. So the integrations wait
at train start, by default, for the learners a barrier needs, and say so while they
wait. Pure; the wait itself is `Learner.wait_for_learners`.
"""

from __future__ import annotations

import math

from gradientmail.algorithms.base import Algorithm
from gradientmail.errors import ConfigError

__all__ = ["check_wait", "learners_to_await"]


def check_wait(wait_for_learners: int | None, wait_timeout: float) -> None:
    """Refuse settings no wait can honour, naming the value and the fix."""
    n = wait_for_learners
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ConfigError(
            f"wait_for_learners={n!r} must be an int >= 0 (0 starts at once) or None (those "
            "a barrier needs: quorum_size when overlap_steps=0, as in standard DiLoCo)"
        )
    t = wait_timeout
    if isinstance(t, bool) or not isinstance(t, int | float) or not (math.isfinite(t) and t > 0):
        raise ConfigError(f"wait_timeout={t!r} must be a finite number of seconds > 0")


def learners_to_await(wait_for_learners: int | None, algorithm: Algorithm) -> int:
    """The learners (this one included) to wait for at train start: the setting, or by
    default those a barrier needs — the quorum size when training waits for every commit
    (`overlap_steps=0`, standard DiLoCo), else 1: a learner that never waits has nobody
    to wait for, and Decoupled learners come and go."""
    if wait_for_learners is not None:
        return wait_for_learners
    return algorithm.quorum_size if algorithm.overlap_steps == 0 else 1
