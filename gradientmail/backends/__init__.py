"""Backends: the `Value` arithmetic the aggregator is written over, once.

`NumpyBackend()` needs numpy alone (a syncer on a CPU box); `TorchBackend(device=None)`
keeps Values on a torch device (a GPU learner). On CPU both give identical bytes for
identical inputs. Importing this package never imports torch: `TorchBackend` is loaded on
first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradientmail.backends.base import Backend, Value
from gradientmail.backends.numpy_backend import NumpyBackend, NumpyRows, NumpyValue

if TYPE_CHECKING:
    from gradientmail.backends.torch_backend import TorchBackend, TorchRows, TorchValue

__all__ = [
    "Backend",
    "NumpyBackend",
    "NumpyRows",
    "NumpyValue",
    "TorchBackend",
    "TorchRows",
    "TorchValue",
    "Value",
    "default_backend",
]


def __getattr__(name: str) -> Any:
    if name in ("TorchBackend", "TorchRows", "TorchValue"):
        from gradientmail.errors import MissingExtra

        try:
            from gradientmail.backends import torch_backend
        except ModuleNotFoundError as exc:
            if exc.name != "torch":
                raise
            raise MissingExtra("torch", "the torch backend") from exc
        return getattr(torch_backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_backend() -> Backend:
    """The numpy backend: the one every party can run, with numpy alone."""
    return NumpyBackend()
