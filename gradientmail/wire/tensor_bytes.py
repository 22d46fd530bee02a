"""`TensorBytes`: a tensor as raw little-endian bytes plus its dtype and shape, and the
dtype tables every payload shares.

A `TensorBytes` holds `bytes`, or without a copy any read-only contiguous buffer whose
memory nobody writes (a slice of a downloaded payload, an array a backend handed over):
payloads are unpacked into views of the one blob they arrived in, and merge outputs reach
the store without being copied into `bytes` first. The wire format lives in
`gradientmail.wire.serialization`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar

import ml_dtypes
import numpy as np
import numpy.typing as npt

from gradientmail.errors import ConfigError, CorruptPayload

__all__ = [
    "DTYPES",
    "STORAGE_DTYPES",
    "TensorBytes",
    "dtype_bits",
    "entry_of",
    "handed_over",
    "nbytes_of",
]

#: Dtypes a schema (a model's parameters) may hold.
STORAGE_DTYPES: tuple[str, ...] = ("F32", "F16", "BF16")
#: Every dtype a payload may hold, with its width in bits.
_BITS: dict[str, int] = {"F32": 32, "F16": 16, "BF16": 16, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4,
                        "U16": 16, "U8": 8, "U32": 32}
DTYPES: tuple[str, ...] = tuple(_BITS)

_A = TypeVar("_A", bound=np.generic)

_NUMPY: dict[str, Any] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    # The offsets of a sparse payload within their chunk (`wire.sparse`).
    "U16": np.dtype("<u2"),
    # Packed codes and offsets of a TOPK_Q2 payload (`wire.sparse`).
    "U8": np.dtype(np.uint8),
    # A SIGN1 payload's seed and threshold (`wire.signs`).
    "U32": np.dtype("<u4"),
}


def dtype_bits(dtype: str) -> int:
    """Width of one element of `dtype` in bits; `ConfigError` for an unknown dtype."""
    try:
        return _BITS[dtype]
    except (KeyError, TypeError):
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}") from None


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes that a tensor of `dtype` and `shape` occupies (F4: two elements per byte)."""
    return (_numel(shape) * dtype_bits(dtype) + 7) // 8


