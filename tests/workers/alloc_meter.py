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
