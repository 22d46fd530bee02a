"""The run's records: frozen dataclasses with a strict, canonical JSON form.

Every record object in the mailbox (manifest, claims, contributions, round records) is a
JSON object carrying the format version `"v": 1`. Writing is canonical (sorted keys,
compact separators, UTF-8, no NaN), so equal records are equal bytes and golden records
are byte-stable. Reading is strict: the exact field set, exact JSON types, finite numbers,
a size bound, and the value rules of each record. Anything else is a peer's or the
store's bad data and raises `RemoteProtocolError` naming the key and the field; building a
record with bad values in this process raises `LocalProtocolError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NoReturn, Self, TypeVar

from gradientmail.algorithms.schedule import Estimates
from gradientmail.errors import (
    GradientmailError,
    LocalProtocolError,
    RemoteProtocolError,
)
from gradientmail.mailbox.base import check_key
from gradientmail.serialization import Schema

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "MAX_RECORD_BYTES",
    "CreationClaim",
    "Dropped",
    "Manifest",
    "Participant",
    "PayloadRef",
    "Record",
    "RoundClaim",
    "RoundRecord",
    "SnapshotRecord",
    "UpdateRef",
    "canonical_json",
    "check_learner_id",
    "parse_json",
]

#: The record format this code writes and the only one it reads.
FORMAT_VERSION = 1
#: Bound on a record's bytes; a manifest (which holds the schema) may be larger.
MAX_RECORD_BYTES = 1 << 20
MAX_MANIFEST_BYTES = 16 << 20
#: Payload codecs a manifest may name (see gradientmail.compression).
CODECS = ("off", "zstd")

_LEARNER_RULE = "[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_LEARNER_ID = re.compile(_LEARNER_RULE)
_SHA256 = re.compile("[0-9a-f]{64}")
_FORMAT = re.compile("[A-Za-z0-9_]{1,32}")
_MAX_INT = (1 << 63) - 1
_MAX_TEXT = 1000
_T = TypeVar("_T")
_HINT = "the writer does not speak gradientmail record format v1, or the object was damaged"


def check_learner_id(learner: object) -> str:
    """Return `learner` if it is a valid learner id; raise `LocalProtocolError` otherwise.

    Ids appear in keys (`snapshots/<round>/<learner>.json`), so they are short and plain.
    """
    if not isinstance(learner, str) or not _LEARNER_ID.fullmatch(learner):
        raise LocalProtocolError(
            f"learner id {learner!r} is invalid; an id must match {_LEARNER_RULE} "
            "(a letter or digit, then up to 63 letters, digits, '.', '_' or '-'), "
            "e.g. 'node-3.gpu0'"
        )
    return learner


def canonical_json(obj: Any) -> bytes:
    """The canonical bytes of a JSON value: sorted keys, compact, UTF-8, finite numbers."""
    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise LocalProtocolError(f"cannot encode {obj!r:.200} as canonical JSON: {exc}") from exc
    return text.encode("utf-8")


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"non-finite number {name} is not JSON")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text} overflows a float")
    return x


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate field {k!r}")
        out[k] = v
    return out


def parse_json(data: bytes, key: str, max_bytes: int = MAX_RECORD_BYTES) -> dict[str, Any]:
    """Parse a record's bytes into a JSON object, or raise `RemoteProtocolError` naming `key`.

    Rejects oversized data, invalid UTF-8, invalid JSON, NaN/Infinity, numbers that overflow,
    duplicate fields, absurd nesting, and any top-level value that is not an object.
    """
    if len(data) > max_bytes:
        raise RemoteProtocolError(
            f"record {key!r} is {len(data)} bytes; records are at most {max_bytes} bytes ({_HINT})"
        )
    try:
        obj = json.loads(
            data.decode("utf-8"),
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            object_pairs_hook=_no_duplicates,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RemoteProtocolError(f"record {key!r} is not valid JSON: {exc} ({_HINT})") from exc
    if not isinstance(obj, dict):
        raise RemoteProtocolError(
            f"record {key!r} is a JSON {type(obj).__name__}, not an object ({_HINT})"
        )
    return obj


_JSON_TYPE = {type(None): "null", bool: "boolean", int: "number", float: "number",
              str: "string", list: "array", dict: "object"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class _Fields:
    """Strict reader of one JSON object at `path` inside the record at `key`."""

    def __init__(self, obj: Any, key: str, path: str, names: tuple[str, ...]) -> None:
        self.key, self.path = key, path
        if not isinstance(obj, dict):
            self.fail("", "must be an object", obj)
        if "v" in names and "v" in obj:  # another format version fails on that first
            self.version(obj["v"])
        missing = sorted(set(names) - obj.keys())
        extra = sorted(obj.keys() - set(names))
        if missing or extra:
            where = f"field {path!r}" if path else "the record"
            raise RemoteProtocolError(
                f"record {key!r}: {where} must have exactly the fields {sorted(names)}; "
                f"missing {missing}, unexpected {extra} ({_HINT})"
            )
        self.obj: dict[str, Any] = obj

    def at(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def fail(self, name: str, rule: str, value: Any) -> NoReturn:
        where = self.at(name) if name else self.path
        raise RemoteProtocolError(
            f"record {self.key!r}: field {where!r} {rule}, got {value!r:.100} "
            f"({_JSON_TYPE.get(type(value), 'value')}) ({_HINT})"
        )

    def get(self, name: str, ok: Callable[[Any], bool], rule: str, null: bool = False) -> Any:
        v = self.obj[name]
        if not (ok(v) or (null and v is None)):
            self.fail(name, rule + (" or null" if null else ""), v)
        return v

    def get_int(self, name: str) -> int:
        return int(self.get(name, _is_int, "must be an integer"))

    def get_opt_float(self, name: str) -> float | None:
        v = self.get(name, _is_number, "must be a number", null=True)
        return None if v is None else float(v)

    def get_str(self, name: str, null: bool = False) -> Any:
        return self.get(name, lambda v: isinstance(v, str), "must be a string", null)

    def get_bool(self, name: str) -> bool:
        return bool(self.get(name, lambda v: isinstance(v, bool), "must be true or false"))

    def get_list(self, name: str) -> list[Any]:
        return list(self.get(name, lambda v: isinstance(v, list), "must be an array"))

    def version(self, v: Any) -> None:
        if v != FORMAT_VERSION or isinstance(v, bool):
            raise RemoteProtocolError(
                f"record {self.key!r}: field 'v' is {v!r}, but this gradientmail reads record "
                f"format version {FORMAT_VERSION} only; upgrade gradientmail on every machine "
                "of the run, or start the run under a fresh prefix"
            )


def _build(cls: type[_T], key: str, path: str, /, **kwargs: Any) -> _T:
    """Construct a record from parsed fields, turning value-rule failures into remote errors."""
    try:
        return cls(**kwargs)
    except (GradientmailError, ValueError) as exc:
        where = f" field {path!r}:" if path else ""
        raise RemoteProtocolError(f"record {key!r}:{where} {exc} ({_HINT})") from exc


def _check_count(what: str, value: int, low: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _MAX_INT:
        raise LocalProtocolError(f"{what}={value!r} must be an integer in [{low}, 2**63 - 1]")


def _check_sha256(what: str, value: str) -> None:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise LocalProtocolError(f"{what}={value!r} must be 64 lowercase hex digits (SHA-256)")


def _check_format(what: str, value: str) -> None:
    if not isinstance(value, str) or not _FORMAT.fullmatch(value):
        raise LocalProtocolError(f"{what}={value!r} must match [A-Za-z0-9_]{{1,32}}, e.g. 'BF16'")


def _check_text(what: str, value: str) -> None:
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise LocalProtocolError(f"{what}={value!r:.100} must be a string of at most {_MAX_TEXT}")


class Record:
    """A top-level record: `encode()` to canonical bytes, `decode(data, key)` strictly."""

    MAX_BYTES: ClassVar[int] = MAX_RECORD_BYTES

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_json(cls, obj: Any, key: str) -> Self:
        raise NotImplementedError

    def encode(self) -> bytes:
        data = canonical_json(self.to_json())
        if len(data) > self.MAX_BYTES:
            raise LocalProtocolError(
                f"{type(self).__name__} encodes to {len(data)} bytes; at most {self.MAX_BYTES}"
            )
        return data

    @classmethod
    def decode(cls, data: bytes, key: str) -> Self:
        return cls.from_json(parse_json(data, key, cls.MAX_BYTES), key)


@dataclasses.dataclass(frozen=True)
class PayloadRef:
    """Where a payload lies (key relative to the run's prefix), its size and its SHA-256."""

    key: str
    size: int
    sha256: str

    def __post_init__(self) -> None:
        check_key(self.key)
        _check_count("payload size", self.size)
        _check_sha256("payload sha256", self.sha256)

    @classmethod
    def of(cls, key: str, data: bytes) -> PayloadRef:
        """The reference to `data` stored at `key`."""
        return cls(key, len(data), hashlib.sha256(data).hexdigest())

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "sha256": self.sha256, "size": self.size}

    @classmethod
    def from_json(cls, obj: Any, key: str, path: str = "payload") -> PayloadRef:
        f = _Fields(obj, key, path, ("key", "sha256", "size"))
        return _build(cls, key, path, key=f.get_str("key"), size=f.get_int("size"),
                      sha256=f.get_str("sha256"))


