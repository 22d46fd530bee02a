"""`open_mailbox(url, **options)`: a Mailbox from a URL, a path, or a Mailbox.

    open_mailbox("/data/run1")                  LocalMailbox (a plain path)
    open_mailbox("file:///data/run1")           LocalMailbox
    open_mailbox("s3://bucket/runs/run1")       S3Mailbox(bucket, prefix="runs/run1")
    open_mailbox("memory://run1")               MemoryMailbox("run1") (shared in-process)

Options go to the mailbox's constructor (`endpoint_url=...` for S3, `fsync=False` for a
directory, `read_only=True` for any: it refuses writes, and a directory is never created);
an option the mailbox does not take is a `ConfigError`. Nothing is opened
here: connections and directories are made on first use.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

from gradientmail.errors import ConfigError
from gradientmail.mailbox.base import Mailbox
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.s3 import S3Mailbox

__all__ = ["SUPPORTED", "open_mailbox"]

SUPPORTED = "file:///dir (or a plain path), s3://bucket/prefix, memory://name"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def open_mailbox(url: str | os.PathLike[str] | Mailbox, **options: Any) -> Mailbox:
    """The Mailbox that `url` names; a Mailbox instance is returned as it is."""
    if isinstance(url, Mailbox):
        if options:
            raise ConfigError(
                f"options {sorted(options)} given with the ready-made mailbox {url!r}; "
                "pass options only with a URL"
            )
        return url
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ConfigError(f"mailbox URL {url!r} is not a non-empty string; use {SUPPORTED}")
    match = _SCHEME.match(url)
    if match is None:
        return _make(LocalMailbox, url, url, options)
    scheme = match.group(1).lower()
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ConfigError(
            f"mailbox URL {url!r} has a query or fragment; pass options as keyword "
            "arguments instead (e.g. endpoint_url=...)"
        )
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(
                f"mailbox URL {url!r} names the host {parts.netloc!r}; a file URL needs an "
                "absolute path with three slashes, e.g. file:///data/run1"
            )
        return _make(LocalMailbox, url, unquote(parts.path), options)
    if scheme == "s3":
        if not parts.netloc:
            raise ConfigError(f"mailbox URL {url!r} names no bucket; use s3://bucket/prefix")
        return _make(S3Mailbox, url, parts.netloc, options, prefix=unquote(parts.path))
    if scheme == "memory":
        name = (parts.netloc + parts.path) or None
        return _make(MemoryMailbox, url, name, options)
    raise ConfigError(
        f"mailbox URL {url!r} has the unsupported scheme {scheme!r}; supported: {SUPPORTED}"
    )


def _make(
    cls: Callable[..., Mailbox], url: str, first: Any, options: dict[str, Any], **fixed: Any
) -> Mailbox:
    accepted = {
        name
        for name, p in inspect.signature(cls).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ConfigError(
            f"option(s) {unknown} are not accepted by {getattr(cls, '__name__', cls)} "
            f"(for {url!r}); accepted: {sorted(accepted) or 'none'}"
        )
    return cls(first, **fixed, **options)
