"""Authenticated runs: every record sealed with HMAC-SHA256 under the run's key.

With a run key, every record (manifest, claims, contributions, commits) is stored sealed;
its canonical JSON is the *body*, and the stored bytes are themselves canonical JSON::

    {"auth":"hmac-sha256","mac":"<64 lowercase hex>","record":<body>}

    mac = HMAC-SHA256(run key, b"gradientmail/record/v1" 0x00 <key> 0x00 <body>)

where `<key>` is the record's key relative to the run's prefix (UTF-8). The MAC covers
the body byte for byte, and the body holds the size and SHA-256 of every payload it
references, so payloads are covered too. Binding the key stops a valid record from
being replayed under another key of the run (another round, another learner); a run
can still be moved to another prefix or bucket. The same key must not serve two runs.

The manifest names the key by its *fingerprint*, SHA-256 over a domain-separated key
(shown as its first 16 hex digits), so a learner with another key, or without one, or
with one against an unauthenticated run, is refused at join with both fingerprints
named. Leases (empty objects whose keys carry the counter) and key listings are not
authenticated; docs/threat-model.md says what a writer without the key can do with them.

Configuration: `run_key=` on Learner, Syncer and Exchange (`str` as UTF-8, or bytes; at
least 16 bytes). A `Learner` given no `run_key` (and so each integration, and the
`gradientmail` command) takes `GRADIENTMAIL_RUN_KEY`; `env_run_key` is the one place that
reads it. Syncer and Exchange take only what they are given.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Mapping
from typing import Protocol

from gradientmail.errors import AuthenticationError, ConfigError, RemoteProtocolError
from gradientmail.wire.record_json import MAX_MANIFEST_BYTES, parse_json
from gradientmail.wire.records import Manifest

__all__ = [
    "MAX_SEALED_BYTES",
    "MIN_KEY_BYTES",
    "RUN_KEY_VARIABLE",
    "SCHEME",
    "HmacSeal",
    "PlainSeal",
    "Seal",
    "check_run_key",
    "env_run_key",
    "is_sealed",
    "key_fingerprint",
    "open_manifest",
    "refuse_sealed",
    "resolve_run_key",
    "short_fingerprint",
]

#: The environment variable holding the run key of an authenticated run.
RUN_KEY_VARIABLE = "GRADIENTMAIL_RUN_KEY"
#: The sealing scheme this code writes and the only one it reads.
SCHEME = "hmac-sha256"
#: A run key's minimum length in bytes (use 32 random bytes).
MIN_KEY_BYTES = 16
#: Bound on a sealed record's stored bytes: the largest body (a manifest) plus the seal.
MAX_SEALED_BYTES = MAX_MANIFEST_BYTES + 256

_SEALED = b'{"auth":'
_HEAD = b'{"auth":"' + SCHEME.encode() + b'","mac":"'
_MID = b'","record":'
_MAC_DOMAIN = b"gradientmail/record/v1\0"
_FINGERPRINT_DOMAIN = b"gradientmail/run-key-fingerprint/v1\0"
_HEX64 = re.compile("[0-9a-f]{64}")
_FIX = (f"set {RUN_KEY_VARIABLE} to the run's key (Learner, the gradientmail command and "
        "the integrations read it) or pass it as run_key=")


def env_run_key(environ: Mapping[str, str] | None = None) -> str | None:
    """The run key in `GRADIENTMAIL_RUN_KEY` of `environ` (default `os.environ`); None
    when unset or empty. The only reader of the variable in the library."""
    env = os.environ if environ is None else environ
    return env.get(RUN_KEY_VARIABLE) or None


def resolve_run_key(run_key: str | bytes | None) -> str | bytes | None:
    """`run_key`, or when it is None the key in `GRADIENTMAIL_RUN_KEY` (None if unset):
    the default of `Learner(run_key=...)`, so a user who set the variable gets an
    authenticated learner whichever integration built it."""
    return run_key if run_key is not None else env_run_key()


def check_run_key(run_key: str | bytes) -> bytes:
    """The key's bytes (a str is UTF-8); `ConfigError` for another type or a short key."""
    if isinstance(run_key, str):
        raw = run_key.encode("utf-8")
    elif isinstance(run_key, bytes):
        raw = run_key
    else:
        raise ConfigError(f"run_key must be a str or bytes, got a {type(run_key).__name__}")
    if len(raw) < MIN_KEY_BYTES:
        raise ConfigError(
            f"the run key is {len(raw)} bytes; a run key needs at least {MIN_KEY_BYTES} bytes. "
            "Use 32 random bytes, e.g. the output of "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`"
        )
    return raw


def key_fingerprint(run_key: str | bytes) -> str:
    """SHA-256 (64 hex digits) of the domain-separated key: names the key, reveals it not."""
    return hashlib.sha256(_FINGERPRINT_DOMAIN + check_run_key(run_key)).hexdigest()


def short_fingerprint(fingerprint: str | None) -> str:
    """The first 16 hex digits, as messages and logs show a fingerprint."""
    return "none" if fingerprint is None else fingerprint[:16]


def is_sealed(data: bytes) -> bool:
    """Whether stored record bytes carry a seal (of any scheme)."""
    return data.startswith(_SEALED)


def refuse_sealed(key: str, data: bytes) -> bytes:
    """`data` unchanged if it carries no seal: how a process without a run key opens a
    record; a sealed one raises `AuthenticationError` saying the run is authenticated."""
    if is_sealed(data):
        raise AuthenticationError(
            f"record {key!r} is sealed with a run key (an authenticated run), but this "
            f"process has none; {_FIX}"
        )
    return data


def _mac(raw_key: bytes, key: str, body: bytes) -> bytes:
    message = _MAC_DOMAIN + key.encode("utf-8") + b"\0" + body
    return hmac.new(raw_key, message, hashlib.sha256).hexdigest().encode("ascii")


def _split(data: bytes) -> tuple[bytes, bytes] | None:
    """(mac, body) of sealed bytes; None when they are not this scheme's."""
    start = len(_HEAD) + 64
    if not data.startswith(_HEAD) or data[start : start + len(_MID)] != _MID \
            or not data.endswith(b"}") or len(data) < start + len(_MID) + 1:
        return None
    return data[len(_HEAD) : start], data[start + len(_MID) : -1]


class Seal(Protocol):
    """Turns a record's bytes into what is stored, and back (raising RemoteProtocolError)."""

    fingerprint: str | None

    def seal(self, key: str, data: bytes) -> bytes: ...

    def open(self, key: str, data: bytes) -> bytes: ...


class PlainSeal:
    """No authentication: records are stored as their canonical JSON bytes."""

    fingerprint: str | None = None

    def seal(self, key: str, data: bytes) -> bytes:
        return data

    def open(self, key: str, data: bytes) -> bytes:
        return refuse_sealed(key, data)


class HmacSeal:
    """Seals records with HMAC-SHA256 under a run key, and opens only what it sealed.

    `open` returns the body, or raises `AuthenticationError` naming the record's key and
    the run key's fingerprint: for an unsealed record, a malformed seal, a record altered
    after sealing, one sealed with another key, or one too large to be a record.
    """

    def __init__(self, run_key: str | bytes) -> None:
        self._key = check_run_key(run_key)
        self.fingerprint: str | None = key_fingerprint(self._key)

    def __repr__(self) -> str:
        return f"HmacSeal(fingerprint={short_fingerprint(self.fingerprint)!r})"

    def seal(self, key: str, data: bytes) -> bytes:
        if not (data.startswith(b"{") and data.endswith(b"}")):
            raise ConfigError(f"record {key!r}: only a JSON object can be sealed")
        return _HEAD + _mac(self._key, key, data) + _MID + data + b"}"

    def open(self, key: str, data: bytes) -> bytes:
        fp = short_fingerprint(self.fingerprint)
        if len(data) > MAX_SEALED_BYTES:
            raise AuthenticationError(
                f"record {key!r} is {len(data)} bytes; a sealed record is at most "
                f"{MAX_SEALED_BYTES} bytes. It is ignored"
            )
        if not is_sealed(data):
            raise AuthenticationError(
                f"record {key!r} is not authenticated: this run uses run key {fp} and the "
                "record carries no MAC. It was written by a process without the run key "
                "(or the bucket was tampered with); it is ignored"
            )
        parts = _split(data)
        if parts is None:
            raise AuthenticationError(
                f"record {key!r} carries a malformed seal or another scheme than {SCHEME!r} "
                f"(stored bytes begin {data[:48]!r}); this run uses run key {fp} with "
                f"{SCHEME!r}, so it is ignored"
            )
        mac, body = parts
        if not hmac.compare_digest(mac, _mac(self._key, key, body)):
            raise AuthenticationError(
                f"record {key!r} fails authentication with run key {fp}: its MAC does not "
                "match its contents. It was altered after sealing, sealed with another key, "
                "or forged by a writer without the key; it is ignored"
            )
        return body


def _claimed_fingerprint(data: bytes) -> str | None:
    """The key fingerprint a manifest's bytes claim, read without checking any MAC."""
    body = data
    if is_sealed(data):
        parts = _split(data)
        if parts is None:
            return None
        body = parts[1]
    try:
        fp = parse_json(body, "manifest", MAX_MANIFEST_BYTES).get("key_fingerprint")
    except RemoteProtocolError:
        return None
    return fp if isinstance(fp, str) and _HEX64.fullmatch(fp) else None


def open_manifest(seal: Seal, data: bytes, key: str, where: str) -> Manifest:
    """The manifest in `data`, opened with `seal` and checked to name `seal`'s key.

    A run whose key differs from this process's (or that has one when this process has
    none, or none when this process has one) raises `AuthenticationError` naming both
    fingerprints, the run (`where`) and the fix.
    """
    ours = seal.fingerprint
    try:
        manifest = Manifest.decode(seal.open(key, data), key)
    except AuthenticationError as exc:
        raise _mismatch(data, ours, where, str(exc)) from exc
    if manifest.key_fingerprint != ours:
        raise _mismatch(data, ours, where, "its manifest names another key than its seal")
    return manifest


def _mismatch(data: bytes, ours: str | None, where: str, cause: str) -> AuthenticationError:
    theirs = _claimed_fingerprint(data)
    sealed = is_sealed(data)
    if sealed and theirs is not None and ours is None:
        text = (f"the run in {where} is authenticated with run key {short_fingerprint(theirs)}, "
                f"but this process has no run key; {_FIX}")
    elif not sealed and theirs is None and ours is not None:
        text = (f"the run in {where} is not authenticated (its manifest names no run key), "
                f"but this process has run key {short_fingerprint(ours)}; join it without a "
                "run key, or start an authenticated run under another prefix")
    elif sealed and theirs is not None and theirs != ours:
        text = (f"the run in {where} uses run key {short_fingerprint(theirs)}, but this "
                f"process has run key {short_fingerprint(ours)}; {_FIX}")
    else:
        text = (f"the manifest of the run in {where} fails authentication (this process has "
                f"run key {short_fingerprint(ours)}, the manifest claims "
                f"{short_fingerprint(theirs)}): {cause}. It was altered or forged by a writer "
                "without the key; restore it, or start the run anew under another prefix")
    return AuthenticationError(text)