@dataclasses.dataclass(frozen=True)
class CreationClaim(Record):
    """`claims/create/<attempt>`: `learner` bids to create the run (attempt 0 first)."""

    attempt: int
    learner: str

    def __post_init__(self) -> None:
        _check_count("attempt", self.attempt)
        check_learner_id(self.learner)

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "learner": self.learner, "v": FORMAT_VERSION}

    @classmethod
    def from_json(cls, obj: Any, key: str) -> Self:
        f = _Fields(obj, key, "", ("attempt", "learner", "v"))
        return _build(cls, key, "", attempt=f.get_int("attempt"), learner=f.get_str("learner"))


@dataclasses.dataclass(frozen=True)
class RoundClaim(Record):
    """`claims/round/<round>/<attempt>`: `closer` bids to close `round`."""

    round: int
    attempt: int
    closer: str

    def __post_init__(self) -> None:
        _check_count("round", self.round)
        _check_count("attempt", self.attempt)
        check_learner_id(self.closer)

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "closer": self.closer, "round": self.round,
                "v": FORMAT_VERSION}

    @classmethod
    def from_json(cls, obj: Any, key: str) -> Self:
        f = _Fields(obj, key, "", ("attempt", "closer", "round", "v"))
        return _build(cls, key, "", round=f.get_int("round"), attempt=f.get_int("attempt"),
                      closer=f.get_str("closer"))


