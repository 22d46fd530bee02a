"""A learner process frozen (SIGSTOP) past its lease, then thawed (SIGCONT).

While it is frozen its lease stops moving; once the lease times out the other learner's
rounds close without it (quorum 2 shrinks to the one live learner). Thawed, it finds the
rounds it missed, realigns with their commits, and contributes again.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from chaos.harness import (
    LearnerResult,
    check_ends_on_commits,
    conclude,
    spawn_learner,
    verify_run,
    wait_until,
)
from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange

pytestmark = pytest.mark.slow

LEASE_EVERY, LEASE_TIMEOUT = 0.3, 1.0
FROZEN = 3.0  # seconds: three lease timeouts
RUN = ["--sync-every", "8", "--fragments", "2", "--quorum", "2", "--overlap", "8",
       "--sleep", "0.02", "--poll", "0.01", "--lease-every", str(LEASE_EVERY),
       "--lease-timeout", str(LEASE_TIMEOUT)]
PREDICTED_STALL = LEASE_TIMEOUT + min(LEASE_EVERY / 2, LEASE_TIMEOUT / 4) + 0.5


def newest(box: Path) -> int:
    return asyncio.run(Exchange(LocalMailbox(box)).newest_round())


def test_a_learner_frozen_past_its_lease_realigns_and_goes_on(tmp_path: Path) -> None:
    box = tmp_path / "run"
    steady = spawn_learner(box, "steady", tmp_path / "steady.json", "--worker", "0",
                           "--steps", "240", "--wait-for", "2", *RUN)
    sleeper = spawn_learner(box, "sleeper", tmp_path / "sleeper.json", "--worker", "1",
                            "--steps", "120", "--ready-at", "30", *RUN)
    try:
        wait_until(sleeper.ready.exists, 60, "the sleeper's step 30", [steady, sleeper])
        sleeper.proc.send_signal(signal.SIGSTOP)
        frozen_at, t_stop = newest(box), time.monotonic()
        time.sleep(FROZEN)
        thawed_at, t_cont = newest(box), time.monotonic()
        sleeper.proc.send_signal(signal.SIGCONT)
        results = [LearnerResult.of(w.finish(timeout=120)) for w in (steady, sleeper)]
    finally:
        for w in (steady, sleeper):
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
            w.stop()
    mailbox = LocalMailbox(box)
    figures = verify_run(mailbox)
    for res in results:
        check_ends_on_commits(mailbox, res)
    assert max(res.rounds_seen for res in results) == figures.rounds - 1
    steady_res, sleeper_res = results
    # Rounds closed while it was frozen; those beyond its publishes in flight (τ = 2
    # rounds) closed without it, once its lease had timed out.
    assert thawed_at >= frozen_at + 3, (frozen_at, thawed_at)
    without = [r for r in range(frozen_at + 3, thawed_at + 1)
               if r not in figures.participants("sleeper")]
    assert without == list(range(frozen_at + 3, thawed_at + 1))
    # Thawed, it realigned with the commits it missed and contributed again.
    aligned = [e for e in sleeper_res.of_type("FragmentAligned") if e["t"] > t_cont]
    assert {e["fragment"] for e in aligned if e["round"] <= thawed_at} == {0, 1}
    assert any(r > thawed_at for r in figures.participants("sleeper"))
    published = [e for e in sleeper_res.of_type("SnapshotPublished") if e["t"] > t_cont]
    assert published
    late = [e["round"] for e in sleeper_res.of_type("PublishCancelled")]
    stall = steady_res.step_max
    assert stall < 10 * PREDICTED_STALL, f"steady's step() stalled {stall:.1f} s"
    conclude("learner SIGSTOPped past its lease, then SIGCONT", figures,
             [e for res in results for e in res.events], stall,
           frozen=f"{t_cont - t_stop:.1f} s", rounds_while_frozen=thawed_at - frozen_at,
           realigned_fragments=len({e['fragment'] for e in aligned}),
           staleness=max(e["staleness"] for e in aligned), publishes_cancelled=late,
           predicted_stall=f"{PREDICTED_STALL:.2f} s")
