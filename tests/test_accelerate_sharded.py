"""A sharded Accelerate launch (issue #15): two CPU processes whose model is FSDP2
(`fully_shard`) are one learner through the `gradientmail_accelerate.DiLoCo` wrapper, each
rank mailing and reading its own rows, alongside a one-process launch.

Accelerate 1.15 applies its FSDP plugin only on accelerator devices: `AcceleratorState`
switches `distributed_type` to FSDP from MULTI_GPU (NPU, XPU, ...) but not from
MULTI_CPU, so on CPU the plugin is ignored and the worker shards the model itself with
`fully_shard` before `accelerator.prepare(optimizer)`. The plugin's own path
(`accelerate launch --use_fsdp --fsdp_version 2`) is checked on a GPU by
benchmarks/gpu_sharded_check.sh. Real processes (torchrun, gloo), a local directory.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
from test_accelerate_launch import (
    WORKER,
    finish,
    free_port,
    load,
    newest_theta,
    records,
    spawn,
    torchrun,
)

from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange

pytestmark = pytest.mark.slow

STEPS, H = 12, 4


@pytest.mark.parametrize("fmt", ["F32", "TOPK_F8"])
def test_an_fsdp2_launch_is_one_learner_alongside_a_one_process_launch(
        tmp_path: Path, fmt: str) -> None:
    # TOPK_F8: sparse deltas, each rank sparsifying its own rows with its own residuals.
    box, out = tmp_path / "run", tmp_path
    common = ["--steps", str(STEPS), "--sync-every", str(H), "--quorum", "2", "--wait-for", "2",
              *([] if fmt == "F32" else ["--delta-dtype", fmt])]
    sharded = spawn(
        [*torchrun(), "--master_port", str(free_port()), str(WORKER), str(box), "fsdp",
         "--out", str(out), "--fsdp", "--seed", "1", *common]
    )  # fmt: skip
    solo = spawn(
        [sys.executable, str(WORKER), str(box), "solo", "--out", str(out), "--seed", "2", *common]
    )
    finish([sharded, solo], timeout=400)
    rank0, rank1, single = load(out, "fsdp", 0), load(out, "fsdp", 1), load(out, "solo", 0)

    # The ranks' shards make the same whole model after every step and after close.
    assert rank0["world"] == rank1["world"] == 2
    assert rank0["records"] == rank1["records"]
    trained = [r for r in rank0["records"] if r["step"] != "closed"]
    assert [r["step"] for r in trained] == list(range(STEPS + 1))
    recs = records(box)
    last = len(recs) - 1
    seen = [r["rounds_seen"] for r in rank0["records"]]
    assert seen == sorted(seen) and seen[0] == -1 and seen[-1] == last
    assert any(s >= 0 for s in seen[:STEPS]), "no commit was applied during training"

    # Both learners in every round; the sharded launch counts both ranks' tokens.
    assert [r.round for r in recs] == list(range(last + 1)) and last + 1 >= STEPS // H
    for rec in recs:
        got = {p.learner: (p.steps, p.tokens) for p in rec.participants}
        assert set(got) == {"fsdp", "solo"}
        assert got["fsdp"][1] == got["fsdp"][0] * 2 * 30 and got["fsdp"][0] >= 1
    assert rank0["local_step"] == STEPS and rank1["local_step"] is None

    # Its contribution to the last round is one part per rank (or swept already).
    snap = asyncio.run(Exchange(LocalMailbox(box)).contribution(last, "fsdp"))
    assert snap is None or (snap.payload is None and len(snap.parts) == 2
                            and snap.delta_format == fmt)

    # The main process's state holds the learner's error feedback: with sparse deltas
    # every rank's residuals, gathered into whole tensors; none with F32 deltas.
    sizes = {n: int(np.prod(t.shape)) for n, t in newest_theta(box).items()}
    for result in (rank0, single):
        feedback = result["state"]["error_feedback"]
        if fmt == "F32":
            assert feedback is None
        else:
            assert feedback["residuals"] == {"0": sizes}, feedback
    assert rank1["state"]["error_feedback"] is None

    # All three processes end on the last commit.
    theta = newest_theta(box)
    for result in (rank0, rank1, single):
        for name, want in theta.items():
            mine = np.asarray(result["params"][name], dtype=np.float32).reshape(want.shape)
            np.testing.assert_array_equal(mine, want)
