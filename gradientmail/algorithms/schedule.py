"""Which fragment each round trains (`RoundSchedule`), and the timing estimates every
party shares (`Estimates`, defined with the records that carry them)."""

from __future__ import annotations

import dataclasses

from gradientmail.errors import ConfigError

__all__ = ["RoundSchedule"]


@dataclasses.dataclass(frozen=True)
class RoundSchedule:
    """Round r trains fragment r mod P, and every fragment is synced once every H steps.

    Staggered (Streaming DiLoCo, the default): a learner publishes every H/P steps on
    average, gap(r) = floor((r+1)H/P) - floor(rH/P), so the gaps of any P consecutive
    rounds add up to H. Not staggered (`stagger=False`, a pipelined barrier): the P rounds
    of a sync go out at the same step, one after another, gap H for the first of them and
    0 for the rest, so one fragment's upload overlaps the merge and download of the one
    before; a learner has all P in flight (τ = P) and waits for them behind the barrier.
    """

    sync_every: int
    fragments: int
    in_flight: int = 1
    overlap_steps: int | None = 0
    stagger: bool = True

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
        if not self.stagger and (tau != p or self.overlap_steps != 0):
            raise ConfigError(
                f"stagger=False with in_flight={tau}, overlap_steps={self.overlap_steps}: "
                f"the {p} rounds of a sync go out at once behind a barrier; need "
                f"in_flight={p} and overlap_steps=0"
            )

    def fragment_of(self, round_: int) -> int:
        return round_ % self.fragments

    def gap(self, round_: int) -> int:
        h, p = self.sync_every, self.fragments
        if not self.stagger:
            return h if round_ % p == 0 else 0
        return ((round_ + 1) * h) // p - (round_ * h) // p

    def ahead(self, round_: int) -> int:
        """Steps a learner trains past its publish of `round_` before it must have the commit."""
        a = self.in_flight * self.gap(round_)
        if self.overlap_steps is not None:
            a = min(a, self.overlap_steps)
        return a

    def spacing(self, round_: int) -> int:
        """The gap a round's grace window counts: gap(r), or H for a pipelined round that
        goes out at the same step as the one before it (its learners' contributions
        arrive as spread out as those of the sync's first round)."""
        return self.gap(round_) or self.sync_every
