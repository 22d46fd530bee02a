"""The learner's communication thread: one asyncio loop that mails and fetches.

A `Learner` owns one `Mailman`, which runs the communication thread: the receive loop
(lease listings, new commits, who published the watched round, the embedded syncer), the
lease loop (beats, roll calls: `gradientmail.run.rollcall`) and the publish loop. The two
threads meet only through the messages of `gradientmail.learner.messages`: contributions
in, commits, failed rounds and one frozen view of what the mailman observed out. The way
out is `gradientmail.learner.poster`, the way in `gradientmail.learner.fetcher`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import math
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from gradientmail.adapters.base import Adapter
from gradientmail.algorithms.base import Algorithm
from gradientmail.clock import Clock, sleep_unless
from gradientmail.errors import RunVanished
from gradientmail.events import (
    CommitRejected,
    EventSink,
    LeaseReleased,
    PollFailed,
    ReleaseFailed,
    RoundRecorded,
)
from gradientmail.learner.feedback import ErrorFeedback, Residuals
from gradientmail.learner.fetcher import CommitFetcher
from gradientmail.learner.hosting import hosted_closer
from gradientmail.learner.lease_keeper import LeaseKeeper
from gradientmail.learner.messages import Commit, Observed, Outgoing
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.poster import Poster
from gradientmail.learner.sharded import Ranks, ranks_of
from gradientmail.mailbox.base import Mailbox
from gradientmail.mailbox.url import open_mailbox
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.run.cadence import poll_delay
from gradientmail.run.join import InitUploader, JoinResult, Loader, join_run
from gradientmail.run.keyspace import MANIFEST_KEY
from gradientmail.run.lease import CLOSERS, LeaseTracker
from gradientmail.run.protocol import Exchange
from gradientmail.syncer.hosted import Host
from gradientmail.syncer.runtime import Syncer
from gradientmail.syncer.standalone import closer_timeout
from gradientmail.wire.auth import HmacSeal
from gradientmail.wire.records import Manifest, RoundRecord
from gradientmail.wire.refs import PayloadRef

__all__ = ["BACKUP_EVERY", "MANIFEST_EVERY", "Mailman"]

#: Polls between a learner's own looks at who published the next round, when its
#: embedded syncer is not watching that round already.
BACKUP_EVERY = 30
#: Polls between a learner's looks at the run's manifest (one GET): a run removed under
#: it must stop it with an error, not leave it training into a directory it recreates.
MANIFEST_EVERY = 10
#: Seconds between lease listings of a learner waiting for others to join
#: (`Learner.wait_for_learners`) on a billed store.
WANTED_LIST = 0.2


def _rows_loader(ranks: Ranks, ex: Exchange) -> Loader:
    async def load(manifest: Manifest, fragment: int, rec: RoundRecord | None) -> Any:
        return (await ranks.load(ex, manifest, fragment, rec))[0]

    return load


def _init_uploader(ranks: Ranks, ex: Exchange) -> InitUploader:
    async def upload(fragment: int, names: tuple[str, ...], attempt: int) -> list[PayloadRef]:
        return await ranks.upload_init(ex, fragment, names, attempt)

    return upload


class Mailman:
    """A learner's communication thread: one asyncio loop that mails and fetches.

    It talks to the training thread through messages only, and reads none of its state.
    In (method calls of the training thread): `start` (join the run), `post` (an
    `Outgoing` contribution to publish), `watch` (the round whose publishers to count),
    `blocked` (training waits for a commit: look sooner), `want_live` (list the leases
    every poll until that many learners hold one), `catch_up` and `stop`. Out: `commits`
    (each `Commit` ready to apply, in order), `failed_rounds` (publishes known not to
    have landed: retract them) and `observed`, one frozen `Observed` replaced whole.

    It calls the adapter's `schema`, `read` (when it creates the run, before training
    starts), `load` (a commit's theta onto the model's device) and `delta` (anchor −
    snapshot of a contribution), never `apply`, `rebase` or `snapshot`: the model's
    parameters belong to the training thread.
    """

    def __init__(
        self,
        mailbox: Mailbox | str,
        adapter: Adapter,
        algorithm: Algorithm,
        learner_id: str,
        options: LearnerOptions,
        *,
        clock: Clock,
        on_event: EventSink,
        backend: Any = None,
        seal: HmacSeal | None = None,
    ) -> None:
        self.adapter = adapter
        self.algorithm = algorithm
        self.learner_id = learner_id
        self.options = options
        self.clock = clock
        self.on_event = on_event
        self.backend = backend
        # The settings read on every pass of the loops, held as plain attributes.
        self.poll_interval = options.poll_interval
        self.lease_every = options.lease_every
        self.lease_timeout = options.lease_timeout
        self._mailbox_arg = mailbox
        self._seal = seal
        # Out: read by the training thread.
        self.commits: queue.Queue[Commit] = queue.Queue()
        self.observed = Observed()
        #: The count of live learners whenever the live set changes while `want_live` is
        #: set: what `Learner.wait_for_learners` blocks on.
        self.live_news: queue.Queue[int] = queue.Queue()
        self._failed: queue.SimpleQueue[int] = queue.SimpleQueue()
        # In: single assignments by the training thread, read at the loops' next pass.
        self._watch: int | None = None
        self._blocked = False
        self._want_live = 0
        # Set by start() and on the communication thread:
        self._exchange: Exchange | None = None
        self.meter: CountingMailbox | None = None  # every request of this learner's, by start()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._jobs: asyncio.Queue[Outgoing | None] | None = None
        self._stop: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._tracker = LeaseTracker(options.lease_timeout)
        # The standalone closers' leases, judged by a timeout they are known to beat in.
        self._closers = LeaseTracker(closer_timeout(options.lease_timeout))
        # The embedded closer and the seam to it, once joined (`options.sync`).
        self._syncer: Syncer | None = None
        self._host: Host | None = None
        self._leases: LeaseKeeper | None = None  # the lease loop, once joined
        self._plan: tuple[tuple[str, ...], ...] = ()
        self._fetcher: CommitFetcher | None = None  # the way in
        self._poster: Poster | None = None  # the way out
        #: The error feedback of sparse deltas (the poster's), which a checkpoint holds.
        ranks = ranks_of(adapter)
        self.residuals: ErrorFeedback = (Residuals(learner_id) if ranks is None
                                         else ranks.feedback(learner_id))
        # The newest round whose commit is queued: the one receive cursor (what `_publish`
        # and `_settle` ask of "has this round closed"; `observed.received` shows it).
        self._cursor = -1
        self._next_watch = -math.inf

    # -- messages from the training thread ------------------------------------------------

    @property
    def where(self) -> str:
        """The run's place, for messages (the mailbox URL and prefix once started)."""
        if self._exchange is not None:
            return self._exchange.where
        arg = self._mailbox_arg
        return arg if isinstance(arg, str) else arg.url

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> concurrent.futures.Future[JoinResult]:
        """Open the mailbox and start the thread, which joins the run and then runs its
        loops; the future resolves with the join's result (or its error)."""
        self.meter = CountingMailbox(open_mailbox(self._mailbox_arg))
        self._exchange = Exchange(
            self.meter, clock=self.clock, compression=self.options.compression,
            prefix=self.options.prefix, seal=self._seal,
        )
        joined: concurrent.futures.Future[JoinResult] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(joined,), name=f"gradientmail-{self.learner_id}",
            daemon=True,
        )
        self._thread.start()
        return joined

    def post(self, job: Outgoing) -> None:
        """Publish `job` (in the order posted)."""
        assert self._loop is not None and self._jobs is not None
        self._loop.call_soon_threadsafe(self._jobs.put_nowait, job)

    def watch(self, round_: int | None) -> None:
        """Count the learners who publish `round_` (the round the training thread may
        publish next; None: none): `observed.others`, for "due by opportunity"."""
        self._watch = round_

    def blocked(self, waiting: bool) -> None:
        """The training thread waits for a commit (True) or trains again (False): while it
        waits, the next record is looked for every `poll_delay`, not every poll."""
        self._blocked = waiting
        loop, wake = self._loop, self._wake
        if waiting and loop is not None and wake is not None:
            # The receive loop may be sleeping out a poll interval begun before this wait.
            with contextlib.suppress(RuntimeError):  # its loop closed: nothing to wake
                loop.call_soon_threadsafe(wake.set)

    def want_live(self, n: int) -> None:
        """Look for `n` learners holding a lease, at the cadence of a wait for a commit,
        until they do (0: list the leases every lease period)."""
        self._want_live = n
        loop, wake = self._loop, self._wake
        if n and loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed: nothing to wake
                loop.call_soon_threadsafe(wake.set)

    def failed_rounds(self) -> list[int]:
        """The rounds whose publish is known not to have landed since the last call."""
        out = []
        while True:
            try:
                out.append(self._failed.get_nowait())
            except queue.Empty:
                return out

    def catch_up(self) -> concurrent.futures.Future[list[RoundRecord]]:
        """Fetch every commit recorded so far (into `commits`)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self._catch_up(), self._loop)

    def stop(self, timeout: float) -> None:
        """Stop the loops, release the lease, and wait up to `timeout` for the thread."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and loop.is_running():
            loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self.clock.join(self._thread, timeout)

    # -- communication thread -----------------------------------------------------------

    def _see(self, **changes: Any) -> None:
        """Replace the view with one that differs by `changes` (this thread only)."""
        before = self.observed.live
        self.observed = dataclasses.replace(self.observed, **changes)
        if self._want_live and self.observed.live != before:
            self.live_news.put(len(self.observed.live))

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
            self._see(dead=exc)
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
        ranks = ranks_of(self.adapter)
        # A learner of several ranks joins with each rank's own rows.
        load = None if ranks is None else _rows_loader(ranks, ex)
        # ... and, creating the run, uploads Θ⁰ as each rank's own rows.
        upload_init = None if ranks is None else _init_uploader(ranks, ex)
        try:
            result = await join_run(
                ex,
                self.adapter,
                self.algorithm,
                self.learner_id,
                poll_interval=self.poll_interval,
                on_event=self.on_event,
                load=load,
                upload_init=upload_init,
            )
        except BaseException as exc:
            joined.set_exception(exc)
            self._see(dead=exc)
            return
        self._plan = result.plan
        self._fetcher = CommitFetcher(ex, self.adapter, result)
        if self.options.sync:
            self._host, self._syncer = hosted_closer(
                ex, self.learner_id, self.options, leases=self._tracker,
                replica=result.replica, on_event=self.on_event, backend=self.backend)
        assert self._wake is not None
        self._poster = Poster(
            ex, self.adapter, self.algorithm, self.learner_id, result.plan, clock=self.clock,
            on_event=self.on_event, hold_own=self.options.hold_own, closed=lambda: self._cursor,
            host=self._host, wake=self._wake, failed=self._failed,
            poll_interval=self.poll_interval, residuals=self.residuals,
        )
        self._leases = LeaseKeeper(
            ex, self.learner_id, self._tracker, clock=self.clock, lease_every=self.lease_every,
            poll_interval=self.poll_interval, on_event=self.on_event,
            on_drop=lambda now: self._see(live=self._tracker.live(now)))
        self._cursor = result.rounds_seen
        self._see(received=result.rounds_seen)
        await self._settle_restored(ex, result.rounds_seen)
        self._begin_loops()
        joined.set_result(result)
        assert self._stop is not None
        await self.clock.idle(self._stop.wait())
        await self._shutdown()

    async def _settle_restored(self, ex: Exchange, newest: int) -> None:
        """Settle the rounds a restored checkpoint had in flight that closed before this
        join (`_catch_up` brings the later ones): their records say whether they stood.
        One whose record is gone (swept), or that the store does not answer for, counts
        as merged, as most are: the join overwrote the model, so no later commit of its
        fragment tells otherwise."""
        for r, fragment in sorted(self.residuals.in_flight().items()):
            if r > newest:
                continue
            try:
                rec = await ex.read_round(r)
            except asyncio.CancelledError:
                raise
            except Exception:
                rec = None
            if rec is not None:
                self.residuals.recorded(rec.round, tuple(p.learner for p in rec.participants))
            else:
                self.residuals.swept(fragment, r, took_part=True)

    def _begin_loops(self) -> None:
        loop = self._loop
        assert loop is not None and self._leases is not None
        self._tasks = [
            loop.create_task(self._receive_loop()),
            loop.create_task(self._leases.run()),
            loop.create_task(self._publish_loop()),
        ]
        for task in self._tasks:
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self.observed.dead is None:
            self._see(dead=exc)

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
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
        ex = self._exchange
        assert ex is not None
        try:
            await ex.release(self.learner_id)
        except Exception as exc:
            self.on_event(ReleaseFailed(self.learner_id, repr(exc)))
            return
        self.on_event(LeaseReleased(self.learner_id))

    async def _receive_loop(self) -> None:
        ex = self._exchange
        assert ex is not None
        tracker = self._tracker

        async def refresh() -> frozenset[str]:
            live = await ex.observe_leases(tracker)
            self._see(live=live)
            return live

        try:
            await self._receive(self._syncer, refresh)
        finally:
            if self._host is not None:
                self._host.close()  # no poll will take an offer now: the publishes upload

    async def _receive(self, syncer: Syncer | None,
                       refresh: Callable[[], Awaitable[frozenset[str]]]) -> None:
        ex = self._exchange
        assert ex is not None
        tracker = self._tracker
        next_leases = -math.inf
        next_manifest = self.clock.now() + MANIFEST_EVERY * self.poll_interval
        blocked, metered, next_wanted = 0, ex.mailbox.metered, -math.inf
        while True:
            assert self._wake is not None
            self._wake.clear()
            now, again = self.clock.now(), False
            if now >= next_manifest:
                await self._check_run_exists()
                next_manifest = now + MANIFEST_EVERY * self.poll_interval
            try:
                short = len(self.observed.live) < self._want_live
                if now >= next_leases and syncer is not None:
                    # Once a lease period, like the learners' leases: a standalone closer
                    # that runs takes the rounds over from the embedded ones.
                    await ex.observe_leases(self._closers, CLOSERS)
                if now >= next_leases or (short and now >= next_wanted):
                    self._see(live=await ex.observe_leases(tracker))
                    # Leases change once per lease period; listing them every poll would
                    # cost a LIST per poll per learner for nothing. While the training
                    # thread waits for learners, every look (on a billed store, at most
                    # every WANTED_LIST: a LIST costs 12.5 GETs on S3).
                    next_leases = now + self.lease_every
                    next_wanted = now + (WANTED_LIST if metered else 0.0)
                fresh = await self._catch_up()
                if fresh:
                    # Its look for the next record went out as this one's download began:
                    # a waiting learner looks again at once (a pipelined barrier's next
                    # commit may have landed meanwhile), then at the first wait's pace.
                    blocked, again = 0, True
                # The embedded closer keeps a cursor of its own (the rounds it has
                # accepted: it is the class a standalone `gradientmail sync` runs, and it
                # leads this one when it commits a round); it is fed the records read
                # here rather than reading them again.
                if syncer is not None and await syncer.poll(
                    live=self.observed.live, refresh_live=refresh, records=fresh,
                    waiting=self._blocked, standalone=self._closers.live(self.clock.now()),
                ):
                    # It committed a round: its own learner takes the commit now, not a
                    # poll later; the sweep after it, while training goes on.
                    await self._catch_up()
                    await syncer.sweep_due()
                # A roll call's verdict may have dropped learners from the tracker.
                self._see(live=tracker.live(self.clock.now()))
                await self._watch_next_round(now)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.on_event(PollFailed(self.learner_id, repr(exc)))
            # Waiting for a commit, or for learners to join (not a wait the closer sees).
            short = len(self.observed.live) < self._want_live
            blocked = blocked + 1 if self._blocked or short else 0
            if again and self._blocked:
                continue
            # Woken early when the training thread starts waiting for a commit, or this
            # learner's contribution is in (its closer looks whether it completed the
            # set): neither waits out a poll interval begun before.
            await sleep_unless(self.clock, poll_delay(self.poll_interval, blocked, metered),
                               self._wake)

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
        """Queue the commits recorded after the cursor; the records read. Runs on the loop
        only; the final catch-up of close() may interleave with the receive loop's, and
        the training thread ignores a commit it applied already."""
        ex = self._exchange
        assert ex is not None
        cursor = self._cursor
        assert self._fetcher is not None
        records: list[RoundRecord] = []
        batch = []
        rec = await ex.read_round(cursor + 1)
        while rec is not None:
            records.append(rec)
            # The look for the next record goes out with this one's download, not before
            # it: a barrier's learners wait for the download, and a GET more in front of
            # it cost each of them a round trip a round.
            following = asyncio.create_task(ex.read_round(rec.round + 1))
            try:
                commit = await self._take(rec)
            except asyncio.CancelledError:
                following.cancel()
                raise
            except Exception:
                await self._give_up(following)
                raise
            if commit is None:
                await self._give_up(following)
                # Swept under us: a newer commit of this fragment exists; start over from
                # the newest record.
                await self._skip_to(await ex.newest_round(cursor), cursor)
                return records
            batch.append(commit)
            try:
                rec = await following
            except Exception:
                self._queue(batch, records[-1].round)  # what is in hand, then the failed poll
                raise
        if records:
            self._queue(batch, records[-1].round)
        return records

    async def _give_up(self, look: asyncio.Task[RoundRecord | None]) -> None:
        """Let a look ahead whose record is no longer wanted end; a failure of it is
        reported like any failed poll (a record that did not read is reported once)."""
        try:
            await look
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.on_event(PollFailed(self.learner_id, repr(exc)))

    async def _take(self, rec: RoundRecord) -> Commit | None:
        """Report `rec` (to the poster, and as `RoundRecorded`) and fetch its commit."""
        if self._poster is not None:
            self._poster.recorded(rec)
        self.on_event(RoundRecorded(rec.round, rec.fragment, rec.version,
                                    tuple(p.learner for p in rec.participants),
                                    rec.mean_cosine, rec.closer))
        return await self._fetch(rec)

    async def _skip_to(self, newest: int, cursor: int) -> None:
        ex = self._exchange
        assert ex is not None
        assert self._fetcher is not None
        latest = await ex.latest_commit_per_fragment(len(self._plan), newest)
        batch = []
        for rec in sorted(latest.values(), key=lambda r: r.round):
            if rec.round <= cursor:
                continue
            if self._poster is not None:
                self._poster.swept(rec)
            commit = await self._fetch(rec)
            if commit is None:
                return
            batch.append(commit)
        self._queue(batch, newest)

    async def _fetch(self, rec: RoundRecord) -> Commit | None:
        """`CommitFetcher.fetch`, reporting a commit that does not fit the model."""
        assert self._fetcher is not None
        commit = await self._fetcher.fetch(rec)
        if commit is not None and commit.rejected is not None:
            self.on_event(CommitRejected(self.learner_id, rec.round, rec.fragment,
                                         commit.rejected))
        return commit

    def _queue(self, batch: list[Commit], newest: int) -> None:
        """Hand a batch of commits to the training thread, and move the cursor to
        `newest`. A batch is queued only once every payload in it is in hand."""
        for commit in batch:
            self.commits.put(commit)
        self._cursor = max(self._cursor, newest)
        self._see(received=self._cursor)

    async def _watch_next_round(self, now: float) -> None:
        """Count the others who published the round the training thread watches (the one
        it may publish next, for "due by opportunity"). The embedded syncer's listing is
        reused when it watches that round; otherwise one LIST every `BACKUP_EVERY` polls:
        a LIST per poll per learner would be the dearest request of the run."""
        ex, candidate = self._exchange, self._watch
        if ex is None or candidate is None:
            return
        who = self._host.publishers_seen(candidate) if self._host is not None else None
        if who is None:
            if now < self._next_watch and self.observed.watched == candidate:
                return
            who = await ex.publishers(candidate)
            self._next_watch = now + (BACKUP_EVERY - 1) * self.poll_interval * 0.999
        self._see(watched=candidate, others=len(who - {self.learner_id}))

    async def _publish_loop(self) -> None:
        assert self._jobs is not None
        while True:
            job = await self.clock.idle(self._jobs.get())
            if job is None:
                return
            assert self._poster is not None
            try:
                await self._poster.post(job)
            finally:
                # Not held while waiting for the next job: its snapshot (a fragment's
                # worth, per rank of a sharded learner) is freed before the next is taken.
                del job
                self._see(finished=self.observed.finished + 1)

