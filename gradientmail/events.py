"""Events: frozen dataclasses describing what a learner or syncer did, and `log_events`.

Every runtime reports through a callback `on_event(event)`; `log_events` is the default
and the integrations turn events into metrics. Modules define their own event classes as
subclasses of `Event` here, so one import gives the whole vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from gradientmail.traffic import Traffic

__all__ = [
    "AwaitingCreator",
    "AwaitingLearners",
    "ClaimSuperseded",
    "Closed",
    "Closing",
    "CommitLost",
    "CommitRejected",
    "ContributionDropped",
    "CreatingRun",
    "Event",
    "EventSink",
    "FragmentAligned",
    "GaveUp",
    "Joined",
    "LearnersGone",
    "LeaseReleased",
    "PollFailed",
    "PublishCancelled",
    "PublishFailed",
    "ReleaseFailed",
    "RollCalled",
    "RoundClaimed",
    "RoundClosed",
    "RoundRecorded",
    "SnapshotPublished",
    "Swept",
    "TookOverCreation",
    "TrafficMeasured",
    "WarningEvent",
    "log_events",
]

_log = logging.getLogger("gradientmail")


@dataclasses.dataclass(frozen=True)
class Event:
    """Base of every event. `level` is the logging level `log_events` uses."""

    @property
    def level(self) -> int:
        return logging.INFO

    def describe(self) -> str:
        fields = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
        )
        return f"{type(self).__name__}({fields})"


EventSink = Callable[[Event], None]


def log_events(event: Event) -> None:
    """Log an event on the `gradientmail` logger at the event's level."""
    _log.log(event.level, "%s", event.describe())


@dataclasses.dataclass(frozen=True)
class WarningEvent(Event):
    """Something went wrong and the runtime went on (a failed poll or publish, a dropped
    contribution, a superseded claim): `log_events` logs it as a warning."""

    @property
    def level(self) -> int:
        return logging.WARNING


# --- learner --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CreatingRun(Event):
    """This learner won the creation election and uploads Θ⁰ and the manifest."""

    learner: str
    attempt: int


@dataclasses.dataclass(frozen=True)
class AwaitingCreator(Event):
    """Another learner is creating the run; this one waits for its manifest."""

    learner: str
    attempt: int


@dataclasses.dataclass(frozen=True)
class AwaitingLearners(Event):
    """The learner waits at train start for `wanted` learners to hold a lease (`live` do,
    this one included): when it starts, whenever the live set changes, and every
    `gradientmail.learner.runtime.AWAIT_REPORT_EVERY` seconds of its clock."""

    learner: str
    live: tuple[str, ...]
    wanted: int
    waited: float

    def describe(self) -> str:
        return (f"learner {self.learner!r} waits for {self.wanted} learners to start: "
                f"{len(self.live)} live ({', '.join(self.live)}) after {self.waited:.0f}s")


@dataclasses.dataclass(frozen=True)
class TookOverCreation(WarningEvent):
    """The creator's payloads never landed: this learner claimed the next attempt."""

    learner: str
    attempt: int


@dataclasses.dataclass(frozen=True)
class Joined(Event):
    """The learner adopted the run and aligned with each fragment's newest commit."""

    learner: str
    rounds_seen: int
    versions: tuple[int, ...]
    created: bool


@dataclasses.dataclass(frozen=True)
class SnapshotPublished(Event):
    learner: str
    round: int
    fragment: int
    steps: int
    tokens: int
    bytes: int
    seconds: float
    #: Merged from memory by this learner's own closer, which the contribution let close
    #: the round: nothing uploaded (`bytes` 0).
    held: bool = False


@dataclasses.dataclass(frozen=True)
class PublishFailed(WarningEvent):
    """A publish failed and its record is not in the store (checked before this is
    reported: a write whose answer was lost counts as published). Its steps stay counted
    and go out with the round published again (at once, if it is still open) or a later
    one; if the round's commit came first, its participants say whether it was in."""

    learner: str
    round: int
    error: str


@dataclasses.dataclass(frozen=True)
class PublishCancelled(Event):
    """A queued publish was dropped: its round was committed before it could go out."""

    learner: str
    round: int
    reason: str


