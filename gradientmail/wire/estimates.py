"""The timing estimates every party shares: each commit record carries the latest."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gradientmail.errors import ConfigError, RemoteProtocolError

__all__ = ["Estimates"]


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
