"""The rules of a round, as pure functions: how long it waits for the learners it
expects (`grace_window`), whether it is too light for an outer step (`light`), how a
delta spanning several sync periods is scaled (`span_scales`), how far a round short of
its fragment's learners steps (`cohort_share`), and which contributions are outliers
(`outliers`); and the run-wide rules every party applies alike: the quorum a
round waits for (`effective_quorum`) and which learners are too slow to wait for
(`much_slower`). `gradientmail.algorithms.diloco` applies the merge's rules; closers and
learners the run-wide ones."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from fractions import Fraction

from gradientmail.algorithms.schedule import RoundSchedule
from gradientmail.errors import ConfigError
from gradientmail.wire.estimates import Estimates

__all__ = [
    "ARRIVAL_POLLS",
    "ARRIVAL_STEPS",
    "LIGHT_ROUND",
    "SLOW_FACTOR",
    "cohort_share",
    "effective_quorum",
    "grace_window",
    "light",
    "much_slower",
    "outliers",
    "span_scales",
]


#: Steps of a learner's pace a round waits, at least, for learners in phase to arrive.
ARRIVAL_STEPS = 5
#: Poll intervals a round waits, at least: learners see a commit up to one poll late and
#: align their next publish to it, and closers see a contribution up to one poll late.
ARRIVAL_POLLS = 3


def grace_window(
    estimates: Estimates, schedule: RoundSchedule, round_: int, poll_interval: float = 1.0
) -> float:
    """Seconds after a round's first contribution that it waits for the learners it
    expects (see `gradientmail.syncer.state.awaited`).

    min(gap·ξ_step, max(ARRIVAL_STEPS·ξ_step, ARRIVAL_POLLS·poll_interval)): learners in
    phase arrive within a few of their steps and a poll or two of each other, so that is
    what the window covers; never more than one round's gap (`RoundSchedule.spacing`),
    after which the next round's contributions are due. Before ξ_step is measured
    (round 0), the poll floor alone.
    """
    floor = ARRIVAL_POLLS * poll_interval
    step = estimates.step
    if step is None:
        return floor
    return min(schedule.spacing(round_) * step, max(ARRIVAL_STEPS * step, floor))


#: A round whose contributions carry less than this share of a sync period (token-
#: weighted) is averaged in, not stepped: see `light`.
LIGHT_ROUND = 0.5


def light(shares: Sequence[float], steps: Sequence[int], sync_every: int) -> bool:
    """Whether a round is light: its contributions carry, weighted by their shares, less
    than LIGHT_ROUND of a sync period (a contribution over one period counts as one).

    Nesterov's step is sized for a round of a period's progress: its momentum pushes the
    fragment a period's worth of the old direction whatever the round carries. When
    learners end at different times, a run's last rounds carry a few steps each from the
    learners still training, and each of them took that full push: at M = 8 the held-out
    loss went from 3.913 after the last full round to 3.999 over three light ones. A light
    round is averaged in like a final one, and the momentum waits for the next full round.
    """
    progress = sum(w * min(s / sync_every, 1.0) for w, s in zip(shares, steps, strict=True))
    return progress < LIGHT_ROUND


def span_scales(steps: Sequence[int], sync_every: int) -> list[float]:
    """What each contribution's delta is multiplied by before merging: 1/k, with its span
    k = max(1, steps/H) in sync periods.

    A learner on schedule contributes a fragment's H steps every round of that fragment
    (k = 1, unchanged). One that missed rounds carries k·H steps in one delta; merged as
    it is, with a weight that already grows with its tokens, it would count k² times a
    punctual learner's progress. Divided by k it counts as k contributions of its
    average per-period progress (its weight, ∝ tokens, is the k), as if it had been
    split across the rounds it missed. A span under one period (published early by
    opportunity) is not scaled up.
    """
    return [float(Fraction(sync_every, s)) if s > sync_every else 1.0 for s in steps]


def cohort_share(steps: Sequence[int], sync_every: int, cohort: int) -> float:
    """What a round's merged delta is multiplied by when `cohort` learners train its
    fragment: the sync periods its contributions carry, each max(1, sᵢ/H), over `cohort`.

    The merge is the participants' (weighted, span-scaled) mean: one period of their
    average progress. Standard DiLoCo's rounds hold every learner, so that mean moves the
    fragment to the learners' average model. A Decoupled round that closes without some
    of them took the same full step from fewer deltas: each delta then weighed 1/n
    instead of 1/M, and the deltas of late learners went out in later rounds at the
    same inflated weight, so the noise of the few (deltas of one fragment agree with a
    cosine of 0.1-0.5) moved the fragment as far as the consensus of all. Scaled by its
    share, a round of n of M punctual learners steps n/M of the way, and the round that
    carries the late learners' spans steps further; each learner's progress enters at
    1/M whichever round it lands in, as in standard DiLoCo's average. At M = 8
    (benchmarks/decoupled.py, 8 processes on 2 cores, a third of the rounds short of
    learners) one run's last two rounds each averaged in a single learner's last 8-9
    steps at full weight and lifted the held-out loss from 3.947 to 3.988 (1.017x
    standard DiLoCo's); over three seeds the Decoupled defaults went from 1.0097x to
    1.0056x standard DiLoCo's loss with cohort shares (benchmarks/RESULTS.md,
    "Streaming and Decoupled at two learners").

    A contribution under one period counts as one learner (its delta is all it trained
    since it last took part); a span of k periods counts k. Rounds that hold every
    learner of the cohort on schedule are unchanged (share 1)."""
    h = _positive("sync_every", sync_every)
    n = _positive("cohort", cohort)
    if not steps:
        raise ConfigError("cohort_share needs the steps of at least one contribution")
    if len(steps) > n:
        raise ConfigError(f"cohort={n} is smaller than the round's {len(steps)} "
                          "contributions; the cohort counts every contributor")
    carried = sum((Fraction(max(_positive("steps", s), h), h) for s in steps), Fraction(0))
    return float(carried / n)


def _positive(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{name}={v!r} must be an int >= 1")
    return v


def outliers(norms: Mapping[str, float], factor: float | None) -> dict[str, str]:
    """The contributions to leave out of a round as outliers: learner -> reason.

    A contribution whose delta norm exceeds `factor` × the median norm of the round's
    contributions (its own included) is an outlier. Nothing is judged without a factor,
    with fewer than 3 contributions (of two, neither is the odd one out), or when the
    median is 0 (no scale to judge by).
    """
    if factor is None or len(norms) < 3:
        return {}
    median = statistics.median(norms.values())
    if not median > 0:
        return {}
    return {
        learner: (f"outlier: delta norm {norm:.6g} exceeds outlier_factor {factor:g} x the "
                  f"round's median delta norm {median:.6g} ({len(norms)} contributions)")
        for learner, norm in sorted(norms.items())
        if norm > factor * median
    }


def effective_quorum(quorum_size: int, live: int) -> int:
    """min(quorum_size, live learners), never under 1: a run of one learner still closes."""
    return max(1, min(quorum_size, live))


#: A live learner whose step time exceeds this many times the run's pace is not waited
#: for: its contributions join whichever round is open when they arrive.
SLOW_FACTOR = 1.5


def much_slower(step_seconds: float | None, pace: float | None,
                slow_factor: float = SLOW_FACTOR) -> bool:
    """Whether a learner stepping `step_seconds` is much slower than the run's `pace`
    (over `slow_factor` times): rounds do not wait for it, and it counts its gap at the
    run's pace. False while either is unknown: a learner of unknown pace is waited for."""
    if not step_seconds or not pace:
        return False
    return step_seconds > slow_factor * pace