def _check_shape(shape: object, what: str) -> tuple[int, ...]:
    if not isinstance(shape, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ConfigError(f"{what}: shape {shape!r} must be a tuple of non-negative ints")
    return shape


class TensorBytes:
    """A tensor as raw little-endian bytes: `len(data) == nbytes_of(dtype, shape)`.

    Built from `bytes`, or without a copy from any read-only C-contiguous buffer of memory
    nobody writes (a memoryview such as a slice of a downloaded payload, a read-only numpy
    array a backend produced and handed over); a writable buffer is refused, since its
    owner could change the tensor afterwards. `buffer` is the zero-copy read-only byte view
    every reader in the library uses; `data` is the same bytes as a `bytes` object (the
    object itself when built from bytes, else a copy made on each access). Immutable;
    equal when dtype, shape and bytes are; the hash follows equality; pickling stores
    plain bytes.
    """

    __slots__ = ("_data", "dtype", "shape")

    dtype: str
    shape: tuple[int, ...]
    _data: bytes | memoryview

    def __init__(self, dtype: str, shape: tuple[int, ...], data: Any) -> None:
        dtype_bits(dtype)
        _check_shape(shape, "TensorBytes")
        held = data if isinstance(data, bytes) else _readonly_view(data)
        want = nbytes_of(dtype, shape)
        if len(held) != want:
            raise ConfigError(
                f"TensorBytes {dtype}{list(shape)} needs {want} bytes but holds {len(held)}"
            )
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "_data", held)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"TensorBytes is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"TensorBytes is immutable; cannot delete {name!r}")

    @property
    def data(self) -> bytes:
        """The data as `bytes` (a copy when the tensor views shared memory; hot paths read
        `buffer` instead)."""
        d = self._data
        return d if isinstance(d, bytes) else d.tobytes()

    @property
    def buffer(self) -> bytes | memoryview:
        """The data without a copy: `bytes`, or a read-only flat byte memoryview."""
        return self._data

    @property
    def is_view(self) -> bool:
        """Whether the data is shared memory (a memoryview) rather than its own bytes."""
        return not isinstance(self._data, bytes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorBytes):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.shape == other.shape
            and _same_bytes(self._data, other._data)
        )

    def __hash__(self) -> int:
        # Equal tensors have equal prefixes: hashing a bounded prefix keeps hash() cheap
        # for large tensors and never needs a hashable buffer owner.
        return hash((self.dtype, self.shape, len(self._data), bytes(self._data[:64])))

    def __reduce__(self) -> tuple[Any, ...]:
        return (TensorBytes, (self.dtype, self.shape, self.data))

    def __repr__(self) -> str:
        return f"TensorBytes(dtype={self.dtype!r}, shape={self.shape!r}, nbytes={self.nbytes})"

    @property
    def numel(self) -> int:
        """Number of elements."""
        return _numel(self.shape)

    @property
    def nbytes(self) -> int:
        """Number of data bytes."""
        return len(self._data)

    @classmethod
    def from_numpy(cls, array: npt.ArrayLike, *, copy: bool = True) -> TensorBytes:
        """Wrap a float32/float16/bfloat16/float8_e4m3fn/float8_e8m0fnu array.

        With `copy` (the default) the data is copied unless it provably cannot change (a
        read-only view of `bytes`, as `to_numpy` returns), so the caller may go on writing
        its array. `copy=False` hands the array over without a copy: it must be
        C-contiguous, little-endian and of one of those dtypes (else `ConfigError`); it is
        marked read-only, and the caller promises that nothing writes its memory again
        through any other alias.

        A `ml_dtypes.float4_e2m1fn` array (one code per byte) is packed two per byte.
        """
        arr = np.asarray(array)
        if arr.dtype == np.dtype(ml_dtypes.float4_e2m1fn):
            return cls("F4", tuple(arr.shape), _pack_nibbles(arr.reshape(-1).view(np.uint8)))
        for name, dt in _NUMPY.items():
            if arr.dtype == dt or (arr.dtype.kind == "f" and arr.dtype.newbyteorder("<") == dt):
                shape = tuple(int(d) for d in arr.shape)
                if not copy:
                    if arr.dtype != dt or not arr.flags.c_contiguous:
                        raise ConfigError(
                            f"from_numpy(copy=False) needs a C-contiguous {dt} array; "
                            f"got {arr.dtype}, contiguous={arr.flags.c_contiguous}"
                        )
                    arr.flags.writeable = False
                    return cls(name, shape, arr)
                if arr.dtype == dt and arr.flags.c_contiguous and _immutable(arr):
                    return cls(name, shape, arr)
                return cls(name, shape, np.ascontiguousarray(arr, dtype=dt).tobytes())
        raise ConfigError(
            f"cannot wrap a numpy array of dtype {arr.dtype}; use float32, float16, "
            "ml_dtypes.bfloat16, float8_e4m3fn, float8_e8m0fnu or float4_e2m1fn"
        )

    def to_numpy(self) -> npt.NDArray[Any]:
        """A read-only numpy view of the data, no copy (F4: unpacked to one
        float4_e2m1fn per byte, a new array)."""
        if self.dtype == "F4":
            codes = _unpack_nibbles(self._data, self.numel)
            out: npt.NDArray[Any] = codes.view(ml_dtypes.float4_e2m1fn).reshape(self.shape)
        else:
            out = np.frombuffer(self._data, dtype=_NUMPY[self.dtype]).reshape(self.shape)
        return out


def handed_over(array: npt.NDArray[_A]) -> npt.NDArray[_A]:
    """`array` made read-only, to be held by a TensorBytes without a copy. For arrays the
    caller just made and references nowhere else: nothing may write them afterwards."""
    array.flags.writeable = False
    return array


