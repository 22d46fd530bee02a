"""The learner's communication thread: one asyncio loop that mails and fetches.

`Mailman` is the half of `Learner` that runs on the communication thread: the receive loop
(lease listings, new commits, who published the next round, the embedded syncer), the
lease loop (beats, roll calls: `gradientmail.rollcall`) and the publish loop (anchor − θ,
quantize, encode, upload). It shares nothing with the training thread but two queues and a
few attributes it overwrites whole; `Learner` holds the other half.

Copies of a fragment's bytes (F32, codec off; "+1 GPU" where a device adds one). Publish:
the snapshot clone (training thread), anchor − θ (a new tensor), its device-to-host copy
(GPU only; `from_torch` then holds that host memory as is), quantize (only with a
delta_dtype: the codes), `pack` (header and tensors joined into one blob), upload.
Receive: download, `decode` (none: the tensors view the payload; zstd: decompress and
unshuffle), `adapter.load` (one copy straight from the payload onto the device, the anchor
the learner keeps), and `apply` (the parameters' in-place copy).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import math
import queue
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from gradientmail import learner_state as ls
from gradientmail.adapters.base import Adapter
from gradientmail.algorithms.base import Algorithm
from gradientmail.algorithms.diloco import rebuild_theta
from gradientmail.algorithms.schedule import RoundSchedule
from gradientmail.auth import HmacSeal
from gradientmail.clock import Clock, sleep_unless
from gradientmail.errors import LocalProtocolError, RemoteProtocolError, RunVanished
from gradientmail.events import (
    EventSink,
    PollFailed,
    PublishCancelled,
    PublishFailed,
    RoundRecorded,
    SnapshotPublished,
)
from gradientmail.join import JoinResult, join_run
from gradientmail.lease import LeaseTracker
from gradientmail.protocol import MANIFEST_KEY, Exchange, payload_bound
from gradientmail.quantization import quantize
from gradientmail.records import RoundRecord, SnapshotRecord
from gradientmail.replica import Replica, theta_digest
from gradientmail.rollcall import READ_EVERY, Call, reply
from gradientmail.serialization import TensorBytes
from gradientmail.syncer import Syncer

__all__ = ["BACKUP_EVERY", "MANIFEST_EVERY", "WAITING_POLL", "Mailman", "delta_format",
           "poll_delay"]

#: Polls between a learner's own looks at who published the next round, when its
#: embedded syncer is not watching that round already.
BACKUP_EVERY = 30
#: Polls between a learner's looks at the run's manifest (one GET): a run removed under
#: it must stop it with an error, not leave it training into a directory it recreates.
MANIFEST_EVERY = 10
#: Seconds between a learner's looks at the next record while its training thread is
#: blocked on a commit (a barrier, or `overlap_steps`), doubling up to WAITING_CAP (or
#: the poll interval, when shorter): a GET of a known key is cheap ($0.40 per million on
#: S3: 20 a second cost $0.029 per hour spent blocked, a few cents a day for a standard
#: DiLoCo learner blocked a few percent of its time), and the wait between the commit and
#: its learners' next look is what a barrier costs on top of the merge. Doubling up to
#: the poll interval (1 s) cost standard DiLoCo ~1 s a round against torchft's 0.35 s;
#: up to 0.16 s, ~80 ms a round on average for the learners that did not close it.
WAITING_POLL = 0.02
WAITING_CAP = 0.05


def poll_delay(poll_interval: float, blocked_polls: int) -> float:
    """The receive loop's sleep: the poll interval, or, `blocked_polls` polls into a wait
    of the training thread, WAITING_POLL doubling per poll up to WAITING_CAP."""
    if blocked_polls <= 0:
        return poll_interval
    return min(poll_interval, WAITING_CAP,
               WAITING_POLL * (1 << min(blocked_polls - 1, 30)))


@dataclasses.dataclass(frozen=True)
class _Job:
    """A due round handed from the training thread to the mailman."""

    round: int
    fragment: int
    base_version: int
    local_step: int
    steps: int
    tokens: int
    final: bool
    snapshot: Any
    anchor: Any
    step_seconds: float | None
    loss: float | None = None


@dataclasses.dataclass(frozen=True)
class _Commit:
    """A commit ready to apply: its record and its parameters on the model's device."""

    record: RoundRecord
    loaded: Any
    nbytes: int


def delta_format(configured: str | None, dtypes: Sequence[str]) -> str:
    """The format a fragment's delta travels in: `delta_dtype` when set, else the model's
    own precision: BF16 when every tensor of the fragment is held in BF16 (its F32 delta
    would be twice the bytes of anything the model can represent), F32 otherwise."""
    if configured is not None:
        return configured
    return "BF16" if dtypes and all(d == "BF16" for d in dtypes) else "F32"