@dataclasses.dataclass(frozen=True)
class Manifest(Record):
    """`manifest.json`: what the run is. Written once (create-if-absent) by its creator.

    `plan[p]` names the tensors of fragment p and `init[p]` references its Θ⁰; `algorithm`
    is the algorithm's own JSON, carried opaquely (a joiner compares it with its own);
    `codec` is the creator's payload codec (informational: every key's extension names
    its codec); `key_fingerprint` identifies the key of an authenticated run (None: none).
    """

    MAX_BYTES: ClassVar[int] = MAX_MANIFEST_BYTES

    schema: Schema
    plan: tuple[tuple[str, ...], ...]
    algorithm: Mapping[str, Any]
    creator: str
    init: tuple[PayloadRef, ...]
    codec: str
    key_fingerprint: str | None = None

    def __post_init__(self) -> None:
        check_learner_id(self.creator)
        if not isinstance(self.algorithm, Mapping):
            raise LocalProtocolError(f"algorithm={self.algorithm!r:.100} must be a JSON object")
        # A private canonical copy, so the frozen record cannot change under us.
        object.__setattr__(self, "algorithm", json.loads(canonical_json(dict(self.algorithm))))
        plan = tuple(tuple(fragment) for fragment in self.plan)
        object.__setattr__(self, "plan", plan)
        object.__setattr__(self, "init", tuple(self.init))
        names = [name for fragment in plan for name in fragment]
        if not plan or not all(plan) or sorted(names) != sorted(self.schema.names):
            raise LocalProtocolError(
                f"plan {[list(f) for f in plan]!r:.200} must split the schema's "
                f"{len(self.schema)} tensors into non-empty fragments, each tensor once"
            )
        if len(self.init) != len(plan):
            raise LocalProtocolError(
                f"init has {len(self.init)} payload refs for {len(plan)} fragments; "
                "need one per fragment"
            )
        if self.codec not in CODECS:
            raise LocalProtocolError(f"codec={self.codec!r} must be one of {CODECS}")
        if self.key_fingerprint is not None:
            _check_sha256("key_fingerprint", self.key_fingerprint)

    def to_json(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "codec": self.codec,
            "creator": self.creator,
            "init": [ref.to_json() for ref in self.init],
            "key_fingerprint": self.key_fingerprint,
            "plan": [list(fragment) for fragment in self.plan],
            "schema": self.schema.to_dict(),
            "v": FORMAT_VERSION,
        }

    @classmethod
    def from_json(cls, obj: Any, key: str) -> Self:
        f = _Fields(obj, key, "", ("algorithm", "codec", "creator", "init", "key_fingerprint",
                                   "plan", "schema", "v"))
        plan = []
        for p, fragment in enumerate(f.get_list("plan")):
            if not isinstance(fragment, list):
                f.fail(f"plan[{p}]", "must be an array of tensor names", fragment)
            for i, name in enumerate(fragment):
                if not isinstance(name, str):
                    f.fail(f"plan[{p}][{i}]", "must be a tensor name (a string)", name)
            plan.append(tuple(fragment))
        if not isinstance(f.obj["algorithm"], dict):
            f.fail("algorithm", "must be an object", f.obj["algorithm"])
        try:
            schema = Schema.from_dict(f.obj["schema"])
        except RemoteProtocolError as exc:
            raise RemoteProtocolError(f"record {key!r}: field 'schema': {exc} ({_HINT})") from exc
        init = tuple(PayloadRef.from_json(r, key, f"init[{p}]")
                     for p, r in enumerate(f.get_list("init")))
        return _build(
            cls, key, "", schema=schema, plan=tuple(plan), algorithm=f.obj["algorithm"],
            creator=f.get_str("creator"), init=init, codec=f.get_str("codec"),
            key_fingerprint=f.get_str("key_fingerprint", null=True),
        )


