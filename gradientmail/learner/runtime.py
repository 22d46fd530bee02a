"""The learner runtime: a training thread that never waits on I/O, and its mailman.

The training thread calls `step()` after every optimizer step. It owns the model and
every counter (a frozen `LearnerState`); it applies commits the mailman queued, snapshots
a fragment when a round is due and hands it over, and waits only where `overlap_steps`
says it must. The `Mailman` (`gradientmail.learner.mailman`) runs the communication thread. They
meet only through messages (`gradientmail.learner.messages`): `Outgoing` contributions and a few
orders in, `Commit`s, failed rounds and one frozen `Observed` view out.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import socket
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from gradientmail.adapters.base import Adapter
from gradientmail.algorithms.base import Algorithm
from gradientmail.algorithms.rounds import effective_quorum, much_slower
from gradientmail.algorithms.schedule import RoundSchedule
from gradientmail.clock import Clock, MonotonicClock
from gradientmail.errors import ConfigError, GradientmailError
from gradientmail.events import (
    AwaitingLearners,
    Closed,
    Closing,
    EventSink,
    FragmentAligned,
    GaveUp,
    PollFailed,
    TrafficMeasured,
    log_events,
)
from gradientmail.learner import state as ls
from gradientmail.learner.mailman import Mailman
from gradientmail.learner.messages import Commit, Outgoing
from gradientmail.learner.options import LearnerOptions
from gradientmail.mailbox.base import Mailbox
from gradientmail.traffic import RequestCounts, Traffic, measure
from gradientmail.wire.auth import HmacSeal, resolve_run_key
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.record_json import check_learner_id
from gradientmail.wire.records import RoundRecord

__all__ = ["AWAIT_REPORT_EVERY", "Learner", "default_learner_id"]

#: Seconds between `AwaitingLearners` reports of a wait whose live set does not change.
AWAIT_REPORT_EVERY = 30.0


def default_learner_id() -> str:
    """`<host>-<pid>`, reduced to the learner id alphabet."""
    raw = f"{socket.gethostname()}-{os.getpid()}"
    clean = re.sub(r"[^A-Za-z0-9._-]", "-", raw).lstrip("._-") or "learner"
    return clean[:64]


def _options(options: LearnerOptions | None, deprecated: dict[str, Any]) -> LearnerOptions:
    """`options`, or the options the keyword arguments of earlier releases spell (with a
    DeprecationWarning naming the new spelling); a name that is neither is a TypeError."""
    unknown = sorted(set(deprecated) - set(LearnerOptions.names()))
    if unknown:
        raise TypeError(f"Learner() got unexpected keyword arguments {unknown}")
    if not deprecated:
        return options if options is not None else LearnerOptions()
    if options is not None:
        raise ConfigError(
            f"Learner got options= and {sorted(deprecated)}; put them in the LearnerOptions"
        )
    spelled = ", ".join(f"{k}={v!r}" for k, v in deprecated.items())
    warnings.warn(
        f"Learner({', '.join(f'{k}=' for k in deprecated)}...) is deprecated and will be "
        f"refused in the next release; pass options=LearnerOptions({spelled})",
        DeprecationWarning,
        stacklevel=3,
    )
    return LearnerOptions(**deprecated)


def _lag_steps(rec: RoundRecord, step_seconds: float | None,
               overlap_steps: int | None) -> int | None:
    """How many of this learner's steps ago the round's first contribution came in:
    the record's latency (first contribution to record) over the learner's step time.
    None when either is unknown (a record from before the latency was recorded), and
    behind a barrier (overlap_steps=0), which keeps learners in step by itself: there a
    learner waits instead of stepping, and its steps would not measure the latency."""
    if rec.arrival is None or not step_seconds or overlap_steps == 0:
        return None
    return int(rec.arrival.latency / step_seconds)


def _wait_steps(algorithm: Algorithm, estimates: Estimates, schedule: RoundSchedule,
                round_: int, poll_interval: float, step_seconds: float | None) -> int | None:
    """How many of this learner's steps a round waits for it after its first contribution
    (the closers' window over its step time); None when it is not waited for (it steps
    much slower than the run's pace) or its pace is unknown."""
    if not step_seconds:
        return None
    if much_slower(step_seconds, estimates.step):
        return None
    window = algorithm.grace_window(estimates, schedule, round_, poll_interval)
    return int(window / step_seconds)


class Learner:
    """One learner of a run: `start()`, then `step(samples)` after each optimizer step,
    then `close()`.

    `mailbox` is a Mailbox or a URL; `options` the learner's settings
    (`LearnerOptions`; None: the defaults). With `options.sync` the communication thread
    also runs a syncer, so a run needs nothing but the bucket; with it, a contribution
    that completes its round's set is merged by this learner's closer from memory and
    never uploaded (`hold_own=False`, or a run whose algorithm sets `keep_rounds`,
    uploads every contribution, so that every merge can be recomputed from the store).
    `run_key` (str or bytes; None: the `GRADIENTMAIL_RUN_KEY` variable, when set) makes
    the run authenticated: every record is sealed and checked (see
    `gradientmail.wire.auth`). `options.prices` price its traffic (`traffic`).
    The settings as keyword arguments (`poll_interval=...`, earlier releases' spelling)
    still build the options, with a DeprecationWarning, for one release.
    """

    def __init__(
        self,
        adapter: Adapter,
        algorithm: Algorithm,
        mailbox: Mailbox | str,
        learner_id: str | None = None,
        *,
        options: LearnerOptions | None = None,
        backend: Any = None,
        clock: Clock | None = None,
        on_event: EventSink = log_events,
        run_key: str | bytes | None = None,
        **deprecated: Any,
    ) -> None:
        options = _options(options, deprecated)
        self.options = options
        self.adapter = adapter
        # RDA averages the model's embeddings by weight: its adapter names them.
        self.algorithm = algorithm.with_direct_names(getattr(adapter, "direct_names", ()))
        self.learner_id = check_learner_id(learner_id or default_learner_id())
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self.poll_interval = options.poll_interval
        self.lease_timeout = options.lease_timeout
        self.on_event = on_event
        self.prices = options.prices
        run_key = resolve_run_key(run_key)  # None: GRADIENTMAIL_RUN_KEY, when set
        seal = None if run_key is None else HmacSeal(run_key)  # validates the key now
        self._mailman = Mailman(
            mailbox, adapter, self.algorithm, self.learner_id, options, clock=self.clock,
            on_event=on_event, backend=backend, seal=seal,
        )
        # Set by start():
        self._schedule: RoundSchedule | None = None
        self._plan: tuple[tuple[str, ...], ...] = ()
        self._state: ls.LearnerState | None = None
        self._anchors: list[Any] = []
        self._closed = False
        self._last_step_time: float | None = None
        self._touched: set[int] = set()
        # Snapshots of own publishes whose commit has not arrived, by round (training
        # thread only): the base a rebasing commit subtracts. At most one per publish in
        # flight; dropped when the round's commit is applied or the publish fails.
        self._kept: dict[int, Any] = {}
        # The newest applied record's estimates: how long closers wait for this learner.
        self._estimates = Estimates()
        # Contributions handed to the mailman (its view counts those finished).
        self._handed = 0
        # The span `traffic` is priced over, on the learner's clock: start() to close().
        self._started_at: float | None = None
        self._stopped_at: float | None = None

    # -- public surface -----------------------------------------------------------------

    @property
    def rounds_seen(self) -> int:
        """The newest round whose commit this learner has applied (-1 before any). The
        mailman may have received newer ones (`observed.received`), not applied yet."""
        return self._state.rounds_seen if self._state is not None else -1

    @property
    def local_step(self) -> int:
        return self._state.local_step if self._state is not None else 0

    @property
    def live_learners(self) -> frozenset[str]:
        return self._mailman.observed.live

    @property
    def batch_size(self) -> int | None:
        """⌈global_batch_size / live learners⌉, or None without a global batch size."""
        g = self.algorithm.global_batch_size
        if g is None:
            return None
        return -(-g // max(len(self._mailman.observed.live), 1))

    @property
    def plan(self) -> tuple[tuple[str, ...], ...]:
        return self._plan

    @property
    def traffic(self) -> Traffic:
        """Every request this learner made of its mailbox since `start()` (its embedded
        closer's included: the closer's work is part of what a learner costs), the bytes
        up and down, and their price at `prices` over the time from `start()` to now (or
        to `close()`) on its clock. Readable from any thread; zeros before `start()`."""
        meter = self._mailman.meter
        counts = meter.snapshot() if meter is not None else RequestCounts()
        if self._started_at is None:
            return measure(counts, 0.0, self.prices)
        end = self._stopped_at if self._stopped_at is not None else self.clock.now()
        return measure(counts, end - self._started_at, self.prices)

    def wait_for_learners(self, n: int, timeout: float | None = None) -> frozenset[str]:
        """Block until at least `n` learners hold a lease (this one included), listing
        the leases meanwhile as often as it looks for a commit it waits for; returns them.
        Standard DiLoCo, whose rounds wait for every learner, starts all of them this way
        so that none runs ahead alone. An `AwaitingLearners` event reports the wait when
        it begins, whenever the live set changes and every `AWAIT_REPORT_EVERY` seconds;
        `GradientmailError` after `timeout` seconds (None: `options.wait_timeout`), naming
        who is live."""
        self._require_started()
        if timeout is None:
            timeout = self.options.wait_timeout
        # The mailman looks for them as for a commit (`poll_delay`): learners that start
        # together leave this wait within milliseconds of each other, not a poll interval
        # apart, and a barrier's first round does not pay for the difference.
        clock = self.clock
        try:
            with clock.busy():
                # Inside busy(): a FakeClock holds still until the mailman is awake.
                self._mailman.want_live(n)
                start = clock.now()
                deadline = start + timeout
                reported: tuple[frozenset[str], float] | None = None
                # This learner beat its lease when it joined: it counts before the
                # mailman's first listing shows it.
                me = frozenset({self.learner_id})
                while len(live := self._mailman.observed.live | me) < n:
                    self._check_alive()
                    now = clock.now()
                    if reported is None or live != reported[0] or \
                            now - reported[1] >= AWAIT_REPORT_EVERY:
                        self.on_event(AwaitingLearners(self.learner_id, tuple(sorted(live)),
                                                       n, now - start))
                        reported = (live, now)
                    if now >= deadline:
                        missing = n - len(live)
                        raise GradientmailError(
                            f"learner {self.learner_id!r} waited {timeout:g}s for {n} "
                            f"learners of the run in {self._mailman.where} to start; "
                            f"{len(live)} hold a lease ({', '.join(sorted(live))}), "
                            f"{missing} more never did. Start the other {missing} (the "
                            "same mailbox and prefix), or set wait_for_learners lower (0 "
                            "starts at once) or wait_timeout longer"
                        )
                    with contextlib.suppress(queue.Empty):  # woken by any news of leases
                        clock.get(self._mailman.live_news,
                                  min(1.0, deadline - now, AWAIT_REPORT_EVERY))
        finally:
            self._mailman.want_live(0)
        return self._mailman.observed.live | me

    def start(self) -> None:
        """Join the run (creating it if nobody has) and align with its newest commits.

        Blocks until joined; raises `SchemaMismatch` / `RunConfigMismatch` when the run
        in the mailbox is another model or configuration.
        """
        if self._mailman.started:
            raise ConfigError(f"learner {self.learner_id!r} was started already")
        self._started_at = self.clock.now()
        result = self.clock.result(self._mailman.start(), None)
        try:
            self._mailman.residuals.check_fragments(result.plan)
        except ConfigError:
            self._mailman.stop(self.lease_timeout)
            raise
        self._plan = result.plan
        self._schedule = self.algorithm.schedule_for(len(result.plan))
        self._anchors = [None] * len(result.plan)
        versions = []
        for p, (version, values) in enumerate(result.fragments):
            self.adapter.apply(values)
            self._anchors[p] = values
            versions.append(version)
        self._set_state(ls.initial_state(len(result.plan), versions, result.rounds_seen))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep of this learner beyond the model and its optimizer:
        ``{"error_feedback": ...}``, the residuals of sparse deltas by fragment and tensor
        name with the rounds still in flight (`Residuals.state_dict`), or None while it
        holds none (no sparse `delta_dtype`, or no payload yet). The arrays are the
        learner's own (torch tensors on the model's device), never written once stored,
        not copies; a sharded learner's ranks each keep their own rows, gathered here
        into whole tensors on the host (`integration.sharded_feedback.RankResiduals`, a
        side command the other ranks serve). The rest of a learner needs no saving: a
        restart joins the run (from its newest commits) as the same learner id."""
        state = self._mailman.residuals.state_dict()
        return {"error_feedback": state if state["residuals"] or state["in_flight"] else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned, before `start()`: the residuals go to the
        model's device (the adapter's `to_device`; float32 numpy arrays for an adapter
        without it). Checked against the model now and against the run's fragments when
        `start()` joins; `ConfigError` naming the mismatch and the fix. Valid when the run
        has moved on since the checkpoint: the residuals are quantities of delta space."""
        if self._mailman.started:
            raise ConfigError(
                f"learner {self.learner_id!r} was started already; call load_state_dict() "
                "before start() (a running learner's residuals are in use)")
        if not isinstance(state, Mapping) or set(state) != {"error_feedback"}:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ConfigError(f"not a Learner state: keys {got}, expected ['error_feedback']; "
                              "pass what Learner.state_dict() returned")
        if state["error_feedback"] is None:
            return
        to_device = getattr(self.adapter, "to_device", None)
        place: Callable[[str, Any], Any] = (
            to_device if to_device is not None
            else lambda _, v: np.array(v, dtype=np.float32).reshape(-1))
        self._mailman.residuals.load_state_dict(
            state["error_feedback"], {s.name: s.numel for s in self.adapter.schema.params},
            place)

    def step(self, samples: int = 0, loss: float | None = None) -> tuple[int, ...]:
        """Account for one optimizer step over `samples` tokens (or samples), whose
        training loss was `loss` if given (each contribution carries the mean since the
        learner last published its fragment: the run's history, `gradientmail log`).

        Applies commits that arrived, publishes a round when one is due, and waits only
        when `overlap_steps` says training may not run further ahead. Never does I/O.
        Returns the fragments whose parameters it overwrote (sorted), so a data-parallel
        integration knows which tensors to broadcast from its rank 0 (`plan[p]` names them).
        """
        self._touched.clear()
        self._require_started()
        self._check_alive()
        with self.clock.busy():
            now = self.clock.now()
            seconds = None if self._last_step_time is None else now - self._last_step_time
            self._last_step_time = now
            # Count the step on the version it was taken on; a commit applied now rebases
            # it, or overwrites it keeping α of it (the steps counters follow the
            # parameters).
            self._set_state(ls.advanced(self._state_now(), int(samples), seconds,
                                        None if loss is None else float(loss)))
            self._apply_arrived()
            self._retract_failed()
            self._maybe_publish()
            self._wait_while_overdue()
        return tuple(sorted(self._touched))

    def close(self, flush: bool | None = None) -> None:
        """Wait for the commits of the rounds in flight, reset the model to the newest
        commits (or flush, with `flush_on_close`), release the lease, stop the thread.
        Idempotent; never raises for a peer's or the store's failure.

        `flush` overrides `flush_on_close`: integrations pass False when training failed,
        since a run resumed from a checkpoint trains those steps again and a flush would
        count them twice."""
        if self._closed:
            return
        self._closed = True
        if self._state is None:  # never started, or its join failed (the thread ended)
            return
        with self.clock.busy():
            self._close(self.algorithm.flush_on_close if flush is None else flush)

    # -- training thread ----------------------------------------------------------------

    def _close(self, flush: bool) -> None:
        pending = self._pending_rounds()
        self.on_event(Closing(self.learner_id, pending, flush))
        if self._mailman.observed.dead is None:
            self._wait_for_pending()
            self._final_catch_up()
            self._apply_arrived()
            if flush:
                self._flush()
                self._wait_for_pending()
                self._final_catch_up()
                self._apply_arrived()
            # Training since the last alignment that went out in no round is dropped:
            # the model ends on the newest commits, as every other learner sees them.
            for anchor in self._anchors:
                self.adapter.apply(anchor)
        self._kept.clear()
        self._mailman.stop(self.lease_timeout)
        self._stopped_at = self.clock.now()
        self.on_event(TrafficMeasured(self.learner_id, self.rounds_seen, self.traffic))
        self.on_event(Closed(self.learner_id, self.rounds_seen, self.local_step))

    def _require_started(self) -> ls.LearnerState:
        if self._state is None:
            raise ConfigError("call Learner.start() before step()")
        if self._closed:
            raise ConfigError(f"learner {self.learner_id!r} is closed")
        return self._state

    def _state_now(self) -> ls.LearnerState:
        assert self._state is not None
        return self._state

    def _set_state(self, state: ls.LearnerState) -> None:
        """Every change of the state goes through here: it tells the mailman the round
        this learner may publish next, whose publishers it counts for `_maybe_publish`."""
        self._state = state
        assert self._schedule is not None
        self._mailman.watch(ls.publishable(state, self._schedule))

    def _check_alive(self) -> None:
        dead = self._mailman.observed.dead
        if dead is not None:
            raise GradientmailError(
                f"the communication thread of learner {self.learner_id!r} died: {dead!r}"
            ) from dead

    def _apply_arrived(self) -> None:
        while True:
            try:
                commit = self._mailman.commits.get_nowait()
            except queue.Empty:
                return
            self._apply(commit)

    def _retract_failed(self) -> bool:
        """Make the rounds whose publish failed publishable again; whether there were any."""
        failed = self._mailman.failed_rounds()
        for r in failed:
            self._set_state(ls.retracted(self._state_now(), r))
            self._kept.pop(r, None)
        return bool(failed)

    def _apply(self, commit: Commit) -> None:
        state = self._state_now()
        rec = commit.record
        if rec.round <= state.rounds_seen:
            return
        if commit.rejected is not None:
            # It does not fit the model (CommitRejected was reported): the fragment stays
            # as it was, and the round no longer holds training back.
            self._set_state(ls.passed_over(state, rec.round))
            for r in [r for r in self._kept if r <= rec.round]:
                del self._kept[r]
            return
        took_part = any(p.learner == self.learner_id for p in rec.participants)
        own = next((p for p in state.publishes if p.round == rec.round), None)
        snapshot = None
        for r in [r for r in self._kept if r <= rec.round]:
            kept = self._kept.pop(r)
            snapshot = kept if r == rec.round else snapshot
        staleness = (
            state.local_step - own.at
            if own is not None and took_part
            else state.fragments[rec.fragment].steps
        )
        mixing = self.algorithm.mixing
        base = self._rebase_base(state, rec.fragment, rec.version, took_part, own, snapshot)
        counters = state.fragments[rec.fragment]
        counted = own.steps if own is not None and took_part else 0
        if base is not None and counters.steps > counted:
            self.adapter.rebase(commit.loaded, base)
        else:
            # Nothing trained past the base (behind a barrier, say): rebasing would add
            # zeros, and overwriting gives the commit's exact bytes.
            self.adapter.apply(commit.loaded, mixing)
        self._touched.add(rec.fragment)
        self._anchors[rec.fragment] = commit.loaded
        self._estimates = rec.estimates
        self._set_state(ls.applied(
            state, rec.round, rec.fragment, rec.version, took_part, mixing,
            rebase=base is not None,
            lag_steps=_lag_steps(rec, state.step_seconds, self.algorithm.overlap_steps),
            led=rec.arrival is not None and rec.arrival.first == self.learner_id,
        ))
        self.on_event(
            FragmentAligned(
                self.learner_id, rec.round, rec.fragment, rec.version, staleness, commit.nbytes
            )
        )
        self.on_event(TrafficMeasured(self.learner_id, rec.round, self.traffic))

    def _rebase_base(
        self,
        state: ls.LearnerState,
        fragment: int,
        version: int,
        took_part: bool,
        own: ls.Publish | None,
        snapshot: Any,
    ) -> Any:
        """What a rebasing commit subtracts from the local parameters, or None to
        overwrite: the values of the base `ls.rebase_base` picks."""
        base = ls.rebase_base(bool(self.algorithm.rebase), state.fragments[fragment].version,
                              version, took_part and own is not None, snapshot is not None)
        if base == "snapshot":
            return snapshot
        return self._anchors[fragment] if base == "anchor" else None

    def _maybe_publish(self, final: bool = False) -> None:
        state = self._state_now()
        sch = self._schedule
        assert sch is not None
        candidate = ls.candidate_round(state)
        seen = self._mailman.observed  # one view: its counts are of one moment
        others = seen.others if seen.watched == candidate else 0
        live = max(len(seen.live), 1)
        quorum = effective_quorum(self.algorithm.quorum_size, live)
        # Only a publish by opportunity (others in the round) asks how long it is waited
        # for: step() computes nothing more while no one has published.
        wait = _wait_steps(self.algorithm, self._estimates, sch, candidate,
                           self.poll_interval, state.step_seconds) if others else None
        r = ls.due_round(state, sch, others, quorum, live, wait, self._estimates.step)
        if r is None:
            return
        self._hand_over(r, final=final)
        if sch.gap(r + 1) == 0:
            # A pipelined barrier (stagger=False): the sync's next round goes out now too,
            # after this one, so its upload overlaps this one's merge and download.
            self._maybe_publish(final)

    def _hand_over(self, r: int, final: bool) -> None:
        state = self._state_now()
        sch = self._schedule
        assert sch is not None
        p = sch.fragment_of(r)
        counters = state.fragments[p]
        snapshot = self.adapter.snapshot(self._plan[p])
        if self.algorithm.rebase and not final:
            self._kept[r] = snapshot
        job = Outgoing(
            round=r,
            fragment=p,
            base_version=counters.version,
            local_step=state.local_step,
            steps=counters.steps,
            tokens=counters.tokens,
            final=final,
            step_seconds=state.step_seconds,
            snapshot=snapshot,
            anchor=self._anchors[p],
            loss=ls.mean_loss(state, p),
        )
        self._set_state(ls.published(state, r, sch))
        self._handed += 1
        self._mailman.post(job)

    def _wait_while_overdue(self) -> None:
        overlap = self.algorithm.overlap_steps

        def overdue() -> bool:
            self._check_alive()
            # A publish that fails while training waits for its round goes out again at
            # once, as it was: that round waits for it (a barrier's closer calls no
            # learner gone while its lease is fresh), so waiting on would hold the run
            # forever, and training on first would keep the others waiting H more steps
            # and send 2H steps in one delta.
            if self._retract_failed():
                self._hand_over(ls.candidate_round(self._state_now()), final=False)
            return ls.overdue(self._state_now(), overlap)

        if overdue():
            self._wait_applying(overdue)

    def _pending_rounds(self) -> tuple[int, ...]:
        state = self._state_now()
        return tuple(p.round for p in state.publishes if p.round > state.rounds_seen)

    def _wait_for_pending(self) -> None:
        # The commits of our rounds in flight: a closer may still be merging them. Past
        # the lease timeout plus a takeover, nobody is going to.
        limit = self.lease_timeout + 10 * self.poll_interval

        def pending() -> bool:
            self._retract_failed()  # a publish that failed has no commit to wait for
            return bool(self._pending_rounds()) and self._mailman.observed.dead is None

        if not self._wait_applying(pending, limit):
            self.on_event(GaveUp(self.learner_id, self._pending_rounds(), limit))

    def _wait_applying(self, waiting: Callable[[], bool], limit: float | None = None) -> bool:
        """Apply commits as they arrive while `waiting()` holds, the mailman polling faster
        meanwhile; False when `limit` seconds passed first."""
        t0 = self.clock.now()
        self._mailman.blocked(True)
        try:
            while waiting():
                if limit is not None and self.clock.now() - t0 > limit:
                    return False
                try:
                    commit = self.clock.get(self._mailman.commits, 0.05)
                except queue.Empty:
                    continue
                self._apply(commit)
            return True
        finally:
            self._mailman.blocked(False)

    def _final_catch_up(self) -> None:
        """Fetch every commit recorded so far, so the model ends on the newest ones."""
        future = self._mailman.catch_up()
        try:
            self.clock.result(future, self.lease_timeout)
        except Exception as exc:  # close() must not fail for the store
            future.cancel()
            self.on_event(PollFailed(self.learner_id, repr(exc)))

    def _flush(self) -> None:
        """Publish what was trained since the last alignment as final snapshots, for the
        rounds this learner may still publish (within τ of the newest commit)."""
        sch = self._schedule
        assert sch is not None
        while True:
            r = ls.publishable(self._state_now(), sch)
            if r is None:
                break
            self._hand_over(r, final=True)
        t0 = self.clock.now()
        while (
            self._handed > (seen := self._mailman.observed).finished
            and seen.dead is None
            and self.clock.now() - t0 < self.lease_timeout
        ):
            self.clock.pause(0.02)
