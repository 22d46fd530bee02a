"""The roll call: liveness on demand, in seconds, for the rounds that wait on it.

A lease proves life once a lease period (60 s by default): a beat every few seconds would
cost a PUT per learner every few seconds, more than a learner's whole request budget. So
a SIGKILLed learner used to hold every round that waits for it (standard DiLoCo's barrier:
quorum = all learners) until its lease timed out, ~2 minutes. The roll call asks for a
beat only when one is needed:

- A closer whose open round has been *short of its quorum* for `call_after` (2 polls,
  at least 1 s) since its first contribution lists the leases and *calls the roll*: it
  writes a `Call` to `CALL_KEY` (`rollcall.json`, one key for the whole run, overwritten
  by each call). So does a backup closer whose learner waits for the round (a barrier)
  when the round could have closed (its quorum in) and nobody has claimed it: the round's
  preferred closer may be the learner that died. A round that has its quorum and waits
  only for a grace window is never called: the window bounds that wait (decoupled DiLoCo
  closes its rounds that way, and its learners never wait for a commit).
- Every learner GETs that key every `READ_EVERY` polls (a missing key is the normal case)
  and answers a call it has not answered with one lease beat.
- The caller lists the leases every poll while its call is open. A called learner whose
  counter has not moved `answer_within` (5 polls, at least 2 s) after the call is *gone*:
  the caller deletes that lease key (exactly the counter it saw, never a newer beat) and
  writes its verdict, the gone learners with their counters, over the call. Every learner
  that reads the verdict drops them from its live set (`LeaseTracker.drop`), so the
  effective quorum shrinks and the round closes without them. Once everyone answers, the
  verdict (nobody gone) is written at once.
- A learner judged gone that beats again (it was alive after all, or restarted) is live
  again at an observer's next lease listing; a live one beats as soon as it reads the
  verdict naming it at its current counter (its lease loop shares the thread its
  publishes run on). A contribution it makes meanwhile counts like any other: towards
  the round's quorum, and merged.
- A round still short after a call is called again after `call_after` × 2, 4, 8, ... (at
  most × 32) from the previous call's end, so a slow but live learner costs a few calls
  per round, not one per poll; a call someone else posted for the round counts as one.

Two closers may call at once (a read, then a write: there is no conditional overwrite);
each judges its own call, a learner answers both, and the verdicts agree on a learner
that answers neither. Leases stay the backstop for a learner no one waits for.

`Call` is the key's strict canonical JSON (sealed like any record in an authenticated
run); the decisions (`next_call`, `should_post`, `verdict`, `reply`) are pure functions
over plain values and observer-clock times.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any, Self

from gradientmail.errors import LocalProtocolError
from gradientmail.wire.record_json import (
    FORMAT_VERSION,
    Fields,
    build_record,
    check_count,
    check_learner_id,
    is_int,
)
from gradientmail.wire.records import Record

__all__ = [
    "ANSWER_WITHIN",
    "CALL_AFTER",
    "READ_EVERY",
    "Call",
    "Judging",
    "Reply",
    "answer_within",
    "call_after",
    "next_call",
    "reply",
    "should_post",
    "verdict",
]

#: Polls a round waits short of its quorum, from its first contribution, before a call.
#: Learners of a healthy barrier run arrive within about a second of each other.
CALL_AFTER = 2
#: Polls a called learner has to beat. It reads the call within READ_EVERY polls.
ANSWER_WITHIN = 5
#: Polls between a learner's looks at the call key (one GET; every poll would cost 40%
#: of a learner's request budget for an event that may never happen).
READ_EVERY = 2
#: Floors in seconds: with very short polls a thread that is not scheduled for a moment
#: must not be judged gone, and a round that waits a moment must not be called.
CALL_AFTER_MIN = 1.0
ANSWER_WITHIN_MIN = 2.0
#: The longest gap between two calls of one round, in units of `call_after`.
RECALL_MAX = 32
_COUNTER_LIMIT = 10**12


def call_after(poll_interval: float) -> float:
    """Seconds a round waits short of its quorum before it is called."""
    return max(CALL_AFTER * poll_interval, CALL_AFTER_MIN)


def answer_within(poll_interval: float) -> float:
    """Seconds a called learner has to beat before its caller judges it gone."""
    return max(ANSWER_WITHIN * poll_interval, ANSWER_WITHIN_MIN)


@dataclasses.dataclass(frozen=True)
class Call(Record):
    """`rollcall.json`: `caller` calls the roll for `round` (call `number` of the run).

    `gone` is None while the call is open; the verdict is the learners judged gone, each
    with the lease counter it was judged at, sorted by learner (empty: all answered).
    """

    round: int
    number: int
    caller: str
    gone: tuple[tuple[str, int], ...] | None = None

    def __post_init__(self) -> None:
        check_count("round", self.round)
        check_count("call number", self.number)
        check_learner_id(self.caller)
        if self.gone is not None:
            names = [x for x, _ in self.gone]
            if names != sorted(set(names)):
                raise LocalProtocolError(
                    f"gone={self.gone!r} must list each learner once, sorted by id")
            for learner, counter in self.gone:
                check_learner_id(learner)
                if not is_int(counter) or not 0 <= counter < _COUNTER_LIMIT:
                    raise LocalProtocolError(
                        f"gone counter of {learner!r}={counter!r} must be an integer in "
                        f"[0, 10**12), a lease counter")

    @property
    def ident(self) -> tuple[int, str]:
        """What tells two calls apart: two closers calling at once pick the same number."""
        return self.number, self.caller

    def with_verdict(self, gone: Mapping[str, int]) -> Call:
        """This call closed: `gone` maps each learner judged gone to its counter."""
        return dataclasses.replace(self, gone=tuple(sorted(gone.items())))

    def to_json(self) -> dict[str, Any]:
        return {"caller": self.caller,
                "gone": None if self.gone is None else dict(self.gone),
                "number": self.number, "round": self.round, "v": FORMAT_VERSION}

    @classmethod
    def from_json(cls, obj: Any, key: str) -> Self:
        f = Fields(obj, key, "", ("caller", "gone", "number", "round", "v"))
        gone = f.get("gone", lambda v: isinstance(v, dict), "must be an object", null=True)
        return build_record(cls, key, "", round=f.get_int("round"), number=f.get_int("number"),
                      caller=f.get_str("caller"),
                      gone=None if gone is None else tuple(sorted(gone.items())))


def next_call(first: float | None, calls: int, last: float | None,
              poll_interval: float, held: float | None = None) -> float | None:
    """When a waiting round is called next (observer time), or None: nothing contributed
    yet (no one could say who is missing). `first` is its first contribution, `calls` the
    calls of the round so far, `last` when the latest of them ended. `held`: the round
    has its quorum and could have closed from then, but this closer is a backup giving
    the preferred closer a head start: not called before then (the preferred closer may
    be the one that is gone)."""
    if first is None:
        return None
    wait = call_after(poll_interval)
    if calls <= 0 or last is None:
        return max(first + wait, -math.inf if held is None else held)
    return last + wait * min(1 << min(calls, 30), RECALL_MAX)


def should_post(call: Call | None, round_: int, counted: Collection[tuple[int, str]]) -> bool:
    """Whether to post a new call for `round_`, having just read `call` from the key. Not
    when it is a call of this round this closer has not counted yet: someone else called
    (it counts as one of the round's calls; the next one waits its turn)."""
    return call is None or call.round != round_ or call.ident in counted


@dataclasses.dataclass(frozen=True)
class Judging:
    """A call this closer posted: `called` maps each learner it called to the lease
    counter listed just before, `posted` is when (observer time)."""

    call: Call
    called: Mapping[str, int]
    posted: float


def verdict(judging: Judging, counters: Mapping[str, int], now: float,
            poll_interval: float) -> dict[str, int] | None:
    """The learners judged gone (with the counter each was judged at), or None while
    undecided. `counters` is the newest listing. A learner answered when its counter
    differs from the one listed before the call (a beat, a restart) or its lease is gone
    (released: no longer live anyway); once all answered the verdict is empty at once,
    else the silent ones are gone `answer_within` after the call."""
    silent = {x: c for x, c in judging.called.items() if counters.get(x) == c}
    if not silent:
        return {}
    # 0.999: a deadline that falls on a poll must not wait one more poll for rounding.
    if now < judging.posted + answer_within(poll_interval) * 0.999:
        return None
    return silent


@dataclasses.dataclass(frozen=True)
class Reply:
    """What a learner does about the call it read: beat its lease now, and drop these
    learners (judged gone, with their counters) from its live set."""

    beat: bool
    drop: Mapping[str, int]


def reply(call: Call, me: str, counter: int | None) -> Reply:
    """A learner's answer to a call it has not handled yet: an open call by someone else
    is answered with a beat; a verdict drops the gone learners, and a verdict naming this
    learner at its current `counter` (it was slow to answer, not dead) is answered with a
    beat, so that observers see it live again at their next listing."""
    if call.gone is None:
        return Reply(beat=call.caller != me, drop={})
    gone = dict(call.gone)
    return Reply(beat=me in gone and gone[me] == counter,
                 drop={x: c for x, c in gone.items() if x != me})

