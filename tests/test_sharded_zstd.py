"""An FSDP2 learner of 2 ranks in a run whose payloads are zstd-compressed: no range of a
zstd frame decodes alone, so each rank downloads every payload whole for its half of the
rows, and each says so once (`ShardedReplica`'s warning), naming the codec and the fix.

Real processes (torchrun, gloo on CPU) on a local-directory mailbox, as in
tests/test_sharded_oracle.py; the learner is alone in its run (a quorum of one).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_learner_oracle import ROUNDS, H
from test_sharded_adapter import free_port
from test_sharded_oracle import ROOT, WORKERS, env, whole_state

from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange

pytestmark = pytest.mark.slow


def test_each_rank_of_an_fsdp2_learner_on_zstd_payloads_warns_once(tmp_path: Path) -> None:
    box, out = tmp_path / "run", tmp_path / "fsdp.json"
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert exe is not None, "torchrun is not installed next to this Python"
    cmd = [exe, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
           str(free_port()), str(WORKERS / "ranked_learner.py"), str(box), "fsdp",
           "--worker", "0", "--out", str(out), "--steps", str(ROUNDS * H), "--sync-every",
           str(H), "--learners", "1", "--fsdp", "--compression", "zstd"]
    proc = subprocess.run(cmd, env=env(), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=600)
    log = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, log[-4000:]

    # ROUNDS commits were read by both ranks, every one whole: one warning a rank. (Θ⁰,
    # which this learner created, is in uncompressed parts: each rank read its rows.)
    warned = [line for line in log.splitlines() if "no range of a zstd frame" in line]
    assert len(warned) == 2, log[-4000:]
    for line in warned:
        found = re.search(r"(\S+\.safetensors\.zst) is zstd-compressed, and no range of a "
                          r"zstd frame decodes alone: this rank downloaded all ([\d,]+) "
                          r"bytes of it \(([\d,]+) decoded\) for ([\d,]+) bytes of its rows",
                          line)
        assert found is not None, line
        size, decoded, rows = (int(g.replace(",", "")) for g in found.groups()[1:])
        assert 0 < rows < decoded and rows < size, line  # half of the rows, or about
        assert 'Set compression: "off" on every learner of the run' in line, line

    # Read whole, the payloads still give the newest commit on both ranks.
    async def newest() -> object:
        recs = await Exchange(LocalMailbox(box)).rounds_after(-1)
        assert len(recs) == ROUNDS
        assert all(r.step is not None and r.step.payload.key.endswith(".zst") for r in recs)
        return recs[-1]

    theta = whole_state(box, asyncio.run(newest())).theta
    for path in (out, Path(f"{out}.rank1")):
        got = json.loads(path.read_text())
        assert got["rounds_seen"] == ROUNDS - 1, path
        for name, t in theta.items():
            want = torch.frombuffer(bytearray(t.buffer), dtype=torch.float32)
            torch.testing.assert_close(torch.tensor(got["params"][name]), want, rtol=0,
                                       atol=0, msg=f"{path.name}: {name}")
