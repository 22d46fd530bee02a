"""Request cost of a run at scale: requests per learner-hour by kind, and S3 dollars.

    python benchmarks/cost.py [--quick] [--learners 8,64,1000] [--no-append]

Simulates, on a fake clock, one observed learner among N of a decoupled run (the defaults:
DiLoCo(sync_every=500, fragments=4), quorum 1, 1 s per step, poll 1 s, leases every 60 s)
and counts only that learner's requests, through a CountingMailbox:

- its receive loop as `Learner._receive_loop` runs it: one GET of the next round's known
  key per poll (rounds are gap-free, so no LIST), one GET of the manifest every
  `MANIFEST_EVERY` polls (a run removed under it stops it), one LIST of the leases per
  lease period, one LIST of the next round's contributions every `BACKUP_EVERY` polls
  unless its closer already watches that round, the step of each commit (GET; theta
  where the run uploads it with every commit);
- its lease loop as `LeaseKeeper.run` runs it: a beat (PUT + free DELETE) and a LIST of
  the standalone closers' leases (`closers/`) per lease period, one GET of the roll call
  (`rollcall.json`) every `READ_EVERY` polls, and a beat for each call it answers
  (`gradientmail.run.rollcall.reply`);
- its embedded closer: the real `Syncer` with the learner as its `Host`, which watches a
  round closely only when it is the round's preferred closer (1 in N rounds) and closes those rounds
  (claim, contributions, step, record, sweep; theta and outer state every 20 versions),
  and calls the roll when a round waits short of its quorum (never here: quorum 1; the
  `calls/h` column counts the calls it answered or made);
- its publishes: one per round of its schedule, offered to its closer first (a poll that
  lists the round), then uploaded (payload + record) unless the closer merged it from
  memory, its contribution having completed the round's set.

Every learner publishes once a gap (H/P steps), the N of them within 2 s of each other:
the phase a decoupled run keeps (learners that miss a round align with its first
contributor), so a round closes once everyone is in and there are P/H rounds per step.

The other N−1 learners write their leases and contributions through an uncounted view of
the same store, answer roll calls, and a closer of theirs closes the rounds the observed
learner does not.
S3 Standard prices (`gradientmail.traffic.S3_STANDARD`, the learners' own: `Learner.traffic`):
PUT/LIST $5 per million, GET $0.40 per million, DELETE free; egress is not counted here.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import platform
import time
from pathlib import Path

import numpy as np

from gradientmail import events as ev
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.learner.mailman import BACKUP_EVERY, MANIFEST_EVERY
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.run.lease import CLOSERS, LeaseTracker
from gradientmail.run.protocol import Exchange
from gradientmail.run.rollcall import READ_EVERY, Call, reply
from gradientmail.syncer.hosted import Host
from gradientmail.syncer.runtime import CloserSettings, Syncer
from gradientmail.syncer.state import preferred_closer
from gradientmail.testing import FakeClock
from gradientmail.traffic import RequestCounts
from gradientmail.wire.records import Manifest
from gradientmail.wire.serialization import Schema
from gradientmail.wire.tensor_bytes import TensorBytes

HOUR = 3600.0
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
# Last in id order: the preferred closer of rounds N-1, 2N-1, ... (its share, 1 in N),
# not of round 0, which the first quarter-hour of a simulation would overweight.
ME = "zz-observed"


def _tensors(names: tuple[str, ...], value: float) -> dict[str, TensorBytes]:
    return {n: TensorBytes.from_numpy(np.full(4, value, np.float32)) for n in names}


async def simulate(learners: int, seconds: float, step: float = 1.0, poll: float = 1.0,
                   lease_every: float = 60.0) -> tuple[RequestCounts, int, int]:
    """The observed learner's requests over `seconds` of simulated time; rounds closed;
    roll calls it answered or made."""
    store = MemoryMailbox()
    store.metered = True  # the cadence of the S3 it prices: polls of a billed store
    counted = CountingMailbox(store)
    clock = FakeClock()
    me = Exchange(counted, clock=clock)
    them = Exchange(store, clock=clock)
    alg = DiLoCo(sync_every=500, fragments=4)
    schema = Schema.from_tensors(_tensors(("a", "b", "c", "d"), 0.0))
    plan = alg.plan(schema)
    sched = alg.schedule_for(len(plan))
    refs = [await them.put_init(p, _tensors(names, 0.0), attempt=0)
            for p, names in enumerate(plan)]
    await them.create_manifest(Manifest(schema, plan, alg.to_json(), "peer-0", tuple(refs),
                                         "off"))
    ids = [ME] + [f"peer-{i}" for i in range(1, learners)]
    for peer in ids[1:]:
        await them.beat(peer)
    await me.beat(ME)
    tracker = LeaseTracker(2 * lease_every)
    closers = LeaseTracker(2 * lease_every)  # none runs here; the learner still looks
    made: list[ev.Event] = []  # roll calls its closer made
    host = Host(ME, tracker, None, clock)
    mine = Syncer(me, closer_id=ME, settings=CloserSettings(poll_interval=poll), host=host,
                  on_event=lambda e: made.append(e) if isinstance(e, ev.RollCalled) else None)
    theirs = Syncer(them, closer_id="peer-1", settings=CloserSettings(poll_interval=poll))
    live = await me.observe_leases(tracker)

    async def refresh() -> frozenset[str]:
        return await me.observe_leases(tracker)

    handled: Call | None = None  # the last call the observed learner handled
    answered: Call | None = None  # the last call the others answered
    answers = 0  # calls the observed learner answered
    cursor, next_watch, next_beat = -1, -math.inf, lease_every
    # Each learner publishes once a gap, to the open round, in phase with the others (as
    # learners that missed a round align with its first contributor, benchmarks/
    # decoupled.py): learner i a fraction i/N of `spread` seconds into the gap.
    published: set[tuple[str, int]] = set()
    cycle = dict.fromkeys(ids, -1)
    spread = 2.0
    digest = schema.digest()
    t, polls = 0.0, 0
    while t < seconds:
        r_open = cursor + 1
        gap_s = sched.gap(r_open) * step
        k, into = int(t // gap_s), t % gap_s
        due_by = 1 + int((learners - 1) * min(1.0, (into + poll) / spread))
        for peer in ids[1:due_by]:
            if cycle[peer] < k and (peer, r_open) not in published:
                cycle[peer] = k
                published.add((peer, r_open))
                frag = sched.fragment_of(r_open)
                await them.publish(r_open, peer, _tensors(plan[frag], 0.01), fragment=frag,
                                   base_version=r_open // len(plan), local_step=r_open,
                                   steps=1, tokens=1, final=False, schema_digest=digest,
                                   delta_format="F32", step_seconds=step)
        # The others' closer takes the rounds the observed learner is not preferred for,
        # as soon as their last contribution completes the set: the learner that made it
        # closes at once (its own closer, `Host.offer`), before the observed one looks.
        if preferred_closer(r_open, live) != ME:
            await theirs.poll(live=live)
        # The observed learner: one receive-loop iteration, as Learner._receive_loop, and
        # its lease loop's (LeaseKeeper.run).
        if t >= next_beat:
            await me.beat(ME)
            await me.observe_leases(closers, CLOSERS)
            live = await me.observe_leases(tracker)
            next_beat = t + lease_every
            for peer in ids[1:]:  # the others beat too (uncounted)
                await them.beat(peer)
        if polls % READ_EVERY == 0:
            call = await me.read_call()
            if call is not None and call != handled:
                handled = call
                answer = reply(call, ME, me.lease_counter(ME))
                for who, counter in answer.drop.items():
                    tracker.drop(who, counter)
                if answer.beat:
                    answers += 1
                    await me.beat(ME)
            call = await them.read_call()
            if call is not None and call.gone is None and call != answered:
                answered = call
                for peer in ids[1:]:
                    if peer != call.caller:
                        await them.beat(peer)
        polls += 1
        if polls % MANIFEST_EVERY == 0:  # the run still exists
            await me.read_manifest()
        fresh = await me.rounds_after(cursor)
        for rec in fresh:
            ref = rec.step.payload if rec.step is not None else rec.theta
            assert ref is not None
            await me.store.fetch_tensors(ref)
            cursor = rec.round
        await mine.poll(live=live, refresh_live=refresh, records=fresh)
        live = tracker.live(clock.now())
        r_open = cursor + 1
        if host.publishers_seen(r_open) is None and t >= next_watch:
            await me.publishers(r_open)
            next_watch = t + (BACKUP_EVERY - 1) * poll * 0.999
        if cycle[ME] < k and (ME, r_open) not in published and into < poll:
            cycle[ME] = k
            published.add((ME, r_open))
            frag = sched.fragment_of(r_open)
            draft = me.draft(r_open, ME, fragment=frag, base_version=r_open // len(plan),
                             local_step=r_open, steps=1, tokens=1, final=False,
                             schema_digest=digest, delta_format="F32", step_seconds=step)
            tensors = _tensors(plan[frag], 0.02)
            # Offered to its closer first (`Mailman._publish`): one poll, which lists the
            # round; uploaded unless that closed the round on it.
            taken = host.offer(draft, tensors)
            await mine.poll(live=live, refresh_live=refresh, records=[])
            if not taken.result():
                await me.publish_draft(draft, tensors)
                host.note(r_open)
        t += poll
        clock.advance(poll)
    return counted.snapshot(), cursor + 1, len(made) + answers


def run(learners_list: list[int], quick: bool) -> str:
    seconds = 600.0 if quick else 1800.0
    scale = HOUR / seconds
    rows = [
        "| learners | LIST | GET | PUT | DELETE | requests | rounds/h | $/learner-hour "
        "| $/run-hour | calls/h |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in learners_list:
        t0 = time.perf_counter()
        c, rounds, calls = asyncio.run(simulate(n, seconds))
        per = RequestCounts(*(round(getattr(c, f) * scale) for f in
                              ("list", "get", "put", "delete", "bytes_up", "bytes_down")))
        usd = per.cost_usd()
        rows.append(
            f"| {n} | {per.list} | {per.get} | {per.put} | {per.delete} | {per.requests} "
            f"| {rounds * scale:.0f} | {usd:.5f} | {usd * n:.3f} | {calls * scale:.0f} |"
        )
        print(f"  simulated {n} learners in {time.perf_counter() - t0:.1f}s", flush=True)
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 simulated minutes, scaled ×6")
    ap.add_argument("--learners", default="8,64,1000")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()
    table = run([int(x) for x in args.learners.split(",")], args.quick)
    header = (
        f"\n## request cost at scale — {datetime.date.today()}\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (a fake clock: the numbers "
        "are counts, not timings). One observed learner among N, decoupled defaults "
        "(H=500, P=4, quorum 1), 1 s steps, poll 1 s, leases 60 s; its own receive loop, "
        "lease loop (roll call read every 2 polls), embedded closer and publishes; S3 "
        "Standard prices. Goal: <= $0.005 per learner-hour, flat in N.\n"
        f"Command: `python benchmarks/cost.py{' --quick' if args.quick else ''} "
        f"--learners {args.learners}`\n\n"
    )
    print(header + table)
    if not args.no_append:
        with RESULTS.open("a") as f:
            f.write(header + table + "\n")


if __name__ == "__main__":
    main()
