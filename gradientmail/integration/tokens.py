"""How many tokens a batch holds: one rule for every integration.

The count weighs a learner's contribution in the merge, so the same batch must count the
same under Lightning and under Accelerate. Padding is no training signal: wherever a
batch carries an `attention_mask`, its non-zero entries are the tokens; otherwise every
element of `input_ids` (or of the batch's inputs tensor) is one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradientmail.errors import ConfigError

__all__ = ["count_tokens"]


def count_tokens(batch: Any) -> int:
    """The tokens in `batch`.

    - an int: itself (a count made by the caller; must be >= 0);
    - a tensor: its element count;
    - a mapping: the non-zero entries of its `attention_mask`, else the element count of
      its `input_ids` (Hugging Face tokenizer and collator output);
    - a list or tuple: the count of its first element (the inputs of `(inputs, targets)`).

    `ConfigError` for anything else, naming what was found: pass `tokens_per_step` to the
    integration instead.
    """
    if isinstance(batch, bool):
        raise ConfigError(f"cannot count tokens in {batch!r}; pass an int, a tensor or a batch")
    if isinstance(batch, int):
        if batch < 0:
            raise ConfigError(f"a token count must be >= 0, got {batch}")
        return batch
    if isinstance(batch, torch.Tensor):
        return int(batch.numel())
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(torch.count_nonzero(mask).item())
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return int(ids.numel())
        raise ConfigError(
            f"cannot count tokens in a batch with keys {sorted(map(str, batch))}; it needs "
            "'attention_mask' or 'input_ids' tensors (or pass tokens_per_step)"
        )
    if isinstance(batch, list | tuple) and batch:
        return count_tokens(batch[0])
    raise ConfigError(
        f"cannot count tokens in a {type(batch).__name__}; pass an int, a tensor, a list or "
        "tuple whose first element is the inputs, or a mapping with input_ids (or pass "
        "tokens_per_step)"
    )
