"""`global_batch_size` made real: each learner's batches sized to its share.

`Learner.batch_size` is the learner's share of the run's `global_batch_size`,
⌈global / live learners⌉, and changes as learners come and go. An integration passes
the share to a *batch-size hook*, a `callable(share) -> None`, at start and whenever it
changes, on every process of the learner. A process's micro-batch is its part of the
share: `per_process_batch(share, processes, accumulation)`.

The built-in loaders read it through a `ShareBatchSampler`, a `BatchSampler` whose
batch size is asked for at every batch; a custom loader can use one too:

    sizes = BatchSizes(default=16)
    loader = DataLoader(data, batch_sampler=ShareBatchSampler(RandomSampler(data), 16,
                                                              False, size=sizes))
    DiLoCoCallback(..., on_batch_size=sizes.resize(processes=world, accumulation=accum))
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

from torch.utils.data import BatchSampler, Sampler

from gradientmail.errors import ConfigError

__all__ = ["BatchSizeHook", "BatchSizes", "ShareBatchSampler", "per_process_batch"]

#: Called with the learner's share of `global_batch_size` (an int >= 1).
BatchSizeHook = Callable[[int], None]


def per_process_batch(share: int, processes: int = 1, accumulation: int = 1) -> int:
    """One process's micro-batch for a learner whose share of the global batch is
    `share`: ⌈share / (processes × accumulation)⌉, at least 1."""
    for name, value in (("share", share), ("processes", processes),
                        ("accumulation", accumulation)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be an int >= 1")
    return max(1, -(-share // (processes * accumulation)))


class BatchSizes:
    """The current micro-batch of this process: `default` until a share arrives.

    Calling it reads the size (what `ShareBatchSampler(size=...)` wants);
    `resize(processes, accumulation)` is a batch-size hook that updates it.
    """

    def __init__(self, default: int) -> None:
        if isinstance(default, bool) or not isinstance(default, int) or default < 1:
            raise ConfigError(f"default={default!r} must be an int >= 1")
        self.default = default
        self.share: int | None = None
        self.current = default

    def __call__(self) -> int:
        return self.current

    def set(self, share: int, processes: int = 1, accumulation: int = 1) -> None:
        self.share = share
        self.current = per_process_batch(share, processes, accumulation)

    def resize(self, processes: int = 1, accumulation: int = 1) -> BatchSizeHook:
        """A hook that sets the size from the learner's share."""
        return lambda share: self.set(share, processes, accumulation)


class ShareBatchSampler(BatchSampler):
    """Batches of `size()` indices of `sampler` (`batch_size` while `size` is None or
    returns None), the size asked for at every batch, so a new share applies from the
    next batch drawn. `drop_last` drops a final batch shorter than its size."""

    def __init__(
        self,
        sampler: Sampler[int] | Iterable[int],
        batch_size: int,
        drop_last: bool,
        size: Callable[[], int | None] | None = None,
    ) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.size = size

    def current_size(self) -> int:
        n = self.size() if self.size is not None else None
        if n is None:
            return int(self.batch_size)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"the batch size hook returned {n!r}; need an int >= 1")
        return n

    def __iter__(self) -> Iterator[list[int]]:
        indices: Iterator[Any] = iter(self.sampler)
        while True:
            n = self.current_size()
            batch = list(itertools.islice(indices, n))
            if not batch or (self.drop_last and len(batch) < n):
                return
            yield batch

    def __len__(self) -> int:
        if not isinstance(self.sampler, Sized):
            raise TypeError("ShareBatchSampler over a sampler without a length has no length")
        n, total = self.current_size(), len(self.sampler)
        return total // n if self.drop_last else -(-total // n)
