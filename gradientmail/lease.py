"""Liveness from leases, judged by each observer's own clock.

Machines share no clock, so a lease carries no timestamp. Each learner keeps one lease key
holding a counter that it bumps every `lease_every` seconds; an observer LISTs the leases
now and then and notes, on *its own* clock, when each counter last changed. A learner is
live while its counter changed less than `timeout` seconds ago (or it was first seen less
than `timeout` ago: a new observer cannot tell a fresh lease from a stale one and gives it
the benefit of the doubt). A released lease (absent from the listing) is not live.

`LeaseTracker` is pure: it is fed counters and times, and tested with plain floats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from gradientmail.errors import ConfigError

__all__ = ["LeaseTracker"]


class LeaseTracker:
    """Remembers, per learner, the counter last observed and when (observer time) it changed."""

    def __init__(self, timeout: float) -> None:
        if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
            raise ConfigError(
                f"lease timeout={timeout!r} must be a finite number of seconds > 0; "
                "use about twice the lease period (e.g. lease_every=60, timeout=120)"
            )
        self.timeout = float(timeout)
        self._counter: dict[str, int] = {}
        self._changed: dict[str, float] = {}

    def observe(self, counters: Mapping[str, int], now: float) -> None:
        """Take one listing of every lease: learner id -> counter, seen at `now`.

        A learner seen for the first time, or whose counter differs from the last
        observation (in either direction: a restarted learner may count from anywhere), is
        stamped `now`. A learner missing from `counters` has released its lease (or it was
        swept) and is forgotten; if it comes back it counts as first seen.
        """
        for learner in list(self._counter):
            if learner not in counters:
                del self._counter[learner]
                del self._changed[learner]
        for learner, counter in counters.items():
            if self._counter.get(learner) != counter:
                self._counter[learner] = counter
                self._changed[learner] = now

    def live(self, now: float) -> frozenset[str]:
        """Learners whose counter changed (or who appeared) less than `timeout` ago."""
        return frozenset(
            learner
            for learner, changed in self._changed.items()
            if now - changed < self.timeout
        )

    def last_change(self, learner: str) -> float | None:
        """Observer time at which `learner`'s counter last changed; None if not listed."""
        return self._changed.get(learner)

    def counters(self) -> dict[str, int]:
        """The counters of the last observation (a copy)."""
        return dict(self._counter)

    def __repr__(self) -> str:
        return f"LeaseTracker(timeout={self.timeout}, learners={len(self._counter)})"
