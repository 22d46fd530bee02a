"""The syncer: closes rounds, strictly in order, by whoever wins the claim.

Closing a round is a role, not a server. Every learner runs one on its communication
thread by default, and `gradientmail sync URL` runs one alone on any CPU machine; several
at once are safe because a round's closer is elected with create-if-absent claims and its
record is itself created only if absent. The decisions (when to look, quorum, grace
window, head starts, takeover: `gradientmail.syncer.state.decide_poll` and its parts) and
the screening of contributions (`keyspace.screen_snapshot`, `screening.screen_delta`)
are pure functions; this module carries them out. A syncer that
lists the leases also calls the roll when its open round waits short of its quorum, and
judges who answered (the decisions in `gradientmail.run.rollcall`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from gradientmail.algorithms.base import Algorithm, Contribution, FragmentState, RoundResult
from gradientmail.algorithms.registry import algorithm_from_json
from gradientmail.algorithms.schedule import RoundSchedule
from gradientmail.backends.base import Backend
from gradientmail.clock import Clock, MonotonicClock, sleep_unless, wall_time
from gradientmail.errors import ConfigError, GradientmailError
from gradientmail.events import (
    ClaimSuperseded,
    CommitLost,
    ContributionDropped,
    EventSink,
    PollFailed,
    RoundClaimed,
    RoundClosed,
    Swept,
    log_events,
)
from gradientmail.mailbox.base import Mailbox
from gradientmail.mailbox.url import open_mailbox
from gradientmail.run.bounds import check_delta
from gradientmail.run.cadence import probe_delay
from gradientmail.run.keyspace import Contributions
from gradientmail.run.lease import LeaseTracker
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import Replica, theta_digest
from gradientmail.syncer.caller import RollCaller
from gradientmail.syncer.hosted import Host, Offer
from gradientmail.syncer.merging import CommitRefs, merge_round, round_record, screen_round
from gradientmail.syncer.standalone import Awaiting, CloserLease, Prefetcher, Sighting, arrived
from gradientmail.syncer.state import (
    PollDecision,
    PollView,
    RoundWatch,
    decide_poll,
    listed,
    lists_claims,
    lists_contributions,
    next_claim_attempt,
    preferred_closer,
    probe_from,
    updated_estimates,
)
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.records import Dropped, Manifest, RoundRecord, SnapshotRecord
from gradientmail.wire.refs import Arrival, StepRef, UpdateRef
from gradientmail.wire.serialization import Schema
from gradientmail.wire.sharded_pieces import DeltaTensor

__all__ = ["CloserSettings", "Syncer"]


@dataclasses.dataclass
class _Open:
    """What this syncer has seen of the open round (observer-clock times)."""

    round: int
    opened: float  # when the record before it was accepted
    first_seen: dict[str, float] = dataclasses.field(default_factory=dict)
    claims: dict[int, float] = dataclasses.field(default_factory=dict)
    refreshed: bool = False  # the leases were listed again before an early close
    idle: int = 0  # listings in a row that found no new contribution
    preferred: bool = False  # this closer was the round's preferred one at the last poll
    # Its own contribution is seen only as an offer (in memory, not uploaded): a sighting
    # forgotten when the offer is declined (`Syncer.poll`).
    offered: bool = False


@dataclasses.dataclass(frozen=True)
class CloserSettings:
    """How a closer looks at the store and what it keeps.

    `poll_interval`: seconds between polls. `lease_timeout`: after how long without a
    beat a learner counts as gone (a standalone closer's own lease beats at least twice
    in it). `keep_versions`: theta versions of each fragment kept by the sweep, which
    runs after each commit when `sweep`. Listing a round's contributions is a LIST, the
    dearest request on S3: a closer lists every `watch_every` polls (None: every poll
    standalone; every 5 polls embedded, for the rounds whose preferred closer it is) and,
    embedded, every `backup_every` polls for the rest, so that a learner's requests do not
    grow with the number of learners.
    """

    poll_interval: float = 1.0
    lease_timeout: float = 120.0
    keep_versions: int = 2
    sweep: bool = True
    watch_every: int | None = None
    backup_every: int = 30


class Syncer:
    """Closes the rounds of the run in `exchange`. `poll()` does one pass; `run()` loops.

    Standalone (`gradientmail sync`, `Syncer.open`) or embedded in a learner, it is this
    one class: an embedded closer is given its learner as `host`
    (`gradientmail.syncer.hosted.Host`: the learner's own contributions, lease tracker and
    replica); a standalone one keeps its own tracker and replica, holds a closer lease in
    `run()`, and downloads deltas as they arrive. Construction does no I/O; the manifest
    is read on the first poll; the clock is the exchange's. `wall_clock` stamps each
    commit's `committed_at` (Unix seconds), read by people only.
    """

    def __init__(
        self,
        exchange: Exchange,
        *,
        closer_id: str = "syncer",
        backend: Backend | None = None,
        settings: CloserSettings = CloserSettings(),
        on_event: EventSink = log_events,
        host: Host | None = None,
        wall_clock: Callable[[], float] = wall_time,
    ) -> None:
        from gradientmail.wire.record_json import check_learner_id

        self.closer_id = check_learner_id(closer_id)
        if host is not None and host.learner != self.closer_id:
            raise ConfigError(f"closer_id={closer_id!r} must be its host learner's id "
                              f"{host.learner!r}")
        self.exchange = exchange
        self.clock: Clock = exchange.clock
        self.wall_clock = wall_clock
        self.backend = backend
        self.on_event = on_event
        self.host = host
        self.poll_interval = float(settings.poll_interval)
        self.lease_timeout = float(settings.lease_timeout)
        self.keep_versions = settings.keep_versions
        self.sweep_after_commit = settings.sweep
        watch = settings.watch_every
        self.watch_every = max(1, int((1 if host is None else 5) if watch is None else watch))
        self.backup_every = max(1, int(settings.backup_every))
        self._sweep_due = False  # a commit of this syncer's awaits its sweep
        self._next_watch = -math.inf
        # The tracker `refresh_live` feeds: an embedded syncer shares its learner's.
        self._tracker = host.leases if host is not None else LeaseTracker(self.lease_timeout)
        self._caller = RollCaller(exchange, self._tracker, self.closer_id, self.poll_interval,
                                  on_event)
        self._manifest: Manifest | None = None
        self._algorithm: Algorithm | None = None
        self._schedule: RoundSchedule | None = None
        self._cursor = -1
        self._last: RoundRecord | None = None
        self._latest: dict[int, RoundRecord] = {}
        # The fragments' states: an embedded syncer shares its learner's replica.
        self._replica = host.replica if host is not None else None
        # Each learner's step seconds as the newest record it took part in reported them.
        self._paces: dict[str, float] = {}
        self._open = _Open(0, self.clock.now())
        self._awaiting: Awaiting | None = None
        self._sighting: Sighting | None = None  # the awaited set completed between polls
        # A standalone closer downloads each delta of its open round as it arrives.
        self._prefetch = Prefetcher(exchange) if host is None else None
        self._codec_from_run = False  # `open`: write in the manifest's codec
        self.rounds_closed = 0

    @classmethod
    def open(cls, mailbox: Mailbox | str, *, prefix: str = "",
             run_key: str | bytes | None = None, clock: Clock | None = None,
             **kwargs: Any) -> Syncer:
        """A standalone closer of the run at `mailbox` (a URL or a `Mailbox`) under
        `prefix`; `run_key` makes it read and write the sealed records of an
        authenticated run (`gradientmail.wire.auth`); `kwargs` are the constructor's. It
        writes its commits in the codec of the run's manifest."""
        exchange = Exchange(open_mailbox(mailbox), clock=clock or MonotonicClock(),
                            prefix=prefix, run_key=run_key)
        syncer = cls(exchange, **kwargs)
        syncer._codec_from_run = True
        return syncer

    # -- loop ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Poll until `stop` is set (or forever); a failed poll is logged and retried. After
        a commit it polls at once: a pipelined barrier's next round may be in already.

        A standalone syncer also holds a lease under `closers/` (`CloserLease`: beaten
        from the start, released when `stop` ends the loop): the
        learners' embedded closers see it and leave the rounds to it, so that no round
        is funnelled through one learner's link while a closer next to the bucket runs.
        """
        beats = None if self.host is not None else CloserLease(
            self.exchange, self.closer_id, self.clock, self.lease_timeout, self.on_event)
        try:
            while stop is None or not stop.is_set():
                committed = False
                try:
                    if beats is not None:
                        # From the start, before any run exists: learners list the
                        # closers once a lease period, the first time when they join.
                        await beats.beat()
                    committed = await self.poll()
                except asyncio.CancelledError:
                    raise
                except (GradientmailError, OSError) as exc:
                    self.on_event(PollFailed(self.closer_id, repr(exc)))
                if not committed:
                    await self._between_polls(stop)
        finally:
            if self._prefetch is not None:
                self._prefetch.close()
            if beats is not None:
                await beats.release()

    async def poll(
        self,
        live: frozenset[str] | None = None,
        refresh_live: Callable[[], Awaitable[frozenset[str]]] | None = None,
        records: Sequence[RoundRecord] | None = None,
        waiting: bool = False,
        standalone: frozenset[str] = frozenset(),
    ) -> bool:
        """One pass: catch up with the records, watch the open round, close it if due.

        `live` is the set of live learners when the caller tracks leases itself, and
        `refresh_live` lists them anew into the tracker given as `leases` (without it, a
        given `live` is final, and the syncer never calls the roll); with neither, the
        syncer lists the leases itself. `waiting`: the embedding learner's training waits
        for a commit (a barrier), so a backup closer calls the roll when the round it could
        close is left unclaimed. `standalone`: the standalone closers the embedding learner
        saw holding a lease; while there is one, an embedded syncer is only a backup (it
        takes no offer, prefers no round, and closes none on completing its set).
        Returns True when this call committed a round.
        """
        host = self.host
        if host is None:
            return await self._poll(live, refresh_live, records, waiting, {})
        host.standalone = bool(standalone)
        # The offers made before this pass: it merges the open round's if it closes that
        # round now; every other is declined when it ends (the learner uploads them).
        offers = host.take_offers()
        try:
            return await self._poll(live, refresh_live, records, waiting, offers)
        finally:
            for o in offers.values():
                o.decline()
                if o.taken.result() is False:
                    self._forget_offer(o.draft.round)
            if self._manifest is not None:
                host.saw(self._open.round, frozenset(self._open.first_seen))

    def _forget_offer(self, round_: int) -> None:
        """A declined offer is no contribution: its learner uploads it now, and until that
        upload is in (`Host.note`, a listing) the round must not count it. Kept,
        the sighting let this closer claim the round at a later poll (its window over)
        and commit it without its own delta, still on its way up: 5 of 20 standard
        rounds at 20 Mbit/s went out with one learner of two."""
        o = self._open
        if o.round == round_ and o.offered:
            o.first_seen.pop(self.closer_id, None)
            o.offered = False

    async def _poll(
        self,
        live: frozenset[str] | None,
        refresh_live: Callable[[], Awaitable[frozenset[str]]] | None,
        records: Sequence[RoundRecord] | None,
        waiting: bool,
        offers: Mapping[int, Offer],
    ) -> bool:
        if self._manifest is None and not await self._load_manifest():
            return False
        await self.sweep_due()
        sight, self._sighting = self._sighting, None
        if sight is not None and (sight.round != self._cursor + 1 or live is not None
                                  or self._caller.judging):
            sight = None
        if sight is None:
            await self._take_records(records)
        calling = live is None or refresh_live is not None
        if refresh_live is None:
            refresh_live = self._observe_leases if live is None else _constant(live)
        listed_now = live is None and sight is None
        if live is None:
            live = sight.live if sight is not None else await refresh_live()
        r = self._cursor + 1
        now = self.clock.now()
        if calling and self._caller.judging:
            # A call of ours is open: the leases every poll, until the verdict.
            live = await self._caller.judge(now, live if listed_now else await refresh_live())
        standalone = self.host is not None and self.host.standalone
        preferred = self.host is None or (
            not standalone and preferred_closer(r, live) == self.closer_id)
        offer = await self._watch(r, now, preferred, None if standalone else offers.get(r),
                                  sight)
        alg = self._alg()
        grace = alg.grace_window(self._estimates(), self._sch(), r, self.poll_interval)
        view = PollView(r, now, self.closer_id, dict(self._open.first_seen), live,
                        dict(self._paces), alg.quorum_size, grace, preferred,
                        self.backup_every, self.poll_interval, calling, waiting,
                        self._open.refreshed, standalone=standalone)
        decision = decide_poll(view)
        while decision.relist is not None:
            self._open.refreshed = self._open.refreshed or decision.relist == "early"
            live = await refresh_live()
            view = dataclasses.replace(view, live=live, refreshed=self._open.refreshed,
                                       relisted=True)
            decision = decide_poll(view)
        if decision.watch_next_poll:
            # The window is open: look every poll, so the round closes as soon as the
            # last learner it waits for is in (one LIST a poll, for one closer a round).
            self._next_watch = -math.inf
        self._awaiting = self._awaited(r, self._open, decision, live)
        if decision.call_roll:
            await self._caller.maybe_call(r, self._open.first_seen, alg.quorum_size, live,
                                          refresh_live, now, decision.held,
                                          waiting and not decision.closes)
        if not decision.claim:
            return False
        return await self._claim(r, now, RoundWatch(r, view.first_seen), decision, grace,
                                 offer, sight is not None)

    async def _take_records(self, records: Sequence[RoundRecord] | None) -> None:
        """Accept the rounds committed since the cursor: those the embedding learner read
        (`records`: no second GET per poll), or as read now."""
        if records is None or (records and records[0].round > self._cursor + 1):
            await self._catch_up()
            return
        for rec in records:
            if rec.round == self._cursor + 1:
                self._accept(rec)

    async def _watch(self, r: int, now: float, preferred: bool, offer: Offer | None,
                     sight: Sighting | None = None) -> Offer | None:
        """Update what this closer has seen of the open round `r`: a listing when one is
        due (not after a `sight`ing, which completed what the last one saw), its host's
        contributions, and (standalone) the downloads of what arrived. Returns `offer` if
        it still counts."""
        o = self._open
        if sight is not None:
            o.first_seen.setdefault(sight.learner, sight.at)
            # Its live set is the one it listed at the poll before, at most a poll
            # interval old: no joiner to look for before an early close (`decide_poll`'s
            # "early" relist is for a live set up to a lease period old).
            o.refreshed = True
        noted = self.host.take_noted(r) if self.host is not None else {}
        if noted:
            # Its own contribution is in: look at the round now (one LIST a round),
            # preferred closer or not: if it completed the set, it closes at once.
            self._next_watch = -math.inf
        if sight is None and lists_contributions(now, self._next_watch, preferred,
                                                 o.preferred, offer is not None):
            self._next_watch = -math.inf  # should the LIST fail, the next poll tries again
            seen = listed(o.first_seen, o.idle, await self.exchange.publishers(r), now,
                          me=self.closer_id, offered=offer is not None, preferred=preferred,
                          watch_every=self.watch_every, backup_every=self.backup_every,
                          poll_interval=self.poll_interval)
            o.first_seen, o.idle, self._next_watch = (dict(seen.first_seen), seen.idle,
                                                      seen.next_listing)
            offer = offer if seen.keeps_offer else None
            o.offered = seen.keeps_offer
        o.preferred = preferred
        for learner, t in noted.items():
            o.first_seen[learner] = min(o.first_seen.get(learner, t), t)
        if self._prefetch is not None:
            assert self._manifest is not None
            self._prefetch.open(r, self._manifest.schema,
                                self._manifest.plan[self._sch().fragment_of(r)])
            for learner in sorted(o.first_seen.keys() - {self.closer_id}):  # its own: in memory
                self._prefetch.start(learner)
        return offer

    def _awaited(self, r: int, o: _Open, decision: PollDecision,
                 live: frozenset[str]) -> Awaiting | None:
        """What a standalone syncer looks for between polls (`probe_from`): the awaited
        learners not in yet, while the round is not due."""
        if self.host is not None or decision.claim:
            return None
        missing = tuple(sorted(decision.awaited - set(o.first_seen)))
        first = min(o.first_seen.values(), default=None)
        since = probe_from(o.opened, self._sch().gap(r), self._estimates().step, first)
        return None if not missing or since is None else Awaiting(r, missing, since, live)

    async def _between_polls(self, stop: asyncio.Event | None) -> None:
        """Sleep out the poll interval; while the open round awaits contributions that are
        due by now (`_awaiting`), GET one missing learner's record every `probe_delay`, in
        turn (a tenth of a LIST's price; the round waits for all of them, so only the last
        one's arrival must be seen at once, and one look at a time keeps the requests per
        second the same at any M), and return as soon as one is there: the round closes
        within ~20 ms of its last arrival, not up to a poll later."""
        end = self.clock.now() + self.poll_interval
        looks = 0
        while stop is None or not stop.is_set():
            now = self.clock.now()
            aw = self._awaiting
            if now >= end:
                return
            if aw is None or now < aw.since:
                wake = end if aw is None else min(end, aw.since)
                await sleep_unless(self.clock, wake - now, stop)
                continue
            looks += 1
            delay = probe_delay(self.poll_interval, self.exchange.mailbox.metered)
            await sleep_unless(self.clock, min(delay, end - now), stop)
            learner = aw.missing[(looks - 1) % len(aw.missing)]
            if await arrived(self.exchange, aw.round, learner, self._prefetch):
                if len(aw.missing) == 1:
                    self._sighting = Sighting(aw.round, learner, self.clock.now(), aw.live)
                return

    async def _claim(self, r: int, now: float, watch: RoundWatch, decision: PollDecision,
                     grace: float, offer: Offer | None, sighted: bool = False) -> bool:
        """Claim the due round `r` if no current claim is another closer's, and close it.
        `sighted`: the round was completed between polls; with no claim seen yet, claim
        the first attempt without listing them (a lost claim is seen as of now, as a
        listed one would be)."""
        ex = self.exchange
        timeout = self._estimates().takeover_timeout(self.poll_interval)
        claims = self._open.claims
        if not (sighted and not claims) and lists_claims(claims, now, timeout):
            for claim in await ex.round_claims(r):
                claims.setdefault(claim, now)
        attempt = next_claim_attempt(claims, now, timeout)
        if attempt is None:
            return False
        if attempt > 0:
            waited = now - claims[attempt - 1]
            self.on_event(ClaimSuperseded(self.closer_id, r, attempt, waited))
        won = await ex.claim_round(r, attempt, self.closer_id)
        claims.setdefault(attempt, now)
        if not won:
            return False
        if await ex.read_round(r) is not None:
            # The sweep deletes the claims of closed rounds, so a syncer that listed them
            # just after another committed and swept the round wins a freed slot. Closing
            # under that attempt would overwrite the payloads the record references.
            await self._catch_up()
            return False
        return await self._close(r, attempt, watch, decision.quorum_time, grace,
                                 decision.awaited, offer, sighted)

    async def _observe_leases(self) -> frozenset[str]:
        return await self.exchange.observe_leases(self._tracker)

    # -- state --------------------------------------------------------------------------

    def _alg(self) -> Algorithm:
        assert self._algorithm is not None
        return self._algorithm

    def _sch(self) -> RoundSchedule:
        assert self._schedule is not None
        return self._schedule

    def _estimates(self) -> Estimates:
        return self._last.estimates if self._last is not None else Estimates()

    async def _load_manifest(self) -> bool:
        manifest = await self.exchange.read_manifest()
        if manifest is None:
            return False
        self._manifest = manifest
        self._algorithm = algorithm_from_json(dict(manifest.algorithm))
        if self._codec_from_run:
            # A standalone closer writes the commits in the codec the run's creator chose
            # (`LearnerOptions.compression`): with zstd, the step every learner downloads
            # is 1.2x smaller (an embedded closer writes in its learner's codec).
            self.exchange.store.compression = manifest.codec
        if self._replica is None:
            self._replica = Replica(self.exchange, manifest, self._algorithm)
        self._schedule = self._algorithm.schedule_for(len(manifest.plan))
        newest = await self.exchange.newest_round()
        self._latest = await self.exchange.latest_commit_per_fragment(len(manifest.plan), newest)
        self._cursor = newest
        self._last = max(self._latest.values(), key=lambda rec: rec.round, default=None)
        self._open = _Open(newest + 1, self.clock.now())
        if self.host is not None:
            self.host.advance(newest)
        return True

    async def _catch_up(self) -> None:
        for rec in await self.exchange.rounds_after(self._cursor):
            self._accept(rec)

    def _accept(self, rec: RoundRecord) -> None:
        self._next_watch = -math.inf  # a new round is open: look at it at once
        self._cursor = rec.round
        self._last = rec
        self._latest[rec.fragment] = rec
        for p in rec.participants:
            if p.step_seconds is not None:
                self._paces[p.learner] = p.step_seconds
        self._open = _Open(rec.round + 1, self.clock.now())
        self._awaiting = None
        if self._prefetch is not None:
            self._prefetch.close()
        if self.host is not None:
            self.host.advance(rec.round)

    async def _fragment_state(self, fragment: int) -> FragmentState:
        assert self._replica is not None
        rec = self._latest.get(fragment)
        state = await self._replica.at(fragment, rec)
        if state is None:
            raise GradientmailError(
                f"the payloads of round {rec.round if rec else 0}'s commit were swept; a "
                "newer commit of the fragment exists and the next poll starts from it"
            )
        return state

    # -- closing ------------------------------------------------------------------------

    async def _close(
        self, r: int, attempt: int, watch: RoundWatch, t_quorum: float | None,
        window: float, expected: frozenset[str], offer: Offer | None = None,
        sighted: bool = False,
    ) -> bool:
        """Close round `r` under claim `attempt`: screen and merge its contributions,
        write the payloads, build the record (`merging.round_record`) and commit it.
        `sighted`: the round was completed between polls (`_claim`)."""
        ex, manifest, alg = self.exchange, self._manifest, self._alg()
        assert manifest is not None
        t_claim = self.clock.now()
        fragment = self._sch().fragment_of(r)
        state = await self._fragment_state(fragment)
        dropped: list[Dropped] = []
        snaps, contributions = await self._gather(r, attempt, fragment, state, offer, dropped,
                                                  sighted)
        missed = tuple(sorted(expected - {s.learner for s in snaps}))
        merge = await asyncio.to_thread(merge_round, alg, state, contributions, manifest.schema,
                                        self.backend, self._latest.get(fragment), missed,
                                        [d.learner for d in dropped])
        keys = {s.learner: s.payload_key for s in snaps}
        for learner, reason in merge.outliers.items():
            self._drop(r, learner, keys.get(learner, f"round {r}"), reason, dropped)
        for learner, reason in merge.overflowed.items():
            self._drop(r, learner, f"round {r}", reason, dropped)
        refs = await self._write(fragment, attempt, merge.result)
        now = self.clock.now()
        t_first = watch.first_time()
        merged = {c.learner for c in contributions} - set(merge.outliers)
        paces = [s.step_seconds for s in snaps
                 if s.learner in merged and s.step_seconds is not None]
        record = round_record(
            r, fragment, merge.result, snaps, merged, refs, self.closer_id,
            held=None if offer is None else offer.draft,
            estimates=updated_estimates(
                self._estimates(), paces,
                None if t_first is None or t_quorum is None else t_quorum - t_first,
                now - (t_claim if t_quorum is None else t_quorum)),
            arrival=Arrival(window, max(now - (t_claim if t_first is None else t_first), 0.0),
                            watch.first_learner(),
                            missed),
            dropped=dropped, committed_at=round(self.wall_clock(), 3))
        if not await ex.commit(record):
            self.on_event(CommitLost(self.closer_id, r))
            return False
        await self._committed(record, merge.result.state, offer, now - t_claim)
        return True

    async def _gather(self, r: int, attempt: int, fragment: int, state: FragmentState,
                      offer: Offer | None, dropped: list[Dropped],
                      sighted: bool = False) -> tuple[list[SnapshotRecord], list[Contribution]]:
        """Round `r`'s contribution records (the offered one in place of any listed for
        this closer) and the contributions among them that screening keeps; each other
        one is dropped into `dropped` with its reason. A `sighted` round of a standalone
        closer takes the records its downloads read (every one it saw), not a listing."""
        manifest = self._manifest
        assert manifest is not None
        schema, names = manifest.schema, manifest.plan[fragment]
        # Sighted, every awaited record was read as it arrived: listing again would cost
        # ~25 ms (100 Mbit/s, M = 4) with the barrier's learners waiting. One that comes
        # after the look is left to a later round, as one after a listing is.
        prefetched = await self._prefetch.records(sorted(self._open.first_seen)) \
            if sighted and self._prefetch is not None else None
        found = await self.exchange.contributions(r) if prefetched is None else \
            Contributions(tuple(prefetched), ())
        snaps = [s for s in found.records if offer is None or s.learner != self.closer_id]
        if offer is not None:
            snaps.append(offer.draft)
        self.on_event(RoundClaimed(self.closer_id, r, attempt, len(snaps)))
        for bad in found.rejected:
            self._drop(r, bad.learner or "?", bad.key, bad.reason, dropped)
        contributions = await screen_round(
            snaps, fragment=fragment, state=state, schema=schema, names=names,
            fetch=lambda snap: self._delta(snap, offer, schema, names),
            drop=lambda learner, key, reason: self._drop(r, learner, key, reason, dropped),
        )
        return snaps, contributions

    async def _write(self, fragment: int, attempt: int, result: RoundResult) -> CommitRefs:
        """Upload what a commit of `result` references: the step, and the new theta and
        outer state when the algorithm publishes or checkpoints them, and the update."""
        ex, alg, state = self.exchange, self._alg(), result.state
        names = self._manifest.plan[fragment] if self._manifest is not None else ()
        fmt = alg.commit_dtype
        # The new theta's digest, which a step and an update carry: hashed once, off the
        # loop, while the step is encoded and uploaded (every learner waits for it).
        hashing = None if result.step is None and (result.update is None or fmt is None) \
            else asyncio.ensure_future(asyncio.to_thread(theta_digest, state.theta, names))
        refs = CommitRefs()
        step = None if result.step is None or result.step_format is None else \
            await ex.put_step(fragment, state.version, result.step, attempt=attempt)
        digest = "" if hashing is None else await hashing
        if step is not None and result.step_format is not None:
            refs = dataclasses.replace(
                refs, step=StepRef(step, result.step_format, result.rule, digest))
        if refs.step is None or alg.checkpoint_at(state.version):
            refs = dataclasses.replace(
                refs,
                theta=await ex.put_theta(fragment, state.version, state.theta,
                                         attempt=attempt),
                outer=await ex.put_outer(fragment, state.version, state.outer(),
                                         attempt=attempt))
        if result.update is not None and fmt is not None:
            ref = await ex.put_update(fragment, state.version, result.update, attempt=attempt)
            refs = dataclasses.replace(refs, update=UpdateRef(ref, fmt, digest))
        return refs

    async def _committed(self, record: RoundRecord, state: FragmentState, offer: Offer | None,
                         took: float) -> None:
        """`record` is committed: hold its state, settle the offer, move on, report, and
        sweep (a standalone closer at once; an embedded one once its learner took it)."""
        assert self._replica is not None
        self._replica.hold(state)
        if offer is not None:
            offer.taken.set_result(True)
        self._accept(record)
        self.rounds_closed += 1
        self.on_event(
            RoundClosed(
                self.closer_id,
                record.round,
                record.fragment,
                record.version,
                tuple(p.learner for p in record.participants),
                sum(p.tokens for p in record.participants),
                record.mean_cosine,
                took,
                sum(ref.size for ref in record.payload_refs()),
            )
        )
        if self.sweep_after_commit:
            self._sweep_due = True
            if self.host is None:
                await self.sweep_due()

    async def sweep_due(self) -> None:
        """Delete what the newest commit made obsolete, if a commit since the last sweep
        asks for it. A sweep is a LIST and a DELETE per key, and learners waiting at a
        barrier must not wait for it: an embedded closer sweeps after its learner took the
        commit (the learner calls this; else the next poll does), and within a pipelined
        barrier's sync (the open round has gap 0) any closer waits for its last round."""
        if not self._sweep_due or self._sch().gap(self._cursor + 1) == 0:
            return
        assert self._manifest is not None
        doomed = await self.exchange.sweep(self.keep_versions, latest=self._latest,
                                           checkpoint_every=self._alg().checkpoint_every,
                                           keep_rounds=self._alg().keep_rounds,
                                           fragments=len(self._manifest.plan))
        self._sweep_due = False  # only now: a sweep cancelled midway is done again
        if doomed:
            self.on_event(Swept(len(doomed), 0))

    def _drop(self, r: int, learner: str, key: str, reason: str, out: list[Dropped]) -> None:
        self.on_event(ContributionDropped(r, learner, key, reason))
        if learner != "?" and all(d.learner != learner for d in out):
            out.append(Dropped(learner, reason[:500]))

    async def _delta(self, snap: SnapshotRecord, offer: Offer | None, schema: Schema,
                     names: Sequence[str]) -> dict[str, DeltaTensor] | None:
        """The delta of `snap`: an offered one (never uploaded), its host's own from
        memory, or one downloaded as it arrived, else the stored payload (None if swept)."""
        if offer is not None and snap is offer.draft:
            return dict(check_delta(offer.tensors, snap, schema, names))
        own = self.host.own_delta(snap) if self.host is not None else None
        if own is not None:
            return dict(check_delta(own, snap, schema, names))
        if self._prefetch is not None:
            fetched, delta = await self._prefetch.take(snap)
            if fetched:
                return delta
        return await self.exchange.fetch_delta(snap, schema, names)


def _constant(live: frozenset[str]) -> Callable[[], Awaitable[frozenset[str]]]:
    async def refresh() -> frozenset[str]:
        return live

    return refresh
