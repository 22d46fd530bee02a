"""The numpy backend: F32 Values as numpy arrays, for a syncer on a CPU box.

Elementwise operations are IEEE float32 (numpy never fuses a multiply and an add), so a
Value computed here has the same bytes as one computed by the torch backend on the same
inputs. Reductions (`dot`, `norm`, `gram`) convert to float64 chunk by chunk: a product of
two float32 numbers is exact in float64, so the only difference between backends is the
order of the float64 summation, far below float32 resolution.

The fused helpers (`gram`, `lincomb`, `outer_step`) walk the tensors in cache-sized chunks
so that a merge reads each contribution from memory about twice instead of once per
operation; they give exactly the bytes of the equivalent chain of Value operations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from gradientmail.errors import ConfigError
from gradientmail.serialization import STORAGE_DTYPES, TensorBytes

__all__ = ["NumpyBackend", "NumpyValue", "f32", "f32_to_bf16_bits"]

F32Array = npt.NDArray[np.float32]

#: Elements per chunk of the fused helpers: a few float32 vectors of this length plus
#: their float64 copies stay in a core's L2 cache.
CHUNK = 1 << 14


def f32(x: float) -> float:
    """`x` rounded to the nearest float32, as a Python float.

    Scalars are rounded before they meet a tensor so that every backend multiplies by the
    same float32 number, whatever precision its kernels use for scalars internally.
    """
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def f32_to_bf16_bits(a: F32Array) -> npt.NDArray[np.uint16]:
    """BF16 bit patterns of float32 `a`, rounded to nearest even; every NaN becomes 0x7FC0."""
    u = np.ascontiguousarray(a, dtype=np.float32).reshape(-1).view(np.uint32)
    bias = ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    out = ((u + bias) >> np.uint32(16)).astype(np.uint16)
    # Without this a NaN with a small payload would round up into infinity.
    out[np.isnan(a.reshape(-1))] = 0x7FC0
    return out


class NumpyValue:
    """An F32 tensor held as a numpy array. Operations return new Values; none mutates."""

    __slots__ = ("_a",)

    def __init__(self, array: F32Array) -> None:
        if array.dtype != np.float32:
            raise ConfigError(f"NumpyValue holds float32 arrays, not {array.dtype}")
        self._a = array

    @property
    def array(self) -> F32Array:
        """The underlying float32 array (possibly read-only; do not modify)."""
        return self._a

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self._a.shape)

    def _other(self, other: object) -> F32Array:
        if not isinstance(other, NumpyValue):
            raise ConfigError(
                f"cannot combine a numpy Value with {type(other).__name__}; "
                "load both tensors with the same backend"
            )
        if other._a.shape != self._a.shape:
            raise ConfigError(f"shape {other.shape} does not match {self.shape}")
        return other._a

    def __add__(self, other: Any) -> NumpyValue:
        return NumpyValue(np.add(self._a, self._other(other)))

    def __sub__(self, other: Any) -> NumpyValue:
        return NumpyValue(np.subtract(self._a, self._other(other)))

    def __mul__(self, k: float) -> NumpyValue:
        with np.errstate(over="ignore"):
            return NumpyValue(np.multiply(self._a, np.float32(k)))

    __rmul__ = __mul__

    def dot(self, other: Any) -> float:
        return NumpyBackend._dot64(self._flat(), _flat(self._other(other)))

    def norm(self) -> float:
        flat = self._flat()
        return math.sqrt(NumpyBackend._dot64(flat, flat))

    def isfinite(self) -> bool:
        flat = self._flat()
        return all(bool(np.isfinite(flat[s : s + CHUNK]).all()) for s in range(0, flat.size, CHUNK))

    def to_bytes(self, dtype: str) -> TensorBytes:
        flat = self._flat()
        if dtype == "F32":
            data = flat.astype("<f4", copy=False).tobytes()
        elif dtype == "F16":
            with np.errstate(over="ignore"):
                data = flat.astype("<f2").tobytes()
        elif dtype == "BF16":
            data = f32_to_bf16_bits(flat).astype("<u2", copy=False).tobytes()
        else:
            raise ConfigError(
                f"to_bytes: dtype {dtype!r} is not one of {', '.join(STORAGE_DTYPES)}"
            )
        return TensorBytes(dtype, self.shape, data)

    def _flat(self) -> F32Array:
        return _flat(self._a)

    def __repr__(self) -> str:
        return f"NumpyValue(shape={self.shape})"


def _flat(a: F32Array) -> F32Array:
    return np.ascontiguousarray(a).reshape(-1)


def _arrays(values: Sequence[Any]) -> list[F32Array]:
    if not values:
        raise ConfigError("need at least one Value")
    first = values[0]
    if not isinstance(first, NumpyValue):
        raise ConfigError(f"the numpy backend cannot use a {type(first).__name__}")
    return [first._flat()] + [_flat(first._other(v)) for v in values[1:]]


class NumpyBackend:
    """Values as numpy float32 arrays; the backend of a CPU syncer (numpy only)."""

    name = "numpy"

    def load(self, tensor: TensorBytes) -> NumpyValue:
        """A Value from F32 (zero-copy, read-only), F16 or BF16 bytes (exactly widened)."""
        if tensor.dtype == "F32":
            a = np.frombuffer(tensor.data, dtype="<f4")
        elif tensor.dtype == "F16":
            a = np.frombuffer(tensor.data, dtype="<f2").astype(np.float32)
        elif tensor.dtype == "BF16":
            bits = np.frombuffer(tensor.data, dtype="<u2").astype(np.uint32) << np.uint32(16)
            a = bits.view(np.float32)
        else:
            raise ConfigError(
                f"cannot load a {tensor.dtype} tensor as a Value; dequantize it to F32 first"
            )
        return NumpyValue(a.reshape(tensor.shape))

    def zeros(self, shape: tuple[int, ...]) -> NumpyValue:
        return NumpyValue(np.zeros(shape, dtype=np.float32))

    @staticmethod
    def _dot64(a: F32Array, b: F32Array) -> float:
        buf = np.empty((2, min(CHUNK, a.size)), dtype=np.float64)
        total = 0.0
        for s in range(0, a.size, CHUNK):
            n = min(CHUNK, a.size - s)
            x, y = buf[0, :n], buf[1, :n]
            np.copyto(x, a[s : s + n])
            np.copyto(y, b[s : s + n])
            total += float(np.dot(x, y))
        return total

    def gram(self, values: Sequence[Any]) -> list[list[float]]:
        """G[i][j] = values[i].dot(values[j]) (float64 sums of exact products), reading
        each value once. A non-finite value gives a non-finite diagonal entry."""
        arrays = _arrays(values)
        m, size = len(arrays), arrays[0].size
        g = np.zeros((m, m), dtype=np.float64)
        buf = np.empty((m, min(CHUNK, size)), dtype=np.float64)
        for s in range(0, size, CHUNK):
            n = min(CHUNK, size - s)
            block = buf[:, :n]
            for i, a in enumerate(arrays):
                np.copyto(block[i], a[s : s + n])
            g += block @ block.T
        return [[float(x) for x in row] for row in g]

    def lincomb(self, values: Sequence[Any], coeffs: Sequence[float]) -> NumpyValue:
        """c₀·v₀ + c₁·v₁ + … evaluated left to right in float32 (coefficients rounded to
        float32 first): the bytes of `v0 * c0 + v1 * c1 + …` with Value operations."""
        arrays = _arrays(values)
        ks = _coeffs(coeffs, len(arrays))
        out = np.empty(arrays[0].size, dtype=np.float32)
        tmp = np.empty(min(CHUNK, out.size), dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            for s in range(0, out.size, CHUNK):
                n = min(CHUNK, out.size - s)
                _lincomb_chunk(arrays, ks, s, n, out[s : s + n], tmp[:n])
        return NumpyValue(out.reshape(values[0].shape))

    def outer_step(
        self,
        theta: Any,
        momentum: Any,
        values: Sequence[Any],
        coeffs: Sequence[float],
        lr: float,
        beta: float,
    ) -> tuple[NumpyValue, NumpyValue]:
        """Nesterov on Δ = lincomb(values, coeffs), in one pass:
        m ← β·m + Δ; Θ ← Θ − η·(Δ + β·m). Returns (Θ, m) with the bytes of
        `nesterov(theta, momentum, lincomb(...), lr, beta)`."""
        arrays = _arrays(values)
        th, mo = _arrays([theta, momentum])
        if th.size != arrays[0].size:
            raise ConfigError(f"theta shape {theta.shape} does not match {values[0].shape}")
        ks = _coeffs(coeffs, len(arrays))
        b, eta = np.float32(beta), np.float32(lr)
        th_out = np.empty_like(th)
        mo_out = np.empty_like(mo)
        d = np.empty(min(CHUNK, th.size), dtype=np.float32)
        tmp = np.empty_like(d)
        with np.errstate(over="ignore", invalid="ignore"):
            for s in range(0, th.size, CHUNK):
                n = min(CHUNK, th.size - s)
                dd, tt, mm = d[:n], tmp[:n], mo_out[s : s + n]
                _lincomb_chunk(arrays, ks, s, n, dd, tt)
                np.multiply(mo[s : s + n], b, out=mm)
                np.add(mm, dd, out=mm)
                np.multiply(mm, b, out=tt)
                np.add(dd, tt, out=tt)
                np.multiply(tt, eta, out=tt)
                np.subtract(th[s : s + n], tt, out=th_out[s : s + n])
        shape = theta.shape
        return NumpyValue(th_out.reshape(shape)), NumpyValue(mo_out.reshape(shape))


def _coeffs(coeffs: Sequence[float], m: int) -> list[np.float32]:
    if len(coeffs) != m:
        raise ConfigError(f"{len(coeffs)} coefficients for {m} values")
    with np.errstate(over="ignore"):
        return [np.float32(c) for c in coeffs]


def _lincomb_chunk(
    arrays: list[F32Array], ks: list[np.float32], s: int, n: int, out: F32Array, tmp: F32Array
) -> None:
    np.multiply(arrays[0][s : s + n], ks[0], out=out)
    for a, k in zip(arrays[1:], ks[1:], strict=True):
        np.multiply(a[s : s + n], k, out=tmp)
        np.add(out, tmp, out=out)
