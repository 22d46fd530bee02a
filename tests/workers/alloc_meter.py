"""Measure the memory a block of code allocates: torch storages and Python/numpy buffers.

torch has no allocator statistics for the CPU, so `AllocationMeter` watches every aten op
(a `TorchDispatchMode`): a storage an op returns that none of its inputs had is new
memory, counted until the last tensor viewing it dies (a weak reference to the storage
says when). Python and numpy buffers (bytes, numpy copies) are measured by `tracemalloc`,
which numpy reports to. The peak is the largest sum of live new storages seen after any
op, plus tracemalloc's peak: an upper bound on what the block had allocated at once.

    with AllocationMeter() as meter:
        out = adapter.delta(anchor, snapshot)
    meter.peak  # bytes
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(values: Any) -> list[torch.UntypedStorage]:
    out = []
    for t in tree_flatten(values)[0]:
        # Wrapper subclasses (DTensor) own no memory; their local tensors show up as plain
        # tensors in the ops DTensor dispatches underneath.
        if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
            out.append(t.untyped_storage())
    return out


class AllocationMeter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.torch_peak = 0
        self.python_peak = 0

    @property
    def peak(self) -> int:
        return self.torch_peak + self.python_peak

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        seen = {s.data_ptr() for s in _storages((args, kwargs)) if s.nbytes()}
        # Pruned first: a freed storage's address may come back for this op's output.
        self._live = {p: v for p, v in self._live.items() if not v[0].expired()}
        for storage in _storages(out):
            ptr = storage.data_ptr()
            if storage.nbytes() and ptr not in seen and ptr not in self._live:
                self._live[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.torch_peak = max(self.torch_peak, sum(n for _, n in self._live.values()))
        return out

    def __enter__(self) -> AllocationMeter:
        tracemalloc.start()
        tracemalloc.reset_peak()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.python_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


class SharedMeter:
    """`AllocationMeter` across threads, in named windows: what a learner allocates while
    it publishes or applies, whichever thread does the work (the communication thread,
    a side channel's thread, the executors `asyncio.to_thread` uses, the training
    thread).

    `install()` starts tracemalloc and makes every thread started afterwards watch torch
    ops (a `TorchDispatchMode` pushed for the thread's life: a dispatch mode is per
    thread); `tap()` watches on the calling thread for a block. Between `begin(name)` and
    `end(name)` every storage any watched thread creates counts until it dies, and
    tracemalloc's peak (every thread's Python and numpy buffers) over the window's start;
    `peaks[name]` lists (torch peak, python peak) per window. One window at a time: a
    `begin` drops a window still open.
    """

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self.window: str | None = None
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._torch_peak = 0
        self._py_start = 0
        self.peaks: dict[str, list[tuple[int, int]]] = {}

    def install(self) -> None:
        import threading

        tracemalloc.start()
        meter, run = self, threading.Thread.run

        def tapped_run(thread: threading.Thread) -> None:
            with _Tap(meter):
                run(thread)

        threading.Thread.run = tapped_run  # type: ignore[method-assign]

    def tap(self) -> _Tap:
        return _Tap(self)

    def begin(self, window: str) -> None:
        with self._lock:
            self.window = window
            self._live = {}
            self._torch_peak = 0
            tracemalloc.reset_peak()
            self._py_start = tracemalloc.get_traced_memory()[0]

    def end(self, window: str) -> None:
        with self._lock:
            if self.window != window:
                return
            py_peak = tracemalloc.get_traced_memory()[1] - self._py_start
            self.peaks.setdefault(window, []).append((self._torch_peak, py_peak))
            self.window = None

    def _record(self, args: Any, kwargs: Any, out: Any) -> None:
        with self._lock:
            if self.window is None:
                return
            seen = {s.data_ptr() for s in _storages((args, kwargs)) if s.nbytes()}
            self._live = {p: v for p, v in self._live.items() if not v[0].expired()}
            for storage in _storages(out):
                ptr = storage.data_ptr()
                if storage.nbytes() and ptr not in seen and ptr not in self._live:
                    self._live[ptr] = (StorageWeakRef(storage), storage.nbytes())
            self._torch_peak = max(self._torch_peak, sum(n for _, n in self._live.values()))


class _Tap(TorchDispatchMode):
    def __init__(self, meter: SharedMeter) -> None:
        super().__init__()
        self._meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._meter.window is not None:
            self._meter._record(args, kwargs, out)
        return out
