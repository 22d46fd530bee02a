"""Closers as OS processes on a local directory: killed after their claim, and racing.

The contributions are written by hand up front (tests/test_syncer_race.py's `publish_all`:
learners a and b in every round), so the committed bytes are known: whatever happens to
the closers, the records must equal those one syncer commits alone (`reference`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from test_syncer import Run, algorithm, fingerprint
from test_syncer_race import publish_all, reference

from chaos.harness import conclude, spawn_closer, verify_run, wait_until
from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange

pytestmark = pytest.mark.slow

TAKEOVER_ROUNDS = 6
RACE_ROUNDS = 100
POLL = 0.05  # the closers' poll interval: a claim is superseded after 10 polls


def write_run(box: Path, rounds: int) -> None:
    asyncio.run(publish_all(Run(LocalMailbox(box), algorithm(fragments=2)), rounds))


# Round 3 trains fragment 1 (rounds alternate fragments) at its version 2.
KILL_POINTS = {
    "after-claim": "create:claims/round/0000000003/*:1:after",
    "after-upload": "put:steps/1/0000000002-*:1:after",
    "before-record": "create:rounds/0000000003.json:1",
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_closer_killed_after_its_claim_is_taken_over(tmp_path: Path, point: str) -> None:
    box = tmp_path / "run"
    write_run(box, TAKEOVER_ROUNDS)
    a = spawn_closer(box, "a-closer", tmp_path / "a.json", "--rounds", str(TAKEOVER_ROUNDS),
                     "--poll", str(POLL), "--kill", KILL_POINTS[point])
    a.killed(timeout=60)
    ex = Exchange(LocalMailbox(box))
    assert asyncio.run(ex.round_claims(3)) == [0]  # a's claim stands, without a record
    assert asyncio.run(ex.newest_round()) == 2
    t0 = time.monotonic()
    b = spawn_closer(box, "b-closer", tmp_path / "b.json", "--rounds", str(TAKEOVER_ROUNDS),
                     "--poll", str(POLL))
    result = b.finish(timeout=60)
    waited = time.monotonic() - t0
    figures = verify_run(LocalMailbox(box))
    assert fingerprint(list(figures.records)) == reference(TAKEOVER_ROUNDS)
    assert [rec.closer for rec in figures.records] == ["a-closer"] * 3 + ["b-closer"] * 3
    superseded = [e for e in result["events"] if e["type"] == "ClaimSuperseded"]
    assert [(e["closer"], e["round"], e["attempt"]) for e in superseded] == [("b-closer", 3, 1)]
    rec3 = figures.records[3]
    assert rec3.step is not None
    assert rec3.step.payload.key == "steps/1/0000000002-000001.safetensors"
    # The superseded attempt's uploads are referenced by nothing and were swept.
    keys = asyncio.run(LocalMailbox(box).list("steps/1/"))
    assert "steps/1/0000000002-000000.safetensors" not in keys
    conclude(f"closer SIGKILLed {point}", figures, result["events"], None,
           takeover_after=f"{superseded[0]['waited']:.2f} s (predicted {10 * POLL:.2f} s)",
           closer_b_total=f"{waited:.1f} s")


def test_two_closer_processes_race_for_100_rounds(tmp_path: Path) -> None:
    box = tmp_path / "run"
    write_run(box, RACE_ROUNDS)
    go = tmp_path / "go"
    closers = [
        spawn_closer(box, f"racer-{i}", tmp_path / f"racer{i}.json", "--rounds",
                     str(RACE_ROUNDS), "--poll", "0.001", "--go", str(go))
        for i in range(2)
    ]
    try:
        wait_until(lambda: all(c.ready.exists() for c in closers), 60, "both closers",
                   closers)
        go.write_text("go")
        results = [c.finish(timeout=240) for c in closers]
    finally:
        for c in closers:
            c.stop()
    figures = verify_run(LocalMailbox(box))
    assert fingerprint(list(figures.records)) == reference(RACE_ROUNDS)
    closed = [e["round"] for res in results for e in res["events"] if e["type"] == "RoundClosed"]
    assert sorted(closed) == list(range(RACE_ROUNDS))  # exactly one closer per round
    assert sum(res["rounds_closed"] for res in results) == RACE_ROUNDS
    split = {res["closer"]: res["rounds_closed"] for res in results}
    # A closer slower than 3·ξ_sync is superseded and the two race for the record: the
    # loser's work is discarded (CommitLost), the bytes are the same.
    def count(kind: str) -> int:
        return sum(1 for res in results for e in res["events"] if e["type"] == kind)

    conclude("two closers racing (100 rounds)", figures,
             [e for res in results for e in res["events"]], None, closed_by=split,
           superseded=count("ClaimSuperseded"), discarded_closes=count("CommitLost"))
