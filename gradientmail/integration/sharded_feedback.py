"""Rank 0's view of a sharded learner's error feedback (docs/design/sharded.md, "Sparse
deltas"): what its mailman holds as `residuals` when every rank keeps the residuals of
its own rows (`ShardedRanks.residuals`).

Rank 0 alone reads the records, so it alone learns what settles a payload; it queues the
settlement (`ShardedRanks.settle`) and every side command carries the queue to every
rank, which applies it before its share. A checkpoint gathers the ranks' residuals into
an unsharded learner's layout (`feedback.join_states`), and a restore hands each rank its
rows of one (`feedback.split_state`), so a checkpoint resumes at any world size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gradientmail.errors import ConfigError
from gradientmail.learner.feedback import STATE_VERSION, Residuals, join_states, split_state
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["FeedbackRanks", "RankResiduals", "rank_restored", "rank_share"]


class FeedbackRanks(Protocol):
    """What `RankResiduals` asks of the ranks (`ShardedRanks`, rank 0)."""

    @property
    def holds_feedback(self) -> bool:
        """The other ranks still serve side commands and some rank keeps residuals."""
        ...

    def residuals(self, learner: str) -> Residuals: ...

    def settle(self, *event: Any) -> None: ...

    def pending_settlements(self) -> list[tuple[Any, ...]]: ...

    def gather_feedback(self) -> list[Any]:
        """Every rank's (spans, residuals' state) on the host, or None (a side command)."""
        ...

    def load_feedback(self, learner: str, state: Mapping[str, Any]) -> None:
        """Every rank keeps its rows of the full `state` (a side command)."""
        ...


class RankResiduals:
    """Rank 0's view of a sharded learner's error feedback (`ErrorFeedback`, what its
    mailman holds as `residuals`): every rank keeps its own rows' residuals
    (`ShardedRanks.residuals`) and encodes them itself (`upload`). Settlements are
    queued for every rank (`ShardedRanks.settle`); `state_dict` gathers the ranks'
    residuals (a side command) into an unsharded learner's layout, full tensors on the
    host, and `load_state_dict` hands each rank its rows of one. After the ranks stop
    (`finish`), `state_dict` gives what they held then."""

    def __init__(self, ranks: FeedbackRanks, learner: str, sizes: Mapping[str, int]) -> None:
        self._ranks = ranks
        self._learner = learner
        self._sizes = dict(sizes)  # elements of each tensor of the model
        self._restored: Residuals | None = None  # checked against the run when joined
        self._final: dict[str, Any] | None = None

    def in_flight(self) -> dict[int, int]:
        """Rank 0's rounds in flight, less those a queued settlement settles (every rank
        holds the same ones)."""
        out = self._ranks.residuals(self._learner).in_flight()
        for kind, *args in self._ranks.pending_settlements():
            if kind == "swept":
                fragment, through = args[0], args[1]
                out = {r: f for r, f in out.items() if not (f == fragment and r <= through)}
            else:
                out.pop(args[0], None)
        return out

    def encode(self, round_: int, fragment: int, delta: Mapping[str, Any], density: float,
               decay: float = 1.0, fmt: str = "TOPK_F8", momentum: float = 0.0,
               offsets: Mapping[str, int] | None = None) -> dict[str, TensorBytes]:
        raise ConfigError("a sharded learner's ranks each encode their own rows "
                          "(ShardedRanks.upload), never rank 0 for all")

    def failed(self, round_: int) -> None:
        self._ranks.settle("failed", round_)

    def recorded(self, round_: int, participants: tuple[str, ...]) -> None:
        self._ranks.settle("recorded", round_, participants)

    def swept(self, fragment: int, through: int, took_part: bool) -> None:
        self._ranks.settle("swept", fragment, through, took_part)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's residuals, settled and joined (`feedback.join_states`): full
        tensors as flat float32 torch tensors on the host, in `Residuals.state_dict`'s
        layout (a side command; rank 0 holds them all while it returns them)."""
        if self._final is not None:
            return self._final
        if not self._ranks.holds_feedback:
            # Gone, or never made (a dense learner): no side command for nothing.
            return {"version": STATE_VERSION, "residuals": {}, "in_flight": {}}
        return self._gathered()

    def keep_final(self) -> None:
        """Gather the ranks' residuals once more before they stop serving."""
        state = self._gathered()
        if state["residuals"] or state["in_flight"]:
            self._final = state

    def _gathered(self) -> dict[str, Any]:
        import torch

        states = [s for s in self._ranks.gather_feedback() if s is not None]
        full = join_states(states, self._sizes)
        return split_state(full, {n: (0, size) for n, size in self._sizes.items()},
                           lambda _, v: torch.from_numpy(v))

    def load_state_dict(self, state: Mapping[str, Any], sizes: Mapping[str, int],
                        place: Callable[[str, Any], Any]) -> None:
        """Check `state` as `Residuals.load_state_dict` does (the same errors), then hand
        every rank its rows of it (a side command)."""
        checked = Residuals(self._learner)
        checked.load_state_dict(state, sizes, lambda _, v: v)
        self._restored = checked
        self._final = None
        self._ranks.load_feedback(self._learner, state)

    def check_fragments(self, plan: tuple[tuple[str, ...], ...]) -> None:
        if self._restored is not None:
            self._restored.check_fragments(plan)
            self._restored = None


def rank_share(mine: Residuals | None, spans: Mapping[str, tuple[int, int]]) -> tuple[
        Mapping[str, tuple[int, int]], dict[str, Any]] | None:
    """A rank's share of a gathered state: the flat `spans` [start, stop) of the tensors
    whose rows it mails and its residuals' state on the host (None while it keeps none)."""
    if mine is None:
        return None
    return spans, split_state(mine.state_dict(), {n: (0, b - a) for n, (a, b) in
                                                  spans.items()}, lambda _, v: v)


def rank_restored(learner: str, state: Mapping[str, Any], spans: Mapping[str, tuple[int, int]],
                  place: Callable[[str, Any], Any]) -> Residuals:
    """A rank's residuals from the full `state`: its `spans` of each tensor, `place`d (on
    its device)."""
    restored = Residuals(learner)
    restored.load_state_dict(split_state(state, spans, place),
                             {n: b - a for n, (a, b) in spans.items()}, lambda _, v: v)
    return restored
