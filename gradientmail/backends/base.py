"""The Backend/Value contract: the arithmetic the aggregator is written over, once.

A `Value` is an F32 tensor held by a backend (numpy on a CPU syncer, torch on a GPU
learner). Elementwise operations are IEEE float32, so equal inputs give equal bytes on
every backend; `dot` and `norm` accumulate in float64 and return Python floats.

Backends also offer three fused helpers (`gram`, `lincomb`, `outer_step`) that walk the
data once instead of once per operation; each gives exactly the bytes of the equivalent
chain of Value operations (reductions: up to the order of their float64 summation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from gradientmail.wire.sharded_pieces import RowPieces
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["Backend", "Value"]


@runtime_checkable
class Value(Protocol):
    """An F32 tensor on some backend. Operations return new Values; none mutates."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __add__(self, other: Value) -> Value: ...

    def __sub__(self, other: Value) -> Value: ...

    def __mul__(self, k: float) -> Value: ...

    def __rmul__(self, k: float) -> Value: ...

    def dot(self, other: Value) -> float: ...

    def norm(self) -> float: ...

    def isfinite(self) -> bool: ...

    def to_bytes(self, dtype: str) -> TensorBytes: ...


@runtime_checkable
class Backend(Protocol):
    """Turns wire tensors into Values and back."""

    name: str

    def load(self, tensor: TensorBytes | RowPieces) -> Value:
        """A Value of `tensor` (F32, F16 or BF16); of a `RowPieces` (raw or `Quantized`
        pieces), one the fused helpers read where its pieces lie, a window at a time
        (numpy; torch on the CPU), or a device tensor filled a window at a time."""
        ...

    def zeros(self, shape: tuple[int, ...]) -> Value: ...

    def all_finite(self, value: Value) -> bool:
        """`value.isfinite()`, possibly faster (several threads, one reduction)."""
        ...

    def gram(self, values: Sequence[Value]) -> list[list[float]]:
        """G[i][j] = values[i].dot(values[j]) for every pair, reading each value once."""
        ...

    def lincomb(self, values: Sequence[Value], coeffs: Sequence[float]) -> Value:
        """c0*v0 + c1*v1 + ... evaluated left to right, coefficients rounded to float32."""
        ...

    def outer_step(
        self,
        theta: Value,
        momentum: Value,
        values: Sequence[Value],
        coeffs: Sequence[float],
        lr: float,
        beta: float,
    ) -> tuple[Value, Value]:
        """Nesterov on delta = lincomb(values, coeffs): m <- beta*m + delta;
        theta <- theta - lr*(delta + beta*m). Returns (theta, m)."""
        ...
