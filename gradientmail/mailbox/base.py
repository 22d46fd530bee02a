"""The Mailbox contract: an async key/value view of an object store.

Five operations are the whole coordination layer: `get`, `put` (overwrite), `create`
(atomic create-if-absent, the only coordination primitive), `list` (sorted keys under a
prefix, optionally after a cursor so polling costs O(new keys)) and `delete`. A sixth,
`get_range`, reads part of an object (a rank of a sharded learner fetches only its rows of
a commit); its default falls back to a full `get`.
"""

from __future__ import annotations

import abc
import re
from types import TracebackType

from gradientmail.errors import LocalProtocolError

__all__ = ["Mailbox", "check_key", "check_range"]

_SEGMENT_BAD = {"", ".", ".."}
_KEY_CHARS = re.compile(r"^[A-Za-z0-9._/\-=+:@,]+$")


def check_key(key: str) -> str:
    """Return `key` if it is a safe relative key; raise `LocalProtocolError` otherwise.

    Keys are '/'-separated segments of a limited alphabet; no empty, '.' or '..' segment,
    no leading '/', no NUL or backslash, so a key can never escape a LocalMailbox's root.
    A segment may not start with '.': hidden names are LocalMailbox's temporary files (and
    the debris of file browsers), which `list` skips.
    """
    if not isinstance(key, str) or not key:
        raise LocalProtocolError(f"mailbox key {key!r} is empty or not a string")
    if len(key) > 1024:
        raise LocalProtocolError(
            f"mailbox key {key[:64]!r}... is {len(key)} characters; at most 1024"
        )
    if not _KEY_CHARS.match(key):
        raise LocalProtocolError(
            f"mailbox key {key!r} has a character outside [A-Za-z0-9._/-=+:@,]"
        )
    if any(seg in _SEGMENT_BAD for seg in key.split("/")):
        raise LocalProtocolError(
            f"mailbox key {key!r} has an empty, '.' or '..' segment or a leading '/'"
        )
    hidden = [seg for seg in key.split("/") if seg.startswith(".")]
    if hidden:
        raise LocalProtocolError(
            f"mailbox key {key!r} has a segment starting with '.' ({hidden[0]!r}); hidden "
            "names are reserved for temporary files, rename the segment"
        )
    return key


def check_prefix(prefix: str) -> str:
    """Like `check_key`, but allows the empty prefix and a trailing '/'."""
    if prefix == "":
        return prefix
    check_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def check_range(key: str, start: int, stop: int) -> None:
    """Raise `LocalProtocolError` unless 0 <= start <= stop are ints (a byte range)."""
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (start, stop))
    if not ints or not 0 <= start <= stop:
        raise LocalProtocolError(
            f"byte range [{start!r}, {stop!r}) of key {key!r} is not a range; need ints "
            "with 0 <= start <= stop"
        )


class Mailbox(abc.ABC):
    """An object store seen as keys and bytes. Every method may be awaited concurrently."""

    #: A human-readable location (URL) used in error messages.
    url: str = "mailbox"
    #: Whether requests are billed, as a cloud store's are. A learner blocked on a commit
    #: looks for it every few milliseconds on an unmetered mailbox (a local directory,
    #: memory), every few tens of milliseconds on a metered one. Wrappers pass it on.
    metered: bool = True

    @abc.abstractmethod
    async def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when the key does not exist."""

    async def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        """Bytes [start, stop) of the object, cut short at its end like a slice, or None
        when the key does not exist.

        This default downloads the whole object; the stores override it with a ranged
        read (a file seek, an S3 `Range` header), so that only the range travels.
        """
        check_range(key, start, stop)
        data = await self.get(key)
        return None if data is None else data[start:stop]

    @abc.abstractmethod
    async def put(self, key: str, data: bytes) -> None:
        """Write the object, replacing any existing one. Readers never see a partial object."""

    @abc.abstractmethod
    async def create(self, key: str, data: bytes) -> bool:
        """Write the object only if the key is absent; True when this call created it."""

    @abc.abstractmethod
    async def list(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        """Every key starting with `prefix` (and greater than `start_after`), sorted."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove the object; deleting an absent key is not an error."""

    async def close(self) -> None:
        """Release connections and threads; the default holds none."""
        return None

    async def __aenter__(self) -> Mailbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