class Mailman:
    """The communication-thread half of a `Learner` (see there for the attributes)."""

    adapter: Adapter
    algorithm: Algorithm
    learner_id: str
    sync: bool
    hold_own: bool
    backend: Any
    clock: Clock
    poll_interval: float
    lease_every: float
    lease_timeout: float
    on_event: EventSink
    prefix: str
    keep_versions: int
    _seal: HmacSeal | None
    _exchange: Exchange | None
    _loop: asyncio.AbstractEventLoop | None
    _schedule: RoundSchedule | None
    _plan: tuple[tuple[str, ...], ...]
    _state: ls.LearnerState | None
    _inbox: queue.Queue[_Commit]
    _jobs: asyncio.Queue[_Job | None] | None
    _dead: BaseException | None
    _stop: asyncio.Event | None
    _wake: asyncio.Event | None
    _others: tuple[int, int]
    _live: frozenset[str]
    _tracker: LeaseTracker
    _syncer: Syncer | None
    _bad_call: str | None
    _newest_seen: int
    _cursor: int
    _next_watch: float
    _want_live: int
    _blocked: bool
    _host: dict[int, tuple[int, dict[str, TensorBytes]]]
    _replica: Replica | None
    _finished: int
    _failed: queue.SimpleQueue[int]
    _tasks: list[asyncio.Task[None]]

    # -- communication thread -----------------------------------------------------------

    def _thread_main(self, joined: concurrent.futures.Future[JoinResult]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._jobs = asyncio.Queue()
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        try:
            loop.run_until_complete(self._main(joined))
        except BaseException as exc:
            self._dead = exc
            if not joined.done():
                joined.set_exception(exc)
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    async def _main(self, joined: concurrent.futures.Future[JoinResult]) -> None:
        ex = self._exchange
        assert ex is not None
        try:
            result = await join_run(
                ex,
                self.adapter,
                self.algorithm,
                self.learner_id,
                poll_interval=self.poll_interval,
                on_event=self.on_event,
            )
        except BaseException as exc:
            joined.set_exception(exc)
            self._dead = exc
            return
        self._replica = result.replica
        joined.set_result(result)
        assert self._stop is not None
        await self.clock.idle(self._stop.wait())
        await self._shutdown()

    def _begin_loops(self, result: JoinResult) -> None:
        loop = self._loop
        assert loop is not None
        self._tracker = LeaseTracker(self.lease_timeout)
        self._tasks = [
            loop.create_task(self._receive_loop(result)),
            loop.create_task(self._lease_loop()),
            loop.create_task(self._publish_loop()),
        ]
        for task in self._tasks:
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._dead is None:
            self._dead = exc

    async def _shutdown(self) -> None:
        for task in getattr(self, "_tasks", []):
            task.cancel()
        for task in getattr(self, "_tasks", []):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._syncer is not None:
            # The sweep after this learner's last commit, if closing cut it short.
            try:
                await self._syncer.sweep_due()
            except Exception as exc:
                self.on_event(PollFailed(self.learner_id, repr(exc)))
        await self._release()
        ex = self._exchange
        if ex is not None:
            await ex.mailbox.close()

    async def _release(self) -> None:
        from gradientmail.events import LeaseReleased, ReleaseFailed

        ex = self._exchange
        assert ex is not None
        try:
            await ex.release(self.learner_id)
        except Exception as exc:
            self.on_event(ReleaseFailed(self.learner_id, repr(exc)))
            return
        self.on_event(LeaseReleased(self.learner_id))

    async def _receive_loop(self, joined: JoinResult) -> None:
        ex = self._exchange
        assert ex is not None
        tracker = self._tracker
        syncer = None
        if self.sync:
            from gradientmail.backends.numpy_backend import NumpyBackend

            # The closer inside a learner merges on one thread: the machine's other cores
            # belong to training. A standalone `gradientmail sync` uses several.
            backend = self.backend if self.backend is not None else NumpyBackend(threads=1)
            syncer = Syncer(
                ex.mailbox,
                closer_id=self.learner_id,
                backend=backend,
                clock=self.clock,
                poll_interval=self.poll_interval,
                lease_timeout=self.lease_timeout,
                on_event=self.on_event,
                prefix=self.prefix,
                exchange=ex,
                keep_versions=self.keep_versions,
                embedded=True,
                leases=tracker,
                replica=joined.replica,
            )
            self._syncer = syncer

        async def refresh() -> frozenset[str]:
            self._live = await ex.observe_leases(tracker)
            return self._live

        try:
            await self._receive(joined, syncer, refresh)
        finally:
            if syncer is not None:
                syncer.decline_offers()  # no poll will take them: the publishes upload

    async def _receive(self, joined: JoinResult, syncer: Syncer | None,
                       refresh: Callable[[], Awaitable[frozenset[str]]]) -> None:
        ex = self._exchange
        assert ex is not None
        tracker = self._tracker
        next_leases = -math.inf
        self._cursor = joined.rounds_seen
        next_manifest = self.clock.now() + MANIFEST_EVERY * self.poll_interval
        blocked = 0
        while True:
            assert self._wake is not None
            self._wake.clear()
            now = self.clock.now()
            if now >= next_manifest:
                await self._check_run_exists()
                next_manifest = now + MANIFEST_EVERY * self.poll_interval
            try:
                if now >= next_leases or len(self._live) < self._want_live:
                    self._live = await ex.observe_leases(tracker)
                    # Leases change once per lease period; listing them every poll would
                    # cost a LIST per poll per learner for nothing.
                    next_leases = now + self.lease_every
                fresh = await self._catch_up()
                if syncer is not None and await syncer.poll(
                    live=self._live, refresh_live=refresh, records=fresh, waiting=self._blocked
                ):
                    # It committed a round: its own learner takes the commit now, not a
                    # poll later; the sweep after it, while training goes on.
                    await self._catch_up()
                    await syncer.sweep_due()
                # A roll call's verdict may have dropped learners from the tracker.
                self._live = tracker.live(self.clock.now())
                await self._watch_next_round(syncer, now)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.on_event(PollFailed(self.learner_id, repr(exc)))
            blocked = blocked + 1 if self._blocked else 0
            # Woken early when the training thread starts waiting for a commit, or this
            # learner's contribution is in (its closer looks whether it completed the
            # set): neither waits out a poll interval begun before.
            await sleep_unless(self.clock, poll_delay(self.poll_interval, blocked), self._wake)

    async def _lease_loop(self) -> None:
        """Beat the lease every `lease_every`, and answer roll calls: the call key is read
        every READ_EVERY polls. A task of its own, so that a receive loop busy for seconds
        (a large commit arriving, its closer merging a round) never makes a live learner
        look gone."""
        ex = self._exchange
        assert ex is not None
        next_beat = self.clock.now() + self.lease_every  # join_run beat already
        next_read = -math.inf
        handled: Call | None = None
        while True:
            now = self.clock.now()
            try:
                beat, answering = now >= next_beat, None
                if now >= next_read:
                    next_read = now + READ_EVERY * self.poll_interval * 0.999
                    call = await self._read_call()
                    if call is not None and call != handled:
                        answer = reply(call, self.learner_id, ex.lease_counter(self.learner_id))
                        for learner, counter in answer.drop.items():
                            self._tracker.drop(learner, counter)
                        if answer.drop:
                            self._live = self._tracker.live(now)
                        beat, answering = beat or answer.beat, call
                if beat:
                    await ex.beat(self.learner_id)
                    next_beat = now + self.lease_every
                if answering is not None:
                    handled = answering  # only once answered: a failed beat answers again
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.on_event(PollFailed(self.learner_id, repr(exc)))
            await self.clock.sleep(self.poll_interval)

    async def _read_call(self) -> Call | None:
        """The roll call, or None; a damaged (or, in an authenticated run, forged) call
        is reported once and ignored until a closer overwrites it with a call of its own."""
        ex = self._exchange
        assert ex is not None
        try:
            return await ex.read_call()
        except RemoteProtocolError as exc:
            if str(exc) != self._bad_call:
                self._bad_call = str(exc)
                self.on_event(PollFailed(self.learner_id, repr(exc)))
            return None

    async def _check_run_exists(self) -> None:
        """Raise `RunVanished` (ending the thread, so `step()` raises it) when the run's
        manifest is gone; a store that fails to answer is only a failed poll."""
        ex = self._exchange
        assert ex is not None
        try:
            manifest = await ex.read_manifest()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.on_event(PollFailed(self.learner_id, repr(exc)))
            return
        if manifest is None:
            raise RunVanished(
                f"the run learner {self.learner_id!r} joined is gone: its manifest "
                f"{MANIFEST_KEY!r} is missing from {ex.where} (the directory was removed, or "
                "the bucket or prefix emptied); nothing trained now can be merged. Stop "
                "this learner, or start a new run"
            )

    async def _catch_up(self) -> list[RoundRecord]:
        # Runs on the loop only; the final catch-up of close() may interleave with the
        # receive loop's, and the training thread ignores a commit it applied already.
        records: list[RoundRecord] = []
        self._cursor = max(self._cursor, await self._receive_commits(self._cursor, records))
        return records

    async def _receive_commits(self, cursor: int, out: list[RoundRecord] | None = None) -> int:
        ex = self._exchange
        assert ex is not None
        records = await ex.rounds_after(cursor)
        if out is not None:
            out.extend(records)
        if not records:
            return cursor
        batch = []
        for rec in records:
            self.on_event(
                RoundRecorded(
                    rec.round,
                    rec.fragment,
                    rec.version,
                    tuple(p.learner for p in rec.participants),
                    rec.mean_cosine,
                    rec.closer,
                )
            )
            commit = await self._fetch_commit(rec)
            if commit is None:
                # Swept under us: a newer commit of this fragment exists; start over from
                # the newest record.
                newest = await ex.newest_round(cursor)
                return await self._skip_to(newest, cursor)
            batch.append(commit)
        # A batch is queued only once every payload in it is in hand.
        for commit in batch:
            self._inbox.put(commit)
        self._newest_seen = records[-1].round
        return records[-1].round

    async def _skip_to(self, newest: int, cursor: int) -> int:
        ex = self._exchange
        assert ex is not None
        latest = await ex.latest_commit_per_fragment(len(self._plan), newest)
        batch = []
        for rec in sorted(latest.values(), key=lambda r: r.round):
            if rec.round <= cursor:
                continue
            commit = await self._fetch_commit(rec)
            if commit is None:
                return cursor
            batch.append(commit)
        for commit in batch:
            self._inbox.put(commit)
        self._newest_seen = max(self._newest_seen, newest)
        return newest

    async def _fetch_commit(self, rec: RoundRecord) -> _Commit | None:
        """The commit's parameters. With a replicated outer step, the replica's state at
        its version (its step applied to the state held); otherwise rebuilt from its
        quantized update when this learner holds the previous version (checked against
        the record's digest), else downloaded. None when the payloads were swept."""
        ex = self._exchange
        assert ex is not None
        names = self._plan[rec.fragment]
        schema = self.adapter.schema
        theta: dict[str, TensorBytes] | None = None
        nbytes = 0
        replica = self._replica
        if replica is not None and replica.algorithm.replicated:
            before = replica.bytes_down
            state = await replica.at(rec.fragment, rec)
            if state is None:
                return None
            theta, nbytes = dict(state.theta), replica.bytes_down - before
        held = self._host.get(rec.fragment)
        if theta is None and rec.update is not None and held is not None \
                and held[0] == rec.version - 1:
            update = await ex.fetch_tensors(rec.update.payload,
                                            payload_bound(schema, names, "updates"))
            if update is not None:
                rebuilt = await asyncio.to_thread(rebuild_theta, held[1], update, rec.update.format)
                if theta_digest(rebuilt, names) == rec.update.theta_sha256:
                    theta, nbytes = rebuilt, rec.update.payload.size
        if theta is None:
            if rec.theta is None:
                raise RemoteProtocolError(
                    f"round {rec.round}'s record carries no theta and this run does not "
                    "replicate its outer step"
                )
            fetched = await ex.fetch_tensors(rec.theta, payload_bound(schema, names, "theta"))
            if fetched is None:
                return None
            theta, nbytes = {n: fetched[n] for n in names}, rec.theta.size
        self._host[rec.fragment] = (rec.version, theta)
        loaded = await asyncio.to_thread(self.adapter.load, theta)
        return _Commit(rec, loaded, nbytes)

    async def _watch_next_round(self, syncer: Any, now: float) -> None:
        """Count the others who published the round this learner may publish next (for
        "due by opportunity"). The embedded syncer's listing is reused when it watches
        that round; otherwise one LIST every `backup_every` polls: a LIST per poll per
        learner would be the dearest request of the run."""
        ex = self._exchange
        state = self._state
        if ex is None or state is None:
            return
        candidate = ls.candidate_round(state)
        if ls.publishable(state, self._schedule_now()) is None:
            return
        who = syncer.publishers_seen(candidate) if syncer is not None else None
        if who is None:
            if now < self._next_watch and self._others[0] == candidate:
                return
            who = await ex.publishers(candidate)
            self._next_watch = now + (BACKUP_EVERY - 1) * self.poll_interval * 0.999
        self._others = (candidate, len(who - {self.learner_id}))

    def _schedule_now(self) -> RoundSchedule:
        assert self._schedule is not None
        return self._schedule

    async def _publish_loop(self) -> None:
        assert self._jobs is not None
        while True:
            job = await self.clock.idle(self._jobs.get())
            if job is None:
                return
            t0 = self.clock.now()
            try:
                await self._publish(job, t0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._publish_failed(job, exc, t0)
            finally:
                self._finished += 1

    async def _publish_failed(self, job: _Job, exc: Exception, t0: float) -> None:
        """A publish raised. Unless the error was our own (a refused field, a round taken
        already), its record may have been written all the same (the answer was lost, or
        the retries ran out after an attempt that landed), so look before retracting: a
        retracted publish whose record landed would have its steps counted twice (once in
        the commit that merged it, again with the next publish)."""
        if isinstance(exc, LocalProtocolError):
            # A refused field, or a round this learner id has a record in already (an
            # earlier run of it): the steps go out with a later round.
            outcome, record = "absent", None
        else:
            outcome, record = await self._settle(job)
        if record is not None:
            self._published(job, record, t0)
            return
        self.on_event(PublishFailed(self.learner_id, job.round, repr(exc)))
        if outcome == "absent":
            # Known not written: the round may be published again, the steps go out later.
            # ("closed": the commit's participants say whether it was merged; the training
            # thread learns it from there.)
            self._failed.put(job.round)

    async def _settle(self, job: _Job) -> tuple[str, SnapshotRecord | None]:
        """Whether a failed publish's record landed: ("landed", record), ("absent", None),
        or ("closed", None) when the round's commit arrived before the store would say
        (one GET per poll interval while it fails)."""
        ex = self._exchange
        assert ex is not None
        while self._newest_seen < job.round:
            try:
                record = await ex.contribution(job.round, self.learner_id)
            except asyncio.CancelledError:
                raise
            except Exception:
                await self.clock.sleep(self.poll_interval)
                continue
            if record is not None and (
                record.fragment, record.base_version, record.local_step, record.steps,
                record.tokens, record.final,
            ) == (job.fragment, job.base_version, job.local_step, job.steps, job.tokens,
                  job.final):
                return "landed", record
            return "absent", None
        return "closed", None

    def _published(self, job: _Job, record: SnapshotRecord, t0: float,
                   tensors: dict[str, TensorBytes] | None = None, held: bool = False) -> None:
        if self._syncer is not None and not held:
            self._syncer.note_contribution(job.round, self.learner_id, record.payload, tensors)
            if self._wake is not None:
                self._wake.set()
        self.on_event(
            SnapshotPublished(
                self.learner_id,
                job.round,
                job.fragment,
                job.steps,
                job.tokens,
                record.payload.size,
                self.clock.now() - t0,
                held,
            )
        )

    async def _publish(self, job: _Job, t0: float) -> None:
        ex = self._exchange
        assert ex is not None
        if job.round <= self._newest_seen and not job.final:
            self.on_event(PublishCancelled(self.learner_id, job.round, "round already closed"))
            return
        fmt = delta_format(self.algorithm.delta_dtype,
                           [self.adapter.schema[n].dtype for n in self._plan[job.fragment]])
        tensors = await asyncio.to_thread(self._encode_delta, job, fmt)
        draft = ex.draft(
            job.round,
            self.learner_id,
            fragment=job.fragment,
            base_version=job.base_version,
            local_step=job.local_step,
            steps=job.steps,
            tokens=job.tokens,
            final=job.final,
            schema_digest=self.adapter.schema.digest(),
            delta_format=fmt,
            step_seconds=job.step_seconds,
            loss=job.loss,
        )
        # A run kept auditable (`keep_rounds`) holds nothing back: a merge is re-derived
        # from the uploaded contributions, and a held one was never uploaded.
        hold = self.hold_own and self.algorithm.keep_rounds is None
        if hold and self._syncer is not None and self._wake is not None:
            # Offered to the embedded closer first: if this contribution completes the
            # round's set, the closer merges it from memory and it is never uploaded.
            taken = self._syncer.offer(draft, tensors)
            self._wake.set()
            if await taken:
                self._published(job, draft, t0, held=True)
                return
        record = await ex.publish_draft(draft, tensors)
        self._published(job, record, t0, tensors)

    def _encode_delta(self, job: _Job, fmt: str) -> dict[str, TensorBytes]:
        delta = self.adapter.delta(job.anchor, job.snapshot)
        if fmt == "F32":
            return delta
        out: dict[str, TensorBytes] = {}
        for name, tensor in delta.items():
            out.update(quantize(name, tensor, fmt))
        return out
