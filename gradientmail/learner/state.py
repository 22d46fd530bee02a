"""The learner's decisions: pure functions over a frozen `LearnerState`.

The training thread owns one `LearnerState` and replaces it on every event: a step
(`advanced`), a publish (`published`), a commit arriving (`applied`). What to publish and
when to wait (`publishable`, `due_round`, `overdue`) are answered from the state alone, so
they are tested exhaustively with no threads, no mailbox and no clock.

Round numbers: `rounds_seen` is the index of the newest commit record applied (-1 before
any): the training thread's count, which the mailman's receive cursor (`Observed.received`:
commits fetched and queued) may be ahead of; `last_published` the newest round this
learner published (-1 before any).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

from gradientmail.algorithms.rounds import much_slower
from gradientmail.algorithms.schedule import RoundSchedule

__all__ = [
    "FragmentCounters",
    "LearnerState",
    "Publish",
    "advanced",
    "applied",
    "due_round",
    "initial_state",
    "mean_loss",
    "missed",
    "overdue",
    "publishable",
    "published",
    "rebase_base",
    "retracted",
    "scheduled_gap",
]

EMA_DECAY = 0.1


@dataclasses.dataclass(frozen=True)
class FragmentCounters:
    """Steps and tokens trained on a fragment since it was last overwritten, and the
    committed version the fragment was last aligned with."""

    steps: int = 0
    tokens: int = 0
    version: int = 0


@dataclasses.dataclass(frozen=True)
class Publish:
    """One own publish: the round, the local step it was taken at, and what it counted."""

    round: int
    at: int
    steps: int
    tokens: int


@dataclasses.dataclass(frozen=True)
class LearnerState:
    local_step: int
    fragments: tuple[FragmentCounters, ...]
    rounds_seen: int = -1
    last_published: int = -1
    last_publish_step: int = 0
    publishes: tuple[Publish, ...] = ()
    step_seconds: float | None = None
    #: The local step the publishing schedule counts from when a commit moved it into
    #: phase with the round's first contributor (it missed the round, or published after
    #: that one); None: from its own last publish.
    phase_step: int | None = None
    #: Per fragment, the sum and count of the training losses reported since this learner
    #: last published it (empty until a step reports one): its contributions' mean loss.
    losses: tuple[tuple[float, int], ...] = ()


def initial_state(
    fragments: int, versions: Sequence[int] | None = None, rounds_seen: int = -1
) -> LearnerState:
    """A learner that has just joined: nothing trained, aligned with `versions`."""
    vs = list(versions) if versions is not None else [0] * fragments
    if len(vs) != fragments:
        raise ValueError(f"{len(vs)} versions given for {fragments} fragments")
    return LearnerState(
        local_step=0,
        fragments=tuple(FragmentCounters(version=v) for v in vs),
        rounds_seen=rounds_seen,
    )


def advanced(state: LearnerState, tokens: int, seconds: float | None = None,
             loss: float | None = None) -> LearnerState:
    """One optimizer step over `tokens` tokens, taking `seconds` (EMA with decay 0.1), with
    training loss `loss` (None: not reported; a non-finite one is left out of the means,
    which the records could not carry)."""
    if tokens < 0:
        raise ValueError(f"tokens={tokens} is negative")
    ema = state.step_seconds
    if seconds is not None:
        ema = seconds if ema is None else (1 - EMA_DECAY) * ema + EMA_DECAY * seconds
    losses = state.losses
    if loss is not None and math.isfinite(loss):
        losses = tuple((total + loss, n + 1) for total, n in
                       (losses or ((0.0, 0),) * len(state.fragments)))
    return dataclasses.replace(
        state,
        local_step=state.local_step + 1,
        fragments=tuple(
            dataclasses.replace(f, steps=f.steps + 1, tokens=f.tokens + tokens)
            for f in state.fragments
        ),
        step_seconds=ema,
        losses=losses,
    )


def mean_loss(state: LearnerState, fragment: int) -> float | None:
    """The mean training loss reported since `fragment` was last published (None: none)."""
    if not state.losses:
        return None
    total, n = state.losses[fragment]
    return total / n if n else None


def candidate_round(state: LearnerState) -> int:
    """The round this learner would publish next: a hole first (an open round below its
    last publish that it has no publish for: one whose upload failed after a later round
    went out; the round may be waiting for it), else the first round after both its last
    publish and the newest commit."""
    own = {p.round for p in state.publishes}
    for r in range(state.rounds_seen + 1, state.last_published):
        if r not in own:
            return r
    return max(state.last_published + 1, state.rounds_seen + 1)


def publishable(state: LearnerState, schedule: RoundSchedule) -> int | None:
    """The round this learner may publish next, or None.

    It is the first round after both its own last publish and the newest commit, within
    τ of the newest commit, and its fragment must have been trained since it was last
    overwritten (a fresh joiner has nothing to say).
    """
    r = candidate_round(state)
    if r > state.rounds_seen + schedule.in_flight:
        return None
    if state.fragments[schedule.fragment_of(r)].steps < 1:
        return None
    return r


#: Step-time noise a schedule ignores: within this factor of the run's pace a learner
#: counts the plain gap.
PACE_TOLERANCE = 1.1


def scheduled_gap(
    schedule: RoundSchedule, round_: int, step_seconds: float | None, run_step: float | None
) -> int:
    """gap(round_) at the run's pace, in this learner's steps: a learner that steps slower
    than the run (`run_step`, the records' ξ_step) publishes after proportionally fewer
    of its steps, so it keeps the run's rhythm in wall-clock time and its contributions
    meet the others' in the same rounds, every fragment in turn. A learner at the run's
    pace or faster counts the plain gap, and so does one within PACE_TOLERANCE of the
    run's pace (noise)."""
    gap = schedule.gap(round_)
    if step_seconds and run_step and step_seconds > PACE_TOLERANCE * run_step:
        return max(1, int(gap * run_step / step_seconds))
    return gap


#: A learner publishes at the latest this many gaps of its own steps after its last
#: publish, whatever its phase says: a schedule moved into phase each round must not
#: postpone a learner's publishes for ever.
MAX_GAPS = 2


def due_round(
    state: LearnerState,
    schedule: RoundSchedule,
    others: int,
    effective_quorum: int,
    live: int | None = None,
    wait_steps: int | None = None,
    run_step: float | None = None,
) -> int | None:
    """The round to publish now, or None.

    Due on schedule (a gap at the run's pace, `scheduled_gap`, since the last publish or
    since the phase a missed round set) or by opportunity: `others` learners have
    published the candidate and they are at most one short of the effective quorum, so
    the round is about to close and this learner's steps would otherwise miss it.

    With `live` (the live learners, this one included) the opportunity is real only when
    the round can close without this learner: the quorum is in already, or some other
    live learner could still complete it. When the round waits for this learner alone
    (standard DiLoCo: quorum = every learner), publishing early would only cut its
    contribution short, so it keeps its schedule. Likewise with `wait_steps` (how many of
    this learner's steps the round waits for the learners it expects): a learner due on
    schedule within that many steps will be waited for, and keeps its schedule.
    """
    r = publishable(state, schedule)
    if r is None:
        return None
    # Moved into phase by a commit: a gap at the run's pace from the phase the round's
    # first contributor set (without the pace, a learner slower than the run moved into
    # phase at every commit and never reached its next publish). On its own schedule, a
    # gap at the run's pace too if the rounds do not wait for it (over SLOW_FACTOR x the
    # run's pace): counting its plain gap, a learner 2x slower published every second
    # round, always the same fragment at P = 2, and the other's progress went out stale.
    # One the rounds wait for keeps its plain gap: shortened by the noise of time-sliced
    # processes, gaps broke the phase of equal-speed learners (1.024x standard's loss at
    # M = 4). Behind a barrier (overlap_steps=0) a contribution carries the plain gap.
    if state.phase_step is None:
        since = state.local_step - state.last_publish_step
        waited = not much_slower(state.step_seconds, run_step)
    else:
        since, waited = state.local_step - state.phase_step, False
    if schedule.overlap_steps == 0 or waited:
        gap = schedule.gap(r)
    else:
        gap = scheduled_gap(schedule, r, state.step_seconds, run_step)
    if r < state.last_published or since >= gap:
        return r  # a hole is due at once: its round may be waiting for this learner
    if state.local_step - state.last_publish_step >= MAX_GAPS * schedule.gap(r):
        return r
    about_to_close = others >= max(effective_quorum - 1, 1)
    closes_without_us = live is None or others >= effective_quorum or others < live - 1
    waited_for = wait_steps is not None and gap - since <= wait_steps
    return r if about_to_close and closes_without_us and not waited_for else None


def published(state: LearnerState, round_: int, schedule: RoundSchedule) -> LearnerState:
    """Record an own publish of `round_` taken now; keeps the last τ publishes."""
    fragment = schedule.fragment_of(round_)
    counters = state.fragments[fragment]
    entry = Publish(round_, state.local_step, counters.steps, counters.tokens)
    losses = state.losses
    if losses:
        losses = (*losses[:fragment], (0.0, 0), *losses[fragment + 1:])
    return dataclasses.replace(
        state,
        losses=losses,
        last_published=max(state.last_published, round_),
        last_publish_step=state.local_step,
        phase_step=None,
        publishes=(*state.publishes, entry)[-schedule.in_flight :],
    )


def retracted(state: LearnerState, round_: int) -> LearnerState:
    """Forget an own publish that failed to upload: the round becomes publishable again
    (before any later one: see `candidate_round`), and its steps, never reset by a
    publish, go out with the fragment's next publish."""
    remaining = tuple(p for p in state.publishes if p.round != round_)
    if len(remaining) == len(state.publishes):
        return state
    last = state.last_published
    if round_ == last:
        last = max((p.round for p in remaining), default=min(last - 1, state.rounds_seen))
    return dataclasses.replace(state, publishes=remaining, last_published=last)


def passed_over(state: LearnerState, round_: int) -> LearnerState:
    """Go past the commit of `round_` without taking it (it did not fit the model): the
    round counts as seen, so nothing waits on it, and an own publish of it or before is
    done with; the fragment keeps its version and counters, whose steps and tokens go
    out with its next publish."""
    return dataclasses.replace(
        state,
        rounds_seen=max(state.rounds_seen, round_),
        publishes=tuple(p for p in state.publishes if p.round > round_),
    )


def overdue(state: LearnerState, overlap_steps: int | None) -> bool:
    """True when training must wait: an own publish still uncommitted was taken at least
    `overlap_steps` steps ago. None never waits; 0 is standard DiLoCo's barrier."""
    if overlap_steps is None:
        return False
    return any(
        p.round > state.rounds_seen and state.local_step - p.at >= overlap_steps
        for p in state.publishes
    )


def applied(
    state: LearnerState,
    round_: int,
    fragment: int,
    version: int,
    took_part: bool,
    mixing: float,
    rebase: bool = False,
    lag_steps: int | None = None,
    led: bool = False,
) -> LearnerState:
    """Align with the commit of `round_` (fragment `fragment`, now at `version`).

    The steps and tokens the commit did not count are those trained after this learner's
    own contribution to that round, or all of them if it took no part. Rebasing keeps the
    local progress on top of the commit, so it keeps all of them: they go out with the
    fragment's next contribution. Otherwise the commit overwrites the fragment; with
    mixing α the learner keeps α of the local parameters and so α of those counts.

    A learner that missed the round (no part in it, no later publish in flight) moves
    its publishing schedule into phase with the round's first contributor, which
    published `lag_steps` of this learner's steps before the commit arrived (the record's
    latency over its step time): its next round is due one gap after that. Without it, a
    learner that was a little late published the next round at once, a gap early for
    it, and the run split into phase groups that each filled half of the rounds. A
    participant that did not lead the round (`led`: its contribution was the first)
    moves its schedule back to the first one's publish when it published later: learners
    stepping a little slower (8 processes time-sliced on 2 cores differ by 20%) would
    otherwise drift a few steps further behind each round until they missed one.
    """
    if rebase and mixing:
        raise ValueError(f"rebase=True and mixing={mixing} exclude each other")
    own = next((p for p in state.publishes if p.round == round_), None) if took_part else None
    f = state.fragments[fragment]
    uncounted_steps = max(f.steps - (own.steps if own else 0), 0)
    uncounted_tokens = max(f.tokens - (own.tokens if own else 0), 0)
    if rebase:
        kept = FragmentCounters(uncounted_steps, uncounted_tokens, version)
    else:
        kept = FragmentCounters(
            steps=_floor_scaled(mixing, uncounted_steps),
            tokens=_floor_scaled(mixing, uncounted_tokens),
            version=version,
        )
    frags = list(state.fragments)
    frags[fragment] = kept
    phase = state.phase_step
    if lag_steps is not None:
        first_at = state.local_step - max(lag_steps, 0)
        later = any(p.round > round_ for p in state.publishes)
        behind = own is not None and not led and not later and first_at < own.at
        if behind or missed(state, round_, took_part):
            phase = first_at
    return dataclasses.replace(
        state,
        fragments=tuple(frags),
        rounds_seen=max(state.rounds_seen, round_),
        phase_step=phase,
        publishes=tuple(p for p in state.publishes if p.round > round_),
    )


def rebase_base(
    rebase: bool, held_version: int, version: int, contributed: bool, kept: bool
) -> Literal["snapshot", "anchor"] | None:
    """What a commit that brings a fragment from `held_version` (the version this learner
    aligned with last) to `version` is applied against, or None to overwrite the
    fragment with it.

    Only a rebasing algorithm (`rebase`) keeps the local progress on top of a commit: it
    subtracts a base from the local parameters and adds the commit. The base is this
    learner's own snapshot of the round ("snapshot") when its contribution is in the
    commit (`contributed`: it took part, with a publish of the round on record) and that
    snapshot was `kept` (a final flush keeps none: then overwrite); else the commit it
    aligned with last ("anchor"), as none of its progress since is in this one. A
    commit more than one version on overwrites: commits were skipped (swept under a slow
    reader), and what they hold of this learner's progress is unknown.
    """
    if not rebase or version != held_version + 1:
        return None
    if contributed:
        return "snapshot" if kept else None
    return "anchor"


def missed(state: LearnerState, round_: int, took_part: bool) -> bool:
    """Whether the commit of `round_` closed without this learner while it had nothing
    newer in flight: its schedule is out of phase with the run's (late, or a joiner)."""
    # Every own publish is of a round <= last_published: nothing newer is in flight.
    return not took_part and state.last_published <= round_


def _floor_scaled(alpha: float, n: int) -> int:
    # floor(α·n) in exact arithmetic: float rounding must not turn 0.5·4 into 1.9999.
    from fractions import Fraction

    return int(Fraction(alpha) * n)
