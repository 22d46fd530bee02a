"""Requests per learner-hour made by the protocol's polling pattern, and their S3 price.

Simulates one learner's receive/publish loop on a FakeClock over a CountingMailbox (a
MemoryMailbox underneath): every `poll` seconds it GETs the next round record
(`rounds_after`), every `publishers_every` seconds it LISTs who published the next round,
every `lease_every` seconds it beats (PUT + DELETE) and LISTs the leases of the learners
and of the standalone closers, every `publish`
seconds it publishes a contribution (payload + record), and for every round committed
(by others, every `round_every` seconds) it downloads the new theta. Only this learner's
requests are counted; closing rounds (the syncer role) is not included.

    python benchmarks/polling.py [--quick] [--no-append]

Appends a markdown table to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import os
import platform
from pathlib import Path

import numpy as np

from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.run.lease import CLOSERS, LeaseTracker
from gradientmail.run.protocol import Exchange
from gradientmail.testing import FakeClock
from gradientmail.traffic import RequestCounts
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.records import Participant, RoundRecord
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["PATTERNS", "Pattern", "per_learner_hour", "polling_requests"]

HOUR = 3600.0
DIGEST = "0" * 64


@dataclasses.dataclass(frozen=True)
class Pattern:
    """One polling configuration, all periods in seconds."""

    name: str
    poll: float = 1.0
    publishers_every: float = 1.0
    lease_every: float = 60.0
    publish: float = 30.0
    round_every: float = 30.0


PATTERNS = (
    Pattern("naive: publishers LIST every poll"),
    Pattern("publishers LIST every 10 s", publishers_every=10.0),
    Pattern("publishers LIST every 15 s", publishers_every=15.0),
    Pattern("publishers LIST every 30 s", publishers_every=30.0),
    Pattern("quiet: no publishes, publishers every 10 s", publishers_every=10.0,
            publish=0.0),
)


def _due(t: float, period: float) -> bool:
    return period > 0 and t % period < 1e-9


async def _simulate(pattern: Pattern, seconds: float) -> RequestCounts:
    store = MemoryMailbox()
    counting = CountingMailbox(store)
    clock = FakeClock()
    me = Exchange(counting, clock=clock)
    others = Exchange(store)  # the rest of the run: uncounted
    tracker = LeaseTracker(timeout=2 * pattern.lease_every)
    closers = LeaseTracker(timeout=2 * pattern.lease_every)
    tiny = {"w": TensorBytes.from_numpy(np.zeros(4, np.float32))}
    cursor, committed, published = -1, 0, 0
    for n in range(10):  # a few other learners holding leases
        await others.beat(f"peer-{n}")
    t = 0.0
    while t < seconds:
        if _due(t, pattern.round_every) and t > 0:
            theta = await others.put_theta(0, committed + 1, tiny, attempt=0)
            await others.commit(RoundRecord(
                committed, 0, committed + 1, theta, theta, None,
                (Participant("peer-0", 1, 1, 1, 1.0),), Estimates(), None, (), "peer-0", False))
            committed += 1
        if _due(t, pattern.lease_every):
            await me.beat("me")
            await me.observe_leases(tracker)
            await me.observe_leases(closers, CLOSERS)
        if _due(t, pattern.poll):
            for record in await me.rounds_after(cursor):
                await me.store.fetch_tensors(record.theta)
                cursor = record.round
        if _due(t, pattern.publishers_every):
            await me.publishers(cursor + 1)
        if _due(t, pattern.publish):
            await me.publish(cursor + 1 + published, "me", tiny, fragment=0, base_version=0,
                             local_step=published, steps=1, tokens=1, final=False,
                             schema_digest=DIGEST, delta_format="F32")
            published += 1
        t += 1.0
        clock.advance(1.0)
    return counting.snapshot()


def per_learner_hour(quick: bool = False) -> list[tuple[Pattern, RequestCounts]]:
    """Each pattern's requests per learner-hour: simulated for an hour, or for 10 minutes
    scaled ×6 with `quick`. Runs its own event loop (call it from a thread if one runs)."""
    seconds = 600.0 if quick else HOUR
    scale = round(HOUR / seconds)
    out = []
    for pattern in PATTERNS:
        c = asyncio.run(_simulate(pattern, seconds))
        out.append((pattern, RequestCounts(
            *(getattr(c, f.name) * scale for f in dataclasses.fields(c)))))
    return out


def polling_requests(quick: bool = False) -> str:
    """A markdown table of requests per learner-hour by kind and their S3 cost."""
    rows = [
        "| pattern | LIST | GET | PUT | DELETE | requests | $/learner-hour |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for pattern, c in per_learner_hour(quick):
        rows.append(f"| {pattern.name} | {c.list} | {c.get} | {c.put} | {c.delete} "
                    f"| {c.requests} | {c.cost_usd():.5f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="simulate 10 minutes, scale ×6")
    parser.add_argument("--no-append", action="store_true", help="do not touch RESULTS.md")
    args = parser.parse_args(argv)
    table = polling_requests(quick=args.quick)
    print(table)
    if not args.no_append:
        command = "python benchmarks/polling.py" + (" --quick" if args.quick else "")
        header = (
            f"\n## Polling requests per learner-hour ({datetime.date.today().isoformat()}, "
            f"{platform.machine()}, {os.cpu_count()} CPUs)\n\n`{command}` — poll 1 s, "
            "beat + lease LISTs (learners, closers) every 60 s, publish every 30 s, a commit "
            "every 30 s (theta downloaded); S3 prices: LIST/PUT $5/M, GET $0.40/M, DELETE "
            "free; goal <= $0.005 per learner-hour.\n\n"
        )
        with open(Path(__file__).with_name("RESULTS.md"), "a", encoding="utf-8") as f:
            f.write(header + table + "\n")


if __name__ == "__main__":
    main()
