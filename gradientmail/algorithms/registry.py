"""The algorithms a run's manifest may name, rebuilt from their JSON records."""

from __future__ import annotations

from typing import Any

from gradientmail.algorithms.base import Algorithm
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.errors import RemoteProtocolError

__all__ = ["algorithm_from_json"]


def algorithm_from_json(obj: Any) -> Algorithm:
    """The algorithm a JSON record describes, by its "type"; `RemoteProtocolError` for an
    unknown type or a record of another shape."""
    kind = obj.get("type") if isinstance(obj, dict) else None
    if kind == "diloco":
        return DiLoCo.from_json(obj)
    raise RemoteProtocolError(
        f"algorithm record {obj!r:.100} has type {kind!r}; known algorithms: 'diloco'"
    )
