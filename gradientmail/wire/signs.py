"""``SIGN1``, a delta format carried with error feedback: the signs of a seeded random
share of the elements, one bit each, and one magnitude per chunk of `CHUNK` elements.

Element i of a tensor is *selected* when `select_hash(seed, i) <= threshold` (a 32-bit
mix of the element's flat index and the payload's seed; threshold = ⌊density · 2³²⌋,
2³² − 1 at density 1: every element). No offsets travel: a reader recomputes the
selection from the seed (a part of a tensor starting at flat element o carries
`shifted_seed(seed, o)`, so it selects the whole tensor's elements there). The poster
seeds with the round, so every learner of a round sends the same elements and their mean
is a mean of whole values. Each selected element travels as ± its chunk's magnitude, the
mean |value| of the chunk's selected elements (the scaled sign of error-feedback
signSGD); what that does not carry stays in the learner's residual (`learner.feedback`).

Entries for a tensor `name` of n elements in m = ⌈n / CHUNK⌉ chunks, s selected:

- ``<name>``: U8, shape [⌈s / 8⌉], the selected elements' signs in index order, bit
  i mod 8 of byte ⌊i / 8⌋ (1: negative); unused bits zero;
- ``<name>.scale``: F32, shape [m], each chunk's magnitude (finite, >= 0);
- ``<name>.select``: U32, shape [2], the seed and the threshold.

About n/8 bytes at density 1 (31.75× fewer than F32 before headers), n·density/8 below.
`decode` refuses, with `CorruptPayload` naming the tensor and the rule, missing or
mis-typed entries, a sign count that is not the selection's, set padding bits and
magnitudes that are negative or not finite; its work and memory are bounded by the
schema's n (any seed and threshold select at most n elements).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from gradientmail.errors import CorruptPayload
from gradientmail.wire.tensor_bytes import TensorBytes, entry_of, handed_over

__all__ = ["decode", "encode", "nbytes", "select_hash", "shifted_seed", "threshold"]

CHUNK = 4096
_BLOCK = 1 << 20  # elements hashed at a time: bounded temporaries


def threshold(density: float) -> int:
    """The 32-bit threshold of `density` in (0, 1]."""
    return min((1 << 32) - 1, math.floor(density * (1 << 32)))


def select_hash(seed: int, start: int, stop: int) -> npt.NDArray[np.uint32]:
    """The 32-bit hashes of flat indices [start, stop) under `seed` (murmur3's finalizer of
    index · golden ratio + seed; uint32 arithmetic wraps the same on every platform)."""
    h = np.arange(start, stop, dtype=np.uint64).astype(np.uint32)
    h *= np.uint32(0x9E3779B1)
    h += np.uint32(seed & 0xFFFFFFFF)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def shifted_seed(seed: int, offset: int) -> int:
    """The seed under which index i selects what index `offset` + i selects under `seed`:
    `select_hash` mixes index · golden ratio + seed in uint32 arithmetic, so a shift of the
    index is one of the seed. A part of a tensor that starts at flat element `offset` (a
    sharded learner's rows, `wire.sharded_parts`) encoded with it selects the elements an
    unsharded learner's payload selects there, and reads as an ordinary payload."""
    return (seed + offset * 0x9E3779B1) & 0xFFFFFFFF


def _selected(n: int, seed: int, thr: int) -> npt.NDArray[np.int64]:
    if thr >= (1 << 32) - 1:
        return np.arange(n, dtype=np.int64)
    parts = [np.flatnonzero(select_hash(seed, a, min(a + _BLOCK, n)) <= np.uint32(thr)) + a
             for a in range(0, n, _BLOCK)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def nbytes(numel: int, density: float, seed: int) -> int:
    """Exact data bytes of a tensor of `numel` elements encoded at `density` with `seed`."""
    s = _selected(numel, seed, threshold(density)).size
    return -(-s // 8) + 4 * -(-numel // CHUNK) + 8


def encode(name: str, x: npt.NDArray[np.float32], density: float,
           seed: int) -> dict[str, TensorBytes]:
    """The ``SIGN1`` entries of the flat float32 array `x` (finite: the caller checks)."""
    n, m = x.size, -(-x.size // CHUNK)
    thr = threshold(density)
    pos = _selected(n, seed, thr)
    chunk = pos // CHUNK
    mag = np.abs(x[pos]).astype(np.float64)
    many = np.bincount(chunk, minlength=m)
    scale = (np.bincount(chunk, mag, minlength=m) / np.maximum(many, 1)).astype("<f4")
    signs = np.packbits((x[pos] < 0).astype(np.uint8), bitorder="little")
    return {
        name: TensorBytes("U8", (signs.size,), handed_over(np.ascontiguousarray(signs))),
        f"{name}.scale": TensorBytes("F32", (m,), handed_over(scale)),
        f"{name}.select": TensorBytes("U32", (2,), handed_over(
            np.array([seed & 0xFFFFFFFF, thr], "<u4"))),
    }


def decode(entries: Mapping[str, TensorBytes], name: str, n: int, where: str) -> \
        npt.NDArray[np.float32]:
    """The flat float32 values the ``SIGN1`` entries of `name` (n elements) carry."""
    m = -(-n // CHUNK)
    signs, scale, select = (entry_of(entries, f"{name}{s}", d, where, flat=True) for s, d in
                            (("", "U8"), (".scale", "F32"), (".select", "U32")))
    if scale.shape != (m,) or select.shape != (2,):
        raise CorruptPayload(
            f"{where}tensor {name!r}: scale {list(scale.shape)} and select "
            f"{list(select.shape)} must be [{m}] and [2] ({n} elements in chunks of {CHUNK})")
    seed, thr = (int(v) for v in np.frombuffer(select.buffer, "<u4"))
    pos = _selected(n, seed, thr)
    if signs.shape != (-(-pos.size // 8),):
        raise CorruptPayload(
            f"{where}tensor {name!r}: seed {seed} and threshold {thr} select {pos.size} "
            f"elements; signs {list(signs.shape)} must be [{-(-pos.size // 8)}]")
    packed = np.frombuffer(signs.buffer, np.uint8)
    if pos.size % 8 and packed[-1] >> (pos.size % 8):
        raise CorruptPayload(f"{where}tensor {name!r}: the last sign byte's unused bits are "
                             "not zero; the payload is corrupt")
    mags = np.frombuffer(scale.buffer, "<f4")
    bad = np.flatnonzero(~(np.isfinite(mags) & (mags >= 0)))
    if bad.size:
        c = int(bad[0])
        raise CorruptPayload(f"{where}tensor {name!r}: chunk {c}'s magnitude "
                             f"{float(mags[c])!r} must be finite and >= 0; the payload is "
                             "corrupt")
    negative = np.unpackbits(packed, count=pos.size, bitorder="little").astype(bool)
    values = mags[pos // CHUNK].astype(np.float32)
    values[negative] *= -1
    out = np.zeros(n, np.float32)
    out[pos] = values
    return out

