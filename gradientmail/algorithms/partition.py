"""How a model is split into fragments: a pure function of the schema, so every party
computes the same plan.

`ByBytes()` bin-packs tensors, largest first (ties by name), each into the lightest
fragment (ties: the lowest index). `Strided(block_pattern)` deals transformer blocks
round-robin in block-index order (fragment p holds every P-th block starting from the
p-th, as Streaming DiLoCo does), then bin-packs the other tensors the same way. A plan has
at most min(P, number of tensors) fragments; empty fragments are dropped. Within a
fragment, tensors keep their schema order.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from gradientmail.errors import ConfigError, RemoteProtocolError
from gradientmail.wire.serialization import Schema

__all__ = ["ByBytes", "Partition", "Strided", "partition_from_json", "plan"]


@dataclasses.dataclass(frozen=True)
class ByBytes:
    """Balance fragments by bytes: greedy largest-first bin packing."""

    def to_json(self) -> dict[str, Any]:
        return {"type": "by_bytes"}


@dataclasses.dataclass(frozen=True)
class Strided:
    """Deal transformer blocks round-robin; `block_pattern` captures the block index.

    The pattern is searched in each tensor name; its single capture group must match the
    block's decimal index (the default matches `h.3.attn.weight` or `layers.3.mlp`).
    """

    block_pattern: str = r"\.(\d+)\."

    def __post_init__(self) -> None:
        if not isinstance(self.block_pattern, str):
            raise ConfigError(f"block_pattern={self.block_pattern!r} must be a string")
        try:
            compiled = re.compile(self.block_pattern)
        except re.error as exc:
            raise ConfigError(
                f"block_pattern={self.block_pattern!r} is not a valid regular expression: {exc}"
            ) from None
        if compiled.groups != 1:
            raise ConfigError(
                f"block_pattern={self.block_pattern!r} has {compiled.groups} capture groups; "
                r"it needs exactly one, around the block index, e.g. r'\.(\d+)\.'"
            )

    def block_of(self, name: str) -> int | None:
        """The block index of tensor `name`, or None when it is not in a block."""
        match = re.search(self.block_pattern, name)
        if match is None or match.group(1) is None:
            return None
        try:
            return int(match.group(1))
        except ValueError:
            raise ConfigError(
                f"block_pattern={self.block_pattern!r} captured {match.group(1)!r} in tensor "
                f"{name!r}, which is not a decimal block index; capture digits only"
            ) from None

    def to_json(self) -> dict[str, Any]:
        return {"type": "strided", "block_pattern": self.block_pattern}


Partition = ByBytes | Strided


def partition_from_json(obj: Any, field: str = "partition") -> Partition:
    """Inverse of `to_json`; `RemoteProtocolError` naming `field` for another shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise RemoteProtocolError(f"{field}={obj!r:.100} must be an object with a string 'type'")
    kind = obj["type"]
    if kind == "by_bytes":
        if set(obj) != {"type"}:
            raise RemoteProtocolError(
                f"{field}: by_bytes takes no options; unexpected keys {sorted(set(obj) - {'type'})}"
            )
        return ByBytes()
    if kind == "strided":
        if set(obj) != {"type", "block_pattern"}:
            raise RemoteProtocolError(
                f"{field}: strided needs exactly 'type' and 'block_pattern'; got {sorted(obj)}"
            )
        if not isinstance(obj["block_pattern"], str):
            raise RemoteProtocolError(
                f"{field}.block_pattern={obj['block_pattern']!r:.100} must be a string"
            )
        try:
            return Strided(obj["block_pattern"])
        except ConfigError as exc:
            raise RemoteProtocolError(f"{field}.block_pattern: {exc}") from None
    raise RemoteProtocolError(
        f"{field}.type={kind!r:.100} is not a partition; use 'by_bytes' or 'strided'"
    )


def _pack(
    names: list[str], sizes: dict[str, int], loads: list[int], bins: list[list[str]]
) -> None:
    for name in sorted(names, key=lambda n: (-sizes[n], n)):
        lightest = min(range(len(loads)), key=lambda p: (loads[p], p))
        bins[lightest].append(name)
        loads[lightest] += sizes[name]


def plan(schema: Schema, fragments: int, partition: Partition) -> tuple[tuple[str, ...], ...]:
    """The tensor names of each fragment, a pure function of the schema.

    At most min(`fragments`, number of tensors) fragments; empty ones are dropped, so the
    result may be shorter than `fragments` (schedule rounds over `len(plan(...))`).
    """
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ConfigError(f"fragments={fragments!r} must be an int >= 1")
    if not isinstance(partition, ByBytes | Strided):
        raise ConfigError(f"partition={partition!r} must be ByBytes() or Strided(...)")
    names = list(schema.names)
    count = min(fragments, len(names))
    if count == 0:
        return ()
    sizes = {n: schema.nbytes(n) for n in names}
    loads = [0] * count
    bins: list[list[str]] = [[] for _ in range(count)]
    rest = names
    if isinstance(partition, Strided):
        block = {n: partition.block_of(n) for n in names}
        indices = sorted({b for b in block.values() if b is not None})
        slot = {b: k % count for k, b in enumerate(indices)}
        rest = []
        for n in names:
            b = block[n]
            if b is None:
                rest.append(n)
            else:
                bins[slot[b]].append(n)
                loads[slot[b]] += sizes[n]
    _pack(rest, sizes, loads, bins)
    order = {n: i for i, n in enumerate(names)}
    return tuple(tuple(sorted(b, key=order.__getitem__)) for b in bins if b)
