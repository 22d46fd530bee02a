"""Accelerate launches as learners, in separate OS processes on a local-directory mailbox.

`accelerate launch --cpu --num_processes 2` starts ONE process (checked with Accelerate
1.15: several CPU processes need mpirun), so the two-process learner is started with
`torchrun --nproc_per_node 2` and `Accelerator(cpu=True)` on gloo, as NOTES.md says.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from gradientmail.algorithms.diloco import DiLoCo as Config
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import state_at
from gradientmail.wire.records import RoundRecord

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "accelerate_worker.py"
EXAMPLE = ROOT / "examples" / "accelerate_train.py"
STEPS, H = 12, 4


def env(**extra: str) -> dict[str, str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GRADIENTMAIL_", "ACCELERATE_", "RANK", "WORLD_SIZE", "MASTER_"))
    }
    return dict(base, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(cmd: list[str], **extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd, env=env(**extra), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def finish(procs: list[subprocess.Popen[bytes]], timeout: float = 150) -> list[str]:
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out.decode())
            assert p.returncode == 0, out.decode()[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def torchrun() -> list[str]:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert exe is not None, "torchrun is not installed next to this Python"
    return [exe, "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]


def records(box: Path) -> list[RoundRecord]:
    return list(asyncio.run(Exchange(LocalMailbox(box)).rounds_after(-1)))


def newest_theta(box: Path) -> dict[str, np.ndarray]:
    """The parameters of each fragment's last commit, as float32 arrays."""

    async def go() -> dict[str, np.ndarray]:
        ex = Exchange(LocalMailbox(box))
        latest: dict[int, RoundRecord] = {}
        for rec in await ex.rounds_after(-1):
            latest[rec.fragment] = rec
        out = {}
        for rec in latest.values():
            tensors = (await state_at(ex, rec.fragment, rec)).theta
            for name, t in tensors.items():
                assert t.dtype == "F32"
                out[name] = np.frombuffer(t.data, dtype="<f4").reshape(t.shape)
        return out

    return asyncio.run(go())


def load(out: Path, learner: str, rank: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / f"{learner}.rank{rank}.json").read_text())
    return data


def test_a_two_process_launch_is_one_learner_alongside_a_one_process_launch(
    tmp_path: Path,
) -> None:
    box, out = tmp_path / "run", tmp_path
    common = ["--steps", str(STEPS), "--sync-every", str(H), "--quorum", "2", "--wait-for", "2"]
    dp = spawn(
        [*torchrun(), "--master_port", str(free_port()), str(WORKER), str(box), "dp",
         "--out", str(out), "--accum", "2", "--seed", "1", *common]
    )  # fmt: skip
    solo = spawn(
        [sys.executable, str(WORKER), str(box), "solo", "--out", str(out), "--seed", "2", *common]
    )
    finish([dp, solo])
    rank0, rank1, single = load(out, "dp", 0), load(out, "dp", 1), load(out, "solo", 0)

    # Ranks started from different models (seeded by rank) and hold identical parameters
    # after start, after every optimizer step (applies included) and after close.
    assert rank0["world"] == rank1["world"] == 2
    assert rank0["records"] == rank1["records"]
    trained = [r for r in rank0["records"] if r["step"] != "closed"]
    assert [r["step"] for r in trained] == list(range(STEPS + 1))
    seen = [r["rounds_seen"] for r in rank0["records"]]
    recs = records(box)
    last = len(recs) - 1
    assert seen == sorted(seen) and seen[0] == -1 and seen[-1] == last
    assert any(s >= 0 for s in seen[:STEPS]), "no commit was applied during training"
    assert len({r["sum"] for r in trained}) == STEPS + 1

    # Gradient accumulation 2: 24 micro-batches, 12 optimizer steps, 12 learner steps.
    assert rank0["micro_batches"] == rank1["micro_batches"] == 2 * STEPS
    assert rank0["local_step"] == STEPS and rank1["local_step"] is None
    assert single["local_step"] == STEPS

    # Each learner publishes at least every H steps, so there are at least STEPS / H
    # rounds (more when early publishes, made when the other learner is one short of the
    # quorum, shift the schedule). Both learners are in every round, and the launch
    # counts both ranks' tokens: 2 micro-batches x 2 ranks x 30 tokens per step.
    assert [r.round for r in recs] == list(range(last + 1)) and last + 1 >= STEPS // H
    for rec in recs:
        got = {p.learner: (p.steps, p.tokens) for p in rec.participants}
        assert set(got) == {"dp", "solo"}
        assert got["dp"][1] == got["dp"][0] * 2 * 2 * 30 and got["dp"][0] >= 1
        assert got["solo"][1] == got["solo"][0] * 30 and got["solo"][0] >= 1
    assert rank0["tokens"] == rank1["tokens"] == STEPS * 2 * 2 * 30

    # All three processes end on the last commit.
    theta = newest_theta(box)
    for result in (rank0, rank1, single):
        for name, want in theta.items():
            mine = np.asarray(result["params"][name], dtype=np.float32).reshape(want.shape)
            np.testing.assert_array_equal(mine, want)
    assert (
        rank0["state"]
        == rank1["state"]
        == {
            "version": 2,
            "learner_id": "dp",
            "optimizer_steps": STEPS,
            "tokens": STEPS * 2 * 2 * 30,
            "rounds_seen": last,
            "error_feedback": None,
        }
    )