def _readonly_view(data: object) -> bytes | memoryview:
    """`data` as bytes, or as a read-only flat byte view of the same memory (no copy)."""
    if isinstance(data, np.ndarray):
        if data.flags.writeable or not data.flags.c_contiguous:
            raise ConfigError(
                "TensorBytes data must be bytes, not a writable or non-contiguous numpy "
                "array; use TensorBytes.from_numpy(...)"
            )
        # A byte view first: the buffer protocol does not know ml_dtypes' dtypes.
        data = data.reshape(-1).view(np.uint8).data
    if isinstance(data, memoryview) and data.readonly and data.c_contiguous:
        if data.ndim != 1 or data.format != "B":
            try:
                data = data.cast("B")
            except TypeError as exc:
                raise ConfigError(f"TensorBytes cannot view this buffer as bytes: {exc}") from None
        return data
    raise ConfigError(
        f"TensorBytes data must be bytes, not {type(data).__name__}, or a read-only "
        "contiguous buffer (memoryview, numpy array); wrap it with bytes(...)"
    )


def _immutable(arr: npt.NDArray[Any]) -> bool:
    """Whether `arr`'s memory provably cannot change: read-only all the way down to a
    `bytes` object (an array that owns its memory can be made writable again)."""
    obj: object = arr
    while True:
        if isinstance(obj, np.ndarray):
            if obj.flags.writeable or obj.base is None:
                return False
            obj = obj.base
        elif isinstance(obj, memoryview):
            if not obj.readonly:
                return False
            obj = obj.obj
        else:
            return isinstance(obj, bytes)


#: Bytes compared per step by `_same_bytes` (memoryview comparison goes element by element).
_COMPARE_STEP = 1 << 20


def _same_bytes(a: bytes | memoryview, b: bytes | memoryview) -> bool:
    if isinstance(a, bytes) and isinstance(b, bytes):
        return a == b
    if len(a) != len(b):
        return False
    va, vb = memoryview(a), memoryview(b)
    return all(
        va[s : s + _COMPARE_STEP].tobytes() == vb[s : s + _COMPARE_STEP].tobytes()
        for s in range(0, len(va), _COMPARE_STEP)
    )


def _pack_nibbles(codes: npt.NDArray[np.uint8]) -> bytes:
    """Pack 4-bit codes two per byte, element 2i in the low nibble; odd tail padded with 0."""
    if codes.size % 2:
        codes = np.concatenate([codes, np.zeros(1, np.uint8)])
    pairs = codes.reshape(-1, 2) & np.uint8(0x0F)
    return (pairs[:, 0] | (pairs[:, 1] << np.uint8(4))).tobytes()


def _unpack_nibbles(data: bytes | memoryview, numel: int) -> npt.NDArray[np.uint8]:
    packed = np.frombuffer(data, dtype=np.uint8)
    out = np.empty(packed.size * 2, dtype=np.uint8)
    out[0::2] = packed & np.uint8(0x0F)
    out[1::2] = packed >> np.uint8(4)
    return out[:numel]


def entry_of(entries: Mapping[str, TensorBytes], name: str, dtype: str, where: str,
             flat: bool = False) -> TensorBytes:
    """Entry `name` of a decoded payload, of `dtype` (and 1-D when `flat`);
    `CorruptPayload` naming it (after `where`) when it is missing or of another kind."""
    entry = entries.get(name)
    if entry is None:
        raise CorruptPayload(f"{where}tensor {name!r} is missing from the payload")
    if not isinstance(entry, TensorBytes) or entry.dtype != dtype \
            or (flat and len(entry.shape) != 1):
        if not flat:
            got = entry.dtype if isinstance(entry, TensorBytes) else type(entry).__name__
            raise CorruptPayload(f"{where}tensor {name!r} is {got}; expected {dtype}")
        got = (f"{entry.dtype}{list(entry.shape)}" if isinstance(entry, TensorBytes)
               else type(entry).__name__)
        raise CorruptPayload(f"{where}tensor {name!r} is {got}; expected a 1-D {dtype}")
    return entry
