"""Which fragment each round trains (`RoundSchedule`), and the timing estimates every
party shares (`Estimates`, defined with the records that carry them)."""

from __future__ import annotations

import dataclasses

from gradientmail.errors import ConfigError

__all__ = ["RoundSchedule"]


@dataclasses.dataclass(frozen=True)
class RoundSchedule:
    """Round r trains fragment r mod P; a learner publishes every H/P steps on average.

    gap(r) = floor((r+1)H/P) - floor(rH/P), so the gaps of any P consecutive rounds add up
    to H and every fragment is synced once every H steps.
    """

    sync_every: int
    fragments: int
    in_flight: int = 1
    overlap_steps: int | None = 0

    def __post_init__(self) -> None:
        h, p, tau = self.sync_every, self.fragments, self.in_flight
        if not (1 <= tau <= p <= h):
            raise ConfigError(
                f"in_flight={tau}, fragments={p}, sync_every={h}; "
                "need 1 <= in_flight <= fragments <= sync_every"
            )
        if self.overlap_steps is not None and self.overlap_steps < 0:
            raise ConfigError(
                f"overlap_steps={self.overlap_steps} is negative; use 0 for a barrier, "
                "a positive number of steps, or None to never wait"
            )

    def fragment_of(self, round_: int) -> int:
        return round_ % self.fragments

    def gap(self, round_: int) -> int:
        h, p = self.sync_every, self.fragments
        return ((round_ + 1) * h) // p - (round_ * h) // p

    def ahead(self, round_: int) -> int:
        """Steps a learner trains past its publish of `round_` before it must have the commit."""
        a = self.in_flight * self.gap(round_)
        if self.overlap_steps is not None:
            a = min(a, self.overlap_steps)
        return a
