"""The numpy backend: F32 Values as numpy arrays, for a syncer on a CPU box.

Elementwise operations are IEEE float32 (numpy never fuses a multiply and an add), so a
Value computed here has the same bytes as one computed by the torch backend on the same
inputs. Reductions (`dot`, `norm`, `gram`) convert to float64 chunk by chunk: a product of
two float32 numbers is exact in float64, so the only difference between backends is the
order of the float64 summation, far below float32 resolution.

The fused helpers (`gram`, `lincomb`, `outer_step`) walk the tensors in cache-sized chunks,
on several threads, so that a merge reads each contribution from memory about twice
instead of once per operation; they give exactly the bytes of the equivalent chain of
Value operations.

A contribution made of parts loads as a `NumpyRows` (`load` of a `RowPieces`): the fused
helpers read each chunk of the logical tensor from the piece that covers it (a view),
copying only a chunk that straddles two pieces (and decoding, chunk by chunk, pieces of
quantized parts), so the blocks and chunks, and therefore the float64 Gram and every
output byte, are those of the same tensor loaded whole.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, overload

import numpy as np
import numpy.typing as npt

from gradientmail.backends.pool import DEFAULT_POOL_BYTES, BufferPool
from gradientmail.errors import ConfigError
from gradientmail.wire.sharded_pieces import FlatRows, RowPieces
from gradientmail.wire.tensor_bytes import STORAGE_DTYPES, TensorBytes

__all__ = ["NumpyBackend", "NumpyRows", "NumpyValue", "f32", "f32_to_bf16_bits"]

F32Array = npt.NDArray[np.float32]

#: Elements per step of the fused elementwise helpers: the few float32 vectors of this
#: length a step touches stay in a core's L2 cache, and each numpy call does enough work
#: to amortise its overhead (and the GIL, when several threads run).
CHUNK = 1 << 16
#: Elements per step of `gram`: its float64 copies of M vectors (two of them, see
#: `_gram_block`) stay within a few MB, and each step's batched product is large enough
#: that two threads do not wait on each other between numpy calls (measured on 2 cores:
#: M=8 1.5x faster than 1 << 14).
GRAM_CHUNK = 1 << 15
#: Elements per task a thread takes. Fixed, not derived from the thread count, so that
#: float64 partial sums are added in the same order whatever the number of threads.
BLOCK = 1 << 20

_T = TypeVar("_T")


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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

    __slots__ = ("_a", "_finite", "_owned", "_source")

    def __init__(self, array: F32Array, source: bytes | memoryview | None = None) -> None:
        if array.dtype != np.float32:
            raise ConfigError(f"NumpyValue holds float32 arrays, not {array.dtype}")
        self._a = array
        # The F32 bytes the array views, when it was loaded from them: to_bytes("F32")
        # hands them back instead of copying (a TensorBytes' data never changes).
        self._source = source
        # Whether the array is this Value's alone (a result of the backend): to_bytes
        # then hands it over without a copy. An array a caller passed in may be written
        # by that caller later, so it is copied.
        self._owned = False
        # Whether every element is finite, when a fused helper found out while writing it.
        self._finite: bool | None = None

    @classmethod
    def _of(cls, array: F32Array, finite: bool | None = None) -> NumpyValue:
        """A Value owning `array`, which nothing else references or writes."""
        value = cls(array)
        value._owned = True
        value._finite = finite
        return value

    @property
    def array(self) -> F32Array:
        """The underlying float32 array (possibly read-only; do not modify)."""
        return self._a

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self._a.shape)

    def _other(self, other: object) -> F32Array:
        if isinstance(other, NumpyRows):
            other = other.joined()
        if not isinstance(other, NumpyValue):
            raise ConfigError(
                f"cannot combine a numpy Value with {type(other).__name__}; "
                "load both tensors with the same backend"
            )
        if other._a.shape != self._a.shape:
            raise ConfigError(f"shape {other.shape} does not match {self.shape}")
        return other._a

    def __add__(self, other: Any) -> NumpyValue:
        return NumpyValue._of(np.add(self._a, self._other(other)))

    def __sub__(self, other: Any) -> NumpyValue:
        return NumpyValue._of(np.subtract(self._a, self._other(other)))

    def __mul__(self, k: float) -> NumpyValue:
        with np.errstate(over="ignore"):
            return NumpyValue._of(np.multiply(self._a, np.float32(k)))

    __rmul__ = __mul__

    def dot(self, other: Any) -> float:
        return _gram(_arrays([self, other]), _serial)[0][1]

    def norm(self) -> float:
        return math.sqrt(_gram([self._flat()], _serial)[0][0])

    def isfinite(self) -> bool:
        if self._finite is not None:
            return self._finite
        flat = self._flat()
        return all(_finite(flat, span) for span in _blocks(flat.size))

    def to_bytes(self, dtype: str) -> TensorBytes:
        """The Value in `dtype`. F32 shares the Value's memory (made read-only) when the
        Value owns it or was loaded from bytes; other dtypes are converted once, into an
        array the TensorBytes then holds without a further copy."""
        flat = self._flat()
        if dtype == "F32":
            if self._source is not None:
                return TensorBytes("F32", self.shape, self._source)
            if self._owned and flat.dtype == np.dtype("<f4"):
                data = flat
            else:
                data = flat.astype("<f4", copy=True)
        elif dtype == "F16":
            with np.errstate(over="ignore", invalid="ignore"):
                data = flat.astype("<f2")
            # NaN payloads differ between converters (numpy keeps the payload, CUDA writes
            # 0x7FFF): pin one NaN so every backend writes the same bytes.
            data.view(np.uint16)[np.isnan(flat)] = 0x7E00
        elif dtype == "BF16":
            data = f32_to_bf16_bits(flat).astype("<u2", copy=False)
        else:
            raise ConfigError(
                f"to_bytes: dtype {dtype!r} is not one of {', '.join(STORAGE_DTYPES)}"
            )
        data.flags.writeable = False
        return TensorBytes(dtype, self.shape, data)

    def _flat(self) -> F32Array:
        return _flat(self._a)

    def __repr__(self) -> str:
        return f"NumpyValue(shape={self.shape})"


def _flat(a: F32Array) -> F32Array:
    return np.ascontiguousarray(a).reshape(-1)


class NumpyRows:
    """A Value over a `RowPieces` (a contribution made of parts). The backend's fused
    helpers and `dot`, `norm`, `isfinite` read it a chunk at a time, where it lies; the
    other operations join it into one array first (a copy of the tensor)."""

    __slots__ = ("_rows", "_tensor")

    def __init__(self, tensor: RowPieces) -> None:
        self._tensor = tensor
        self._rows = FlatRows(tensor)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._tensor.shape

    def joined(self) -> NumpyValue:
        """The Value as one array (a copy of every piece)."""
        return _load(self._tensor.joined())

    def __add__(self, other: Any) -> NumpyValue:
        return self.joined().__add__(other)

    def __sub__(self, other: Any) -> NumpyValue:
        return self.joined().__sub__(other)

    def __mul__(self, k: float) -> NumpyValue:
        return self.joined() * k

    __rmul__ = __mul__

    def dot(self, other: Any) -> float:
        return _gram(_arrays([self, other]), _serial)[0][1]

    def norm(self) -> float:
        return math.sqrt(_gram([self._rows], _serial)[0][0])

    def isfinite(self) -> bool:
        return all(_finite(self._rows, span) for span in _blocks(self._rows.size))

    def to_bytes(self, dtype: str) -> TensorBytes:
        return self.joined().to_bytes(dtype)

    def __repr__(self) -> str:
        return f"NumpyRows(shape={self.shape})"


#: What the fused helpers read: a flat float32 array, or the pieces of one.
_Flat = F32Array | FlatRows


def _reader(v: NumpyValue | NumpyRows) -> _Flat:
    return v._rows if isinstance(v, NumpyRows) else v._flat()


def _arrays(values: Sequence[Any]) -> list[_Flat]:
    if not values:
        raise ConfigError("need at least one Value")
    first = values[0]
    if not isinstance(first, NumpyValue | NumpyRows):
        raise ConfigError(f"the numpy backend cannot use a {type(first).__name__}")
    out = [_reader(first)]
    for v in values[1:]:
        if not isinstance(v, NumpyValue | NumpyRows):
            raise ConfigError(
                f"cannot combine a numpy Value with {type(v).__name__}; "
                "load both tensors with the same backend"
            )
        if v.shape != first.shape:
            raise ConfigError(f"shape {v.shape} does not match {first.shape}")
        out.append(_reader(v))
    return out


def _load(tensor: TensorBytes) -> NumpyValue:
    if tensor.dtype == "F32":
        a = np.frombuffer(tensor.buffer, dtype="<f4").reshape(tensor.shape)
        return NumpyValue(a, tensor.buffer)
    if tensor.dtype == "F16":
        a = np.frombuffer(tensor.buffer, dtype="<f2").astype(np.float32)
    elif tensor.dtype == "BF16":
        bits = np.frombuffer(tensor.buffer, dtype="<u2").astype(np.uint32) << np.uint32(16)
        a = bits.view(np.float32)
    else:
        raise ConfigError(
            f"cannot load a {tensor.dtype} tensor as a Value; dequantize it to F32 first"
        )
    return NumpyValue._of(a.reshape(tensor.shape))


class NumpyBackend:
    """Values as numpy float32 arrays; the backend of a CPU syncer (numpy only).

    The fused helpers split the data into fixed blocks and run them on `threads` threads
    (default: the usable CPUs, at most 4, about where a merge becomes bound by memory
    bandwidth; numpy releases the GIL inside its loops). The result does not depend on the
    number of threads. Their outputs come from a `BufferPool` of up to `pool_bytes`
    (0: always allocate), so a round reuses the memory of a state dropped since.
    """

    name = "numpy"

    def __init__(self, threads: int | None = None, pool_bytes: int = DEFAULT_POOL_BYTES) -> None:
        if threads is None:
            threads = min(_usable_cpus(), 4)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads={threads!r} must be an int >= 1")
        self.threads = threads
        self.buffers = BufferPool(pool_bytes)
        self._pool: ThreadPoolExecutor | None = None

    @overload
    def load(self, tensor: TensorBytes) -> NumpyValue: ...

    @overload
    def load(self, tensor: RowPieces) -> NumpyRows: ...

    @overload
    def load(self, tensor: TensorBytes | RowPieces) -> NumpyValue | NumpyRows: ...

    def load(self, tensor: TensorBytes | RowPieces) -> NumpyValue | NumpyRows:
        """A Value from F32 (zero-copy, read-only), F16 or BF16 bytes (exactly widened);
        from `RowPieces`, a `NumpyRows` reading them where they lie (nothing copied)."""
        if isinstance(tensor, RowPieces):
            return NumpyRows(tensor)
        return _load(tensor)

    def zeros(self, shape: tuple[int, ...]) -> NumpyValue:
        return NumpyValue._of(np.zeros(shape, dtype=np.float32))

    def _map(self, fn: Callable[[tuple[int, int]], _T], spans: list[tuple[int, int]]) -> list[_T]:
        if self.threads == 1 or len(spans) < 2:
            return [fn(span) for span in spans]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gradientmail-numpy")
        return list(self._pool.map(fn, spans))

    def gram(self, values: Sequence[Any]) -> list[list[float]]:
        """G[i][j] = values[i].dot(values[j]) (float64 sums of exact products), reading
        each value once. A non-finite value gives a non-finite diagonal entry."""
        return _gram(_arrays(values), self._map)

    def lincomb(self, values: Sequence[Any], coeffs: Sequence[float]) -> NumpyValue:
        """c₀·v₀ + c₁·v₁ + … evaluated left to right in float32 (coefficients rounded to
        float32 first): the bytes of `v0 * c0 + v1 * c1 + …` with Value operations."""
        arrays = _arrays(values)
        ks = _coeffs(coeffs, len(arrays))
        out = self.buffers.empty(arrays[0].size)

        def run(span: tuple[int, int]) -> None:
            tmp = np.empty(min(CHUNK, span[1] - span[0]), dtype=np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                for s, n in _chunks(span):
                    _lincomb_chunk(arrays, ks, s, n, out[s : s + n], tmp[:n])

        self._map(run, _blocks(out.size))
        return NumpyValue._of(out.reshape(values[0].shape))

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
        th_out = self.buffers.empty(th.size)
        mo_out = self.buffers.empty(mo.size)

        def run(span: tuple[int, int]) -> bool:
            # No larger than the span: a sharded rank steps its rows a few at a time.
            d = np.empty(min(CHUNK, span[1] - span[0]), dtype=np.float32)
            tmp = np.empty_like(d)
            finite = True
            with np.errstate(over="ignore", invalid="ignore"):
                for s, n in _chunks(span):
                    dd, tt, mm = d[:n], tmp[:n], mo_out[s : s + n]
                    _lincomb_chunk(arrays, ks, s, n, dd, tt)
                    np.multiply(mo[s : s + n], b, out=mm)
                    np.add(mm, dd, out=mm)
                    np.multiply(mm, b, out=tt)
                    np.add(dd, tt, out=tt)
                    np.multiply(tt, eta, out=tt)
                    np.subtract(th[s : s + n], tt, out=th_out[s : s + n])
                    # Checked while the chunk is in cache: all_finite(Θ) needs no pass.
                    finite = finite and bool(np.isfinite(th_out[s : s + n]).all())
            return finite

        finite = all(self._map(run, _blocks(th.size)))
        shape = theta.shape
        return (NumpyValue._of(th_out.reshape(shape), finite),
                NumpyValue._of(mo_out.reshape(shape)))

    def all_finite(self, value: Any) -> bool:
        """`value.isfinite()`, on the backend's threads (known without a pass for the
        theta of `outer_step`, which checks it while writing it)."""
        (a,) = _arrays([value])
        known = getattr(value, "_finite", None)
        if known is not None:
            return bool(known)
        return all(self._map(lambda span: _finite(a, span), _blocks(a.size)))


def _blocks(size: int) -> list[tuple[int, int]]:
    return [(s, min(size, s + BLOCK)) for s in range(0, size, BLOCK)]


def _chunks(span: tuple[int, int], step: int = CHUNK) -> Iterator[tuple[int, int]]:
    start, end = span
    for s in range(start, end, step):
        yield s, min(step, end - s)


def _finite(a: _Flat, span: tuple[int, int]) -> bool:
    return all(bool(np.isfinite(a[s : s + n]).all()) for s, n in _chunks(span))


def _gram_block(arrays: list[_Flat], span: tuple[int, int]) -> npt.NDArray[np.float64]:
    m = len(arrays)
    # Multiply in slices of k elements, small enough (m·m·k <= 2^17) that OpenBLAS runs
    # each product on the calling thread: above 2^18 it uses its own thread pool, which
    # serialises concurrent callers on a lock, and our threads would wait for each other.
    k = 1 << max(6, min(GRAM_CHUNK, (1 << 17) // (m * m)).bit_length() - 1)
    g = np.zeros((m, m), dtype=np.float64)
    # Sized to the span: a small tensor (a LayerNorm's 128 weights) must not allocate two
    # GRAM_CHUNK-long float64 blocks per round; that allocation held the GIL for 3% of a
    # tiny GPT-2 run on the training thread's time.
    rows = max(min(GRAM_CHUNK, span[1] - span[0]) // k, 1)
    buf = np.empty((rows, m, k), dtype=np.float64)
    # A second copy of the block as the right operand: numpy sends block @ block.T to
    # BLAS syrk, which for these shapes (m rows, k long) runs 1.2-2.7x slower than gemm on
    # two distinct operands, the float64 copy included.
    twin = np.empty_like(buf)
    for s, n in _chunks(span, GRAM_CHUNK):
        full = n // k
        if full:
            block = buf[:full]
            for i, a in enumerate(arrays):
                np.copyto(block[:, i, :], a[s : s + full * k].reshape(full, k))
            np.copyto(twin[:full], block)
            # np.dot releases the GIL around BLAS; batched np.matmul holds it, which stalled
            # the training thread of a learner whose embedded closer was merging.
            acc = np.dot(block[0], twin[0].T)
            for r in range(1, full):
                acc += np.dot(block[r], twin[r].T)
            g += acc
        if n > full * k:
            tail = np.empty((m, n - full * k), dtype=np.float64)
            for i, a in enumerate(arrays):
                np.copyto(tail[i], a[s + full * k : s + n])
            g += tail @ tail.T
    return g


def _gram(
    arrays: list[_Flat],
    mapper: Callable[
        [Callable[[tuple[int, int]], npt.NDArray[np.float64]], list[tuple[int, int]]],
        list[npt.NDArray[np.float64]],
    ],
) -> list[list[float]]:
    m = len(arrays)
    total = np.zeros((m, m), dtype=np.float64)
    # Block partial sums are added in block order: the same float64 result for any
    # number of threads, and for Value.dot, which runs the same blocks in one thread.
    for part in mapper(lambda span: _gram_block(arrays, span), _blocks(arrays[0].size)):
        total += part
    # gemm may round G[i][j] and G[j][i] differently: keep the upper triangle, mirrored.
    return [[float(total[min(i, j), max(i, j)]) for j in range(m)] for i in range(m)]


def _serial(fn: Callable[[tuple[int, int]], _T], spans: list[tuple[int, int]]) -> list[_T]:
    return [fn(span) for span in spans]


def _coeffs(coeffs: Sequence[float], m: int) -> list[np.float32]:
    if len(coeffs) != m:
        raise ConfigError(f"{len(coeffs)} coefficients for {m} values")
    with np.errstate(over="ignore"):
        return [np.float32(c) for c in coeffs]


def _lincomb_chunk(
    arrays: list[_Flat], ks: list[np.float32], s: int, n: int, out: F32Array, tmp: F32Array
) -> None:
    np.multiply(arrays[0][s : s + n], ks[0], out=out)
    for a, k in zip(arrays[1:], ks[1:], strict=True):
        np.multiply(a[s : s + n], k, out=tmp)
        np.add(out, tmp, out=out)
