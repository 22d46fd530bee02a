"""The Backend/Value contract: the arithmetic the aggregator is written over, once.

A `Value` is an F32 tensor held by a backend (numpy on a CPU syncer, torch on a GPU
learner). Elementwise operations are IEEE float32, so equal inputs give equal bytes on
every backend; `dot` and `norm` accumulate in float64 and return Python floats.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gradientmail.serialization import TensorBytes

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

    def load(self, tensor: TensorBytes) -> Value: ...

    def zeros(self, shape: tuple[int, ...]) -> Value: ...
