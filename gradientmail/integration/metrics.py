"""The metrics of a learner, under one set of names for every integration.

`METRICS` names each metric and says what it means; `RunMetrics` accumulates a learner's
events (fed from both of its threads) and reads them back as a flat dict of floats, which
Lightning hands to the Trainer's loggers and Accelerate to `accelerator.log`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

from gradientmail import events as ev
from gradientmail.traffic import Traffic

__all__ = ["METRICS", "PREFIX", "TRAFFIC_METRICS", "RunMetrics", "traffic_values"]

#: Every metric name starts with it.
PREFIX = "diloco/"

#: Each metric's name and meaning. Names follow the library's own words (the
#: `Learner.live_learners` property, the records' `mean_cosine`); a metric whose value is
#: not known yet (no commit applied, no publish made) is absent rather than zero.
METRICS: Mapping[str, str] = MappingProxyType({
    PREFIX + "rounds_seen": "the newest round whose commit this learner applied (-1: none)",
    PREFIX + "rounds_committed": "rounds committed in the run, as far as this learner knows",
    PREFIX + "published": "contributions (snapshots) this learner published, counting "
                          "those its own closer merged from memory (held, not uploaded)",
    PREFIX + "bytes_sent": "payload bytes this learner uploaded",
    PREFIX + "bytes_received": "commit bytes this learner downloaded and applied",
    PREFIX + "staleness": "rounds between the last applied commit and the newest one",
    PREFIX + "mean_cosine": "mean cosine of the last commit's contributions to their merge",
    PREFIX + "live_learners": "learners holding a fresh lease, this one included",
    PREFIX + "since_commit": "seconds since the last commit was recorded (or since start)",
    PREFIX + "failures": "failed publishes and polls (retried)",
    PREFIX + "optimizer_steps": "real optimizer steps taken (accumulation counts once)",
    PREFIX + "tokens": "tokens counted over all processes of this learner",
    PREFIX + "batch_size": "this learner's share of global_batch_size (only with one)",
    # The learner's meter (`Learner.traffic`): every request of its mailbox since it
    # started, its embedded closer's included, priced at the learner's `prices`.
    PREFIX + "requests": "requests this learner made of the mailbox (S3 billing units)",
    PREFIX + "requests_get": "GET requests (each poll of the next record is one)",
    PREFIX + "requests_put": "PUT requests, conditional creates included",
    PREFIX + "requests_create": "conditional creates (create-if-absent), of requests_put",
    PREFIX + "requests_list": "LIST requests (one per page of 1,000 keys)",
    PREFIX + "requests_delete": "DELETE requests (free on S3)",
    PREFIX + "mailbox_bytes_up": "every byte this learner wrote to the mailbox: payloads, "
                                 "records, leases, its closer's commits",
    PREFIX + "mailbox_bytes_down": "every byte this learner read from the mailbox",
    PREFIX + "cost_usd": "estimated dollars of its requests and egress so far",
    PREFIX + "cost_usd_per_hour": "cost_usd per hour since the learner started "
                                  "(dollars per learner-hour)",
})

#: The `METRICS` that `traffic_values` reads from a `Traffic`.
TRAFFIC_METRICS = tuple(name for name in METRICS
                        if name.startswith((PREFIX + "requests", PREFIX + "mailbox_bytes",
                                            PREFIX + "cost_usd")))


def traffic_values(traffic: Traffic) -> dict[str, float]:
    """The traffic metrics of `METRICS` from a learner's `Traffic` (`cost_usd_per_hour`
    absent before any time has passed)."""
    c = traffic.counts
    out = {
        PREFIX + "requests": float(c.requests),
        PREFIX + "requests_get": float(c.get),
        PREFIX + "requests_put": float(c.put),
        PREFIX + "requests_create": float(c.create),
        PREFIX + "requests_list": float(c.list),
        PREFIX + "requests_delete": float(c.delete),
        PREFIX + "mailbox_bytes_up": float(c.bytes_up),
        PREFIX + "mailbox_bytes_down": float(c.bytes_down),
        PREFIX + "cost_usd": traffic.usd,
    }
    if traffic.usd_per_hour is not None:
        out[PREFIX + "cost_usd_per_hour"] = traffic.usd_per_hour
    return out


class RunMetrics:
    """A thread-safe accumulator of a learner's events; `values()` reads `METRICS`'
    event-based entries. `now` is the clock `since_commit` is measured on."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._lock = threading.Lock()
        self._started = now()
        self._newest_round = -1
        self._last_commit: float | None = None
        self._bytes_sent = 0
        self._bytes_received = 0
        self._published = 0
        self._staleness: int | None = None
        self._cosine: float | None = None
        self._failures = 0

    def feed(self, event: ev.Event) -> None:
        with self._lock:
            if isinstance(event, ev.RoundRecorded):
                self._newest_round = max(self._newest_round, event.round)
                self._last_commit = self._now()
                if event.mean_cosine is not None:
                    self._cosine = event.mean_cosine
            elif isinstance(event, ev.SnapshotPublished):
                self._bytes_sent += event.bytes
                self._published += 1
            elif isinstance(event, ev.FragmentAligned):
                self._bytes_received += event.bytes
                self._staleness = event.staleness
            elif isinstance(event, ev.PublishFailed | ev.PollFailed):
                self._failures += 1

    def values(self) -> dict[str, float]:
        """The event-based metrics now (`RankSync.metrics` adds the learner's own)."""
        with self._lock:
            since = self._last_commit if self._last_commit is not None else self._started
            out = {
                PREFIX + "rounds_committed": float(self._newest_round + 1),
                PREFIX + "published": float(self._published),
                PREFIX + "bytes_sent": float(self._bytes_sent),
                PREFIX + "bytes_received": float(self._bytes_received),
                PREFIX + "since_commit": self._now() - since,
                PREFIX + "failures": float(self._failures),
            }
            if self._staleness is not None:
                out[PREFIX + "staleness"] = float(self._staleness)
            if self._cosine is not None:
                out[PREFIX + "mean_cosine"] = float(self._cosine)
        return out
