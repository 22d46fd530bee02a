"""The collectives among the processes of one learner, behind a small contract.

An integration runs one learner per launch: every process of a DDP group trains, and only
the main process (global rank 0) talks to the mailbox. `RankSync` needs four collectives
to keep the others in step; `Ranks` is that contract, `TorchRanks` carries it out with
`torch.distributed` (the group Lightning and Accelerate set up), `SingleRank` is the
trivial one of a single process, and `ThreadRanks` is the shipped fake: ranks as threads
of one process, so the synchronisation is tested without process groups.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from gradientmail.errors import GradientmailError

__all__ = ["Ranks", "SingleRank", "ThreadRanks", "TorchRanks"]

_log = logging.getLogger("gradientmail.integration")


class Ranks(Protocol):
    """Collectives among one learner's processes; every process calls each one in the
    same order. Values flow from rank 0 (the main process) unless said otherwise."""

    @property
    def world_size(self) -> int: ...

    @property
    def is_main(self) -> bool: ...

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` (picklable) on every rank."""
        ...

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        """Rank 0's `values` on every rank (each rank passes as many)."""
        ...

    def sum_int(self, value: int) -> int:
        """The sum of every rank's `value`, on every rank."""
        ...

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0's values copied into every rank's `tensors`, in place."""
        ...


class SingleRank:
    """One process: every collective is the identity."""

    world_size = 1
    is_main = True

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        return list(values)

    def sum_int(self, value: int) -> int:
        return value

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


# Sleeps between looks at a tensor a process group may still hold: from 10 µs, doubling
# up to 1 ms each, 10 s in all.
_RELEASE_SLEEPS = tuple(1e-5 * 2**k for k in range(7)) + (1e-3,) * 10_000


def _released(
    tensor: torch.Tensor,
    sleeps: Sequence[float] = _RELEASE_SLEEPS,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Wait (sleeping `sleeps` in turn, without the GIL) until nothing but the caller holds
    `tensor`; False when something still does after the last sleep."""
    use_count = getattr(tensor, "_use_count", None)  # as torch.utils.swap_tensors reads it
    if use_count is None:
        return True
    for seconds in sleeps:
        if int(use_count()) <= 1:
            return True
        sleep(seconds)
    return int(use_count()) <= 1


class TorchRanks:
    """`Ranks` on the default `torch.distributed` group, with tensors on `device` (the
    device the backend communicates from: cuda for NCCL, cpu for gloo).

    `broadcast_object` is the framework's own (Lightning's `strategy.broadcast`); without
    one, `torch.distributed.broadcast_object_list`. `group`: a process group over every
    rank other than the default one (the side group of `gradientmail.integration.sharded`).

    Every collective on CPU tensors keeps them until the backend has let go of them
    (`_released`). Gloo's worker thread marks a collective done, which wakes the caller,
    and drops its own reference to the tensor a moment later (up to ~5 ms later after
    about half the collectives, measured on a loaded 2-core machine). A tensor this
    process dropped first is then freed by that worker thread, which needs the GIL to
    free the Python object. After the last collective of a run (`RankSync.close()`) the
    process goes on to exit; when the worker's turn comes once the interpreter is
    finalizing, Python ends that non-Python thread with pthread_exit, the unwinding
    meets a noexcept C++ frame and the rank aborts ("terminate called without an active
    exception", SIGABRT, exit -6) after a good run. Holding the tensor until the backend
    let go makes this process's own drop the last: on this thread, with the GIL.
    """

    def __init__(
        self,
        device: torch.device | str,
        broadcast_object: Callable[[Any], Any] | None = None,
        group: Any = None,
    ) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._device = torch.device(device)
        self._broadcast_object = broadcast_object
        # Passed only when given: the default group's calls stay exactly what they were.
        self._group: dict[str, Any] = {} if group is None else {"group": group}
        self.world_size = int(dist.get_world_size(**self._group))
        self.is_main = dist.get_rank() == 0

    def broadcast_object(self, obj: Any) -> Any:
        if self._broadcast_object is not None:
            return self._broadcast_object(obj)
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, device=self._device, **self._group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, **self._group)
        return out

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        mine = [int(v) for v in values]
        t = torch.tensor(mine, dtype=torch.int64, device=self._device)
        self._dist.broadcast(t, src=0, **self._group)
        self._let_go(t)
        if self.is_main:
            return mine  # unchanged: no read back (on a GPU, no wait for the device)
        out: list[int] = t.tolist()
        return out

    def sum_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self._device)
        self._dist.all_reduce(t, **self._group)
        self._let_go(t)
        return int(t.item())

    def _let_go(self, t: torch.Tensor) -> None:
        # Gloo's case only: NCCL's watchdog thread holds a CUDA collective's tensor until
        # the GPU has run it, checking every 100 ms, and a step must not wait for that.
        if t.device.type == "cpu" and not _released(t):
            _log.warning("a collective's tensor is still held by the process group after 10 s")

    @torch.no_grad()
    def broadcast_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        # One broadcast per dtype (in a fixed order, the same on every rank), not one per
        # tensor: a fragment of a transformer holds hundreds of small tensors.
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t)
        for dtype in sorted(groups, key=str):
            group = groups[dtype]
            flat = torch.cat([t.detach().reshape(-1).to(self._device) for t in group])
            self._dist.broadcast(flat, src=0, **self._group)
            self._let_go(flat)
            if self.is_main:
                continue
            offset = 0
            for t in group:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


