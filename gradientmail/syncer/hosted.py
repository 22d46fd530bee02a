"""The seam between a learner and the closer it hosts.

A learner runs a closer on its communication thread (the *embedded* closer) so that a
run needs nothing but a bucket. The closer is the same `Syncer` a standalone
`gradientmail sync` runs; what makes it embedded is a `Host`, given at construction,
through which the two meet and nothing else:

- the learner's own contribution reaches the closer before its upload (`offer`: if it
  completes its round and this closer closes the round, it is merged from memory and
  never uploaded), or after it (`note`: seen at once, and merged from memory too);
- the closer shares the learner's lease tracker and replica (`leases`, `replica`);
- the closer says what it has seen of a round (`publishers_seen`), which rounds are
  closed, and whether a standalone closer holds the rounds (then offers are declined).

The learner's side is `offer`, `note`, `close` and `publishers_seen`; the closer's is
the rest. Both run on the communication thread's loop.
"""

from __future__ import annotations

import asyncio
import dataclasses

from gradientmail.clock import Clock
from gradientmail.run.lease import LeaseTracker
from gradientmail.run.replica import Replica
from gradientmail.wire.records import SnapshotRecord
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["Host", "Offer"]


@dataclasses.dataclass(frozen=True)
class Offer:
    """The learner's contribution `draft` (`Exchange.draft`) with its delta, before any
    upload; `taken` resolves True if the closer merged it, False if the learner must
    upload it."""

    draft: SnapshotRecord
    tensors: dict[str, TensorBytes]
    taken: asyncio.Future[bool]

    def decline(self) -> None:
        if not self.taken.done():
            self.taken.set_result(False)


class Host:
    """Learner `learner` hosting a closer: its contributions as the closer may use them,
    its lease tracker and its replica (None: the closer keeps its own; see the module's
    docstring)."""

    def __init__(self, learner: str, leases: LeaseTracker, replica: Replica | None,
                 clock: Clock) -> None:
        self.learner = learner
        self.clock = clock
        self.leases = leases
        self.replica = replica
        # Set by the closer: the newest round it has accepted, whether a standalone
        # closer holds the rounds, and the contributors it listed for its open round.
        self.cursor = -1
        self.standalone = False
        self._seen: tuple[int, frozenset[str]] | None = None
        self._offers: dict[int, Offer] = {}  # not uploaded yet, by round
        self._noted: dict[int, dict[str, float]] = {}  # seen at `note`, by round
        # Its uploaded deltas, by round: (payload SHA-256, the tensors).
        self._own: dict[int, tuple[str, dict[str, TensorBytes]]] = {}
        self._closed = False

    # -- the learner's side ---------------------------------------------------------------

    def offer(self, draft: SnapshotRecord, tensors: dict[str, TensorBytes]) -> asyncio.Future[bool]:
        """Offer `draft` with its delta before any upload. The closer's next poll takes
        it if it closes that round then (the future resolves True: nothing is to be
        uploaded, the record marks the participant `held`); else it resolves False when
        that poll ends and the learner uploads as usual. Declined at once for a round
        closed already, while a standalone closer holds the rounds, or once closed."""
        taken: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if (draft.learner != self.learner or draft.round <= self.cursor or self.standalone
                or self._closed):
            taken.set_result(False)
            return taken
        old = self._offers.pop(draft.round, None)
        if old is not None:
            old.decline()
        self._offers[draft.round] = Offer(draft, tensors, taken)
        return taken

    def note(self, round_: int, payload: PayloadRef | None = None,
             tensors: dict[str, TensorBytes] | None = None) -> None:
        """The learner's contribution to `round_` is in the store: seen now,
        without waiting for a listing (a backup closer lists every `backup_every` polls),
        so that a round short of its quorum is called on time. With the `tensors` it
        uploaded as `payload`, closing that round merges them from memory: a closer does
        not download its own delta."""
        if round_ > self.cursor:
            self._noted.setdefault(round_, {}).setdefault(self.learner, self.clock.now())
            if payload is not None and tensors is not None:
                self._own[round_] = (payload.sha256, tensors)
        self._prune()

    def close(self) -> None:
        """No closer polls any more: decline every pending offer, and every later one."""
        self._closed = True
        for offer in self.take_offers().values():
            offer.decline()

    def publishers_seen(self, round_: int) -> frozenset[str] | None:
        """The contributors of `round_` the closer listed at its last poll (None: it is
        not watching that round)."""
        seen = self._seen
        return seen[1] if seen is not None and seen[0] == round_ else None

    # -- the closer's side ----------------------------------------------------------------

    def take_offers(self) -> dict[int, Offer]:
        """The offers made since the last call (the closer declines those it does not
        merge)."""
        offers, self._offers = self._offers, {}
        return offers

    def take_noted(self, round_: int) -> dict[str, float]:
        """When each contribution to `round_` noted since the last call came in."""
        return self._noted.pop(round_, {})

    def own_delta(self, snap: SnapshotRecord) -> dict[str, TensorBytes] | None:
        """The tensors the learner uploaded as `snap`'s payload, if it is its own."""
        own = self._own.get(snap.round)
        if own is None or snap.learner != self.learner or snap.payload is None \
                or own[0] != snap.payload.sha256:
            return None
        return own[1]

    def advance(self, cursor: int) -> None:
        """The closer accepted every round up to `cursor`."""
        self.cursor = max(self.cursor, cursor)
        self._prune()

    def saw(self, round_: int, publishers: frozenset[str]) -> None:
        self._seen = (round_, publishers)

    def _prune(self) -> None:
        self._noted = {k: v for k, v in self._noted.items() if k > self.cursor}
        self._own = {k: v for k, v in self._own.items() if k > self.cursor}
