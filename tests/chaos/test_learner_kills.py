"""A learner process SIGKILLed at each point of its life, on a local directory.

Two learners (`steady` and `victim`) train with quorum 2 and a barrier of H steps, so a
dead learner that still holds its lease makes the survivor wait: the wait is bounded by
the lease timeout, and every figure printed here is measured in the workers. The victim
kills itself from inside its mailbox (`--kill`), at its 5th publish: before the payload,
between the payload and its record, after the record; or during `close()`. It is then
restarted under the same id (a restart is a join) and takes part again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from chaos.harness import (
    LearnerResult,
    check_ends_on_commits,
    conclude,
    spawn_learner,
    verify_run,
)
from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange

pytestmark = pytest.mark.slow

LEASE_EVERY, LEASE_TIMEOUT = 0.5, 1.5
RUN = ["--sync-every", "8", "--fragments", "2", "--quorum", "2", "--overlap", "8",
       "--sleep", "0.02", "--poll", "0.01", "--lease-every", str(LEASE_EVERY),
       "--lease-timeout", str(LEASE_TIMEOUT)]
# A survivor waits for a dead learner's contribution until its lease times out, plus one
# lease listing (every min(lease_every/2, lease_timeout/4) s), plus the close itself.
PREDICTED_STALL = LEASE_TIMEOUT + min(LEASE_EVERY / 2, LEASE_TIMEOUT / 4) + 0.5
HANG = 10 * PREDICTED_STALL  # a step() this long is a hang, not a wait

KILL_POINTS = {  # the 5th publish: payloads/<round>/victim.safetensors, then its record
    "before its payload": ["--kill", "create:payloads/*/victim.*:5"],
    "between payload and record": ["--kill", "create:snapshots/*/victim.json:5"],
    "after its record": ["--kill", "create:snapshots/*/victim.json:5:after"],
    "while it closes": ["--kill-closing", "--kill", "get:rounds/*:1"],
}


def newest(box: Path) -> int:
    return asyncio.run(Exchange(LocalMailbox(box)).newest_round())


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_learner_killed_mid_run_loses_no_commit(tmp_path: Path, point: str) -> None:
    box = tmp_path / "run"
    closing = point == "while it closes"
    steady = spawn_learner(box, "steady", tmp_path / "steady.json", "--worker", "0",
                           "--steps", "160", "--wait-for", "2", *RUN)
    victim = spawn_learner(box, "victim", tmp_path / "victim.json", "--worker", "1",
                           "--steps", "30" if closing else "200", *RUN, *KILL_POINTS[point])
    workers = [steady]
    try:
        victim.killed(timeout=60)
        op, key = victim.killed_at()
        killed_at = newest(box)
        if not closing:
            again = spawn_learner(box, "victim", tmp_path / "again.json", "--worker", "1",
                                  "--steps", "40", "--start-step", "40", *RUN)
            workers.append(again)
        results = [LearnerResult.of(w.finish(timeout=120)) for w in workers]
    finally:
        for w in (steady, victim, *workers):
            w.stop()
    mailbox = LocalMailbox(box)
    figures = verify_run(mailbox)
    for res in results:
        check_ends_on_commits(mailbox, res)
    assert max(res.rounds_seen for res in results) == figures.rounds - 1
    # The run went on: the survivor took part in rounds committed after the kill.
    assert max(figures.participants("steady")) > killed_at
    if not closing:
        [joined] = results[1].of_type("Joined")
        assert any(r > joined["rounds_seen"] for r in figures.participants("victim"))
    stall = results[0].step_max
    assert stall < HANG, f"steady's step() stalled {stall:.1f} s (predicted {PREDICTED_STALL} s)"
    if point == "after its record":
        # Its record was complete: its round merged the dead learner's contribution.
        assert int(key.split("/")[1]) in figures.participants("victim")
    extra = {}
    if point == "between payload and record":
        # The orphan payload of the dead publish: replaced by the restarted learner when
        # its round was still open, else swept with its round.
        orphan = int(key.split("/")[1])
        rejoined = [e["round"] for e in results[1].of_type("SnapshotPublished")]
        extra["orphan_round_republished"] = orphan in rejoined
    conclude(f"learner SIGKILLed {point}", figures,
             [e for res in results for e in res.events], stall, killed_at=f"{op} {key}",
           newest_round_then=killed_at,
           predicted_stall=f"{PREDICTED_STALL:.2f} s", **extra)
