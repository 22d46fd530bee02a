"""Liveness from leases, judged by each observer's own clock.

Machines share no clock, so a lease carries no timestamp. Each learner keeps one lease key
holding a counter that it bumps every `lease_every` seconds; an observer LISTs the leases
now and then and notes, on *its own* clock, when each counter last changed. A learner is
live while its counter changed less than `timeout` seconds ago (or it was first seen less
than `timeout` ago: a new observer cannot tell a fresh lease from a stale one and gives it
the benefit of the doubt). A released lease (absent from the listing) is not live, and
neither is a learner a roll call judged gone (`drop`, see `gradientmail.run.rollcall`) until a
listing shows its counter moved.

Keys: `leases/<learner>/<counter>` (12 digits). A beat creates the next key and then
deletes the previous one, so one LIST of `leases/` (one page per 1,000 learners) returns
every learner's counter. A standalone closer (`gradientmail sync`) beats a lease of the
same shape under `closers/<closer>/<counter>`, apart from the learners' because it is no
learner: it never counts toward a quorum. `LeaseTracker` and `lease_counters` are pure:
fed keys, counters and times, and tested with plain floats.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Literal

from gradientmail.errors import ConfigError, LocalProtocolError
from gradientmail.wire.record_json import check_learner_id

__all__ = ["CLOSERS", "LEARNERS", "LeaseArea", "LeaseTracker", "lease_counters", "lease_key"]

#: Where a lease lives: the learners' (`leases/`) or the standalone closers' (`closers/`).
LeaseArea = Literal["leases", "closers"]
LEARNERS: LeaseArea = "leases"
CLOSERS: LeaseArea = "closers"
_LEASE = {area: re.compile(area + r"/([^/]+)/(\d{12})") for area in (LEARNERS, CLOSERS)}


def lease_key(learner: str, counter: int, area: LeaseArea = LEARNERS) -> str:
    """`<area>/<learner>/<counter>`, the key a beat number `counter` creates."""
    check_learner_id(learner)
    if isinstance(counter, bool) or not isinstance(counter, int) or not 0 <= counter < 10**12:
        raise LocalProtocolError(f"lease counter={counter!r} must be an integer in [0, 10**12)")
    if area not in _LEASE:
        raise LocalProtocolError(f"lease area={area!r} must be one of {sorted(_LEASE)}")
    return f"{area}/{learner}/{counter:012d}"


def lease_counters(keys: Iterable[str], area: LeaseArea = LEARNERS) -> dict[str, int]:
    """Each holder's counter from a listing of `<area>/` (the highest, if a beat is half
    done). Keys of another shape are ignored: a stray key names no learner we could
    attribute it to, and must not deny everyone else's liveness."""
    pattern = _LEASE[area]
    out: dict[str, int] = {}
    for key in keys:
        m = pattern.fullmatch(key)
        if m is None:
            continue
        learner, counter = m.group(1), int(m.group(2))
        try:
            check_learner_id(learner)
        except LocalProtocolError:
            continue
        out[learner] = max(counter, out.get(learner, -1))
    return out


class LeaseTracker:
    """Remembers, per learner, the counter last observed and when (observer time) it changed."""

    def __init__(self, timeout: float) -> None:
        if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
            raise ConfigError(
                f"lease timeout={timeout!r} must be a finite number of seconds > 0; "
                "use about twice the lease period (e.g. lease_every=60, timeout=120)"
            )
        self.timeout = float(timeout)
        self._counter: dict[str, int] = {}
        self._changed: dict[str, float] = {}
        self._gone: set[str] = set()

    def observe(self, counters: Mapping[str, int], now: float) -> None:
        """Take one listing of every lease: learner id -> counter, seen at `now`.

        A learner seen for the first time, or whose counter differs from the last
        observation (in either direction: a restarted learner may count from anywhere), is
        stamped `now`, and is no longer gone. A learner missing from `counters` has
        released its lease (or it was swept, or judged gone) and is forgotten; if it comes
        back it counts as first seen.
        """
        for learner in list(self._counter):
            if learner not in counters:
                del self._counter[learner]
                del self._changed[learner]
                self._gone.discard(learner)
        for learner, counter in counters.items():
            if self._counter.get(learner) != counter:
                self._counter[learner] = counter
                self._changed[learner] = now
                self._gone.discard(learner)

    def drop(self, learner: str, counter: int) -> None:
        """A roll call judged `learner` gone at lease `counter`: not live until a listing
        shows another counter (it beat, or restarted) or none (its lease was deleted).
        Ignored when this observer already saw a newer counter: it beat since."""
        known = self._counter.get(learner)
        if known is not None and known > counter:
            return
        self._counter[learner] = counter
        self._changed.setdefault(learner, -math.inf)
        self._gone.add(learner)

    def live(self, now: float) -> frozenset[str]:
        """Learners whose counter changed (or who appeared) less than `timeout` ago, less
        those judged gone since."""
        return frozenset(
            learner
            for learner, changed in self._changed.items()
            if now - changed < self.timeout and learner not in self._gone
        )

    def last_change(self, learner: str) -> float | None:
        """Observer time at which `learner`'s counter last changed; None if not listed."""
        return self._changed.get(learner)

    def counters(self) -> dict[str, int]:
        """The counters of the last observation (a copy)."""
        return dict(self._counter)

    def __repr__(self) -> str:
        return f"LeaseTracker(timeout={self.timeout}, learners={len(self._counter)})"