@dataclasses.dataclass(frozen=True)
class SnapshotRecord(Record):
    """`snapshots/<round>/<learner>.json`: one learner's contribution to one round.

    `base_version` is the fragment version the delta was taken against, `local_step` the
    learner's step counter when it snapshotted, `steps`/`tokens` what the delta holds,
    `final` marks a flush on close, `delta_format` the dtype of the delta's tensors (e.g.
    "F32", "BF16", "F8_E4M3", "F4"; quantized ones add `<name>.scale` entries) and
    `payload` the delta itself.
    """

    learner: str
    round: int
    fragment: int
    base_version: int
    local_step: int
    steps: int
    tokens: int
    final: bool
    schema_digest: str
    delta_format: str
    payload: PayloadRef
    step_seconds: float | None = None

    def __post_init__(self) -> None:
        check_learner_id(self.learner)
        for name in ("round", "fragment", "base_version", "local_step", "steps", "tokens"):
            _check_count(name, getattr(self, name))
        if not isinstance(self.final, bool):
            raise LocalProtocolError(f"final={self.final!r} must be a bool")
        _check_sha256("schema_digest", self.schema_digest)
        _check_format("delta_format", self.delta_format)
        s = self.step_seconds
        if s is not None:
            if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) \
                    or s < 0:
                raise LocalProtocolError(f"step_seconds={s!r} must be a finite number >= 0")
            object.__setattr__(self, "step_seconds", float(s))

    def to_json(self) -> dict[str, Any]:
        return {
            "base_version": self.base_version,
            "delta_format": self.delta_format,
            "final": self.final,
            "fragment": self.fragment,
            "learner": self.learner,
            "local_step": self.local_step,
            "payload": self.payload.to_json(),
            "round": self.round,
            "schema_digest": self.schema_digest,
            "step_seconds": self.step_seconds,
            "steps": self.steps,
            "tokens": self.tokens,
            "v": FORMAT_VERSION,
        }

    @classmethod
    def from_json(cls, obj: Any, key: str) -> Self:
        f = _Fields(obj, key, "", ("base_version", "delta_format", "final", "fragment",
                                   "learner", "local_step", "payload", "round",
                                   "schema_digest", "step_seconds", "steps", "tokens", "v"))
        return _build(
            cls, key, "", learner=f.get_str("learner"), round=f.get_int("round"),
            fragment=f.get_int("fragment"), base_version=f.get_int("base_version"),
            local_step=f.get_int("local_step"), steps=f.get_int("steps"),
            tokens=f.get_int("tokens"),
            final=f.get_bool("final"), schema_digest=f.get_str("schema_digest"),
            delta_format=f.get_str("delta_format"),
            payload=PayloadRef.from_json(f.obj["payload"], key, "payload"),
            step_seconds=f.get_opt_float("step_seconds"),
        )


