"""What a learner's training thread and its mailman hand each other, and nothing else.

Training thread → mailman: an `Outgoing` contribution (a job), and a few orders given as
method calls on the `Mailman` (which round to watch, blocked or not, how many learners to
wait for, catch up, stop). Mailman → training thread: each `Commit` ready to apply (a
queue), the rounds whose publish is known not to have landed (a queue), and one frozen
`Observed` view of what it saw, replaced whole at every change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from gradientmail.run.protocol import Exchange
from gradientmail.wire.records import RoundRecord, SnapshotRecord

__all__ = ["Commit", "Observed", "Outgoing", "delta_format"]


@dataclasses.dataclass(frozen=True)
class Outgoing:
    """One contribution, as the training thread describes it when its round is due: the
    counters its record carries, and the fragment's snapshot with the anchor its delta
    is taken against (anchor − snapshot, computed by the mailman). The one description
    from the learner's state to the record: `draft` maps it onto `Exchange.draft`."""

    round: int
    fragment: int
    base_version: int
    local_step: int
    steps: int
    tokens: int
    final: bool
    step_seconds: float | None
    snapshot: Any
    anchor: Any
    #: The mean training loss over its steps, when the training loop reported one.
    loss: float | None = None

    def draft(self, exchange: Exchange, learner: str, schema_digest: str,
              delta_format: str) -> SnapshotRecord:
        """Its record before the upload (`Exchange.draft`)."""
        return exchange.draft(
            self.round,
            learner,
            fragment=self.fragment,
            base_version=self.base_version,
            local_step=self.local_step,
            steps=self.steps,
            tokens=self.tokens,
            final=self.final,
            schema_digest=schema_digest,
            delta_format=delta_format,
            step_seconds=self.step_seconds,
            loss=self.loss,
        )

    def landed_as(self, record: SnapshotRecord) -> bool:
        """Whether `record` (this learner's record of the round, read back after a failed
        publish) is this contribution's: the same counters. A record of an earlier run of
        the same learner id counts other steps."""
        return (record.round, record.fragment, record.base_version, record.local_step,
                record.steps, record.tokens, record.final) == (
            self.round, self.fragment, self.base_version, self.local_step, self.steps,
            self.tokens, self.final)


def delta_format(configured: str | None, dtypes: Sequence[str]) -> str:
    """The format a fragment's delta travels in: `delta_dtype` when set, else the model's
    own precision: BF16 when every tensor of the fragment is held in BF16 (its F32 delta
    would be twice the bytes of anything the model can represent), F32 otherwise."""
    if configured is not None:
        return configured
    return "BF16" if dtypes and all(d == "BF16" for d in dtypes) else "F32"


@dataclasses.dataclass(frozen=True)
class Commit:
    """A commit ready to apply: its record and its parameters on the model's device; or,
    with `rejected` (why), one whose parameters do not fit the model, which the training
    thread passes over (`loaded` is None then)."""

    record: RoundRecord
    loaded: Any
    nbytes: int
    rejected: str | None = None


@dataclasses.dataclass(frozen=True)
class Observed:
    """What the mailman has seen, as one value the training thread reads whole (the mailman
    replaces it with a single assignment; never a mix of two moments).

    `live`: the learners holding a lease (this one included once it beat). `watched` and
    `others`: the round the training thread asked it to watch, and how many learners other
    than this one were seen to have published it (-1 and 0 before any). `received`: the
    newest round whose commit it has queued (its receive cursor; the training thread's
    `rounds_seen` counts those it has applied). `finished`: the contributions handed over
    whose publish ended (uploaded, held, cancelled or failed). `dead`: what ended the
    communication thread, if anything did."""

    live: frozenset[str] = frozenset()
    watched: int = -1
    others: int = 0
    received: int = -1
    finished: int = 0
    dead: BaseException | None = None
