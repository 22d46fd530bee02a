"""`RowPieces`: a tensor held as consecutive row ranges of other tensors, never joined.

A contribution made of parts (docs/design/sharded.md §3) arrives as each rank's rows of each
tensor. The closer merges them where they lie: the numpy backend reads each window of
the logical tensor from the piece that covers it (a view), copying only a window that
straddles two pieces, so no full copy of the tensor is made for the merge. Pieces of
quantized parts stay quantized (`Quantized`, each with its own scales): the merge reads
them as F32, a window at a time, so no F32 copy of them is made either.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import numpy as np
import numpy.typing as npt

from gradientmail.errors import ConfigError
from gradientmail.wire.quantization import Quantized
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["DeltaTensor", "FlatRows", "Piece", "RowPieces"]

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


class FlatRows:
    """The flat float32 elements of a `RowPieces`, sliced as an array is (`[s:e]`, step 1):
    a slice inside one F32 piece is a view of it; one across pieces, or of an F16/BF16
    piece (exactly widened) or a `Quantized` one (decoded), is a new array of that slice
    alone. What a backend's merge reads, a window at a time."""

    __slots__ = ("_pieces", "_starts", "size")

    def __init__(self, rows: RowPieces) -> None:
        native = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}[rows.dtype]
        self._pieces = [t if isinstance(t, Quantized) else np.frombuffer(t.buffer, native)
                        for _, t in rows.pieces]
        self._starts = [0]
        for _, t in rows.pieces:
            self._starts.append(self._starts[-1] + t.numel)
        self.size = self._starts[-1]

    def _read(self, i: int, s: int, e: int,
              out: npt.NDArray[np.float32] | None = None) -> npt.NDArray[np.float32]:
        """Elements [s, e) of piece i."""
        piece = self._pieces[i]
        if isinstance(piece, Quantized):
            return piece.read(s, e, out=out)
        if out is None:
            return _widened(piece[s:e])
        np.copyto(out, _widened(piece[s:e]))
        return out

    def __getitem__(self, window: slice) -> npt.NDArray[np.float32]:
        s, e = window.start, min(window.stop, self.size)
        if e <= s:
            return np.empty(0, dtype=np.float32)
        i = bisect.bisect_right(self._starts, s) - 1
        if e <= self._starts[i + 1]:
            base = self._starts[i]
            return self._read(i, s - base, e - base)
        out = np.empty(e - s, dtype=np.float32)
        at = s
        while at < e:
            base, end = self._starts[i], self._starts[i + 1]
            n = min(e, end) - at
            self._read(i, at - base, at - base + n, out[at - s : at - s + n])
            at += n
            i += 1
        return out


def _widened(a: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """Float32 elements of F32 (as they are), F16 or BF16 bits (exactly widened)."""
    if a.dtype == np.float32:
        return a
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return a.astype(np.float32)
