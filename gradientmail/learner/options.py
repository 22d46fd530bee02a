"""`LearnerOptions`: how one learner takes part in a run, as one frozen value.

Every entry point — `Learner(..., options=...)`, the Lightning callback and
`gradientmail-train`'s `diloco:` section, the Accelerate plugin's YAML and
`GRADIENTMAIL_*` variables — reads a learner's settings through this dataclass, so they
have one name and one default each. The runtime passes it whole from Learner to Mailman,
which builds its embedded closer from the fields closing needs. What is not a setting but
an object of the process (the clock, the backend, the event sink, the run key) stays a
separate argument.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from gradientmail.errors import ConfigError
from gradientmail.traffic import S3_STANDARD, Prices

__all__ = ["COMPRESSIONS", "WAIT_TIMEOUT", "LearnerOptions"]

#: Seconds a learner waits at train start for the others by default: learners started by
#: hand on several machines, or queued by a cluster scheduler, start minutes apart.
WAIT_TIMEOUT = 600.0
#: The codecs of `compression`.
COMPRESSIONS = ("off", "zstd")


def _setting(default: Any, doc: str) -> Any:
    """A field's default and its one line of meaning (the configuration reference)."""
    return dataclasses.field(default=default, metadata={"doc": doc})


def _seconds(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
        raise ConfigError(f"{name}={v!r} must be a finite number of seconds > 0")
    return float(v)


@dataclasses.dataclass(frozen=True)
class LearnerOptions:
    """A learner's settings, validated when built; `LearnerOptions()` holds the defaults
    every entry point shares. `from_mapping` reads them from a recipe's or a YAML file's
    flat keys."""

    sync: bool = _setting(
        True, "run a closer in the learner, so a run needs nothing but the bucket")
    hold_own: bool = _setting(
        True, "merge the contribution that completes a round from memory, without uploading "
        "it (false: upload every contribution)")
    poll_interval: float = _setting(1.0, "seconds between two looks for a new commit")
    lease_every: float = _setting(60.0, "seconds between two beats of the learner's lease")
    lease_timeout: float = _setting(
        120.0, "seconds after its last beat a learner counts as gone (> lease_every)")
    compression: str = _setting("off", "the payloads' codec: off or zstd")
    prefix: str = _setting("", "the key prefix of the run inside the mailbox")
    keep_versions: int = _setting(2, "theta versions of each fragment kept in the store")
    prices: Prices = _setting(  # noqa: RUF009 (frozen: one shared default is safe)
        S3_STANDARD, "what the learner's traffic is priced at (put_per_1000, get_per_1000, "
        "egress_per_gb in USD; default S3 Standard)")
    wait_for_learners: int | None = _setting(
        None, "learners (this one included) to wait for at train start; None: those a "
        "barrier needs (quorum_size when overlap_steps=0), 0: start at once")
    wait_timeout: float = _setting(
        WAIT_TIMEOUT, "seconds to wait for them before failing, naming who is live")

    def __post_init__(self) -> None:
        for name in ("sync", "hold_own"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false")
        for name in ("poll_interval", "lease_every", "lease_timeout", "wait_timeout"):
            object.__setattr__(self, name, _seconds(name, getattr(self, name)))
        if self.lease_timeout <= self.lease_every:
            raise ConfigError(
                f"lease_timeout={self.lease_timeout} must exceed lease_every="
                f"{self.lease_every}, or every learner looks dead between two beats; use "
                "about twice lease_every"
            )
        if self.compression not in COMPRESSIONS:
            hint = (
                ' (YAML reads a bare off as false: write compression: "off")'
                if self.compression is False  # type: ignore[comparison-overlap]
                else ""
            )
            raise ConfigError(
                f"compression={self.compression!r} is not a codec; use 'off' or 'zstd'{hint}"
            )
        if not isinstance(self.prefix, str):
            raise ConfigError(f"prefix={self.prefix!r} must be a string")
        k = self.keep_versions
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"keep_versions={k!r} must be an int >= 1 (2 lets readers of "
                              "the previous version finish)")
        if not isinstance(self.prices, Prices):
            raise ConfigError(
                f"prices={self.prices!r} must be a gradientmail.traffic.Prices, e.g. "
                "Prices(egress_per_gb=0.0) for learners in the bucket's region"
            )
        n = self.wait_for_learners
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ConfigError(
                f"wait_for_learners={n!r} must be an int >= 0 (0 starts at once) or None "
                "(those a barrier needs: quorum_size when overlap_steps=0, as in standard "
                "DiLoCo)"
            )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings' names, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "config",
                     prefix: str = "") -> LearnerOptions:
        """The options a flat mapping of setting names describes (a missing name takes
        its default; `prices` may be a mapping of `Prices` fields). Errors name `source`,
        the key (after `prefix`) and the fix."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: learner options must be a mapping, "
                              f"got {type(data).__name__} {data!r:.60}")
        valid = cls.names()
        unknown = [str(k) for k in data if k not in valid]
        if unknown:
            raise ConfigError(
                f"{source}: unknown learner option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(prefix + k for k in unknown)}; valid: {', '.join(valid)}"
            )
        kw = dict(data)
        prices = kw.get("prices")
        try:
            if isinstance(prices, Mapping):
                kw["prices"] = _prices(prices)
            elif prices is None and "prices" in kw:
                kw["prices"] = S3_STANDARD
            return cls(**kw)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {prefix}{exc}") from None

    def to_mapping(self) -> dict[str, Any]:
        """The flat mapping `from_mapping` reads back as these options."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["prices"] = dataclasses.asdict(self.prices)
        return out


def _prices(data: Mapping[str, Any]) -> Prices:
    valid = [f.name for f in dataclasses.fields(Prices)]
    unknown = [str(k) for k in data if k not in valid]
    if unknown:
        raise ConfigError(f"prices has unknown keys {', '.join(unknown)}; valid: "
                          f"{', '.join(valid)}")
    return Prices(**data)
