"""A sharded learner's ranks hold no more than their shard plus one tensor of the
fragment while they publish and while they apply a commit (issue #15), measured through
the learner in real processes: an FSDP2 learner over 2 ranks (gloo, CPU), closed by a
`gradientmail sync` process, every allocation of every thread of each rank counted while
it mails its part and while it reads, replays and applies a commit
(tests/workers/memory_learner.py, `SharedMeter`).

The bound is the issue's: shard (F32) + the largest tensor (F32) + a small constant for
the Python objects of the learner's threads (records, asyncio, headers). The model has
many small blocks, so twice the shard (what a rank held when it built its delta and then
the payload from it, or when it received a fragment whole) is well over the bound.
Deterministic: the windows are bounded by the code they measure, not by time. The join is
measured apart: it makes the rank's rows of the state it keeps (with a replicated outer
step, theta and momentum), bounded by that state, not the fragment.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_sharded_adapter import free_port
from test_sharded_oracle import env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "workers" / "memory_learner.py"
ROUNDS = 3
#: Python objects of a learner's threads during one window (records, events, the
#: payload's header, asyncio: 50–120 KB measured), and the outer step's temporaries (a
#: few buffers of one tensor's rows). The meter adds the torch and Python peaks as if
#: they fell at once, which they need not.
SLACK = 256 * 1024


@pytest.mark.parametrize("checkpoint_every", [1, 20], ids=["theta-rows", "replicated"])
def test_a_sharded_ranks_publish_and_apply_stay_within_shard_plus_one_tensor(
        tmp_path: Path, checkpoint_every: int) -> None:
    box = tmp_path / "run"
    closer = subprocess.Popen(
        [sys.executable, "-m", "gradientmail.app.cli", "sync", str(box), "--poll-interval",
         "0.01", "--closer-id", "closer", "--quiet"],
        cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert exe is not None
    out = tmp_path / "mem"
    try:
        proc = subprocess.run(
            [exe, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
             str(free_port()), str(WORKER), str(box), str(out), "--rounds", str(ROUNDS),
             "--checkpoint-every", str(checkpoint_every), "--layers", "12"],
            env=env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            timeout=600)
        assert proc.returncode == 0, proc.stdout.decode()[-4000:]
    finally:
        closer.send_signal(signal.SIGTERM)
        try:
            closer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            closer.kill()
    for rank in range(2):
        report = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert report["rounds_seen"] == ROUNDS - 1
        shard, largest = report["shard_f32"], report["largest_f32"]
        assert 2 * shard > shard + largest + SLACK  # the bound tells the two apart
        peaks = report["peaks"]
        assert len(peaks["publish"]) == ROUNDS, peaks
        assert len(peaks["apply"]) >= ROUNDS, peaks
        for window in ("publish", "apply", "snapshot"):
            for torch_peak, py_peak in peaks[window]:
                assert torch_peak + py_peak <= shard + largest + SLACK, (
                    f"rank {rank} {window}: {torch_peak} + {py_peak} bytes; shard {shard}, "
                    f"largest tensor {largest}")
        # What the windows hold is the rank's rows, not the fragment: the part, or the
        # commit's rows loaded onto the device.
        assert max(t + p for t, p in peaks["publish"]) >= shard // 2
        # Joining makes what the rank keeps from then on: the rows it loads and, with a
        # replicated outer step, its rows of theta and momentum (F32; no master apart
        # for an F32 model): the rank's state, never the fragment's (the window also
        # holds the rest of joining: the store's self-test, the manifest, leases).
        (join,) = peaks["join"]
        kept = shard * (3 if checkpoint_every > 1 else 1)
        assert sum(join) <= kept + largest + 2 * SLACK, (rank, join, shard, largest)
        print(f"rank {rank}: shard {shard}, largest {largest}: " + ", ".join(
            f"{w} {max(t + p for t, p in v)}" for w, v in peaks.items()))