@dataclasses.dataclass(frozen=True)
class Participant:
    """A contribution merged into a round: who, at which step, how much, with what weight."""

    learner: str
    local_step: int
    steps: int
    tokens: int
    weight: float

    def __post_init__(self) -> None:
        check_learner_id(self.learner)
        for name in ("local_step", "steps", "tokens"):
            _check_count(name, getattr(self, name))
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) \
                or w < 0:
            raise LocalProtocolError(f"weight={w!r} must be a finite number >= 0")
        object.__setattr__(self, "weight", float(w))

    def to_json(self) -> dict[str, Any]:
        return {"learner": self.learner, "local_step": self.local_step, "steps": self.steps,
                "tokens": self.tokens, "weight": self.weight}

    @classmethod
    def from_json(cls, obj: Any, key: str, path: str) -> Participant:
        f = _Fields(obj, key, path, ("learner", "local_step", "steps", "tokens", "weight"))
        return _build(cls, key, path, learner=f.get_str("learner"),
                      local_step=f.get_int("local_step"), steps=f.get_int("steps"),
                      tokens=f.get_int("tokens"), weight=float(f.get(
                          "weight", _is_number, "must be a number")))


@dataclasses.dataclass(frozen=True)
class Dropped:
    """A contribution the closer left out, and why (e.g. 'stale base version 3')."""

    learner: str
    reason: str

    def __post_init__(self) -> None:
        check_learner_id(self.learner)
        _check_text("reason", self.reason)

    def to_json(self) -> dict[str, Any]:
        return {"learner": self.learner, "reason": self.reason}

    @classmethod
    def from_json(cls, obj: Any, key: str, path: str) -> Dropped:
        f = _Fields(obj, key, path, ("learner", "reason"))
        return _build(cls, key, path, learner=f.get_str("learner"),
                      reason=f.get_str("reason"))


@dataclasses.dataclass(frozen=True)
class UpdateRef:
    """A quantized Θ_new − Θ_old: its payload, its format, and the SHA-256 of the theta
    it rebuilds (as the algorithm defines that digest), so a learner can check its work."""

    payload: PayloadRef
    format: str
    theta_sha256: str

    def __post_init__(self) -> None:
        _check_format("update format", self.format)
        _check_sha256("theta_sha256", self.theta_sha256)

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "payload": self.payload.to_json(),
                "theta_sha256": self.theta_sha256}

    @classmethod
    def from_json(cls, obj: Any, key: str, path: str) -> UpdateRef:
        f = _Fields(obj, key, path, ("format", "payload", "theta_sha256"))
        return _build(cls, key, path, format=f.get_str("format"),
                      theta_sha256=f.get_str("theta_sha256"),
                      payload=PayloadRef.from_json(f.obj["payload"], key, f"{path}.payload"))


