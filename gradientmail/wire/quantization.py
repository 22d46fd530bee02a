"""Transfer formats for deltas and commits: BF16, F8_E4M3 and F4 (E2M1 in the MX layout).

`quantize(name, tensor, fmt)` turns a storage tensor (F32, F16 or BF16) into the entries
that travel in a payload; `dequantize(entries, name, fmt)` turns them back into F32, and
`dequantizing` (F8, F4) into a `Quantized` that reads any window of those F32 values
from the codes and scales alone (a closer merges a quantized delta that way). The
dequantized values are exactly the values the format represents (code value × 2^k, with
no rounding in float32), so a tensor already representable round-trips bit for bit and
`roundtrip(roundtrip(t)) == roundtrip(t)`.

Formats (entry names and dtypes are the wire format):

- ``BF16``: ``<name>`` as BF16, rounded to nearest even. No scale.
- ``F8_E4M3``: ``<name>`` as F8_E4M3 codes (the "fn" variant: max 448, no infinity) and
  ``<name>.scale``, one F32 power of two 2^k per tensor, k in [-126, 127], chosen as the
  smallest k with absmax <= 448 · 2^k (k = 0 for an all-zero or empty tensor).
- ``F4``: ``<name>`` as F4 (E2M1 codes, values 0, ±0.5 … ±6, two per byte, element 2i in
  the low nibble, same shape as the input) and ``<name>.scale`` as F8_E8M0 (the MX scale
  type: a byte e meaning 2^(e − 127), 0xFF is NaN), one per block of 32 consecutive
  elements in row-major order, the last block possibly short; k in [-127, 127] is the
  smallest with the block's absmax <= 6 · 2^k (k = 0 for an all-zero block).

Errors: non-finite input, or finite input whose rounding would exceed float32's range,
raises `NonFiniteError` naming the tensor; missing, mis-typed or mis-shaped entries and
NaN, infinite, zero or non-power-of-two scales raise `CorruptPayload` naming the tensor.

F8 and F4 codes come from the float32 bits: each scaled value is rounded to odd at 16
bits (its top 16 bits, the lowest of them set when any bit below is), and a 65,536-entry
table maps that to the code ml_dtypes' round-to-nearest-even cast gives (rounding to odd
first, with at least two bits more than the target keeps, rounds the same). numpy does it
a cache-sized chunk at a time in the calling thread; the kernels of
`gradientmail.wire.quantization_torch` give the same bytes (which the tests check),
which also quantize a torch tensor on its own device (`quantize_tensor`). BF16 uses
ml_dtypes' cast, which is fast already.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from gradientmail.errors import ConfigError, CorruptPayload, NonFiniteError
from gradientmail.wire.tensor_bytes import STORAGE_DTYPES, TensorBytes, entry_of, handed_over

__all__ = [
    "BLOCK",
    "F4_CODES",
    "F8_CODES",
    "FORMATS",
    "Quantized",
    "bytes_per_element",
    "check_format",
    "dequantize",
    "dequantizing",
    "non_finite_error",
    "overflow_error",
    "quantize",
    "quantized_nbytes",
    "roundtrip",
    "scale_name",
]

FORMATS: tuple[str, ...] = ("BF16", "F8_E4M3", "F4")
#: Elements per F4 scale block (the MX block size).
BLOCK = 32

_F32 = np.float32
_F32_MAX = float(np.finfo(np.float32).max)
# Elements per pass of the numpy quantizers: their temporaries (9 bytes per element,
# 576 KiB) stay in a core's L2, so each pass after the first reads cache, not memory;
# smaller chunks lose more to numpy's per-call cost (measured: 1 << 14 is 25% slower).
_CODE_CHUNK = 1 << 16
# Elements `Quantized` decodes at a time: its temporaries (a few bytes per element) stay
# far below the window of F32 a closer's merge reads (the numpy backend's 64 Ki).
_DECODE = 1 << 16
_GATHER = 1 << 13  # codes per `take`: its int64 copy of them is 64 KiB

# (largest code value as mantissa · 2^exponent with mantissa in [0.5, 1), k range)
_F8_MAX_M, _F8_MAX_E, _F8_K = 0.875, 9, (-126, 127)  # 448 = 0.875 · 2^9
_F4_K = (-127, 127)  # 6 = 1.5 · 2^2: see `_f4_exponents`

# Code → value tables for decoding, built from ml_dtypes (a gather beats its cast 3×).
_F8_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(_F32)
_F4_VALUES = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(_F32)
# Byte → the values of its two nibbles (low first) as one 8-byte word: one gather decodes
# two elements, in their order in memory.
_F4_PAIRS = np.stack([_F4_VALUES[np.arange(256) & 15], _F4_VALUES[np.arange(256) >> 4]],
                     axis=1).reshape(-1).view(np.uint64)


def check_format(fmt: str) -> str:
    """Return `fmt` if it is a transfer format; `ConfigError` otherwise."""
    if fmt not in FORMATS:
        raise ConfigError(f"transfer format {fmt!r} is not one of {', '.join(FORMATS)}")
    return fmt


def scale_name(name: str) -> str:
    """The entry that carries `name`'s scale: ``<name>.scale``."""
    return name + ".scale"


