"""The sparse transfer formats for deltas: the k largest magnitudes of every chunk of
`CHUNK` elements, as ``TOPK_F8`` (F8_E4M3 codes with one power-of-two scale per chunk,
U16 offsets: 3 bytes a value) or ``TOPK_Q2`` (2-bit codes, a sign and one of two
magnitudes per chunk, 12-bit offsets: 1.75 bytes a value). The formats carried with error
feedback (`SPARSE_FORMATS`) also include ``SIGN1`` (`wire.signs`: 1-bit signs of a seeded
random share of the elements), which `sparsify` and `densify` hand to that module.

`sparsify(name, tensor, density, fmt)` keeps k = `chunk_k(density)` elements of each
chunk of the flat tensor (the last chunk, when shorter, min(k, its length)): those of
largest |value|, ties going to the lower index; `densify(entries, name, shape, fmt)`
turns the entries back into the dense F32 tensor they carry (zeros elsewhere). Chunks let
a reader merge by ranges: chunk c holds elements [c · CHUNK, (c + 1) · CHUNK) and only
those.

``TOPK_F8`` entries for a tensor `name` of n elements in m = ⌈n / CHUNK⌉ chunks, nnz
values in all (the wire format):

- ``<name>``: F8_E4M3 codes, shape [nnz], chunk by chunk, indices ascending;
- ``<name>.index``: U16, shape [nnz], each value's offset within its chunk;
- ``<name>.count``: U16, shape [m], the values of each chunk;
- ``<name>.scale``: F32, shape [m], each chunk's scale 2^k, k in [-126, 127], the smallest
  with the chunk's absmax <= 448 · 2^k (F8_E4M3's rule, per chunk; k = 0 for a chunk of
  zeros).

A value is its code's value times its chunk's scale, exact in float32, so
densify(sparsify(densify(...))) is a fixed point.

``TOPK_Q2`` entries (the chunks, counts and order of ``TOPK_F8``; packed little-endian):

- ``<name>``: U8, shape [⌈nnz / 4⌉], four 2-bit codes a byte, value i in bits
  2·(i mod 4) and up of byte ⌊i / 4⌋: bit 0 the sign (1: negative), bit 1 the level
  (0: the chunk's low magnitude, 1: its high one); unused bits zero;
- ``<name>.index``: U8, shape [⌈3 · nnz / 2⌉], each value's offset within its chunk in
  12 bits, two a 3-byte group (a | b << 12, little-endian), an odd last one in 2 bytes;
  unused bits zero;
- ``<name>.count``: U16, shape [m], as in ``TOPK_F8``;
- ``<name>.scale``: F32, shape [2m], each chunk's low and high magnitudes: the values
  kept split at their mean magnitude, each level the mean magnitude of its side.

A value is ± a level, exact in float32. What a learner keeps as its error feedback
(`true − densify(sent)`) is exact in either format. `densify` refuses, with
`CorruptPayload` naming the tensor and the rule: missing or mis-typed entries, counts that
exceed their chunk or do not add up to the values given, offsets past their chunk,
offsets not strictly ascending within a chunk (a duplicate or an unsorted one), F8 scales
that are not such powers of two, F8 codes that decode to NaN, Q2 levels that are negative
or not finite, Q2 padding bits that are not zero. Its work and memory are bounded by the
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
from gradientmail.wire import signs
from gradientmail.wire.quantization import non_finite_error, overflow_error
from gradientmail.wire.tensor_bytes import STORAGE_DTYPES, TensorBytes, entry_of, handed_over

__all__ = [
    "CHUNK",
    "DEFAULT_DENSITY",
    "SPARSE_FORMATS",
    "check_decay",
    "check_density",
    "check_overflow",
    "chunk_counts",
    "chunk_k",
    "default_density",
    "densify",
    "entry_names",
    "sparse_entries",
    "sparse_nbytes",
    "sparsify",
    "sparsify_sent",
]

#: Sparse transfer formats (a record's `delta_format`).
SPARSE_FORMATS: tuple[str, ...] = ("TOPK_F8", "TOPK_Q2", "SIGN1")
#: Elements per chunk: offsets fit a U16, and a chunk's values are a few hundred bytes.
CHUNK = 4096
#: The share of each chunk a top-k delta carries when a run's `delta_density` is None
#: (SIGN1's is 1: every element's sign).
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


def check_decay(decay: object) -> float:
    """`decay` (a sparse delta's `feedback_decay`) as a float in (0, 1]; `ConfigError`
    otherwise."""
    if isinstance(decay, bool) or not isinstance(decay, int | float) \
            or not math.isfinite(decay) or not 0 < decay <= 1:
        raise ConfigError(f"feedback_decay={decay!r} must be a number in (0, 1], e.g. 0.95 "
                          "(None keeps the residual whole)")
    return float(decay)


def chunk_k(density: float) -> int:
    """Values kept per full chunk: max(1, round(density · CHUNK))."""
    return max(1, round(check_density(density) * CHUNK))


def default_density(fmt: str) -> float:
    """The density of `fmt` when a run's `delta_density` is None."""
    return 1.0 if _format(fmt) == "SIGN1" else DEFAULT_DENSITY


def entry_names(name: str, fmt: str) -> tuple[str, ...]:
    """The entries that carry tensor `name` in the sparse format `fmt`."""
    suffixes = ("", ".scale", ".select") if _format(fmt) == "SIGN1" else ("", *(
        f".{s}" for s in _SUFFIXES))
    return tuple(f"{name}{s}" for s in suffixes)


def sparse_nbytes(numel: int, density: float, fmt: str = "TOPK_F8", seed: int = 0) -> int:
    """Exact data bytes of a tensor of `numel` elements sparsified in `fmt` (entries'
    headers aside; `seed`: SIGN1's)."""
    if _format(fmt) == "SIGN1":
        return signs.nbytes(numel, check_density(density), seed)
    k, m = chunk_k(density), -(-numel // CHUNK)
    nnz = sum(min(k, min(CHUNK, numel - c * CHUNK)) for c in range(m))
    if _format(fmt) == "TOPK_Q2":
        return -(-nnz // 4) + -(-3 * nnz // 2) + 10 * m
    return 3 * nnz + 6 * m


def _format(fmt: str) -> str:
    if fmt not in SPARSE_FORMATS:
        raise ConfigError(f"{fmt!r} is not a sparse format; use one of "
                          f"{', '.join(SPARSE_FORMATS)}")
    return fmt


def sparsify(name: str, tensor: TensorBytes, density: float, fmt: str = "TOPK_F8",
             seed: int = 0) -> dict[str, TensorBytes]:
    """The `fmt` entries carrying the top k = `chunk_k(density)` of each chunk of
    `tensor` (F32, F16 or BF16), or for SIGN1 the signs of the elements `seed` selects
    (`wire.signs`). `NonFiniteError` for NaN or infinite input, or (F8) values so near
    float32's maximum that their code would overflow it."""
    if not isinstance(tensor, TensorBytes) or tensor.dtype not in STORAGE_DTYPES:
        raise ConfigError(f"tensor {name!r}: can only sparsify {', '.join(STORAGE_DTYPES)} "
                          "TensorBytes")
    if _format(fmt) == "TOPK_F8":
        return sparsify_sent(name, tensor, density)[0]
    k = chunk_k(density)
    x = tensor.to_numpy().reshape(-1).astype(_F32, copy=False)
    if not np.isfinite(x).all():
        bad = np.flatnonzero(~np.isfinite(x))
        raise non_finite_error(name, int(bad.size), int(bad[0]), fmt)
    if fmt == "SIGN1":
        return signs.encode(name, x, density, seed)
    pos, counts = _kept(x, k)
    return _q2_entries(name, pos, pos // CHUNK, x[pos], counts)


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
    pos, counts = _kept(x, k)
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


def _kept(x: npt.NDArray[np.float32], k: int) -> tuple[npt.NDArray[np.int64],
                                                        npt.NDArray[np.uint16]]:
    """The flat positions (ascending) of the top k |values| of each chunk of `x`, and the
    values each chunk keeps."""
    n = x.size
    full = n // CHUNK
    flat: list[npt.NDArray[np.int64]] = []
    if full:
        flat.append(_top(np.abs(x[: full * CHUNK]).reshape(full, CHUNK), min(k, CHUNK)))
    if n % CHUNK:
        last = np.abs(x[full * CHUNK :]).reshape(1, -1)
        flat.append(_top(last, min(k, last.shape[1])) + full * CHUNK)
    pos = np.concatenate(flat) if flat else np.zeros(0, np.int64)
    return pos, chunk_counts(n, k)


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


def _q2_entries(name: str, pos: npt.NDArray[np.int64], chunk: npt.NDArray[np.int64],
                values: npt.NDArray[np.float32],
                counts: npt.NDArray[np.uint16]) -> dict[str, TensorBytes]:
    m = counts.size
    mag = np.abs(values).astype(np.float64)
    n_per = np.maximum(counts.astype(np.float64), 1.0)
    split = np.bincount(chunk, mag, minlength=m) / n_per
    high = mag > split[chunk]
    levels = np.zeros((m, 2), np.float64)
    for side in (0, 1):
        pick = high == bool(side)
        total = np.bincount(chunk[pick], mag[pick], minlength=m)
        many = np.bincount(chunk[pick], minlength=m)
        levels[:, side] = total / np.maximum(many, 1)
    # A chunk whose kept values share one magnitude has no high side: both levels alike.
    levels[:, 1] = np.where(levels[:, 1] > 0, levels[:, 1], levels[:, 0])
    codes = ((values < 0).astype(np.uint8) | (high.astype(np.uint8) << 1)).astype(np.uint8)
    return {
        name: TensorBytes("U8", (-(-pos.size // 4),), handed_over(_pack2(codes))),
        f"{name}.index": TensorBytes("U8", (-(-3 * pos.size // 2),),
                                     handed_over(_pack12(pos % CHUNK))),
        f"{name}.count": TensorBytes("U16", (m,), handed_over(counts.astype("<u2"))),
        f"{name}.scale": TensorBytes("F32", (2 * m,),
                                     handed_over(levels.astype("<f4").reshape(-1))),
    }


def _pack2(codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    padded = np.zeros(-(-codes.size // 4) * 4, np.uint8)
    padded[: codes.size] = codes
    q = padded.reshape(-1, 4)
    return np.ascontiguousarray(q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6))


def _unpack2(packed: npt.NDArray[np.uint8], nnz: int) -> npt.NDArray[np.uint8]:
    shifts = np.array([0, 2, 4, 6], np.uint8)
    return ((packed[:, None] >> shifts) & 3).reshape(-1)[:nnz].astype(np.uint8)


def _pack12(offsets: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
    n = offsets.size
    padded = np.zeros(n + n % 2, np.uint32)
    padded[:n] = offsets
    pair = padded[0::2] | (padded[1::2] << 12)  # 24 bits: a | b << 12
    out = np.stack([pair & 0xFF, (pair >> 8) & 0xFF, pair >> 16], axis=1).astype(np.uint8)
    return np.ascontiguousarray(out.reshape(-1)[: -(-3 * n // 2)])


def _unpack12(packed: npt.NDArray[np.uint8], nnz: int) -> npt.NDArray[np.int64]:
    full = np.zeros(-(-nnz // 2) * 3, np.uint32)
    full[: packed.size] = packed
    g = full.reshape(-1, 3)
    pair = g[:, 0] | (g[:, 1] << 8) | (g[:, 2] << 16)
    return np.stack([pair & 0xFFF, pair >> 12], axis=1).reshape(-1)[:nnz].astype(np.int64)


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


def densify(entries: Mapping[str, TensorBytes], name: str, shape: tuple[int, ...],
            fmt: str = "TOPK_F8", *, key: str | None = None) -> TensorBytes:
    """The dense F32 tensor of `shape` that the `fmt` entries of `name` carry;
    `CorruptPayload` (naming `key`, the tensor and the rule) for entries that break the
    format. `key` is only used in error messages."""
    where = f"{key}: " if key else ""
    q2 = _format(fmt) == "TOPK_Q2"
    n = math.prod(shape)
    if fmt == "SIGN1":
        return TensorBytes("F32", shape, handed_over(signs.decode(entries, name, n, where)))
    m = -(-n // CHUNK)
    codes = entry_of(entries, name, "U8" if q2 else "F8_E4M3", where, flat=True)
    index, count, scale = (entry_of(entries, f"{name}.{s}", d, where, flat=True)
                           for s, d in zip(_SUFFIXES, ("U8" if q2 else "U16", "U16", "F32"),
                                           strict=True))
    per = 2 if q2 else 1
    if count.shape != (m,) or scale.shape != (per * m,):
        raise CorruptPayload(
            f"{where}tensor {name!r}: count {list(count.shape)} and scale "
            f"{list(scale.shape)} must be [{m}] and [{per * m}] ({n} elements in chunks "
            f"of {CHUNK})")
    counts = np.frombuffer(count.buffer, "<u2").astype(np.int64)
    lengths = np.minimum(CHUNK, n - np.arange(m, dtype=np.int64) * CHUNK)
    over = np.flatnonzero(counts > lengths)
    if over.size:
        c = int(over[0])
        raise CorruptPayload(f"{where}tensor {name!r}: chunk {c} claims {int(counts[c])} "
                             f"values; it has {int(lengths[c])} elements")
    nnz = int(counts.sum())
    want = ((-(-nnz // 4),), (-(-3 * nnz // 2),)) if q2 else ((nnz,), (nnz,))
    if (codes.shape, index.shape) != want:
        raise CorruptPayload(
            f"{where}tensor {name!r}: counts add up to {nnz} values; codes "
            f"{list(codes.shape)} and index {list(index.shape)} must be "
            f"{list(want[0])} and {list(want[1])}")
    chunk = np.repeat(np.arange(m, dtype=np.int64), counts)
    if q2:
        return _q2_dense(codes, index, scale, chunk, lengths, n, shape, name, where)
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


def _q2_dense(codes: TensorBytes, index: TensorBytes, scale: TensorBytes,
              chunk: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], n: int,
              shape: tuple[int, ...], name: str, where: str) -> TensorBytes:
    nnz = chunk.size
    packed = np.frombuffer(codes.buffer, np.uint8)
    if nnz % 4 and packed[-1] >> (2 * (nnz % 4)):
        raise CorruptPayload(f"{where}tensor {name!r}: the last code byte's unused bits are "
                             "not zero; the payload is corrupt")
    raw = np.frombuffer(index.buffer, np.uint8)
    if nnz % 2 and raw[-1] >> 4:
        raise CorruptPayload(f"{where}tensor {name!r}: the last offset's unused bits are not "
                             "zero; the payload is corrupt")
    offsets = _unpack12(raw, nnz)
    _check_offsets(offsets, chunk, lengths, name, where)
    levels = np.frombuffer(scale.buffer, "<f4").reshape(-1, 2)
    bad = np.flatnonzero(~(np.isfinite(levels) & (levels >= 0)).all(axis=1))
    if bad.size:
        c = int(bad[0])
        raise CorruptPayload(
            f"{where}tensor {name!r}: chunk {c}'s levels {levels[c].tolist()} must be "
            "finite and >= 0; the payload is corrupt")
    q = _unpack2(packed, nnz)
    values = levels[chunk, q >> 1].astype(_F32)
    values[(q & 1).astype(bool)] *= -1
    out = np.zeros(n, _F32)
    out[chunk * CHUNK + offsets] = values
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

