"""Which fragment each round trains, and the timing estimates every party shares."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gradientmail.errors import ConfigError, RemoteProtocolError

__all__ = ["Estimates", "RoundSchedule"]


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


@dataclasses.dataclass(frozen=True)
class Estimates:
    """ξ_step (seconds per learner step), ξ_quorum (first contribution to quorum) and
    ξ_sync (quorum to record), in seconds; None until measured. Each commit record carries
    the latest, so every party predicts the same timeouts."""

    step: float | None = None
    quorum: float | None = None
    sync: float | None = None

    def __post_init__(self) -> None:
        for name in ("step", "quorum", "sync"):
            v = getattr(self, name)
            if v is not None and (not math.isfinite(v) or v < 0):
                raise ConfigError(f"estimate {name}={v!r} must be a finite number >= 0 or None")

    def takeover_timeout(self, poll_interval: float, floor_polls: int = 10) -> float:
        """Seconds after a closer's claim before another may supersede it.

        Three times the predicted close time, never under `floor_polls` polls: a closer on
        a slow link must not be superseded while it is still uploading.
        """
        predicted = 3.0 * (self.sync or 0.0)
        return max(floor_polls * poll_interval, predicted)

    def to_json(self) -> dict[str, float | None]:
        return {"step": self.step, "quorum": self.quorum, "sync": self.sync}

    @classmethod
    def from_json(cls, obj: Any) -> Estimates:
        if not isinstance(obj, dict) or set(obj) != {"step", "quorum", "sync"}:
            raise RemoteProtocolError(
                f"estimates {obj!r} must be an object with exactly step, quorum and sync"
            )
        vals: dict[str, float | None] = {}
        for k in ("step", "quorum", "sync"):
            v = obj[k]
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise RemoteProtocolError(f"estimate {k}={v!r} is not a number or null")
            vals[k] = None if v is None else float(v)
        try:
            return cls(**vals)
        except ConfigError as exc:
            raise RemoteProtocolError(str(exc)) from exc
