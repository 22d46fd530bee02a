"""The training loss an integration hands to `Learner.step`: the mean over the
micro-batches of one optimizer step, as rank 0 saw them (only rank 0 holds a learner)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["LossMean", "output_loss"]


def output_loss(outputs: Any) -> Any:
    """The loss in what a training step returned (a tensor, a number, or a mapping with
    "loss", as Lightning's `on_train_batch_end` gets it); None when there is none."""
    if isinstance(outputs, Mapping):
        outputs = outputs.get("loss")
    if isinstance(outputs, torch.Tensor):
        return outputs.detach() if outputs.numel() == 1 else None
    if isinstance(outputs, int | float) and not isinstance(outputs, bool):
        return float(outputs)
    return None


class LossMean:
    """Sums the losses of the micro-batches since the last `take()`. Tensors stay on their
    device until `take()`, so adding one costs no device synchronisation."""

    def __init__(self) -> None:
        self._total: Any = 0.0
        self._count = 0

    def add(self, loss: Any) -> None:
        """Add one micro-batch's loss (a one-element tensor or a number; None is skipped)."""
        if loss is None:
            return
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().reshape(())
        self._total = self._total + loss
        self._count += 1

    def take(self) -> float | None:
        """The mean since the last take (None: nothing was added), and start over."""
        total, count = self._total, self._count
        self._total, self._count = 0.0, 0
        return float(total) / count if count else None
