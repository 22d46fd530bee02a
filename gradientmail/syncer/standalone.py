"""What a standalone closer (`gradientmail sync`) does that an embedded one does not: it
holds a lease under `closers/`, which tells the learners to leave it the rounds, and it
looks for its open round's missing contributions between polls (and claims the round as
soon as a look finds the last one: `Sighting`).

Why both: between sites, a learner's link is the slowest hop a round crosses, and the
learner that closes a round pulls every other contribution down through it (20 Mbit/s, two
learners: a standard round's barrier 5.4 s against 2.0 s for torchft's allreduce on the
same links). A closer next to the bucket takes that off every learner's link; looking
for the last arrivals every 20 ms (a GET each) closes a round within moments of them,
not a poll interval later; and it downloads each contribution's delta as soon as it sees
the record (`Prefetcher`), so closing waits for the last one only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Iterable, Sequence

from gradientmail.clock import Clock
from gradientmail.errors import GradientmailError, RemoteProtocolError
from gradientmail.events import EventSink, PollFailed
from gradientmail.run.lease import CLOSERS
from gradientmail.run.protocol import Exchange, contribution_key, misfiled
from gradientmail.wire.records import SnapshotRecord
from gradientmail.wire.serialization import Schema
from gradientmail.wire.sharded_pieces import DeltaTensor

__all__ = ["BEAT_EVERY", "JUDGED_AFTER", "Awaiting", "CloserLease", "Prefetcher", "Sighting",
           "arrived", "closer_timeout"]

#: Seconds between a standalone closer's beats (at most: half its lease timeout when that
#: is shorter). Learners judge it by their own lease timeout, which it does not know: the
#: tiny recipe's learners (lease timeout 30 s) judged a closer beating every 60 s gone,
#: and took 4 of 10 rounds back. A beat is a PUT and a DELETE: 10 s of them cost $0.004
#: a day on S3.
BEAT_EVERY = 10.0
#: Beats a learner waits through, at the least, before it judges a standalone closer gone.
JUDGED_AFTER = 3


def closer_timeout(lease_timeout: float) -> float:
    """The timeout a learner whose own is `lease_timeout` judges standalone closers by:
    never under `JUDGED_AFTER` beats."""
    return max(lease_timeout, JUDGED_AFTER * BEAT_EVERY)


class CloserLease:
    """A standalone closer's lease under `closers/<closer>/`: beaten every `BEAT_EVERY`
    seconds (or half `lease_timeout`, when shorter), so learners judging it by
    `closer_timeout` never see it lapse while it runs, and released when it stops
    (learners take the rounds back at their next listing)."""

    def __init__(self, exchange: Exchange, closer: str, clock: Clock, lease_timeout: float,
                 on_event: EventSink) -> None:
        self._ex = exchange
        self._closer = closer
        self._clock = clock
        self._every = min(BEAT_EVERY, lease_timeout / 2)
        self._on_event = on_event
        self._next = -math.inf
        self._held = False

    async def beat(self) -> None:
        """Beat if a beat period passed since the last beat."""
        now = self._clock.now()
        if now < self._next:
            return
        await self._ex.beat(self._closer, CLOSERS)
        self._held = True
        self._next = now + self._every

    async def release(self) -> None:
        """Delete the lease; a store that fails here only delays the learners' taking the
        rounds back until the lease times out."""
        if not self._held:
            return
        try:
            await self._ex.release(self._closer, CLOSERS)
        except (GradientmailError, OSError) as exc:
            self._on_event(PollFailed(self._closer, repr(exc)))


@dataclasses.dataclass(frozen=True)
class Awaiting:
    """The open round `round` awaits `missing`: from `since` (observer time) on, the
    closer looks for their records between polls (`syncer.state.probe_from`). `live`:
    the learners live at the poll that decided it."""

    round: int
    missing: tuple[str, ...]
    since: float
    live: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Sighting:
    """A look between polls found `learner`'s contribution to `round` at `at`, the last
    one the round awaited: the next poll closes it without looking at the store again
    for what the poll before it read (the records before it, the leases: `live`, the
    round's other contributions) — those requests cost ~40 ms after the last upload at
    100 Mbit/s, with every learner of the barrier waiting."""

    round: int
    learner: str
    at: float
    live: frozenset[str]


async def arrived(exchange: Exchange, round_: int, learner: str,
                  prefetch: Prefetcher | None = None) -> bool:
    """Whether `learner` has a contribution record in `round_` (one GET), or something the
    next poll must look at (a record that does not read); False while the store fails
    (the next poll reports it). A record found is handed to `prefetch`."""
    try:
        snap = await exchange.contribution(round_, learner)
    except RemoteProtocolError:
        return True
    except (GradientmailError, OSError):
        return False
    if snap is not None and prefetch is not None:
        prefetch.start(learner, snap)
    return snap is not None


_Fetched = tuple[SnapshotRecord, dict[str, DeltaTensor] | None] | None


class Prefetcher:
    """The open round's deltas, each downloaded as soon as its contribution is seen.

    A standalone closer's round waits for every learner it awaits; downloading the deltas
    only once the last one is in puts all of them and the merge between the last upload
    and the commit every learner waits for (100 Mbit/s, M = 4: closing added 0.17 s to a
    round's two transfers, half of it reading deltas back). Fetched as they arrive, closing
    reads only what came last.

    What `take` gives is what `Exchange.fetch_delta` gives at closing time for the same
    record (records are written once, payloads verified against them); a fetch that
    failed, found nothing, or read another record than the one closing is given is not
    used: the closer fetches that one itself. One round's deltas at most are held:
    `open` of another round, and `close`, drop the rest.
    """

    def __init__(self, exchange: Exchange) -> None:
        self._ex = exchange
        self._round = -1
        self._schema: Schema | None = None
        self._names: tuple[str, ...] = ()
        self._tasks: dict[str, asyncio.Task[_Fetched]] = {}

    def open(self, round_: int, schema: Schema, names: Sequence[str]) -> None:
        """Keep the deltas of `round_`, whose fragment holds `names`."""
        if round_ != self._round:
            self.close()
            self._round, self._schema, self._names = round_, schema, tuple(names)

    def close(self) -> None:
        """Cancel and drop every fetch."""
        for task in self._tasks.values():
            task.cancel()
        self._tasks = {}
        self._schema = None

    def start(self, learner: str, snap: SnapshotRecord | None = None) -> None:
        """Download `learner`'s delta for the open round in the background, reading its
        record first unless given; once per learner and round."""
        if self._schema is None or learner in self._tasks or (
                snap is not None and snap.round != self._round):
            return
        task = asyncio.get_running_loop().create_task(self._fetch(learner, snap))
        task.add_done_callback(_retrieved)
        self._tasks[learner] = task

    async def _fetch(self, learner: str, snap: SnapshotRecord | None) -> _Fetched:
        assert self._schema is not None
        schema, names = self._schema, self._names
        if snap is None:
            snap = await self._ex.contribution(self._round, learner)
            if snap is None:
                return None
        return snap, await self._ex.fetch_delta(snap, schema, names)

    async def records(self, learners: Iterable[str]) -> list[SnapshotRecord] | None:
        """The contribution records of `learners` to the open round, as their downloads
        read them (waiting for those in flight), in the order given; None unless every one
        was read here and is filed where it belongs (`misfiled`): then the closer lists the
        round, as it does when it was not sighted."""
        out = []
        for learner in learners:
            task = self._tasks.get(learner)
            if task is None:
                return None
            try:
                got = await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.cancelled():
                    return None
                raise
            except (GradientmailError, OSError):
                return None
            if got is None or misfiled(got[0], contribution_key(self._round, learner),
                                       self._round, learner) is not None:
                return None
            out.append(got[0])
        return out

    async def take(self, snap: SnapshotRecord) -> tuple[bool, dict[str, DeltaTensor] | None]:
        """(True, `snap`'s delta) when it was downloaded here (waiting for it while in
        flight); (False, None) when the caller must fetch it itself."""
        task = self._tasks.get(snap.learner)
        if task is None or snap.round != self._round:
            return False, None
        try:
            got = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                return False, None
            raise
        except (GradientmailError, OSError):
            return False, None
        if got is None or got[0] != snap or got[1] is None:
            return False, None
        return True, got[1]


def _retrieved(task: asyncio.Task[_Fetched]) -> None:
    """A failed fetch nobody takes is no error (closing fetches again): retrieve it so
    asyncio does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()
