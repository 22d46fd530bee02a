"""Output buffers reused across rounds, so a close does not fault in fresh pages.

A closer writes every round's theta and momentum into new arrays of the same sizes as
the last round's. Freshly mapped memory costs a page fault per page on first touch (on
a VM, about as long as the merge itself), so a backend takes its large outputs from a
`BufferPool`: an array whose memory nothing references any more (the state that held it
was dropped) is handed out again instead of allocating.

"Nothing references it" is decided by CPython's reference count of the pooled array:
every view of a numpy array (a reshape, a memoryview, `np.frombuffer` of that view, a
torch tensor made by `torch.from_numpy` or `torch.frombuffer`) keeps a reference to the
array that owns the memory, so an owner whose only references are the pool's own is
unreachable from anywhere else and safe to write. The count that means "free" is measured
once, on a probe, through the same code path as the check, so it does not depend on how
the interpreter counts the temporaries of a call. An object caught in a reference cycle
counts as in use until the garbage collector frees it: the pool then allocates, never
reuses early.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import numpy.typing as npt

from gradientmail.errors import ConfigError

__all__ = ["DEFAULT_POOL_BYTES", "MIN_POOLED_BYTES", "BufferPool"]

#: Bytes a pool may hold (in use and free) by default.
DEFAULT_POOL_BYTES = 1 << 30
#: Smaller outputs are allocated plainly: malloc reuses their memory anyway.
MIN_POOLED_BYTES = 1 << 20


def _refs(buffers: list[npt.NDArray[np.float32]], i: int) -> int:
    return sys.getrefcount(buffers[i])


class BufferPool:
    """Float32 arrays handed out again once nothing but the pool references them.

    Holds at most `limit` bytes of arrays (in use and free); past that, and for arrays
    under `MIN_POOLED_BYTES`, `empty` allocates a plain array. `limit=0` turns reuse off.
    Thread-safe.
    """

    def __init__(self, limit: int = DEFAULT_POOL_BYTES) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ConfigError(f"pool limit={limit!r} must be an int >= 0 (bytes)")
        self.limit = limit
        self._buffers: list[npt.NDArray[np.float32]] = []
        self._lock = threading.Lock()
        probe = [np.empty(1, np.float32)]
        self._free_refs = _refs(probe, 0)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays the pool holds, in use or free."""
        return sum(b.nbytes for b in self._buffers)

    def _free(self, i: int) -> bool:
        return _refs(self._buffers, i) <= self._free_refs

    def empty(self, size: int) -> npt.NDArray[np.float32]:
        """A flat float32 array of `size` elements with arbitrary contents."""
        nbytes = 4 * size
        if nbytes < MIN_POOLED_BYTES or nbytes > self.limit:
            return np.empty(size, np.float32)
        with self._lock:
            for i in range(len(self._buffers)):
                if self._buffers[i].size == size and self._free(i):
                    # Move it to the end: the least recently used free arrays go first.
                    found = self._buffers.pop(i)
                    self._buffers.append(found)
                    return found[:]
            held = self.nbytes
            i = 0
            while held + nbytes > self.limit and i < len(self._buffers):
                if self._free(i):
                    held -= self._buffers.pop(i).nbytes
                else:
                    i += 1
            out = np.empty(size, np.float32)
            if held + nbytes <= self.limit:
                self._buffers.append(out)
            return out[:]

    def clear(self) -> None:
        """Forget every array (those in use stay valid; their memory is freed with them)."""
        with self._lock:
            self._buffers.clear()