def bytes_per_element(fmt: str) -> float:
    """Average bytes per element on the wire, scales included (F8's one scale excluded)."""
    return {"BF16": 2.0, "F8_E4M3": 1.0, "F4": 0.5 + 1 / BLOCK}[check_format(fmt)]


def quantized_nbytes(fmt: str, numel: int) -> int:
    """Exact data bytes of a quantized tensor of `numel` elements, scales included."""
    check_format(fmt)
    if fmt == "BF16":
        return 2 * numel
    if fmt == "F8_E4M3":
        return numel + 4
    return (numel + 1) // 2 + -(-numel // BLOCK)


def check_quantizable(name: str, tensor: TensorBytes, fmt: str) -> None:
    """`ConfigError` unless `fmt` is a format and `tensor` a TensorBytes of a float dtype
    a format can carry."""
    check_format(fmt)
    if not isinstance(tensor, TensorBytes) or tensor.dtype not in STORAGE_DTYPES:
        got = tensor.dtype if isinstance(tensor, TensorBytes) else type(tensor).__name__
        raise ConfigError(
            f"tensor {name!r}: can only quantize {', '.join(STORAGE_DTYPES)} TensorBytes, not {got}"
        )


def quantize(name: str, tensor: TensorBytes, fmt: str) -> dict[str, TensorBytes]:
    """The entries carrying `tensor` in format `fmt`: ``{name: codes[, name.scale: scale]}``,
    computed by numpy in the calling thread (`quantization_torch.quantize_bytes` gives the
    same bytes from torch kernels)."""
    check_quantizable(name, tensor, fmt)
    x = tensor.to_numpy().reshape(-1)
    if fmt == "BF16":
        return {name: _quantize_bf16(name, tensor, x)}
    if fmt == "F8_E4M3":
        return _quantize_f8(name, tensor.shape, x)
    return _quantize_f4(name, tensor.shape, x)


def roundtrip(tensor: TensorBytes, fmt: str) -> TensorBytes:
    """The F32 tensor that `fmt` represents for `tensor`: dequantize(quantize(tensor))."""
    return dequantize(quantize("t", tensor, fmt), "t", fmt)


def non_finite_error(name: str, count: int, first: int, fmt: str) -> NonFiniteError:
    """The error for a tensor holding `count` NaN or infinite values, the first at flat
    index `first` (shared with the torch kernels, which count on the device)."""
    return NonFiniteError(
        f"tensor {name!r} holds {count} NaN or infinite values (first at flat index "
        f"{first}); cannot quantize to {fmt}. Check the training loss and gradients "
        "before publishing"
    )


def _non_finite(name: str, x: npt.NDArray[Any], fmt: str) -> NonFiniteError:
    bad = np.flatnonzero(~np.isfinite(x))
    return non_finite_error(name, int(bad.size), int(bad[0]), fmt)


def overflow_error(name: str, fmt: str) -> NonFiniteError:
    """The error for finite values that round past float32's range."""
    return NonFiniteError(
        f"tensor {name!r} holds values near float32's maximum that overflow to infinity "
        f"when rounded to {fmt}; rescale the tensor"
    )


def _chunks(x: npt.NDArray[Any], step: int) -> Iterator[tuple[int, npt.NDArray[np.float32]]]:
    """(start, x[start : start + step] as float32) over flat `x`: views of F32 input,
    F16/BF16 converted a chunk at a time into one reused buffer."""
    buf = None if x.dtype == _F32 else np.empty(min(step, x.size), _F32)
    for i in range(0, x.size, step):
        part = x[i : i + step]
        if buf is not None:
            part = buf[: part.size]
            part[...] = x[i : i + step]
        yield i, part


