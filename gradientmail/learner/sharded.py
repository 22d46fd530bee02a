"""A learner whose ranks each mail their own rows: what its mailman asks of them.

A learner run by several ranks that each hold a shard (FSDP2), or that split their upload
(DDP), publishes a contribution as one part per rank and reads each commit by ranges, each
rank its own rows (docs/design/sharded.md §3). Rank 0 runs the `Learner`; its adapter then has a
`ranks`: the other ranks, reached over a side process group that the integration core
(`gradientmail.integration.sharded`) carries out. The mailman's poster and fetcher ask it
for three things, and for nothing else:

- `upload`: every rank computes anchor − θ over the rows it owns and uploads it as its
  part of the round; the part references, in rank order (a failure on any rank raises).
- `load`: every rank reads its rows of a fragment's parameters at a commit (or Θ⁰, when
  joining) and loads them onto its device; with a replicated outer step each rank
  replays the commit's step on its own rows of the fragment's state. Rank 0's loaded
  values (what the training thread applies, which tells every rank to apply its own),
  and the bytes all ranks downloaded. No rank holds the fragment whole.
- `feedback`: with a sparse `delta_dtype` each rank keeps the error feedback of its own
  rows (`learner.feedback.Residuals`) and `upload` sparsifies them (`Sparse`); rank 0's
  mailman holds the view `feedback` returns, through which it settles them and a
  checkpoint saves and restores them.
- `upload_init`: when the learner creates the run, every rank uploads its own rows of a
  fragment's Θ⁰ as its part; the part references, in rank order.

`anchor` and `snapshot` are the adapter's handles, as the training thread made them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from gradientmail.learner.feedback import ErrorFeedback
from gradientmail.run.protocol import Exchange
from gradientmail.wire.records import Manifest, RoundRecord
from gradientmail.wire.refs import PayloadRef

__all__ = ["Ranks", "Sparse", "ranks_of"]


@dataclasses.dataclass(frozen=True)
class Sparse:
    """How each rank sparsifies its rows of a contribution of `fragment`: the run's
    density, feedback decay and feedback momentum (0: none), as `Residuals.encode` takes
    them."""

    fragment: int
    density: float
    decay: float
    momentum: float


class Ranks(Protocol):
    """The ranks of a learner that mails its contribution in parts (see the module)."""

    @property
    def size(self) -> int:
        """How many ranks, and parts per contribution."""
        ...

    async def upload(self, exchange: Exchange, round_: int, learner: str, anchor: Any,
                     snapshot: Any, delta_format: str, sparse: Sparse | None = None
                     ) -> list[PayloadRef]:
        """Every rank's part of `learner`'s contribution to `round_`, in rank order; with
        a sparse `delta_format`, `sparse` says how (each rank's own error feedback)."""
        ...

    def feedback(self, learner: str) -> ErrorFeedback:
        """The error feedback of `learner`'s ranks, as rank 0's mailman holds it."""
        ...

    async def upload_init(self, exchange: Exchange, fragment: int, names: tuple[str, ...],
                          attempt: int) -> list[PayloadRef]:
        """Every rank's part of Θ⁰ of `fragment` (tensors `names`) for creation
        `attempt`, in rank order."""
        ...

    async def load(self, exchange: Exchange, manifest: Manifest, fragment: int,
                   record: RoundRecord | None) -> tuple[Any, int]:
        """Every rank's rows of `fragment`'s parameters as `record` committed them (Θ⁰
        for None), loaded; rank 0's (None when a payload was swept), and the bytes all
        ranks read."""
        ...


def ranks_of(adapter: Any) -> Ranks | None:
    """The ranks an adapter brings (its `ranks` attribute), or None: a learner of one rank,
    or one whose rank 0 mails for all (the whole-model adapters)."""
    ranks: Ranks | None = getattr(adapter, "ranks", None)
    return ranks
