"""What a round merges of a contribution whose record passed `keyspace.screen_snapshot`:
its delta's values checked, and its norm for the outlier rule (`diloco.outliers`).

Pure functions over tensors: the syncer fetches a payload and reports what these say.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gradientmail.algorithms.base import Contribution
from gradientmail.backends.base import Backend
from gradientmail.backends.numpy_backend import NumpyBackend
from gradientmail.errors import GradientmailError
from gradientmail.wire.quantization import dequantize
from gradientmail.wire.serialization import TensorBytes

__all__ = ["delta_norms", "screen_delta"]


def screen_delta(
    entries: Mapping[str, TensorBytes] | None, names: Sequence[str], delta_format: str | None
) -> dict[str, TensorBytes] | str:
    """The delta of `names` a round merges from a contribution's checked payload
    `entries` (dequantized to F32 unless stored as F32, F16 or BF16), or why it cannot:
    "payload swept" (no `entries`: the payload is gone), "unreadable: ..." (it does not
    dequantize), "non-finite values in [names]"."""
    if entries is None:
        return "payload swept"
    try:
        delta = _dequantized(entries, names, delta_format)
    except GradientmailError as exc:
        return f"unreadable: {exc}"
    bad = [n for n in names if not _finite(delta[n])]
    if bad:
        return f"non-finite values in {bad}"
    return delta


def delta_norms(contributions: Sequence[Contribution],
                backend: Backend | None = None) -> dict[str, float]:
    """Each contribution's delta norm over all its tensors, as one vector."""
    be = NumpyBackend() if backend is None else backend
    return {c.learner: math.sqrt(sum(be.load(t).norm() ** 2 for t in c.delta.values()))
            for c in contributions}


def _dequantized(
    entries: Mapping[str, TensorBytes], names: Sequence[str], fmt: str | None
) -> dict[str, TensorBytes]:
    if fmt is None or (
        fmt in ("F32", "F16", "BF16") and all(entries[n].dtype == fmt for n in names)
    ):
        return {n: entries[n] for n in names}
    if all(entries[n].dtype == "F32" and f"{n}.scale" not in entries for n in names):
        # A quantized delta made of parts: each part was dequantized on its own
        # (`wire.parts.assemble`), its scales with it.
        return {n: entries[n] for n in names}
    return {n: dequantize(entries, n, fmt) for n in names}


def _finite(t: TensorBytes) -> bool:
    arr: Any = t.to_numpy()
    return bool(np.isfinite(arr.astype(np.float32)).all()) if arr.size else True