def _absmax_bits(x: npt.NDArray[Any]) -> int:
    """The largest float32 bit pattern of |x| (0 when empty): above 0x7F800000 for a NaN,
    equal for an infinity. Integer max over the sign-cleared bits: one pass, no NaN rules."""
    best = 0
    tmp = np.empty(min(_CODE_CHUNK, x.size), np.uint32)
    for _, part in _chunks(x, _CODE_CHUNK):
        t = tmp[: part.size]
        np.bitwise_and(part.view(np.uint32), 0x7FFFFFFF, out=t)
        best = max(best, int(t.max()))
    return best


def _absmax(x: npt.NDArray[Any]) -> float:
    """max |x| (NaN if any NaN, inf if any infinity), 0 for an empty array."""
    return float(np.array(_absmax_bits(x), np.uint32).view(_F32))


def _quantize_bf16(name: str, tensor: TensorBytes, x: npt.NDArray[Any]) -> TensorBytes:
    amax = _absmax(x)
    if not math.isfinite(amax):
        raise _non_finite(name, x.astype(_F32), "BF16")
    if not math.isfinite(float(np.array(amax, _F32).astype(ml_dtypes.bfloat16))):
        raise overflow_error(name, "BF16")
    if tensor.dtype == "BF16":
        return TensorBytes("BF16", tensor.shape, tensor.buffer)
    data = handed_over(x.astype(ml_dtypes.bfloat16))
    return TensorBytes("BF16", tensor.shape, data)


def _exponents(
    amax: npt.NDArray[np.float64], max_m: float, max_e: int, k_range: tuple[int, int]
) -> npt.NDArray[np.int32]:
    """Smallest k per element with amax <= max · 2^k, clamped to `k_range`; 0 where amax is 0.

    With amax = m · 2^e (m in [0.5, 1)) and max = max_m · 2^max_e, k = e − max_e when
    m <= max_m, else one more: exact integer arithmetic, no log2 rounding at the edges.
    """
    m, e = np.frexp(amax)
    k = e.astype(np.int32) - np.int32(max_e) + (m > max_m).astype(np.int32)
    k[amax == 0] = 0
    out: npt.NDArray[np.int32] = np.clip(k, k_range[0], k_range[1]).astype(np.int32)
    return out


def _f4_exponents(bits: npt.NDArray[np.uint32]) -> npt.NDArray[np.int32]:
    """`_exponents` for F4 from the bits of finite block absmaxes (sign clear): with
    absmax = 1.f · 2^(b − 127), 6 = 1.5 · 2^2, k = b − 129, one more when 1.f > 1.5
    (f > 0x400000); a subnormal (b = 0) clamps to −127."""
    k = (bits >> 23).astype(np.int32)
    k += (bits & 0x7FFFFF) > 0x400000
    k -= 129
    np.maximum(k, _F4_K[0], out=k)
    k[bits == 0] = 0
    return k


def _pow2(k: npt.NDArray[np.int32]) -> npt.NDArray[np.float32]:
    return np.ldexp(np.ones(k.shape, _F32), k).astype(_F32)


def _code_table(dtype: Any) -> npt.NDArray[np.uint8]:
    """Code of every 16-bit pattern (the top half of a float32) cast to `dtype`; the
    patterns of NaN and infinity, which no finite input reaches, map to 0."""
    top = (np.arange(1 << 16, dtype=np.uint32) << 16).view(_F32)
    with np.errstate(invalid="ignore", over="ignore"):
        codes = np.where(np.isfinite(top), top, 0).astype(dtype).view(np.uint8)
    return handed_over(np.ascontiguousarray(codes))


#: F8_E4M3 and F4 (E2M1, one per byte) codes of each float32's top 16 bits, rounded to odd.
F8_CODES = _code_table(ml_dtypes.float8_e4m3fn)
F4_CODES = _code_table(ml_dtypes.float4_e2m1fn)


