"""MemoryMailbox: the whole contract in a dict, for tests and simulations.

Instances opened with the same name share one store (within a process), so several
learners in one test see each other, as they would through a bucket.
"""

from __future__ import annotations

import bisect
import threading

from gradientmail.errors import LocalProtocolError
from gradientmail.mailbox.base import Mailbox, check_key, check_prefix, check_range

__all__ = ["MemoryMailbox"]

_STORES: dict[str, _Store] = {}
_STORES_LOCK = threading.Lock()


class _Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, bytes] = {}
        self.keys: list[str] = []  # sorted


class MemoryMailbox(Mailbox):
    """A process-local mailbox. `MemoryMailbox()` is private; `MemoryMailbox("x")` is shared.

    `read_only=True` refuses `put`, `create` and `delete` (`LocalProtocolError`)."""

    metered = False  # requests are dict lookups

    def __init__(self, name: str | None = None, *, read_only: bool = False) -> None:
        self.read_only = read_only
        if name is None:
            self._store = _Store()
            self.url = "memory://"
        else:
            with _STORES_LOCK:
                self._store = _STORES.setdefault(name, _Store())
            self.url = f"memory://{name}"

    def _writable(self, op: str, key: str) -> None:
        if self.read_only:
            raise LocalProtocolError(
                f"{op} of {key!r} refused: {self.url} was opened read-only; open it without "
                "read_only=True to write"
            )

    @staticmethod
    def forget(name: str) -> None:
        """Drop the shared store called `name` (tests call this between cases)."""
        with _STORES_LOCK:
            _STORES.pop(name, None)

    async def get(self, key: str) -> bytes | None:
        check_key(key)
        with self._store.lock:
            return self._store.objects.get(key)

    async def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        check_key(key)
        check_range(key, start, stop)
        with self._store.lock:
            data = self._store.objects.get(key)
        return None if data is None else data[start:stop]

    async def put(self, key: str, data: bytes) -> None:
        check_key(key)
        self._writable("put", key)
        data = bytes(data)
        s = self._store
        with s.lock:
            if key not in s.objects:
                bisect.insort(s.keys, key)
            s.objects[key] = data

    async def create(self, key: str, data: bytes) -> bool:
        check_key(key)
        self._writable("create", key)
        data = bytes(data)
        s = self._store
        with s.lock:
            if key in s.objects:
                return False
            bisect.insort(s.keys, key)
            s.objects[key] = data
            return True

    async def list(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        check_prefix(prefix)
        s = self._store
        with s.lock:
            lo = bisect.bisect_left(s.keys, prefix)
            if start_after is not None:
                lo = max(lo, bisect.bisect_right(s.keys, start_after))
            out: list[str] = []
            for key in s.keys[lo:]:
                if not key.startswith(prefix):
                    break
                out.append(key)
            return out

    async def delete(self, key: str) -> None:
        check_key(key)
        self._writable("delete", key)
        s = self._store
        with s.lock:
            if s.objects.pop(key, None) is not None:
                i = bisect.bisect_left(s.keys, key)
                del s.keys[i]
