"""`RowPieces`: a tensor held as consecutive row ranges of other tensors, never joined.

A contribution made of parts (docs/sharded.md §3) arrives as each rank's rows of each
tensor. The closer merges them where they lie: the numpy backend reads each window of
the logical tensor from the piece that covers it (a view), copying only a window that
straddles two pieces, so no full copy of the tensor is made for the merge. Pieces of
quantized parts stay quantized (`Quantized`, each with its own scales): the merge reads
them as F32, a window at a time, so no F32 copy of them is made either.
"""

from __future__ import annotations

import math

import numpy as np

from gradientmail.errors import ConfigError
from gradientmail.wire.quantization import Quantized
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["DeltaTensor", "Piece", "RowPieces"]

#: Dtypes whose pieces a merge reads as they are (quantized parts are `Quantized`, F32).
_MERGEABLE = ("F32", "F16", "BF16")

#: One piece's rows: stored bytes, or a quantized part's codes read as F32.
Piece = TensorBytes | Quantized


class RowPieces:
    """The tensor of `dtype` and `shape` whose rows [start, start + len) are each piece's,
    the pieces in row order tiling dim 0 exactly once (no empty piece). A piece is a
    `TensorBytes` of `dtype`, or, in an F32 tensor, a `Quantized` (its F32 values).
    Immutable."""

    __slots__ = ("dtype", "pieces", "shape")

    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[tuple[int, Piece], ...]

    def __init__(self, dtype: str, shape: tuple[int, ...],
                 pieces: tuple[tuple[int, Piece], ...]) -> None:
        if dtype not in _MERGEABLE:
            raise ConfigError(f"RowPieces of {dtype}: a merge reads {', '.join(_MERGEABLE)} "
                              "pieces; put a quantized part's rows in an F32 RowPieces as "
                              "a `Quantized` (quantization.dequantizing)")
        if not shape:
            raise ConfigError("RowPieces needs a tensor with rows, not a scalar")
        at = 0
        for start, t in pieces:
            read_as = "F32" if isinstance(t, Quantized) else t.dtype
            if start != at or read_as != dtype or not t.shape or t.shape[0] == 0 \
                    or t.shape[1:] != shape[1:]:
                raise ConfigError(
                    f"piece at row {start} ({t.dtype}{list(t.shape)}) does not continue a "
                    f"{dtype}{list(shape)} tensor at row {at}; pieces must tile its rows "
                    "in order, none empty")
            at += t.shape[0]
        if at != shape[0]:
            raise ConfigError(f"pieces hold {at} rows of a tensor of {shape[0]}")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "pieces", pieces)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"RowPieces is immutable; cannot set {name!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def joined(self) -> TensorBytes:
        """The tensor as one `TensorBytes`: a copy of every piece (`Quantized` ones
        decoded), for readers that need it whole (`parts.assemble`)."""
        itemsize = 2 if self.dtype in ("F16", "BF16") else 4
        out = bytearray(itemsize * self.numel)
        pos = 0
        for _, t in self.pieces:
            if isinstance(t, Quantized):
                t.read(0, t.numel, out=np.frombuffer(out, np.float32, t.numel, pos))
                pos += 4 * t.numel
            else:
                out[pos : pos + t.nbytes] = t.buffer
                pos += t.nbytes
        return TensorBytes(self.dtype, self.shape, memoryview(out).toreadonly())

    def __repr__(self) -> str:
        rows = [[a, a + t.shape[0]] for a, t in self.pieces]
        kinds = sorted({t.dtype for _, t in self.pieces} - {self.dtype})
        read = f", read from {'/'.join(kinds)}" if kinds else ""
        return f"RowPieces({self.dtype}{list(self.shape)}, rows={rows}{read})"


#: A delta tensor as a merge takes it: whole, or in row pieces.
DeltaTensor = TensorBytes | RowPieces
