"""A sharded Lightning learner (issue #15): `ModelParallelStrategy` with FSDP2, every rank
mailing its own rows through the DiLoCoCallback, SIGKILLed, and resumed from its
Lightning checkpoint at another world size; and (issue #27) one beside a plain Lightning
learner of a standard DiLoCo run, the two training together in every round.

Real processes (torchrun, gloo on CPU) on a local-directory mailbox. The phases run one
after the other, so what each must end on is known exactly; no timing is asserted and
the timeouts are generous for two loaded cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gradientmail.learner.options import LearnerOptions

pytest.importorskip("lightning")

from test_lightning_processes import newest_theta
from test_sharded_adapter import free_port
from workers.lightning_sharded import ALGORITHM, STANDARD
from workers.lightning_toy import ToyModule, toy_loader

from gradientmail.adapters import TorchAdapter
from gradientmail.errors import ConfigError
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange
from gradientmail_lightning.callback import check_strategy

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "lightning_sharded.py"


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "GRADIENTMAIL_"))}
    out.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), out.get("PYTHONPATH", "")]))
    return out


def torchrun(ranks: int) -> list[str]:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert exe is not None, "torchrun is not installed next to this Python"
    return [exe, "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port())]


def launch(ranks: int, box: Path, out: Path, *extra: str, timeout: float = 600
           ) -> tuple[int, str]:
    cmd = [*torchrun(ranks), str(WORKER), str(box), str(out), *extra]
    proc = subprocess.Popen(cmd, env=env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, log.decode()


def records(box: Path) -> list[Any]:
    async def go() -> list[Any]:
        ex = Exchange(LocalMailbox(box))
        recs = list(await ex.rounds_after(-1))
        last = recs[-1].round
        snaps = {p.learner: await ex.contribution(last, p.learner)
                 for p in recs[-1].participants}
        await ex.mailbox.close()
        return [recs, snaps]

    return asyncio.run(go())


def manifest_of(box: Path) -> Any:
    async def go() -> Any:
        ex = Exchange(LocalMailbox(box))
        try:
            return await ex.read_manifest()
        finally:
            await ex.mailbox.close()

    return asyncio.run(go())


def parts_written(log: Path, ranks: int, learner: str) -> list[dict[int, tuple[int, int]]]:
    """Per rank, {round: (k, n)} of the parts `learner`'s ranks wrote (their key logs);
    a whole payload written by any of them fails the test."""
    out: list[dict[int, tuple[int, int]]] = []
    for rank in range(ranks):
        path = Path(f"{log}.rank{rank}")
        keys = path.read_text().split() if path.exists() else []
        assert not [k for k in keys if k.startswith("payloads/")], keys
        mine = [m for k in keys
                if (m := re.fullmatch(rf"parts/(\d+)/{re.escape(learner)}/(\d+)-of-(\d+)"
                                      r"\.safetensors", k))]
        out.append({int(m[1]): (int(m[2]), int(m[3])) for m in mine})
    return out


def assert_params(got: dict[str, list[float]], want: dict[str, torch.Tensor], who: str) -> None:
    assert set(got) == set(want), who
    for name, w in want.items():
        g = torch.tensor(got[name], dtype=torch.float32).reshape(w.shape)
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=f"{who}: {name}")


def test_strategies_are_checked_by_name() -> None:
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )

    for fine in (SingleDeviceStrategy("cpu"), DDPStrategy(), ModelParallelStrategy()):
        check_strategy(fine)
    # DeepSpeed is not installed here, and its strategy refuses to be built without it;
    # the check looks at the type alone.
    deepspeed = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    for strategy, name in ((FSDPStrategy(), "FSDPStrategy"), (deepspeed, "DeepSpeedStrategy")):
        with pytest.raises(ConfigError) as info:
            check_strategy(strategy)
        text = str(info.value)
        assert text.startswith(f"DiLoCoCallback does not support the {name} strategy; ")
        assert "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)" in text
        assert "torch.distributed.fsdp.fully_shard in your LightningModule's configure_model" \
            in text


@pytest.mark.slow
def test_a_killed_fsdp2_learner_resumes_at_another_world_size_as_the_same_learner(
        tmp_path: Path) -> None:
    box, ckpts = tmp_path / "run", tmp_path / "ckpt"

    # 1. The sharded learner (2 ranks) creates the run, checkpoints at step 6 and is
    #    killed at step 8, mid-run: its lease is left to expire, nothing is flushed.
    first, keys = tmp_path / "first", tmp_path / "keys"
    rc, log = launch(2, box, first, "--steps", "20", "--ckpt-dir", str(ckpts),
                     "--ckpt-every", "6", "--die-at", "8", "--key-log", f"{keys}-first")
    assert rc != 0, "the learner was to be killed:\n" + log[-4000:]
    started = json.loads(Path(f"{first}.start.json").read_text())
    learner_id = started["learner_id"]
    checkpoint = ckpts / "epoch=0-step=6.ckpt"
    assert checkpoint.is_dir(), sorted(p.name for p in ckpts.iterdir())
    recs, snaps = records(box)
    assert recs and {p.learner for r in recs for p in r.participants} == {learner_id}
    # Its contributions were made of one part per rank, each written by that rank.
    mine = snaps[learner_id]
    assert mine is None or (mine.payload is None and len(mine.parts) == 2)
    written = parts_written(Path(f"{keys}-first"), 2, learner_id)
    for r in recs:
        assert [w.get(r.round) for w in written] == [(0, 2), (1, 2)], (r.round, written)
    # It created the run: each rank uploaded its own rows of every fragment's Θ⁰ as a
    # part, and none of them a whole fragment.
    manifest = manifest_of(box)
    assert manifest is not None and manifest.creator == learner_id
    fragments = len(manifest.plan)
    assert manifest.init == (None,) * fragments
    for rank in range(2):
        logged = Path(f"{keys}-first.rank{rank}").read_text().split()
        assert [k for k in logged if k.startswith("init/")] == [
            f"init/000000/{p}/{rank}-of-2.safetensors" for p in range(fragments)], logged
        assert [ref.key for ref in (refs[rank] for refs in manifest.init_parts)] == [
            f"init/000000/{p}/{rank}-of-2.safetensors" for p in range(fragments)]
    before = len(recs)

    # 2. Meanwhile a plain learner moves the run on.
    other = ToyModule(seed=5)
    learner = Learner(
        TorchAdapter(other),
        ALGORITHM,
        str(box),
        "other",
        options=LearnerOptions(poll_interval=0.01, lease_every=1.0, lease_timeout=6.0),
    )
    learner.start()
    opt = torch.optim.SGD(other.parameters(), lr=0.05)
    for x, y in toy_loader(n=40, seed=3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(other.net(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        learner.step(24)
    learner.close()
    moved = newest_theta(LocalMailbox(box))
    recs, _ = records(box)
    assert len(recs) >= before + 4
    after_other = len(recs)

    # 3. Resumed from the step-6 checkpoint with 3 ranks (the 2-row layer leaves rank 2
    #    an empty shard): the same learner, joined on the newest commits, not on the
    #    checkpoint's weights; it ends on the newest commits.
    second = tmp_path / "second"
    rc, log = launch(3, box, second, "--steps", "14", "--resume", str(checkpoint),
                     "--key-log", f"{keys}-second")
    assert rc == 0, log[-6000:]
    start = json.loads(Path(f"{second}.start.json").read_text())
    end = json.loads(Path(f"{second}.end.json").read_text())
    assert start["learner_id"] == end["learner_id"] == learner_id
    assert start["global_step"] == 6 and end["global_step"] == 14 and end["world"] == 3
    assert_params(start["params"], moved, "joined")
    recs, snaps = records(box)
    resumed = recs[after_other:]
    assert len(resumed) >= 3, [r.round for r in recs]
    assert all([p.learner for p in r.participants] == [learner_id] for r in resumed)
    assert end["published"] and min(end["published"]) >= after_other
    mine = snaps[learner_id]
    assert mine is None or (mine.payload is None and len(mine.parts) == 3)
    written = parts_written(Path(f"{keys}-second"), 3, learner_id)
    for r in resumed:
        assert [w.get(r.round) for w in written] == [(0, 3), (1, 3), (2, 3)], (r.round, written)
    assert end["rounds_seen"] == recs[-1].round
    assert_params(end["params"], newest_theta(LocalMailbox(box)), "ended")


# ~25 s on an idle 2-core machine; the deadline below leaves time to show the logs.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_fsdp2_learner_and_a_plain_one_of_a_standard_run_train_together_every_round(
        tmp_path: Path) -> None:
    """Issue #27: neither learner is told to wait; the callback's default (standard
    DiLoCo's quorum of 2) holds the plain one at train start until the FSDP2 one, whose
    launch comes seconds later, holds a lease too."""
    box, steps, h = tmp_path / "run", 16, STANDARD.sync_every
    assert (STANDARD.quorum_size, STANDARD.overlap_steps, STANDARD.fragments) == (2, 0, 1)
    plain_out, fsdp_out = tmp_path / "plain", tmp_path / "fsdp"
    common = ["--algorithm", "standard", "--steps", str(steps)]
    logs: dict[str, Any] = {}

    def start(name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        logs[name] = (tmp_path / f"{name}.log").open("wb")
        return subprocess.Popen(cmd, env=env(), cwd=ROOT, stdout=logs[name],
                                stderr=subprocess.STDOUT)

    def log_of(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text(errors="replace")[-6000:]

    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["plain"] = start("plain", [
            sys.executable, str(WORKER), str(box), str(plain_out), "--plain",
            "--learner-id", "plain", "--seed", "7", "--data-seed", "1", *common])
        # The FSDP2 launch starts once the plain learner waits for it (or has ended, as
        # it does when it does not wait): so the plain learner's wait is always seen,
        # however the two start-ups interleave on a loaded machine.
        waiting = Path(f"{plain_out}.awaiting.json")
        deadline = time.monotonic() + 540
        while not waiting.exists() and procs["plain"].poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        procs["fsdp"] = start("fsdp", [
            *torchrun(2), str(WORKER), str(box), str(fsdp_out), "--learner-id", "fsdp",
            "--data-seed", "2", *common])
        for name, proc in procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} did not end:\n{log_of(name)}") from None
            assert proc.returncode == 0, f"{name}:\n{log_of(name)}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in logs.values():
            f.close()

    plain = json.loads(Path(f"{plain_out}.end.json").read_text())
    fsdp = json.loads(Path(f"{fsdp_out}.end.json").read_text())
    assert (plain["learner_id"], plain["world"], plain["global_step"]) == ("plain", 1, steps)
    assert (fsdp["learner_id"], fsdp["world"], fsdp["global_step"]) == ("fsdp", 2, steps)
    # The plain learner waited at train start, alone, for the quorum of 2 (by default).
    assert plain["awaited"] and plain["awaited"][0] == {"live": ["plain"], "wanted": 2}, \
        plain["awaited"]
    assert all(e["wanted"] == 2 for e in fsdp["awaited"]), fsdp["awaited"]
    # Both trained from Θ⁰ (the plain learner created the run; no round closed before
    # the FSDP2 learner joined).
    started = [json.loads(Path(f"{o}.start.json").read_text()) for o in (plain_out, fsdp_out)]
    assert manifest_of(box).creator == "plain"
    assert [s["global_step"] for s in started] == [0, 0]
    assert started[1]["params"] == started[0]["params"]

    # Every round, both learners, H steps each: steps / H rounds.
    recs, _ = records(box)
    assert [r.round for r in recs] == list(range(steps // h))
    for r in recs:
        got = {p.learner: p.steps for p in r.participants}
        assert got == {"plain": h, "fsdp": h}, (r.round, got)
    assert plain["rounds_seen"] == fsdp["rounds_seen"] == recs[-1].round

    # Both end on the newest commit: the same parameters.
    assert set(plain["params"]) == set(fsdp["params"])
    for name, values in plain["params"].items():
        torch.testing.assert_close(torch.tensor(fsdp["params"][name]), torch.tensor(values),
                                   rtol=0, atol=1e-5, msg=name)
    theta = newest_theta(LocalMailbox(box))
    assert_params(plain["params"], theta, "plain ended")
    assert_params(fsdp["params"], theta, "fsdp ended")


@pytest.mark.slow
def test_a_sparse_fsdp2_learner_checkpoints_its_ranks_residuals_and_resumes_them_on_3_ranks(
        tmp_path: Path) -> None:
    """TOPK_F8 deltas with error feedback: each rank keeps its own rows' residuals; the
    step-6 Lightning checkpoint (written by global rank 0 alone) holds them gathered into
    whole tensors; resumed from it with 3 ranks (one with an empty shard of the 2-row
    layer), each rank takes its rows, and gathered again after the join they are the
    checkpoint's, byte for byte: the rounds the checkpoint had in flight stood."""
    box, ckpts = tmp_path / "run", tmp_path / "ckpt"
    first = tmp_path / "first"
    rc, log = launch(2, box, first, "--steps", "12", "--ckpt-dir", str(ckpts),
                     "--ckpt-every", "6", "--algorithm", "sparse", "--learner-id", "lsp")
    assert rc == 0, log[-4000:]
    checkpoint = ckpts / "epoch=0-step=6.ckpt"
    meta = torch.load(checkpoint / "meta.pt", weights_only=False)
    saved = meta["callbacks"]["DiLoCoCallback"]["error_feedback"]
    manifest = manifest_of(box)
    assert manifest is not None and saved is not None
    shapes = {p.name: p.shape for p in manifest.schema.params}
    assert saved["residuals"], saved
    for f, arrays in saved["residuals"].items():
        assert set(arrays) == set(manifest.plan[f]), f
        for name, a in arrays.items():
            # Whole tensors on the host, not one rank's rows.
            assert isinstance(a, torch.Tensor) and a.device.type == "cpu"
            assert a.numel() == torch.Size(shapes[name]).numel(), name
            assert bool(a.abs().sum() > 0), name
    recs, _ = records(box)
    for r in saved["in_flight"]:
        assert [p.learner for p in recs[r].participants] == ["lsp"], r

    second = tmp_path / "second"
    rc, log = launch(3, box, second, "--steps", "10", "--resume", str(checkpoint),
                     "--algorithm", "sparse", "--learner-id", "lsp")
    assert rc == 0, log[-6000:]
    start = json.loads(Path(f"{second}.start.json").read_text())
    end = json.loads(Path(f"{second}.end.json").read_text())
    assert start["global_step"] == 6 and end["world"] == 3 and end["published"]
    resumed = start["feedback"]
    assert resumed["in_flight"] == []  # settled from their records at the join
    assert set(resumed["residuals"]) == {str(f) for f in saved["residuals"]}
    for f, arrays in saved["residuals"].items():
        for name, a in arrays.items():
            got = torch.tensor(resumed["residuals"][str(f)][name], dtype=torch.float32)
            assert torch.equal(got, a.reshape(-1)), (f, name)
