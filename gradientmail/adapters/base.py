"""The Adapter contract: what a learner needs from a model, framework-free.

The learner never touches framework tensors itself. It holds opaque handles the adapter
made: snapshots (taken on the training thread, cheap, on the model's device) and loaded
commits (made on the communication thread, so a host-to-device copy never stalls a step).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from gradientmail.errors import SchemaMismatch
from gradientmail.wire.serialization import Schema
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["Adapter", "check_fits"]


@runtime_checkable
class Adapter(Protocol):
    """What a learner needs from a model. An adapter may also have `direct_names`, the
    frozenset of its embedding parameters' names (RDA merges them by weighted mean,
    `Rda.direct_names`); without it, only `Rda.direct_pattern` picks them. It may also have
    `delta_quantized(anchor, snapshot, fmt)`: `delta` already quantized to transfer format
    `fmt` (the entries `wire.quantization.quantize` gives), which the learner then uses
    instead of quantizing the host bytes itself (`TorchAdapter` quantizes on a GPU). And
    `delta_tensors(anchor, snapshot)` with `to_device(name, array)`: `delta` as float32
    torch tensors on the model's device, where the error feedback of sparse deltas then
    keeps its residuals (`learner.feedback`), and an array moved there."""

    @property
    def schema(self) -> Schema: ...

    def read(self, names: Sequence[str] | None = None) -> dict[str, TensorBytes]:
        """Host bytes of the named parameters in their storage dtypes (training thread)."""
        ...

    def snapshot(self, names: Sequence[str]) -> Any:
        """A copy of the named parameters, on their device (training thread, no I/O)."""
        ...

    def load(self, values: Mapping[str, TensorBytes]) -> Any:
        """Committed parameters, moved to the model's device (communication thread)."""
        ...

    def delta(self, anchor: Any, snapshot: Any) -> dict[str, TensorBytes]:
        """anchor − snapshot for each name, as F32 host bytes (communication thread)."""
        ...

    def apply(self, values: Any, mixing: float = 0.0) -> None:
        """Write loaded values into the parameters in place (training thread)."""
        ...

    def rebase(self, values: Any, base: Any) -> None:
        """θ ← value + (θ − base) for each name, in place (training thread): the local
        progress since `base` (a snapshot or an earlier loaded commit) moved onto the
        loaded `values`."""
        ...


def check_fits(values: Mapping[str, Any], what: str, synced: Container[str],
               misfit: Callable[[str, Any], str | None]) -> None:
    """The one "does it fit" check of every adapter: a `SchemaMismatch` that says it
    cannot `what` and names each value that does not fit, at once (a name not in
    `synced`, or what `misfit(name, value)` finds wrong with it; None when it fits)."""
    problems = []
    for name, value in values.items():
        problem = (f"{name!r} is not a synced parameter" if name not in synced
                   else misfit(name, value))
        if problem is not None:
            problems.append(problem)
    if problems:
        raise SchemaMismatch(f"cannot {what}: " + "; ".join(problems))
