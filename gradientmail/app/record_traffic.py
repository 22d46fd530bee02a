"""A run's traffic as its round records tell it: what `gradientmail status` shows.

`status` reads the bucket from outside, so it cannot count a learner's requests (each
learner's own meter does: `Learner.traffic`). What the records do say, per round: the
size of every contribution merged (`Participant.payload_size`; one its closer merged from
memory was never uploaded), of every payload the closer wrote (theta, outer state,
update, step), of what a learner following the run downloads for the commit, and the
writes those imply. With the closers' `committed_at` stamps that gives rounds per hour,
and with the number of learners an estimate per learner-hour. Pure: records in, numbers
out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from gradientmail.traffic import S3_STANDARD, Prices
from gradientmail.wire.records import RoundRecord

__all__ = ["RecordTraffic", "follow_bytes", "record_traffic"]

_HOUR = 3600.0


def follow_bytes(rec: RoundRecord) -> int:
    """What a learner holding the previous version downloads to follow `rec`: the step
    of a replicated commit, else the update, else theta."""
    if rec.step is not None:
        return rec.step.payload.size
    if rec.update is not None:
        return rec.update.payload.size
    return rec.theta.size if rec.theta is not None else 0


@dataclasses.dataclass(frozen=True)
class RecordTraffic:
    """Means per round over the records `first_round`..`last_round` (`rounds` of them),
    and estimates per learner-hour for `learners` learners.

    Per round: `uploads` contributions uploaded (held ones were merged from their closer's
    memory), `contribution_bytes` their size (None when a record predates
    `payload_size`), `commit_payloads` and `commit_bytes` what the closer wrote,
    `follow_bytes` what a learner holding the previous version downloads, and `puts`, the
    writes that implies: payload and record of each upload, the closer's claim, its
    payloads and its record. `rounds_per_hour` comes from the closers' `committed_at`
    stamps (None without two apart), and the per-learner-hour figures from it.
    """

    rounds: int
    first_round: int
    last_round: int
    learners: int
    uploads: float
    contribution_bytes: float | None
    commit_payloads: float
    commit_bytes: float
    follow_bytes: float
    rounds_per_hour: float | None
    prices: Prices = S3_STANDARD

    @property
    def puts(self) -> float:
        return 2 * self.uploads + 1 + self.commit_payloads + 1

    def per_learner_hour(self) -> dict[str, float] | None:
        """A learner's share of an hour of the run: it uploads its share of the
        contributions and closes its share of the rounds (`bytes_up`, `puts`), downloads
        every commit and its share of the contributions the closers merge (`bytes_down`),
        and GETs the record and payload of each (`gets`); `usd` prices them. `gets` and so
        `usd` are floors: polls that find nothing new leave no trace in the records (a
        learner's meter counts them: `Learner.traffic`). None without `rounds_per_hour`."""
        rate, n = self.rounds_per_hour, max(self.learners, 1)
        if rate is None:
            return None
        contributions = self.contribution_bytes or 0.0
        up = (contributions + self.commit_bytes) * rate / n
        down = self.follow_bytes * rate + contributions * rate / n
        puts = self.puts * rate / n
        gets = 2 * rate + 2 * self.uploads * rate / n
        usd = ((puts * self.prices.put_per_1000 + gets * self.prices.get_per_1000) / 1000
               + self.prices.egress_usd(round(down)))
        return {"bytes_up": up, "bytes_down": down, "puts": puts, "gets": gets, "usd": usd}

    def to_json(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "first_round": self.first_round,
            "last_round": self.last_round,
            "learners": self.learners,
            "per_round": {
                "uploads": self.uploads,
                "contribution_bytes": self.contribution_bytes,
                "commit_payloads": self.commit_payloads,
                "commit_bytes": self.commit_bytes,
                "follow_bytes": self.follow_bytes,
                "puts": self.puts,
            },
            "rounds_per_hour": self.rounds_per_hour,
            "per_learner_hour": self.per_learner_hour(),
            "prices": self.prices.to_json(),
        }


def record_traffic(records: Sequence[RoundRecord], learners: int,
                   prices: Prices = S3_STANDARD) -> RecordTraffic | None:
    """The traffic `records` (consecutive rounds, in order) tell of, for `learners`
    learners (0: as many as took part in them); None without records."""
    if not records:
        return None
    n = len(records)
    uploaded = [[p for p in rec.participants if not p.held] for rec in records]
    known = all(p.payload_size is not None for ps in uploaded for p in ps)
    stamps = [rec.committed_at for rec in records if rec.committed_at is not None]
    rate = None
    if len(stamps) >= 2 and stamps[-1] > stamps[0]:
        rate = (len(stamps) - 1) * _HOUR / (stamps[-1] - stamps[0])
    took_part = {p.learner for rec in records for p in rec.participants}
    return RecordTraffic(
        rounds=n,
        first_round=records[0].round,
        last_round=records[-1].round,
        learners=learners if learners > 0 else len(took_part),
        uploads=sum(len(ps) for ps in uploaded) / n,
        contribution_bytes=(sum(p.payload_size or 0 for ps in uploaded for p in ps) / n
                            if known else None),
        commit_payloads=sum(len(rec.payload_refs()) for rec in records) / n,
        commit_bytes=sum(sum(ref.size for ref in rec.payload_refs()) for rec in records) / n,
        follow_bytes=sum(follow_bytes(rec) for rec in records) / n,
        rounds_per_hour=rate,
        prices=prices,
    )
