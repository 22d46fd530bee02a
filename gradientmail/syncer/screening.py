"""What a round merges of a contribution whose record passed `keyspace.screen_snapshot`:
its delta's values checked, and its norm for the outlier rule (`algorithms.rounds.outliers`).

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
from gradientmail.wire.quantization import Quantized, dequantize, dequantizing
from gradientmail.wire.sharded_pieces import DeltaTensor, RowPieces
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["delta_norms", "screen_delta"]

#: Elements `_finite` checks at a time.
_WINDOW = 1 << 16


def screen_delta(
    entries: Mapping[str, DeltaTensor] | None, names: Sequence[str], delta_format: str | None
) -> dict[str, DeltaTensor] | str:
    """The delta of `names` a round merges from a contribution's checked payload
    `entries` (read as F32 unless stored as F32, F16 or BF16: an F8/F4 tensor with rows
    becomes a `RowPieces` of one `Quantized` piece, decoded a window at a time by the
    merge; a tensor in `RowPieces` stays in its pieces), or why it cannot:
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
    entries: Mapping[str, DeltaTensor], names: Sequence[str], fmt: str | None
) -> dict[str, DeltaTensor]:
    if fmt is None or (
        fmt in ("F32", "F16", "BF16") and all(entries[n].dtype == fmt for n in names)
    ):
        return {n: entries[n] for n in names}
    if all(entries[n].dtype == "F32" and f"{n}.scale" not in entries for n in names):
        # A quantized delta made of parts: each part read with its own scales
        # (`wire.sharded_parts.pieces_of`).
        return {n: entries[n] for n in names}
    whole = {n: t for n, t in entries.items() if isinstance(t, TensorBytes)}
    return {n: _read_as_f32(whole, n, fmt) for n in names}


def _read_as_f32(entries: Mapping[str, TensorBytes], name: str, fmt: str) -> DeltaTensor:
    codes = entries.get(name)
    if fmt in ("F8_E4M3", "F4") and codes is not None and codes.shape and codes.shape[0]:
        # The same checks and errors as `dequantize`, without its F32 copy of the tensor.
        q = dequantizing(entries, name, fmt)
        return RowPieces("F32", q.shape, ((0, q),))
    return dequantize(entries, name, fmt)


def _finite(t: DeltaTensor | Quantized) -> bool:
    if isinstance(t, RowPieces):
        # Piece by piece: a contribution of parts is never joined to be screened.
        return all(_finite(piece) for _, piece in t.pieces)
    if isinstance(t, Quantized):
        return True  # `dequantizing` checked every value it decodes to
    arr: Any = t.to_numpy().reshape(-1)
    # A window at a time: checking a tensor must not cost a float32 copy of it.
    for s in range(0, arr.size, _WINDOW):
        window = arr[s : s + _WINDOW]
        if window.dtype != np.float32:
            window = window.astype(np.float32)
        if not np.isfinite(window).all():
            return False
    return True
