"""Adapters: a framework's model seen as a Schema and TensorBytes.

`TorchAdapter` (whole parameters) and `ShardedAdapter` (FSDP2 shards, row by row) are
imported lazily so `import gradientmail.adapters` never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradientmail.adapters.sharded import ShardedAdapter
    from gradientmail.adapters.torch import TorchAdapter

__all__ = ["ShardedAdapter", "TorchAdapter"]


def __getattr__(name: str) -> Any:
    if name == "TorchAdapter":
        from gradientmail.adapters.torch import TorchAdapter

        return TorchAdapter
    if name == "ShardedAdapter":
        from gradientmail.adapters.sharded import ShardedAdapter

        return ShardedAdapter
    raise AttributeError(f"module 'gradientmail.adapters' has no attribute {name!r}")
