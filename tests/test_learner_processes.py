"""Learners as separate OS processes on a local-directory mailbox: the oracle holds across
processes, and a learner SIGKILLed mid-run is restarted and rejoins the run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_learner_oracle import ROUNDS, H, oracle

from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parent / "workers" / "learner_proc.py"


def spawn(mailbox: Path, learner: str, out: Path, *args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(mailbox), learner, "--out", str(out), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def finish(proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out.decode()[-3000:]


def test_standard_diloco_across_processes_equals_the_oracle(tmp_path: Path) -> None:
    box = tmp_path / "run"
    outs = [tmp_path / f"w{w}.json" for w in range(2)]
    procs = [
        spawn(
            box,
            f"proc-{w}",
            outs[w],
            "--worker",
            str(w),
            "--steps",
            str(ROUNDS * H),
            "--sync-every",
            str(H),
            "--standard",
            "2",
            "--wait-for",
            "2",
        )
        for w in range(2)
    ]
    for p in procs:
        finish(p)
    want = oracle()
    names = [
        n
        for n, _ in torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
        ).named_parameters()
    ]
    for out in outs:
        got = json.loads(out.read_text())
        assert got["rounds_seen"] == ROUNDS - 1
        for name, w in zip(names, want, strict=True):
            g = torch.tensor(got["params"][name]).reshape(w.shape)
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def records(box: Path) -> list[Any]:
    return list(asyncio.run(Exchange(LocalMailbox(box)).rounds_after(-1)))


def test_a_learner_killed_mid_run_restarts_and_rejoins(tmp_path: Path) -> None:
    box = tmp_path / "run"
    steady = spawn(
        box,
        "steady",
        tmp_path / "steady.json",
        "--worker",
        "0",
        "--steps",
        "240",
        "--sync-every",
        "8",
        "--fragments",
        "2",
        "--sleep",
        "0.01",
    )
    victim_out = tmp_path / "victim1.json"
    victim = spawn(
        box,
        "victim",
        victim_out,
        "--worker",
        "1",
        "--steps",
        "100",
        "--sync-every",
        "8",
        "--fragments",
        "2",
        "--sleep",
        "0.01",
        "--pause-at",
        "40",
    )
    ready = Path(str(victim_out) + ".ready")
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline, "the victim never reached its pause step"
        assert victim.poll() is None, victim.communicate()[0].decode()[-3000:]
        time.sleep(0.05)
    before = len(records(box))
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    again_out = tmp_path / "victim2.json"
    again = spawn(
        box,
        "victim",
        again_out,
        "--worker",
        "1",
        "--steps",
        "60",
        "--sync-every",
        "8",
        "--fragments",
        "2",
        "--sleep",
        "0.01",
        "--start-step",
        "40",
        "--until-merged",
    )
    finish(again)
    finish(steady)
    recs = records(box)
    assert [r.round for r in recs] == list(range(len(recs)))
    joined = [e for e in json.loads(again_out.read_text())["events"] if e["type"] == "Joined"]
    assert len(joined) == 1 and joined[0]["rounds_seen"] >= before - 1 >= 0
    # the restarted learner took part in rounds after its restart
    restart_round = joined[0]["rounds_seen"]
    assert any(
        p.learner == "victim" for r in recs if r.round > restart_round for p in r.participants
    )
    steady_events = json.loads((tmp_path / "steady.json").read_text())["events"]
    assert any(e["type"] == "RoundClosed" for e in steady_events)
