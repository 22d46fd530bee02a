"""What a mailbox's traffic costs: request counts, bytes, and an S3 price estimate.

`RequestCounts` is what `CountingMailbox` (`gradientmail.mailbox.wrappers`, the meter
every `Learner` wraps its mailbox in) counts; `Prices` is the one definition of what a
request and a downloaded byte cost, with S3 Standard's us-east-1 list prices as defaults;
`measure` turns counts over some seconds into a `Traffic`, the figure `Learner.traffic`,
its `TrafficMeasured` events and the integrations' `diloco/cost_*` metrics report.
Everything here is pure: no clock, no I/O (callers pass the seconds).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gradientmail.errors import ConfigError

__all__ = ["GIB", "S3_STANDARD", "Prices", "RequestCounts", "Traffic", "measure"]

#: AWS bills data transfer per "GB" of 2^30 bytes.
GIB = 1 << 30
_HOUR = 3600.0


@dataclasses.dataclass(frozen=True)
class Prices:
    """Dollars per request and per byte out of the store.

    Defaults: S3 Standard in us-east-1 (list prices as of 2025): PUT, COPY, POST and LIST
    $0.005 per 1,000 requests; GET and every other request $0.0004 per 1,000; DELETE free;
    data transfer out to the internet $0.09 per GB (the first 10 TB a month; AWS's GB is
    2^30 bytes). Transfer into S3 is free, and so is transfer out to EC2 in the same
    region: learners there should pass `egress_per_gb=0.0`. For another store (R2 has no
    egress fee; GCS and Azure price requests per 10,000) pass its prices.
    """

    put_per_1000: float = 0.005
    get_per_1000: float = 0.0004
    egress_per_gb: float = 0.09

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not math.isfinite(value) or value < 0):
                raise ConfigError(f"{f.name}={value!r} must be a finite number of dollars >= 0")

    def requests_usd(self, counts: RequestCounts) -> float:
        """The requests' cost: PUT (creates included) and LIST at the PUT price, GET at the
        GET price, DELETE free."""
        return ((counts.put + counts.list) * self.put_per_1000
                + counts.get * self.get_per_1000) / 1000

    def egress_usd(self, bytes_down: int) -> float:
        """The cost of `bytes_down` bytes read out of the store."""
        return bytes_down * self.egress_per_gb / GIB

    def to_json(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}


#: S3 Standard, us-east-1, internet egress: the default `Prices`.
S3_STANDARD = Prices()


@dataclasses.dataclass(frozen=True)
class RequestCounts:
    """Requests by kind as S3 bills them, and payload bytes up and down.

    `put` counts plain puts and conditional creates (both are a PUT to S3); `create`
    says how many of them were creates. A `list` of n keys counts one LIST per page of
    1,000. The Mailbox contract has no HEAD: existence is a GET, counted as one.
    """

    list: int = 0
    get: int = 0
    put: int = 0  # put and create
    delete: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    create: int = 0  # of `put`, the conditional creates (added last: positional callers)

    @property
    def requests(self) -> int:
        return self.list + self.get + self.put + self.delete

    def cost_usd(self, per_million_put_list: float | None = None,
                 per_million_get: float | None = None) -> float:
        """Request cost (DELETE is free) at `S3_STANDARD`'s prices unless given per
        million; egress is `Prices.egress_usd`'s."""
        prices = Prices(
            S3_STANDARD.put_per_1000 if per_million_put_list is None
            else per_million_put_list / 1000,
            S3_STANDARD.get_per_1000 if per_million_get is None else per_million_get / 1000,
        )
        return prices.requests_usd(self)

    def __sub__(self, other: RequestCounts) -> RequestCounts:
        return RequestCounts(
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self))
        )


@dataclasses.dataclass(frozen=True)
class Traffic:
    """A learner's requests and bytes over `seconds` on its clock, priced.

    `usd_requests` and `usd_egress` are `prices` applied to the counts; `usd` their sum;
    `usd_per_hour` the dollars per learner-hour (None before any time has passed).
    """

    counts: RequestCounts
    seconds: float
    prices: Prices = S3_STANDARD

    @property
    def requests(self) -> int:
        return self.counts.requests

    @property
    def bytes_up(self) -> int:
        return self.counts.bytes_up

    @property
    def bytes_down(self) -> int:
        return self.counts.bytes_down

    @property
    def usd_requests(self) -> float:
        return self.prices.requests_usd(self.counts)

    @property
    def usd_egress(self) -> float:
        return self.prices.egress_usd(self.counts.bytes_down)

    @property
    def usd(self) -> float:
        return self.usd_requests + self.usd_egress

    @property
    def usd_per_hour(self) -> float | None:
        return self.usd * _HOUR / self.seconds if self.seconds > 0 else None

    def to_json(self) -> dict[str, Any]:
        """Counts, bytes, seconds and dollars as one flat JSON-ready mapping."""
        out: dict[str, Any] = dataclasses.asdict(self.counts)
        out.update(requests=self.requests, seconds=self.seconds, usd=self.usd,
                   usd_requests=self.usd_requests, usd_egress=self.usd_egress,
                   usd_per_hour=self.usd_per_hour)
        return out

    def __str__(self) -> str:
        c = self.counts
        rate = "-" if self.usd_per_hour is None else f"${self.usd_per_hour:.5f}/h"
        return (f"{c.requests} requests (GET {c.get}, PUT {c.put} of which create "
                f"{c.create}, LIST {c.list}, DELETE {c.delete}), {c.bytes_up} B up, "
                f"{c.bytes_down} B down in {self.seconds:.1f} s: ${self.usd:.6f} ({rate})")


def measure(counts: RequestCounts, seconds: float, prices: Prices = S3_STANDARD) -> Traffic:
    """`counts` taken over `seconds` (negative clamps to 0), priced at `prices`."""
    return Traffic(counts, max(float(seconds), 0.0), prices)
