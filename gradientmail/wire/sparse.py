"""The sparse transfer format for deltas: ``TOPK_F8``, the k largest magnitudes of every
chunk of `CHUNK` elements, as F8_E4M3 codes with one power-of-two scale per chunk.

`sparsify(name, tensor, density)` keeps k = `chunk_k(density)` elements of each chunk of
the flat tensor (the last chunk, when shorter, min(k, its length)): those of largest
|value|, ties going to the lower index; `densify(entries, name, shape)` turns the entries
back into the dense F32 tensor they carry (zeros elsewhere). Chunks let a reader merge by
ranges: chunk c holds elements [c · CHUNK, (c + 1) · CHUNK) and only those.

Entries for a tensor `name` of n elements in m = ⌈n / CHUNK⌉ chunks, nnz values in all
(the wire format):

- ``<name>``: F8_E4M3 codes, shape [nnz], chunk by chunk, indices ascending;
- ``<name>.index``: U16, shape [nnz], each value's offset within its chunk;
- ``<name>.count``: U16, shape [m], the values of each chunk;
- ``<name>.scale``: F32, shape [m], each chunk's scale 2^k, k in [-126, 127], the smallest
  with the chunk's absmax <= 448 · 2^k (F8_E4M3's rule, per chunk; k = 0 for a chunk of
  zeros).

A value is its code's value times its chunk's scale, exact in float32, so
densify(sparsify(densify(...))) is a fixed point and what a learner keeps as its error
feedback (`true − densify(sent)`) is exact. `densify` refuses, with `CorruptPayload`
naming the tensor and the rule: missing or mis-typed entries, counts that exceed their
chunk or do not add up to the values given, offsets past their chunk, offsets not
strictly ascending within a chunk (a duplicate or an unsorted one), scales that are not
such powers of two, codes that decode to NaN. Its work and memory are bounded by the
schema's n, never by what the payload claims.

This module owns the format; encoders only compute. `sparsify_sent` also returns what
the entries carry (positions and values, for a learner's error feedback), and the torch
kernels of `gradientmail.wire.sparse_torch` compute the same codes, offsets and exponents
on a tensor's device and hand them to `sparse_entries` (the layout) and `check_overflow`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import ml_dtypes
import numpy as np
import numpy.typing as npt

from gradientmail.errors import ConfigError, CorruptPayload
from gradientmail.wire.quantization import non_finite_error, overflow_error
from gradientmail.wire.tensor_bytes import STORAGE_DTYPES, TensorBytes, handed_over

__all__ = [
    "CHUNK",
    "DEFAULT_DENSITY",
    "SPARSE_FORMATS",
    "check_density",
    "check_overflow",
    "chunk_counts",
    "chunk_k",
    "densify",
    "sparse_entries",
    "sparse_nbytes",
    "sparsify",
    "sparsify_sent",
]

#: Sparse transfer formats (a record's `delta_format`).
SPARSE_FORMATS: tuple[str, ...] = ("TOPK_F8",)
#: Elements per chunk: offsets fit a U16, and a chunk's values are a few hundred bytes.
CHUNK = 4096
#: The share of each chunk a sparse delta carries when a run's `delta_density` is None.
DEFAULT_DENSITY = 1 / 32

_F32 = np.float32
_F32_MAX = float(np.finfo(np.float32).max)
_K_RANGE = (-126, 127)
_F8_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(_F32)
_SUFFIXES = ("index", "count", "scale")
_ROWS = 256  # chunks `_top` selects from at a time: 1 Mi elements


def check_density(density: object) -> float:
    """`density` as a float in (0, 1]; `ConfigError` otherwise."""
    if isinstance(density, bool) or not isinstance(density, int | float) \
            or not math.isfinite(density) or not 0 < density <= 1:
        raise ConfigError(f"delta_density={density!r} must be a number in (0, 1], e.g. 0.02")
    return float(density)


def chunk_k(density: float) -> int:
    """Values kept per full chunk: max(1, round(density · CHUNK))."""
    return max(1, round(check_density(density) * CHUNK))


def sparse_nbytes(numel: int, density: float) -> int:
    """Exact data bytes of a sparsified tensor of `numel` elements (entries' headers aside)."""
    k, m = chunk_k(density), -(-numel // CHUNK)
    nnz = sum(min(k, min(CHUNK, numel - c * CHUNK)) for c in range(m))
    return 3 * nnz + 6 * m


def sparsify(name: str, tensor: TensorBytes, density: float) -> dict[str, TensorBytes]:
    """The ``TOPK_F8`` entries carrying the top k = `chunk_k(density)` of each chunk of
    `tensor` (F32, F16 or BF16). `NonFiniteError` for NaN or infinite input, or values so
    near float32's maximum that their code would overflow it."""
    return sparsify_sent(name, tensor, density)[0]


def sparsify_sent(name: str, tensor: TensorBytes, density: float) -> tuple[
        dict[str, TensorBytes], npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """`sparsify`'s entries, with what they carry: the flat positions kept (ascending)
    and the float32 values `densify` gives them there (what a learner's error feedback
    subtracts, without decoding the entries again)."""
    if not isinstance(tensor, TensorBytes) or tensor.dtype not in STORAGE_DTYPES:
        raise ConfigError(f"tensor {name!r}: can only sparsify {', '.join(STORAGE_DTYPES)} "
                          "TensorBytes")
    k = chunk_k(density)
    x = tensor.to_numpy().reshape(-1).astype(_F32, copy=False)
    if not np.isfinite(x).all():
        bad = np.flatnonzero(~np.isfinite(x))
        raise non_finite_error(name, int(bad.size), int(bad[0]), "TOPK_F8")
    n = x.size
    full = n // CHUNK
    flat: list[npt.NDArray[np.int64]] = []
    counts = chunk_counts(n, k)
    if full:
        flat.append(_top(np.abs(x[: full * CHUNK]).reshape(full, CHUNK), min(k, CHUNK)))
    if n % CHUNK:
        last = np.abs(x[full * CHUNK :]).reshape(1, -1)
        flat.append(_top(last, min(k, last.shape[1])) + full * CHUNK)
    pos = np.concatenate(flat) if flat else np.zeros(0, np.int64)
    chunk = pos // CHUNK
    values = x[pos]
    amax = np.zeros(counts.size, _F32)
    np.maximum.at(amax, chunk, np.abs(values))
    mant, e = np.frexp(amax.astype(np.float64))
    kexp = e.astype(np.int32) - 9 + (mant > 0.875).astype(np.int32)  # 448 = 0.875 · 2^9
    kexp[amax == 0] = 0
    kexp = np.clip(kexp, *_K_RANGE).astype(np.int32)
    check_overflow(name, amax, kexp)
    scaled = values * np.ldexp(np.ones(chunk.size, _F32), -kexp[chunk]).astype(_F32)
    codes = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    entries = sparse_entries(name, codes, (pos % CHUNK).astype("<u2"), counts, kexp)
    sent = _F8_VALUES[codes] * np.ldexp(np.ones(chunk.size, _F32), kexp[chunk]).astype(_F32)
    return entries, pos, sent


def chunk_counts(numel: int, k: int) -> npt.NDArray[np.uint16]:
    """The values each chunk of a tensor of `numel` elements keeps: min(k, its length)."""
    m = -(-numel // CHUNK)
    lengths = np.minimum(CHUNK, numel - np.arange(m, dtype=np.int64) * CHUNK)
    return np.minimum(k, lengths).astype("<u2")


def check_overflow(name: str, amax: npt.NDArray[np.float32],
                   kexp: npt.NDArray[np.int32]) -> None:
    """`NonFiniteError` when a chunk's largest |value| `amax`, coded at its exponent
    `kexp`, decodes past float32's maximum (the largest code of each chunk is its
    absmax's: the F8 cast is monotone)."""
    top = (amax * np.ldexp(np.ones(amax.size, _F32), -kexp).astype(_F32)).astype(
        ml_dtypes.float8_e4m3fn)
    if amax.size and float(np.abs(np.ldexp(top.astype(np.float64), kexp)).max()) > _F32_MAX:
        raise overflow_error(name, "TOPK_F8")


def sparse_entries(name: str, codes: npt.NDArray[np.uint8], offsets: npt.NDArray[np.uint16],
                   counts: npt.NDArray[np.uint16], kexp: npt.NDArray[np.int32]
                   ) -> dict[str, TensorBytes]:
    """The ``TOPK_F8`` entries of `name` from what an encoder computed: the F8_E4M3 codes
    and the offsets within their chunks (nnz each, chunk by chunk), the values each chunk
    keeps and its exponent k (m each). The one place the layout is written."""
    scale = np.ldexp(np.ones(kexp.size, _F32), kexp.astype(np.int32)).astype("<f4")
    return {
        name: TensorBytes("F8_E4M3", (codes.size,), handed_over(np.ascontiguousarray(codes))),
        f"{name}.index": TensorBytes("U16", (offsets.size,),
                                     handed_over(np.ascontiguousarray(offsets, "<u2"))),
        f"{name}.count": TensorBytes("U16", (counts.size,),
                                     handed_over(np.ascontiguousarray(counts, "<u2"))),
        f"{name}.scale": TensorBytes("F32", (kexp.size,), handed_over(scale)),
    }


def _top(a: npt.NDArray[np.float32], k: int) -> npt.NDArray[np.int64]:
    """Flat positions (row-major, ascending) of the k largest of each row of `a`; among
    equal values at the threshold, the lowest indices (deterministic on every platform).
    `_ROWS` rows at a time, so that the temporaries stay a few MiB whatever the tensor."""
    width = a.shape[1]
    kth = width - k
    out: list[npt.NDArray[np.int64]] = []
    for r in range(0, a.shape[0], _ROWS):
        block = a[r : r + _ROWS]
        thr = np.partition(block, kth, axis=1)[:, kth : kth + 1]
        keep = block > thr
        need = k - keep.sum(axis=1)
        tied = block == thr
        many = np.flatnonzero(tied.sum(axis=1) > need)
        keep |= tied
        if many.size:  # more ties at the threshold than places left: the first ones
            first = np.cumsum(tied[many], axis=1) <= need[many, None]
            keep[many] = (block[many] > thr[many]) | (tied[many] & first)
        out.append(np.flatnonzero(keep).astype(np.int64) + r * width)
    return np.concatenate(out)


def densify(entries: Mapping[str, TensorBytes], name: str, shape: tuple[int, ...], *,
            key: str | None = None) -> TensorBytes:
    """The dense F32 tensor of `shape` that the ``TOPK_F8`` entries of `name` carry;
    `CorruptPayload` (naming `key`, the tensor and the rule) for entries that break the
    format. `key` is only used in error messages."""
    where = f"{key}: " if key else ""
    n = math.prod(shape)
    m = -(-n // CHUNK)
    codes = _entry(entries, name, "F8_E4M3", where)
    index, count, scale = (_entry(entries, f"{name}.{s}", d, where)
                           for s, d in zip(_SUFFIXES, ("U16", "U16", "F32"), strict=True))
    if count.shape != (m,) or scale.shape != (m,):
        raise CorruptPayload(
            f"{where}tensor {name!r}: count {list(count.shape)} and scale "
            f"{list(scale.shape)} must be [{m}] ({n} elements in chunks of {CHUNK})")
    counts = np.frombuffer(count.buffer, "<u2").astype(np.int64)
    lengths = np.minimum(CHUNK, n - np.arange(m, dtype=np.int64) * CHUNK)
    over = np.flatnonzero(counts > lengths)
    if over.size:
        c = int(over[0])
        raise CorruptPayload(f"{where}tensor {name!r}: chunk {c} claims {int(counts[c])} "
                             f"values; it has {int(lengths[c])} elements")
    nnz = int(counts.sum())
    if codes.shape != (nnz,) or index.shape != (nnz,):
        raise CorruptPayload(
            f"{where}tensor {name!r}: counts add up to {nnz} values; codes "
            f"{list(codes.shape)} and index {list(index.shape)} must be [{nnz}]")
    chunk = np.repeat(np.arange(m, dtype=np.int64), counts)
    offsets = np.frombuffer(index.buffer, "<u2").astype(np.int64)
    _check_offsets(offsets, chunk, lengths, name, where)
    factors = _scales(scale, name, where)
    values = _F8_VALUES[np.frombuffer(codes.buffer, np.uint8)]
    if not np.isfinite(values).all():
        raise CorruptPayload(f"{where}tensor {name!r}: TOPK_F8 codes decode to NaN; "
                             "the payload is corrupt")
    out = np.zeros(n, _F32)
    out[chunk * CHUNK + offsets] = values * factors[chunk]
    return TensorBytes("F32", shape, handed_over(out))


def _check_offsets(offsets: npt.NDArray[np.int64], chunk: npt.NDArray[np.int64],
                   lengths: npt.NDArray[np.int64], name: str, where: str) -> None:
    past = np.flatnonzero(offsets >= lengths[chunk])
    if past.size:
        i = int(past[0])
        raise CorruptPayload(
            f"{where}tensor {name!r}: value {i} has offset {int(offsets[i])} in chunk "
            f"{int(chunk[i])} of {int(lengths[chunk[i]])} elements")
    same = chunk[1:] == chunk[:-1]
    bad = np.flatnonzero(same & (offsets[1:] <= offsets[:-1]))
    if bad.size:
        i = int(bad[0]) + 1
        what = "repeats" if offsets[i] == offsets[i - 1] else "is below"
        raise CorruptPayload(
            f"{where}tensor {name!r}: value {i}'s offset {int(offsets[i])} {what} the one "
            f"before it in chunk {int(chunk[i])}; offsets must ascend strictly")


def _scales(scale: TensorBytes, name: str, where: str) -> npt.NDArray[np.float32]:
    s = np.frombuffer(scale.buffer, "<f4")
    with np.errstate(invalid="ignore"):
        mant, e = np.frexp(s.astype(np.float64))
    bad = np.flatnonzero(~np.isfinite(s) | (mant != 0.5) | (e - 1 < _K_RANGE[0])
                         | (e - 1 > _K_RANGE[1]))
    if bad.size:
        c = int(bad[0])
        raise CorruptPayload(
            f"{where}tensor {name!r}: chunk {c}'s scale {float(s[c])!r} is not a power of "
            f"two 2^k with k in [{_K_RANGE[0]}, {_K_RANGE[1]}]; the payload is corrupt")
    return s.astype(_F32)


def _entry(entries: Mapping[str, TensorBytes], name: str, dtype: str, where: str) -> TensorBytes:
    entry = entries.get(name)
    if entry is None:
        raise CorruptPayload(f"{where}tensor {name!r} is missing from the payload")
    if not isinstance(entry, TensorBytes) or entry.dtype != dtype or len(entry.shape) != 1:
        got = (f"{entry.dtype}{list(entry.shape)}" if isinstance(entry, TensorBytes)
               else type(entry).__name__)
        raise CorruptPayload(f"{where}tensor {name!r} is {got}; expected a 1-D {dtype}")
    return entry