class _Rendezvous:
    def __init__(self, n: int, timeout: float) -> None:
        self.slots: list[Any] = [None] * n
        self.barrier = threading.Barrier(n, timeout=timeout)


class ThreadRanks:
    """`Ranks` among threads of one process (a fake for tests): `ThreadRanks.group(n)`
    makes the n members; run each in its own thread. A rank that stops calling (or
    calls another collective) breaks the barrier, and every rank raises instead of
    hanging past `timeout` seconds."""

    def __init__(self, rank: int, rendezvous: _Rendezvous) -> None:
        self.rank = rank
        self._r = rendezvous
        self.world_size = len(rendezvous.slots)
        self.is_main = rank == 0

    @classmethod
    def group(cls, n: int, timeout: float = 30.0) -> list[ThreadRanks]:
        rendezvous = _Rendezvous(n, timeout)
        return [cls(rank, rendezvous) for rank in range(n)]

    def _exchange(self, kind: str, mine: Any) -> list[Any]:
        r = self._r
        try:
            r.slots[self.rank] = (kind, mine)
            r.barrier.wait()
            got = list(r.slots)
            r.barrier.wait()  # nobody writes the next collective's slot before all read
        except threading.BrokenBarrierError:
            raise GradientmailError(
                f"rank {self.rank}: another rank stopped taking part in the collectives"
            ) from None
        kinds = {k for k, _ in got}
        if kinds != {kind}:
            raise GradientmailError(f"rank {self.rank}: ranks called different collectives "
                                    f"at once: {sorted(kinds)}")
        return [v for _, v in got]

    def broadcast_object(self, obj: Any) -> Any:
        return copy.deepcopy(self._exchange("object", obj)[0])

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        got = self._exchange("ints", list(values))
        if len({len(v) for v in got}) != 1:
            raise GradientmailError(f"broadcast_ints: lengths differ across ranks: {got}")
        return list(got[0])

    def sum_int(self, value: int) -> int:
        return sum(self._exchange("sum", int(value)))

    def all_gather_object(self, obj: Any) -> list[Any]:
        return copy.deepcopy(self._exchange("gather", obj))

    @torch.no_grad()
    def broadcast_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        mine = [t.detach().clone() for t in tensors] if self.is_main else list(tensors)
        theirs = self._exchange("tensors", mine)[0]
        if not self.is_main:
            for t, value in zip(tensors, theirs, strict=True):
                t.copy_(value)
