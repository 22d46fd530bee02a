"""References to payloads and the small values a record holds about them.

`PayloadRef` (where a payload lies, its size and SHA-256), `UpdateRef` and `StepRef` (a
commit's optional update and replicated step), and `Arrival` (how a round waited for its
learners). Kept apart from `gradientmail.wire.records`, which holds the records that carry
them, so that the records module stays one concept: the records themselves.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from typing import Any

from gradientmail.errors import LocalProtocolError
from gradientmail.mailbox.base import check_key
from gradientmail.wire.record_json import (
    Fields,
    build_record,
    check_count,
    check_format,
    check_learner_id,
    check_seconds,
    check_sha256,
)

__all__ = ["Arrival", "PayloadRef", "StepRef", "UpdateRef"]


@dataclasses.dataclass(frozen=True)
class PayloadRef:
    """Where a payload lies (key relative to the run's prefix), its size and its SHA-256;
    for a payload written for ranged readers, the SHA-256 of its header too
    (`header_sha256`: the 8-byte length and the JSON, which holds the block digests of
    the data; `gradientmail.wire.sharded_blocks`). Omitted from the JSON when None, so records
    of payloads without it keep their bytes."""

    key: str
    size: int
    sha256: str
    header_sha256: str | None = None

    def __post_init__(self) -> None:
        check_key(self.key)
        check_count("payload size", self.size)
        check_sha256("payload sha256", self.sha256)
        if self.header_sha256 is not None:
            check_sha256("payload header_sha256", self.header_sha256)

    @classmethod
    def of(cls, key: str, data: bytes, *, header: bool = False) -> PayloadRef:
        """The reference to `data` stored at `key`; with `header`, pinning the header of
        the uncompressed payload `data` as well."""
        head = None
        if header:
            n = struct.unpack("<Q", bytes(data[:8]))[0] if len(data) >= 8 else len(data)
            if 8 + n > len(data):
                raise LocalProtocolError(f"{key}: {len(data)} bytes do not start with a "
                                         "safetensors header; cannot pin it")
            head = hashlib.sha256(memoryview(data)[: 8 + n]).hexdigest()
        return cls(key, len(data), hashlib.sha256(data).hexdigest(), head)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "sha256": self.sha256, "size": self.size}
        if self.header_sha256 is not None:
            out["header_sha256"] = self.header_sha256
        return out

    @classmethod
    def from_json(cls, obj: Any, key: str, path: str = "payload") -> PayloadRef:
        optional = ("header_sha256",) if isinstance(obj, dict) and "header_sha256" in obj \
            else ()
        f = Fields(obj, key, path, ("key", "sha256", "size", *optional))
        return build_record(cls, key, path, key=f.get_str("key"), size=f.get_int("size"),
                            sha256=f.get_str("sha256"),
                            header_sha256=f.get_str("header_sha256") if optional else None)


@dataclasses.dataclass(frozen=True)
class Arrival:
    """How a round waited for its learners, as its closer saw it: the `window` (seconds
    after the first contribution it would wait for the learners it expected), `latency`
    (seconds from the first contribution it saw to the record), `first` (whose
    contribution that was; None when the closer saw none before it claimed) and `missed`
    (expected learners not in when it closed). Every other learner aligns its next
    publish with the first one's by the latency."""

    window: float
    latency: float
    first: str | None = None
    missed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "window", check_seconds("window", self.window))
        object.__setattr__(self, "latency", check_seconds("latency", self.latency))
        object.__setattr__(self, "missed", tuple(sorted(self.missed)))
        for learner in (*self.missed, *([] if self.first is None else [self.first])):
            check_learner_id(learner)

    def to_json(self) -> dict[str, Any]:
        return {"first": self.first, "latency": self.latency, "missed": list(self.missed),
                "window": self.window}

    @classmethod
    def from_json(cls, obj: Any, key: str, path: str) -> Arrival:
        f = Fields(obj, key, path, ("first", "latency", "missed", "window"))
        missed = f.get_list("missed")
        if not all(isinstance(m, str) for m in missed):
            f.fail("missed", "must be a list of learner ids", missed)
        return build_record(cls, key, path, window=f.get_float("window"),
                      latency=f.get_float("latency"), first=f.get_str("first", null=True),
                      missed=tuple(missed))


@dataclasses.dataclass(frozen=True)
class UpdateRef:
    """A quantized Θ_new − Θ_old: its payload, its format, and the SHA-256 of the theta
    it rebuilds (as the algorithm defines that digest), so a learner can check its work."""

    payload: PayloadRef
    format: str
    theta_sha256: str

    def __post_init__(self) -> None:
        check_format("update format", self.format)
        check_sha256("theta_sha256", self.theta_sha256)

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "payload": self.payload.to_json(),
                "theta_sha256": self.theta_sha256}

    @classmethod
    def from_json(cls, obj: Any, key: str, path: str) -> UpdateRef:
        f = Fields(obj, key, path, ("format", "payload", "theta_sha256"))
        return build_record(cls, key, path, format=f.get_str("format"),
                      theta_sha256=f.get_str("theta_sha256"),
                      payload=PayloadRef.from_json(f.obj["payload"], key, f"{path}.payload"))


@dataclasses.dataclass(frozen=True)
class StepRef:
    """A replicated commit's merged Δ: its payload, its format, the rule every party
    applies it by ("nesterov" or "average"), and the SHA-256 of the theta that applying
    it to the previous version gives (as the algorithm defines that digest)."""

    payload: PayloadRef
    format: str
    rule: str
    theta_sha256: str

    def __post_init__(self) -> None:
        check_format("step format", self.format)
        if self.rule not in ("nesterov", "average"):
            raise LocalProtocolError(f"step rule={self.rule!r} must be 'nesterov' or 'average'")
        check_sha256("theta_sha256", self.theta_sha256)

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "payload": self.payload.to_json(), "rule": self.rule,
                "theta_sha256": self.theta_sha256}

    @classmethod
    def from_json(cls, obj: Any, key: str, path: str) -> StepRef:
        f = Fields(obj, key, path, ("format", "payload", "rule", "theta_sha256"))
        return build_record(cls, key, path, format=f.get_str("format"), rule=f.get_str("rule"),
                      theta_sha256=f.get_str("theta_sha256"),
                      payload=PayloadRef.from_json(f.obj["payload"], key, f"{path}.payload"))