def test_two_launches_of_the_example_commit_rounds_together(tmp_path: Path) -> None:
    box = tmp_path / "run"
    settings = dict(
        GRADIENTMAIL_CONFIG=str(ROOT / "examples" / "diloco.yaml"),
        GRADIENTMAIL_MAILBOX=str(box),
        GRADIENTMAIL_SYNC_EVERY="5",
        GRADIENTMAIL_FRAGMENTS="1",
        GRADIENTMAIL_IN_FLIGHT="1",
        GRADIENTMAIL_OVERLAP_STEPS="0",
        GRADIENTMAIL_QUORUM_SIZE="2",
        GRADIENTMAIL_MERGE="mean",
        GRADIENTMAIL_POLL_INTERVAL="0.02",
        GRADIENTMAIL_LEASE_EVERY="1",
        GRADIENTMAIL_LEASE_TIMEOUT="5",
    )
    procs = [
        spawn(
            [
                sys.executable,
                str(EXAMPLE),
                "--cpu",
                "--steps",
                "20",
                "--batch-size",
                "16",
                "--log-every",
                "10",
                "--wait-for",
                "2",
                "--data-seed",
                str(i + 1),
                "--output",
                str(tmp_path / f"n{i}.safetensors"),
            ],
            GRADIENTMAIL_LEARNER_ID=f"n{i}",
            **settings,
        )
        for i in range(2)
    ]
    logs = finish(procs)
    recs = records(box)
    assert [r.round for r in recs] == list(range(len(recs))) and len(recs) >= 20 // 5
    for log in logs:
        assert "held-out loss" in log and f"rounds_seen={len(recs) - 1}" in log, log[-2000:]

    manifest = asyncio.run(Exchange(LocalMailbox(box)).read_manifest())
    assert manifest is not None
    # The file's settings with the variables' overrides made the run's configuration:
    # standard DiLoCo's fields, and the file's cohort share (a round of every learner,
    # as a barrier's are, steps in full with it or without).
    assert Config.from_json(manifest.algorithm) == Config.standard(
        5, 2, merge=WeightedMean(), cohort_share=True)
    for rec in recs:
        assert sorted(p.learner for p in rec.participants) == ["n0", "n1"]
        assert all(p.tokens == 16 * p.steps >= 16 for p in rec.participants)
    theta = newest_theta(box)
    finals = [load_file(str(tmp_path / f"n{i}.safetensors")) for i in range(2)]
    assert set(finals[0]) == set(theta)
    for final in finals:
        for name, want in theta.items():
            np.testing.assert_array_equal(final[name], want)