@dataclasses.dataclass(frozen=True)
class RoundRecord(Record):
    """`rounds/<round>.json`, the commit: the single source of truth about a round.

    Fragment `fragment` moved to `version` (init is version 0); `theta` holds its new
    parameters, `outer` the outer state any later closer continues from, `update` the
    optional quantized difference. `all_final` marks a round made only of final flushes.
    """

    round: int
    fragment: int
    version: int
    theta: PayloadRef
    outer: PayloadRef
    update: UpdateRef | None
    participants: tuple[Participant, ...]
    estimates: Estimates
    mean_cosine: float | None
    dropped: tuple[Dropped, ...]
    closer: str
    all_final: bool

    def __post_init__(self) -> None:
        _check_count("round", self.round)
        _check_count("fragment", self.fragment)
        _check_count("version", self.version, low=1)
        object.__setattr__(self, "participants", tuple(self.participants))
        object.__setattr__(self, "dropped", tuple(self.dropped))
        learners = [p.learner for p in self.participants]
        if len(set(learners)) != len(learners):
            raise LocalProtocolError(f"participants {learners} name a learner twice")
        c = self.mean_cosine
        if c is not None:
            if isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c):
                raise LocalProtocolError(f"mean_cosine={c!r} must be a finite number or None")
            object.__setattr__(self, "mean_cosine", float(c))
        check_learner_id(self.closer)
        if not isinstance(self.all_final, bool):
            raise LocalProtocolError(f"all_final={self.all_final!r} must be a bool")

    def payload_refs(self) -> tuple[PayloadRef, ...]:
        """Every payload this record references (what sweeping must keep)."""
        refs = [self.theta, self.outer]
        if self.update is not None:
            refs.append(self.update.payload)
        return tuple(refs)

    def to_json(self) -> dict[str, Any]:
        return {
            "all_final": self.all_final,
            "closer": self.closer,
            "dropped": [d.to_json() for d in self.dropped],
            "estimates": self.estimates.to_json(),
            "fragment": self.fragment,
            "mean_cosine": self.mean_cosine,
            "outer": self.outer.to_json(),
            "participants": [p.to_json() for p in self.participants],
            "round": self.round,
            "theta": self.theta.to_json(),
            "update": None if self.update is None else self.update.to_json(),
            "v": FORMAT_VERSION,
            "version": self.version,
        }

    @classmethod
    def from_json(cls, obj: Any, key: str) -> Self:
        f = _Fields(obj, key, "", ("all_final", "closer", "dropped", "estimates", "fragment",
                                   "mean_cosine", "outer", "participants", "round", "theta",
                                   "update", "v", "version"))
        try:
            estimates = Estimates.from_json(f.obj["estimates"])
        except GradientmailError as exc:
            raise RemoteProtocolError(
                f"record {key!r}: field 'estimates': {exc} ({_HINT})"
            ) from exc
        update = f.obj["update"]
        return _build(
            cls, key, "", round=f.get_int("round"), fragment=f.get_int("fragment"),
            version=f.get_int("version"),
            theta=PayloadRef.from_json(f.obj["theta"], key, "theta"),
            outer=PayloadRef.from_json(f.obj["outer"], key, "outer"),
            update=None if update is None else UpdateRef.from_json(update, key, "update"),
            participants=tuple(Participant.from_json(p, key, f"participants[{i}]")
                               for i, p in enumerate(f.get_list("participants"))),
            estimates=estimates, mean_cosine=f.get_opt_float("mean_cosine"),
            dropped=tuple(Dropped.from_json(d, key, f"dropped[{i}]")
                          for i, d in enumerate(f.get_list("dropped"))),
            closer=f.get_str("closer"), all_final=f.get_bool("all_final"),
        )