def _round_to_odd_16(bits: npt.NDArray[np.uint32], tmp: npt.NDArray[np.uint32]) -> None:
    """bits ← its top 16 bits, the lowest set when any of the low 16 is (in place).

    That is the value rounded to odd at 8 significant bits (bfloat16), from which
    rounding to nearest even at 4 or fewer bits (E4M3, E2M1) gives what rounding the
    float32 directly gives: a tie stays a tie only when it was one (no bit below), and
    nothing else moves across a rounding boundary. (low + 0xFFFF) carries into bit 16
    exactly when low is not 0.
    """
    np.bitwise_and(bits, 0xFFFF, out=tmp)
    np.add(tmp, 0xFFFF, out=tmp)
    np.bitwise_or(bits, tmp, out=bits)
    np.right_shift(bits, 16, out=bits)


def _quantize_f8(
    name: str, shape: tuple[int, ...], x: npt.NDArray[Any]
) -> dict[str, TensorBytes]:
    amax = _absmax(x)
    if not math.isfinite(amax):
        raise _non_finite(name, x.astype(_F32), "F8_E4M3")
    k = _exponents(np.array([amax]), _F8_MAX_M, _F8_MAX_E, _F8_K)
    inv = float(_pow2(-k)[0])
    top = np.array([amax * inv], _F32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    if math.ldexp(float(top[0]), int(k[0])) > _F32_MAX:
        raise overflow_error(name, "F8_E4M3")
    out = np.empty(x.size, np.uint8)
    y = np.empty(min(_CODE_CHUNK, x.size), _F32)
    tmp = np.empty(y.size, np.uint32)
    f = _F32(inv)
    for i, part in _chunks(x, _CODE_CHUNK):
        bits = y[: part.size].view(np.uint32)
        np.multiply(part, f, out=y[: part.size])
        _round_to_odd_16(bits, tmp[: part.size])
        np.take(F8_CODES, bits, out=out[i : i + part.size])
    scale = TensorBytes("F32", (), _pow2(k).reshape(()).tobytes())
    return {name: TensorBytes("F8_E4M3", shape, handed_over(out)), scale_name(name): scale}


def _quantize_f4(
    name: str, shape: tuple[int, ...], x: npt.NDArray[Any]
) -> dict[str, TensorBytes]:
    """One pass over `x`, a chunk of whole blocks at a time: the blocks' absmaxes (an
    integer max of the sign-cleared bits), their exponents, the scaled values, their
    codes, the packed bytes; the short last block is padded with zeros, which change no
    absmax and pack as the zero nibble an odd length ends in."""
    n = x.size
    e8 = np.empty(-(-n // BLOCK), np.uint8)
    packed = np.empty((n + 1) // 2, np.uint8)
    y = np.empty(min(_CODE_CHUNK, -(-n // BLOCK) * BLOCK), _F32)
    tmp = np.empty(y.size, np.uint32)
    codes = np.empty(y.size, np.uint8)
    for i, part in _chunks(x, _CODE_CHUNK):
        m = part.size
        if m % BLOCK:
            padded = np.zeros(m + -m % BLOCK, _F32)
            padded[:m] = part
            part = padded
        nb = part.size // BLOCK
        t = tmp[: part.size]
        np.bitwise_and(part.view(np.uint32), 0x7FFFFFFF, out=t)
        amax = t.reshape(nb, BLOCK).max(axis=1)
        if int(amax.max()) >= 0x7F800000:
            raise _non_finite(name, x.astype(_F32), "F4")
        k = _f4_exponents(amax)
        if (k >= _F4_K[1] - 1).any():
            _check_f4_overflow(name, amax.view(_F32), k)
        e8[i // BLOCK : i // BLOCK + nb] = k + 127
        # 2^-k from its bits: k <= 126 for any finite absmax (6 · 2^125 < 2^128), so
        # 127 − k >= 1 and the factor is a normal float.
        inv = ((127 - k) << 23).astype(np.uint32).view(_F32)
        yb = y[: part.size]
        np.multiply(part.reshape(nb, BLOCK), inv[:, None], out=yb.reshape(nb, BLOCK))
        bits = yb.view(np.uint32)
        _round_to_odd_16(bits, t)
        c = codes[: part.size]
        np.take(F4_CODES, bits, out=c)
        # Two codes c0, c1 read as one little-endian uint16 c0 | c1 << 8; OR-ing in its
        # shift by 4 puts c1 in the high nibble of the low byte, which the store keeps.
        pairs = c.view("<u2")
        joined = pairs >> 4
        joined |= pairs
        packed[i // 2 : i // 2 + (m + 1) // 2] = joined[: (m + 1) // 2]
    scale = TensorBytes("F8_E8M0", (e8.size,), e8.tobytes())
    return {name: TensorBytes("F4", shape, handed_over(packed)), scale_name(name): scale}


def _check_f4_overflow(name: str, amax: npt.NDArray[np.float32], k: npt.NDArray[np.int32]) -> None:
    """`overflow_error` if a block's largest value, rounded to E2M1 and scaled back by
    its 2^k, passes float32's maximum (only k >= 126 can)."""
    big = k >= _F4_K[1] - 1
    top = (amax[big] * _pow2(-k[big])).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    if (np.ldexp(top, k[big]) > _F32_MAX).any():
        raise overflow_error(name, "F4")


def dequantize(
    entries: Mapping[str, TensorBytes], name: str, fmt: str, *, key: str | None = None
) -> TensorBytes:
    """The F32 tensor that `entries` carry for `name` in format `fmt` (exact values).

    `key` (the payload's key) is only used in error messages.
    """
    check_format(fmt)
    where = f"{key}: " if key else ""
    codes = entry_of(entries, name, fmt, where)
    if fmt == "BF16":
        values = codes.to_numpy().reshape(-1).astype(_F32)
        if not np.isfinite(values).all():
            raise CorruptPayload(
                f"{where}tensor {name!r}: BF16 values hold NaN or infinity; the payload is corrupt"
            )
        return TensorBytes("F32", codes.shape, handed_over(values))
    q = _quantized(entries, name, fmt, codes, where)
    values = q.read(0, q.numel)
    if not np.isfinite(values).all():
        raise _undecodable(name, fmt, where)
    return TensorBytes("F32", codes.shape, handed_over(values))


def dequantizing(
    entries: Mapping[str, TensorBytes], name: str, fmt: str, *, key: str | None = None
) -> Quantized:
    """`dequantize` for F8_E4M3 and F4 without its F32 tensor: the same checks and errors
    (the values decoded and checked a window at a time, then dropped), and a `Quantized`
    that reads any window of those values later, from the codes and scales alone."""
    if check_format(fmt) == "BF16":
        raise ConfigError("dequantizing reads F8_E4M3 and F4 entries; BF16 is read as stored")
    where = f"{key}: " if key else ""
    q = _quantized(entries, name, fmt, entry_of(entries, name, fmt, where), where)
    buf = np.empty(min(_DECODE, q.numel), _F32)
    for i in range(0, q.numel, _DECODE):
        j = min(i + _DECODE, q.numel)
        if not np.isfinite(q.read(i, j, out=buf[: j - i])).all():
            raise _undecodable(name, fmt, where)
    return q


class Quantized:
    """An F8_E4M3 or F4 tensor held as its codes and scales (views of the payload), read
    as the F32 values it carries a window of flat elements at a time: `read(a, b)` is
    byte for byte `dequantize(...)`'s elements [a, b), each decoded alone (its code's value
    times its scale: its tensor's for F8, its 32-element block's for F4). Made by
    `dequantizing`, which checked that every value is finite. Immutable."""

    __slots__ = ("_codes", "_k", "dtype", "shape")

    dtype: str
    shape: tuple[int, ...]
    _codes: npt.NDArray[np.uint8]
    _k: npt.NDArray[np.int32] | npt.NDArray[np.uint8]

    def __init__(self, fmt: str, shape: tuple[int, ...], codes: bytes | memoryview,
                 k: npt.NDArray[np.int32] | npt.NDArray[np.uint8]) -> None:
        # k: F8, the tensor's exponent (one int32); F4, the E8M0 byte of each block.
        object.__setattr__(self, "dtype", fmt)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "_codes", np.frombuffer(codes, np.uint8))
        object.__setattr__(self, "_k", k)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Quantized is immutable; cannot set {name!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes it holds: codes and scales."""
        return int(self._codes.nbytes + self._k.nbytes)

    def read(self, start: int, stop: int,
             out: npt.NDArray[np.float32] | None = None) -> npt.NDArray[np.float32]:
        """Elements [start, stop) of the flat tensor as float32, into `out` when given
        (stop − start elements); temporaries of a few bytes per element of 64 Ki."""
        if not 0 <= start <= stop <= self.numel:
            raise ConfigError(f"window [{start}, {stop}) is not within {self.numel} elements")
        values = np.empty(stop - start, _F32) if out is None else out
        with np.errstate(over="ignore"):  # hostile scales overflow; checked by the maker
            for i in range(start, stop, _DECODE):
                j = min(i + _DECODE, stop)
                self._decode(i, j, values[i - start : j - start])
        return values

    def _decode(self, i: int, j: int, out: npt.NDArray[np.float32]) -> None:
        if self.dtype == "F8_E4M3":
            _gather(_F8_VALUES, self._codes[i:j], out)
            np.multiply(out, _F32(math.ldexp(1.0, int(self._k[0]))), out=out)
            return
        # Element e is nibble e % 2 of byte e // 2, scaled by block e // BLOCK's factor.
        codes, e = self._codes, i
        if e % 2 and e < j:  # the window starts at a high nibble
            out[0] = _F4_VALUES[codes[e // 2] >> 4]
            e += 1
        pairs = (j - e) // 2
        _gather(_F4_PAIRS, codes[e // 2 : e // 2 + pairs],
                out[e - i : e - i + 2 * pairs].view(np.uint64))
        e += 2 * pairs
        if e < j:  # ... or ends at a low one
            out[e - i] = _F4_VALUES[codes[e // 2] & 15]
        factors = _pow2(self._k[i // BLOCK : -(-j // BLOCK)].astype(np.int32) - 127)
        # The window's first block may start before i, its last end after j: scale the
        # part of each that lies in the window, the whole blocks between as a matrix.
        head = min(-i % BLOCK, j - i)
        np.multiply(out[:head], factors[0], out=out[:head])
        whole = (j - i - head) // BLOCK
        body = out[head : head + whole * BLOCK].reshape(whole, BLOCK)
        first = 1 if head else 0
        np.multiply(body, factors[first : first + whole, None], out=body)
        tail = out[head + whole * BLOCK :]
        if tail.size:
            np.multiply(tail, factors[-1], out=tail)

    def __repr__(self) -> str:
        return f"Quantized({self.dtype}{list(self.shape)})"


def _gather(table: npt.NDArray[Any], codes: npt.NDArray[np.uint8],
            out: npt.NDArray[Any]) -> None:
    """out = table[codes], a slice at a time: `take` widens its indices to int64 first."""
    for a in range(0, codes.size, _GATHER):
        np.take(table, codes[a : a + _GATHER], out=out[a : a + _GATHER], mode="wrap")


def _quantized(entries: Mapping[str, TensorBytes], name: str, fmt: str, codes: TensorBytes,
               where: str) -> Quantized:
    """`codes` of `name` with its scale entry, checked as `dequantize` checks them."""
    scale = entry_of(entries, scale_name(name), "F32" if fmt == "F8_E4M3" else "F8_E8M0", where)
    if fmt == "F8_E4M3":
        if scale.shape != ():
            raise CorruptPayload(
                f"{where}tensor {name!r}: F8_E4M3 scale has shape {list(scale.shape)}; need []"
            )
        s = float(np.frombuffer(scale.buffer, _F32)[0])
        m, e = math.frexp(s) if math.isfinite(s) else (0.0, 0)
        if m != 0.5 or not _F8_K[0] <= e - 1 <= _F8_K[1]:
            raise CorruptPayload(
                f"{where}tensor {name!r}: F8_E4M3 scale {s!r} is not a power of two 2^k with "
                f"k in [{_F8_K[0]}, {_F8_K[1]}]; the payload is corrupt"
            )
        return Quantized(fmt, codes.shape, codes.buffer, np.full(1, e - 1, np.int32))
    nblocks = -(-codes.numel // BLOCK)
    if scale.shape != (nblocks,):
        raise CorruptPayload(
            f"{where}tensor {name!r}: F4 scale has shape {list(scale.shape)}; "
            f"{codes.numel} elements need [{nblocks}] (one per block of {BLOCK})"
        )
    e8 = np.frombuffer(scale.buffer, np.uint8)
    if (e8 == 0xFF).any():
        raise CorruptPayload(
            f"{where}tensor {name!r}: F4 scale block {int(np.argmax(e8 == 0xFF))} is NaN "
            "(E8M0 0xFF); the payload is corrupt"
        )
    return Quantized(fmt, codes.shape, codes.buffer, e8)


def _undecodable(name: str, fmt: str, where: str) -> CorruptPayload:
    return CorruptPayload(
        f"{where}tensor {name!r}: {fmt} codes decode to NaN or past float32's range; "
        "the payload is corrupt"
    )

