"""The training channel's messages of a sharded learner (docs/design/sharded.md §3).

What rank 0's training thread does to the model (snapshot, apply, rebase, release) is
sent to the other ranks as it happens, one `Ranks.broadcast_ints` per op in the steady
state, inside the collectives `RankSync` makes anyway. A message has a fixed width:
`[code, kind, a, b, n, released x RELEASES, *tail]`. `code` is `END` (no more ops; `tail`
is what the caller closes the collective with), `OP` (the op in the ints: kind, its two
ints, n released handles) or `OBJECT` (the op follows as an object: a name list not sent
before, more releases than fit). `OpMessages` turns ops into messages and back; every
rank keeps the same numbering of the name lists snapshots were taken of.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

__all__ = ["END", "HEAD", "OBJECT", "OP", "OpMessages"]

END, OP, OBJECT = 0, 1, 2
#: Released handles a message carries in its ints; more go as an object.
RELEASES = 4
#: The width of a message before the tail.
HEAD = 5 + RELEASES
_KINDS = ("snapshot", "apply", "rebase", "release")


class OpMessages:
    """The name lists snapshots were taken of, numbered in the order the training channel
    first sent each (the same on every rank: later snapshots send the number), and the
    ops in ints."""

    def __init__(self) -> None:
        self._lists: list[list[str]] = []
        self._list_ids: dict[tuple[str, ...], int] = {}  # rank 0

    @staticmethod
    def closing(tail: Sequence[int]) -> list[int]:
        """The message that ends the ops, closing the collective with `tail`."""
        return [END] + [0] * (HEAD - 1) + list(tail)

    def is_new(self, kind: str, args: tuple[Any, ...]) -> bool:
        """Rank 0: whether op `kind` names a list not sent before (sent as an object)."""
        return kind == "snapshot" and tuple(args[1]) not in self._list_ids

    def learn(self, names: Sequence[str]) -> None:
        """Number `names`, a list just sent with an op as an object (on every rank)."""
        self._list_ids[tuple(names)] = len(self._lists)
        self._lists.append(list(names))

    def encode(self, kind: str, args: tuple[Any, ...],
               released: Sequence[int]) -> list[int] | None:
        """Rank 0: the message of an op in ints (before the tail), or None when it needs
        an object."""
        if len(released) > RELEASES:
            return None
        if kind == "snapshot":
            listed = self._list_ids.get(tuple(args[1]))
            if listed is None:
                return None
            a, b = args[0], listed
        elif kind == "apply":
            a, b = args[0], struct.unpack("<q", struct.pack("<d", args[1]))[0]
        elif kind == "rebase":
            a, b = args
        else:
            a, b = 0, 0
        rel = list(released) + [0] * (RELEASES - len(released))
        return [OP, _KINDS.index(kind), a, b, len(released), *rel]

    def decode(self, got: Sequence[int]) -> tuple[str, tuple[Any, ...], list[int]]:
        """The op (kind, args, released handles) of an `OP` message."""
        kind, a, b, n = _KINDS[got[1]], got[2], got[3], got[4]
        released = list(got[5:5 + n])
        if kind == "snapshot":
            return kind, (a, self._lists[b]), released
        if kind == "apply":
            return kind, (a, struct.unpack("<d", struct.pack("<q", b))[0]), released
        if kind == "rebase":
            return kind, (a, b), released
        return kind, (), released
