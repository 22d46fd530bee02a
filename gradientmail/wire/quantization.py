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

F8 and F4 quantization of large inputs runs on torch when it is importable (its float8
cast is several times faster than ml_dtypes', and F4 is computed from the float bits),
single-threaded in the calling thread; both paths give identical bytes, which the tests
check. BF16 always uses ml_dtypes' cast, which is fast already.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from gradientmail.errors import ConfigError, CorruptPayload, MissingExtra, NonFiniteError
from gradientmail.wire.tensor_bytes import STORAGE_DTYPES, TensorBytes, handed_over

__all__ = [
    "BLOCK",
    "FORMATS",
    "TORCH_MIN_NUMEL",
    "Quantized",
    "bytes_per_element",
    "check_format",
    "dequantize",
    "dequantizing",
    "quantize",
    "quantized_nbytes",
    "roundtrip",
    "scale_name",
]

FORMATS: tuple[str, ...] = ("BF16", "F8_E4M3", "F4")
#: Elements per F4 scale block (the MX block size).
BLOCK = 32
#: Inputs with at least this many elements use the torch path under backend="auto".
TORCH_MIN_NUMEL = 1 << 16

_F32 = np.float32
_F32_MAX = float(np.finfo(np.float32).max)
_CHUNK = 1 << 18  # elements per numpy pass: keeps temporaries in cache
# Elements `Quantized` decodes at a time: its temporaries (a few bytes per element) stay
# far below the window of F32 a closer's merge reads (the numpy backend's 64 Ki).
_DECODE = 1 << 16
_GATHER = 1 << 13  # codes per `take`: its int64 copy of them is 64 KiB
# Elements per torch op: ATen's grain size, below which an op runs in the calling thread.
# The learner quantizes on its communication thread while training runs torch on the
# others; multi-threaded ops there meet at OpenMP barriers that stall whenever the cores
# are oversubscribed (measured 10x to 100x slowdowns on a busy 2-core machine).
_TORCH_CHUNK = 1 << 15

# (largest code value as mantissa · 2^exponent with mantissa in [0.5, 1), k range)
_F8_MAX_M, _F8_MAX_E, _F8_K = 0.875, 9, (-126, 127)  # 448 = 0.875 · 2^9
_F4_MAX_M, _F4_MAX_E, _F4_K = 0.75, 3, (-127, 127)  # 6 = 0.75 · 2^3

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


def quantize(
    name: str, tensor: TensorBytes, fmt: str, *, backend: str = "auto"
) -> dict[str, TensorBytes]:
    """The entries carrying `tensor` in format `fmt`: ``{name: codes[, name.scale: scale]}``.

    `backend` is "auto" (torch for large inputs when importable), "numpy" or "torch".
    """
    check_format(fmt)
    if not isinstance(tensor, TensorBytes) or tensor.dtype not in STORAGE_DTYPES:
        got = tensor.dtype if isinstance(tensor, TensorBytes) else type(tensor).__name__
        raise ConfigError(
            f"tensor {name!r}: can only quantize {', '.join(STORAGE_DTYPES)} TensorBytes, not {got}"
        )
    if backend not in ("auto", "numpy", "torch"):
        raise ConfigError(f"backend {backend!r} must be 'auto', 'numpy' or 'torch'")
    x = tensor.to_numpy().reshape(-1)
    if fmt == "BF16":
        return {name: _quantize_bf16(name, tensor, x)}
    torch_path = _use_torch(backend, tensor.numel)
    if tensor.dtype != "F32":
        x = x.astype(_F32)
    if fmt == "F8_E4M3":
        return _quantize_f8(name, tensor.shape, x, torch_path)
    return _quantize_f4(name, tensor.shape, x, torch_path)


def roundtrip(tensor: TensorBytes, fmt: str, *, backend: str = "auto") -> TensorBytes:
    """The F32 tensor that `fmt` represents for `tensor`: dequantize(quantize(tensor))."""
    return dequantize(quantize("t", tensor, fmt, backend=backend), "t", fmt)


def _use_torch(backend: str, numel: int) -> bool:
    if backend == "numpy" or (backend == "auto" and numel < TORCH_MIN_NUMEL):
        return False
    try:
        import torch  # noqa: F401
    except ImportError:
        if backend == "torch":
            raise MissingExtra("torch", "the torch quantization path") from None
        return False
    return True


def _non_finite(name: str, x: npt.NDArray[Any], fmt: str) -> NonFiniteError:
    bad = np.flatnonzero(~np.isfinite(x))
    return NonFiniteError(
        f"tensor {name!r} holds {bad.size} NaN or infinite values (first at flat index "
        f"{int(bad[0])}); cannot quantize to {fmt}. Check the training loss and gradients "
        "before publishing"
    )


def _overflow(name: str, fmt: str) -> NonFiniteError:
    return NonFiniteError(
        f"tensor {name!r} holds values near float32's maximum that overflow to infinity "
        f"when rounded to {fmt}; rescale the tensor"
    )


def _absmax(x: npt.NDArray[np.float32]) -> float:
    """max |x| (NaN if any NaN), 0 for an empty array; chunked to stay in cache."""
    best = 0.0
    for i in range(0, x.size, _CHUNK):
        part = x[i : i + _CHUNK]
        hi, lo = float(part.max()), float(part.min())
        if math.isnan(hi) or math.isnan(lo):
            return math.nan  # max() would drop a NaN operand silently
        best = max(best, hi, -lo)
    return best


def _quantize_bf16(name: str, tensor: TensorBytes, x: npt.NDArray[Any]) -> TensorBytes:
    amax = _absmax(x if x.dtype == _F32 else x.astype(_F32))
    if not math.isfinite(amax):
        raise _non_finite(name, x.astype(_F32), "BF16")
    if not math.isfinite(float(np.array(amax, _F32).astype(ml_dtypes.bfloat16))):
        raise _overflow(name, "BF16")
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


def _pow2(k: npt.NDArray[np.int32]) -> npt.NDArray[np.float32]:
    return np.ldexp(np.ones(k.shape, _F32), k).astype(_F32)


def _quantize_f8(
    name: str, shape: tuple[int, ...], x: npt.NDArray[np.float32], torch_path: bool
) -> dict[str, TensorBytes]:
    amax = _torch_absmax(x) if torch_path else _absmax(x)
    if not math.isfinite(amax):
        raise _non_finite(name, x, "F8_E4M3")
    k = _exponents(np.array([amax]), _F8_MAX_M, _F8_MAX_E, _F8_K)
    inv = float(_pow2(-k)[0])
    top = np.array([amax * inv], _F32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    if math.ldexp(float(top[0]), int(k[0])) > _F32_MAX:
        raise _overflow(name, "F8_E4M3")
    codes = _cast_f8_torch(x, inv) if torch_path else _cast_f8_numpy(x, inv)
    scale = TensorBytes("F32", (), _pow2(k).reshape(()).tobytes())
    return {name: TensorBytes("F8_E4M3", shape, codes), scale_name(name): scale}


def _cast_f8_numpy(x: npt.NDArray[np.float32], inv: float) -> npt.NDArray[np.uint8]:
    out = np.empty(x.size, np.uint8)
    f = _F32(inv)
    for i in range(0, x.size, _CHUNK):
        y = x[i : i + _CHUNK] * f
        out[i : i + _CHUNK] = y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return handed_over(out)


def _torch_view(x: npt.NDArray[Any]) -> Any:
    import torch

    with warnings.catch_warnings():  # read-only input: we never write through the view
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(x)


def _torch_absmax(x: npt.NDArray[np.float32]) -> float:
    import torch

    xt = _torch_view(x)
    best = 0.0
    for i in range(0, x.size, _TORCH_CHUNK):
        lo, hi = (float(v) for v in torch.aminmax(xt[i : i + _TORCH_CHUNK]))
        if math.isnan(lo) or math.isnan(hi):
            return math.nan
        best = max(best, hi, -lo)
    return best


def _cast_f8_torch(x: npt.NDArray[np.float32], inv: float) -> npt.NDArray[np.uint8]:
    import torch

    xt = _torch_view(x)
    out = torch.empty(x.size, dtype=torch.float8_e4m3fn)
    buf = torch.empty(min(_TORCH_CHUNK, x.size), dtype=torch.float32)
    for i in range(0, x.size, _TORCH_CHUNK):
        part = xt[i : i + _TORCH_CHUNK]
        y = torch.mul(part, inv, out=buf[: part.numel()])
        out[i : i + _TORCH_CHUNK].copy_(y)
    return handed_over(out.view(torch.uint8).numpy())


def _quantize_f4(
    name: str, shape: tuple[int, ...], x: npt.NDArray[np.float32], torch_path: bool
) -> dict[str, TensorBytes]:
    n = x.size
    nfull, rest = divmod(n, BLOCK)
    parts = [x[: nfull * BLOCK].reshape(nfull, BLOCK)]
    if rest:
        # Only the short last block is copied: zero padding changes no absmax.
        tail = np.zeros((1, BLOCK), _F32)
        tail[0, :rest] = x[nfull * BLOCK :]
        parts.append(tail)
    absmax = _block_absmax_torch if torch_path else _block_absmax_numpy
    amax = np.concatenate([absmax(p) for p in parts])
    if not np.isfinite(amax).all():
        raise _non_finite(name, x, "F4")
    k = _exponents(amax.astype(np.float64), _F4_MAX_M, _F4_MAX_E, _F4_K)
    inv = _pow2(-k)
    big = k >= _F4_K[1] - 1  # only scales this large can overflow float32 when decoded
    if big.any():
        top = (amax[big] * inv[big]).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
        if (np.ldexp(top, k[big]) > _F32_MAX).any():
            raise _overflow(name, "F4")
    codes = _codes_f4_torch if torch_path else _codes_f4_numpy
    packed = codes(parts[0], inv[:nfull])
    if rest:
        # The padding is zeros, so an odd tail ends in the zero nibble the layout requires.
        packed = handed_over(
            np.concatenate([packed, codes(parts[1], inv[nfull:])[: (rest + 1) // 2]])
        )
    scale = TensorBytes("F8_E8M0", (nfull + (rest > 0),), (k + 127).astype(np.uint8).tobytes())
    return {name: TensorBytes("F4", shape, packed), scale_name(name): scale}


def _block_absmax_numpy(blocks: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    out = np.empty(blocks.shape[0], _F32)
    step = _CHUNK // BLOCK
    for i in range(0, blocks.shape[0], step):
        part = blocks[i : i + step]
        out[i : i + step] = np.maximum(part.max(axis=1), -part.min(axis=1))
    return out


def _block_absmax_torch(blocks: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    import torch

    bt = _torch_view(blocks)
    out = torch.empty(blocks.shape[0], dtype=torch.float32)
    step = _TORCH_CHUNK // BLOCK
    for i in range(0, blocks.shape[0], step):
        torch.amax(bt[i : i + step].abs(), dim=1, out=out[i : i + step])
    result: npt.NDArray[np.float32] = out.numpy()
    return result


def _codes_f4_numpy(
    blocks: npt.NDArray[np.float32], inv: npt.NDArray[np.float32]
) -> npt.NDArray[np.uint8]:
    """E2M1 codes of blocks · inv (one factor per block), packed two per byte."""
    out = np.empty(blocks.size // 2, np.uint8)
    step = _CHUNK // BLOCK
    for i in range(0, blocks.shape[0], step):
        y = blocks[i : i + step] * inv[i : i + step, None]
        pairs = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(-1, 2)
        out[i * BLOCK // 2 : (i + step) * BLOCK // 2] = pairs[:, 0] | (pairs[:, 1] << 4)
    return handed_over(out)


def _codes_f4_torch(
    blocks: npt.NDArray[np.float32], inv: npt.NDArray[np.float32]
) -> npt.NDArray[np.uint8]:
    """Same bytes as `_codes_f4_numpy`, by integer arithmetic on the float32 bits.

    torch cannot cast to E2M1, and comparing against the seven rounding thresholds costs
    twice as much as this. On [0, 2) E2M1 is a grid of step 1/2, on [2, 4) of step 1, on
    [4, 8) of step 2: adding M = max(2^floor(log2 |y|), 1) · 2^22 rounds |y| to that step
    (nearest even, in the float adder), and the low bits of the sum count the steps. The
    code is that count plus 2 per binade above [0, 2); a rounding carry lands on the next
    binade's first code, which is the right one.
    """
    import torch

    bt, it = _torch_view(blocks), _torch_view(inv)
    out = torch.empty(blocks.size // 2, dtype=torch.uint8)
    step = _TORCH_CHUNK // BLOCK
    for i in range(0, blocks.shape[0], step):
        bits = (bt[i : i + step] * it[i : i + step, None]).view(torch.int32)
        mag = bits & 0x7FFFFFFF
        m = (mag & 0x7F800000).clamp_(min=0x3F800000).add_(22 << 23)  # bits of M
        total = (mag.view(torch.float32) + m.view(torch.float32)).view(torch.int32)
        # code = total - M + 2 · (biased exponent of M - 22 - 127); (m >> 22) is twice it.
        code = total.sub_(m).add_(m >> 22).sub_(2 * (22 + 127))
        code |= (bits >> 28) & 8  # sign bit 31 → bit 3
        pairs = code.to(torch.uint8).view(-1, 2)
        out[i * BLOCK // 2 : (i + step) * BLOCK // 2] = pairs[:, 0] | (pairs[:, 1] << 4)
    return handed_over(out.numpy())


def dequantize(
    entries: Mapping[str, TensorBytes], name: str, fmt: str, *, key: str | None = None
) -> TensorBytes:
    """The F32 tensor that `entries` carry for `name` in format `fmt` (exact values).

    `key` (the payload's key) is only used in error messages.
    """
    check_format(fmt)
    where = f"{key}: " if key else ""
    codes = _entry(entries, name, fmt, where)
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
    q = _quantized(entries, name, fmt, _entry(entries, name, fmt, where), where)
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
    scale = _entry(entries, scale_name(name), "F32" if fmt == "F8_E4M3" else "F8_E8M0", where)
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


def _entry(entries: Mapping[str, TensorBytes], name: str, dtype: str, where: str) -> TensorBytes:
    entry = entries.get(name)
    if entry is None:
        raise CorruptPayload(f"{where}tensor {name!r} is missing from the payload")
    if not isinstance(entry, TensorBytes) or entry.dtype != dtype:
        got = entry.dtype if isinstance(entry, TensorBytes) else type(entry).__name__
        raise CorruptPayload(f"{where}tensor {name!r} is {got}; expected {dtype}")
    return entry
