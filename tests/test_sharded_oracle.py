"""Learners of three shapes in one run equal standard DiLoCo's oracle (issue #15): an
FSDP2 learner over 2 ranks and a 2-rank learner of the same model kept whole (each rank
mails its own rows, `ShardedRanks` under `RankSync`), and one plain process.

Real processes (torchrun, gloo on CPU) on a local-directory mailbox. Each multi-rank
learner trains every rank on its worker's batches, so its gradient is the one process's;
the plain learner counts the tokens of two ranks per step, so every contribution weighs
the same. No timing is asserted: the timeouts are generous for two loaded cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_learner_oracle import ROUNDS, H, oracle
from test_sharded_adapter import free_port
from workers.toy import make_model

from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import state_at
from gradientmail.wire.sharded_ranges import rows_of

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
LEARNERS = 3


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    out.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), out.get("PYTHONPATH", "")]))
    return out


def ranked(box: Path, learner: str, worker: int, out: Path, *extra: str
           ) -> subprocess.Popen[bytes]:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert exe is not None, "torchrun is not installed next to this Python"
    cmd = [exe, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
           str(free_port()), str(WORKERS / "ranked_learner.py"), str(box), learner,
           "--worker", str(worker), "--out", str(out), "--steps", str(ROUNDS * H),
           "--sync-every", str(H), "--learners", str(LEARNERS), *extra]
    return subprocess.Popen(cmd, env=env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def plain(box: Path, learner: str, worker: int, out: Path, *extra: str
          ) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(WORKERS / "learner_proc.py"), str(box), learner,
           "--worker", str(worker), "--out", str(out), "--steps", str(ROUNDS * H),
           "--sync-every", str(H), "--standard", str(LEARNERS), "--wait-for",
           str(LEARNERS), "--tokens", "10", *extra]
    return subprocess.Popen(cmd, env=env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def records(box: Path) -> list[Any]:
    import asyncio

    async def read() -> list[Any]:
        ex = Exchange(LocalMailbox(box))
        recs = await ex.rounds_after(-1)
        snaps = {(r, who): await ex.contribution(r, who)
                 for r in range(len(recs)) for who in ("fsdp", "split", "plain")}
        manifest = await ex.read_manifest()
        assert manifest is not None
        # Whoever won the creation election: a sharded learner's ranks upload Θ⁰ in
        # parts, one per rank; the plain process one payload.
        if manifest.creator == "plain":
            assert manifest.init_parts == () and manifest.init[0] is not None
        else:
            assert manifest.init == (None,) and len(manifest.init_parts[0]) == 2
        return [recs, snaps]

    return asyncio.run(read())


def whole_state(box: Path, rec: Any) -> Any:
    import asyncio

    return asyncio.run(state_at(Exchange(LocalMailbox(box)), 0, rec))


@pytest.mark.parametrize("checkpoint_every", [1, 20], ids=["rows", "replicated"])
def test_fsdp2_a_split_ddp_learner_and_a_plain_one_equal_the_oracle(
        tmp_path: Path, checkpoint_every: int) -> None:
    box = tmp_path / "run"
    outs = {who: tmp_path / f"{who}.json" for who in ("fsdp", "split", "plain")}
    extra = ("--checkpoint-every", str(checkpoint_every))
    procs = {
        "fsdp": ranked(box, "fsdp", 0, outs["fsdp"], "--fsdp", *extra),
        "split": ranked(box, "split", 1, outs["split"], *extra),
        "plain": plain(box, "plain", 2, outs["plain"], *extra),
    }
    try:
        for who, proc in procs.items():
            log, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"{who}:\n" + log.decode()[-4000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    want = oracle(LEARNERS)
    names = [n for n, _ in make_model().named_parameters()]
    got = {who: json.loads(out.read_text()) for who, out in outs.items()}
    got["split rank 1"] = json.loads(Path(f"{outs['split']}.rank1").read_text())
    got["fsdp rank 1"] = json.loads(Path(f"{outs['fsdp']}.rank1").read_text())
    for who, result in got.items():
        assert result["rounds_seen"] == ROUNDS - 1, who
        for name, w in zip(names, want, strict=True):
            g = torch.tensor(result["params"][name]).reshape(w.shape)
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=f"{who}: {name}")
    recs, snaps = records(box)
    if checkpoint_every > 1:
        # Every rank replayed the outer step on its own rows of the state (FSDP2: half of
        # each tensor's rows): byte for byte those rows of the state the closers computed.
        whole = whole_state(box, recs[-1])
        for who in ("fsdp", "fsdp rank 1", "split", "split rank 1"):
            rows = got[who]["rows"]
            assert rows["version"] == recs[-1].version, who
            for key, digest in rows["sha256"].items():
                kind, name = key.split("/", 1)
                a, b = rows["held"][name]
                want = rows_of(getattr(whole, kind)[name], a, b).tensor
                assert digest == hashlib.sha256(want.buffer).hexdigest(), (who, key)
        assert got["fsdp"]["rows"]["held"] != got["fsdp rank 1"]["rows"]["held"]
    else:
        assert all(got[who]["rows"] is None for who in ("fsdp", "split"))
    assert [sorted(p.learner for p in r.participants) for r in recs] == \
        [["fsdp", "plain", "split"]] * ROUNDS
    assert all(r.theta is not None for r in recs) == (checkpoint_every == 1)
    # Swept after each commit but the last: what is left shows the shapes on the wire.
    last = ROUNDS - 1
    for who, n in (("fsdp", 2), ("split", 2)):
        snap = snaps[(last, who)]
        assert snap is None or (snap.payload is None and len(snap.parts) == n), who
    assert snaps[(last, "plain")] is None or snaps[(last, "plain")].parts == ()
