"""Canonical JSON and the strict field reader behind `gradientmail.wire.records`.

Writing is canonical (sorted keys, compact separators, UTF-8, no NaN); reading checks the
exact field set, exact JSON types and finite numbers of every object, naming the record's
key and the field on any departure. The value rules the record classes share (counts,
digests, formats, learner ids, seconds) live here too.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from gradientmail.errors import GradientmailError, LocalProtocolError, RemoteProtocolError

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "HINT",
    "MAX_MANIFEST_BYTES",
    "MAX_RECORD_BYTES",
    "Fields",
    "build_record",
    "canonical_json",
    "check_count",
    "check_finite",
    "check_format",
    "check_learner_id",
    "check_seconds",
    "check_sha256",
    "check_text",
    "is_int",
    "is_number",
    "parse_json",
]

#: The record format this code writes and the only one it reads.
FORMAT_VERSION = 1
#: Bound on a record's bytes; a manifest (which holds the schema) may be larger.
MAX_RECORD_BYTES = 1 << 20
MAX_MANIFEST_BYTES = 16 << 20
#: Payload codecs a manifest may name (see gradientmail.wire.compression).
CODECS = ("off", "zstd")

_LEARNER_RULE = "[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_LEARNER_ID = re.compile(_LEARNER_RULE)
_SHA256 = re.compile("[0-9a-f]{64}")
_FORMAT = re.compile("[A-Za-z0-9_]{1,32}")
_MAX_INT = (1 << 63) - 1
_MAX_TEXT = 1000
_T = TypeVar("_T")
HINT = "the writer does not speak gradientmail record format v1, or the object was damaged"


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
            f"record {key!r} is {len(data)} bytes; records are at most {max_bytes} bytes ({HINT})"
        )
    try:
        obj = json.loads(
            data.decode("utf-8"),
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            object_pairs_hook=_no_duplicates,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RemoteProtocolError(f"record {key!r} is not valid JSON: {exc} ({HINT})") from exc
    if not isinstance(obj, dict):
        raise RemoteProtocolError(
            f"record {key!r} is a JSON {type(obj).__name__}, not an object ({HINT})"
        )
    return obj


_JSON_TYPE = {type(None): "null", bool: "boolean", int: "number", float: "number",
              str: "string", list: "array", dict: "object"}


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class Fields:
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
                f"missing {missing}, unexpected {extra} ({HINT})"
            )
        self.obj: dict[str, Any] = obj

    def at(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def fail(self, name: str, rule: str, value: Any) -> NoReturn:
        where = self.at(name) if name else self.path
        raise RemoteProtocolError(
            f"record {self.key!r}: field {where!r} {rule}, got {value!r:.100} "
            f"({_JSON_TYPE.get(type(value), 'value')}) ({HINT})"
        )

    def get(self, name: str, ok: Callable[[Any], bool], rule: str, null: bool = False) -> Any:
        v = self.obj[name]
        if not (ok(v) or (null and v is None)):
            self.fail(name, rule + (" or null" if null else ""), v)
        return v

    def get_int(self, name: str) -> int:
        return int(self.get(name, is_int, "must be an integer"))

    def get_float(self, name: str) -> float:
        return float(self.get(name, is_number, "must be a number"))

    def get_opt_float(self, name: str) -> float | None:
        v = self.get(name, is_number, "must be a number", null=True)
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


def build_record(cls: type[_T], key: str, path: str, /, **kwargs: Any) -> _T:
    """Construct a record from parsed fields, turning value-rule failures into remote errors."""
    try:
        return cls(**kwargs)
    except (GradientmailError, ValueError) as exc:
        where = f" field {path!r}:" if path else ""
        raise RemoteProtocolError(f"record {key!r}:{where} {exc} ({HINT})") from exc


def check_count(what: str, value: int, low: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _MAX_INT:
        raise LocalProtocolError(f"{what}={value!r} must be an integer in [{low}, 2**63 - 1]")


def check_sha256(what: str, value: str) -> None:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise LocalProtocolError(f"{what}={value!r} must be 64 lowercase hex digits (SHA-256)")


def check_format(what: str, value: str) -> None:
    if not isinstance(value, str) or not _FORMAT.fullmatch(value):
        raise LocalProtocolError(f"{what}={value!r} must match [A-Za-z0-9_]{{1,32}}, e.g. 'BF16'")


def check_text(what: str, value: str) -> None:
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise LocalProtocolError(f"{what}={value!r:.100} must be a string of at most {_MAX_TEXT}")


def check_finite(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise LocalProtocolError(f"{name}={v!r} must be a finite number")
    return float(v)


def check_seconds(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise LocalProtocolError(f"{name}={v!r} must be a finite number >= 0")
    return float(v)