@dataclasses.dataclass(frozen=True)
class PollFailed(WarningEvent):
    learner: str
    error: str


@dataclasses.dataclass(frozen=True)
class RoundRecorded(Event):
    """A commit record was read (by a learner) or written (by its closer)."""

    round: int
    fragment: int
    version: int
    participants: tuple[str, ...]
    mean_cosine: float | None
    closer: str


@dataclasses.dataclass(frozen=True)
class FragmentAligned(Event):
    """The learner applied a committed fragment; staleness is the steps it had trained
    since its own snapshot of that round (or since it last aligned, if it took no part)."""

    learner: str
    round: int
    fragment: int
    version: int
    staleness: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class CommitRejected(WarningEvent):
    """A learner read a commit whose parameters do not fit its model (`reason` names the
    tensors): it keeps the fragment as it was and goes on training; the fragment's next
    good commit brings it back in line."""

    learner: str
    round: int
    fragment: int
    reason: str


@dataclasses.dataclass(frozen=True)
class TrafficMeasured(Event):
    """What this learner's mailbox traffic came to since `start()`: every request of its
    threads and its embedded closer, counted by its meter (`Learner.traffic`). Reported
    once per commit it applies (`round`) and once more on close, so a sink that prices
    runs needs no timer of its own; the counts are cumulative."""

    learner: str
    round: int
    traffic: Traffic

    def describe(self) -> str:
        return f"TrafficMeasured(learner={self.learner!r}, round={self.round}, {self.traffic})"


@dataclasses.dataclass(frozen=True)
class Closing(Event):
    learner: str
    in_flight: tuple[int, ...]
    flush: bool


@dataclasses.dataclass(frozen=True)
class GaveUp(WarningEvent):
    """close() stopped waiting for the commits of its rounds in flight."""

    learner: str
    rounds: tuple[int, ...]
    seconds: float


@dataclasses.dataclass(frozen=True)
class LeaseReleased(Event):
    learner: str


@dataclasses.dataclass(frozen=True)
class ReleaseFailed(WarningEvent):
    learner: str
    error: str


@dataclasses.dataclass(frozen=True)
class Closed(Event):
    learner: str
    rounds_seen: int
    local_step: int


# --- syncer ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RoundClaimed(Event):
    """This closer won claim `attempt` of `round` and is merging it."""

    closer: str
    round: int
    attempt: int
    contributions: int


@dataclasses.dataclass(frozen=True)
class ClaimSuperseded(WarningEvent):
    """A claim's record did not appear in time; the next attempt takes the round over."""

    closer: str
    round: int
    attempt: int
    waited: float


@dataclasses.dataclass(frozen=True)
class ContributionDropped(WarningEvent):
    """A contribution was left out of a round: stale, mis-shaped, unreadable, non-finite."""

    round: int
    learner: str
    key: str
    reason: str


@dataclasses.dataclass(frozen=True)
class RoundClosed(Event):
    """This closer wrote the commit record of `round`; `bytes` sums every payload it
    wrote for it (theta, outer state, update, step: each ref of the record), records and
    claims not included."""

    closer: str
    round: int
    fragment: int
    version: int
    participants: tuple[str, ...]
    tokens: int
    mean_cosine: float | None
    seconds: float
    bytes: int


@dataclasses.dataclass(frozen=True)
class CommitLost(Event):
    """Another closer committed the round first; this closer's work is discarded."""

    closer: str
    round: int


@dataclasses.dataclass(frozen=True)
class Swept(Event):
    deleted: int
    keys_kept: int


@dataclasses.dataclass(frozen=True)
class RollCalled(Event):
    """`round` waited short of its quorum, so this closer called the roll (call `number`):
    the `called` live learners must beat their leases within the answer deadline."""

    closer: str
    round: int
    number: int
    called: int


@dataclasses.dataclass(frozen=True)
class LearnersGone(WarningEvent):
    """These learners did not answer the roll call within `seconds`: their leases are
    deleted and the rounds close without them until they beat again."""

    closer: str
    round: int
    learners: tuple[str, ...]
    seconds: float
