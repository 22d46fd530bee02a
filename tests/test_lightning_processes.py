"""Lightning learners as separate OS processes: two GPT-2 learners on a local directory
and on moto S3, a 2-rank DDP learner whose ranks stay identical, and the tiny recipe
through the `gradientmail-train` command."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gradientmail.learner.options import LearnerOptions

# Before any Hugging Face import: they read it once. Tests never download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

from safetensors.torch import load_file

from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import LocalMailbox, Mailbox, S3Mailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import state_at

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), out.get("PYTHONPATH", "")])
    out.update(extra)
    return out


def spawn(
    args: list[str], cwd: Path | None = None, extra: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        args, env=env(**(extra or {})), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def finish(proc: subprocess.Popen[bytes], timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(out.decode()[-4000:]) from None
    text = out.decode()
    assert proc.returncode == 0, text[-4000:]
    return text


def newest_theta(mailbox: Mailbox) -> dict[str, torch.Tensor]:
    async def go() -> dict[str, torch.Tensor]:
        ex = Exchange(mailbox)
        manifest = await ex.read_manifest()
        assert manifest is not None
        latest = await ex.latest_commit_per_fragment(len(manifest.plan))
        out: dict[str, torch.Tensor] = {}
        for p, names in enumerate(manifest.plan):
            tensors = (await state_at(ex, p, latest.get(p), manifest)).theta
            for n in names:
                t = tensors[n]
                out[n] = torch.frombuffer(bytearray(t.data), dtype=torch.float32).reshape(t.shape)
        await mailbox.close()
        return out

    return asyncio.run(go())


def all_records(mailbox: Mailbox) -> list[Any]:
    async def go() -> list[Any]:
        recs = await Exchange(mailbox).rounds_after(-1)
        await mailbox.close()
        return list(recs)

    return asyncio.run(go())


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_two_gpt2_learners_commit_rounds_and_end_on_the_last_commits(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    extra: dict[str, str] = {}
    if kind == "local":
        url = str(tmp_path / "run")

        def open_box() -> Mailbox:
            return LocalMailbox(tmp_path / "run")
    else:
        bucket = request.getfixturevalue("s3_bucket")
        endpoint = request.getfixturevalue("moto_endpoint")
        prefix = f"lit-{secrets.token_hex(4)}"
        url = f"s3://{bucket}/{prefix}"
        extra["AWS_ENDPOINT_URL"] = endpoint

        def open_box() -> Mailbox:
            return S3Mailbox(bucket, prefix=prefix, endpoint_url=endpoint)

    steps = 24
    outs = [str(tmp_path / f"learner-{i}") for i in range(2)]
    procs = [
        spawn(
            [
                sys.executable,
                str(WORKERS / "lightning_gpt2.py"),
                url,
                f"learner-{i}",
                outs[i],
                "--steps",
                str(steps),
                "--cache",
                str(tmp_path / "cache"),
                "--start-after",
                str(4 * i),  # learner-1 seconds late: the callback waits for it
            ],
            extra=extra,
        )
        for i in range(2)
    ]
    for p in procs:
        finish(p)
    recs = all_records(open_box())
    # Standard DiLoCo, H = 4, a quorum of both: though learner-1 starts seconds late,
    # learner-0 waits for it at train start, and every round merges both.
    assert [r.round for r in recs] == list(range(steps // 4))
    assert [sorted(p.learner for p in r.participants) for r in recs] == [
        ["learner-0", "learner-1"]] * (steps // 4)
    for r in recs:
        for p in r.participants:
            assert p.tokens == p.steps * 8 * 64
    box = open_box()
    for i in range(2):
        got = json.loads(Path(outs[i] + ".json").read_text())
        state = got["state"]
        assert (state["learner_id"], state["local_step"]) == (f"learner-{i}", steps)
        losses = got["losses"]
        assert len(losses) == steps
        assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
        # close() reset the model to the newest commit it had seen (kept: keep_versions).
        last = recs[state["rounds_seen"]]
        theta = dict(asyncio.run(state_at(Exchange(box), last.fragment, last)).theta)
        final = load_file(outs[i] + ".safetensors")
        assert set(final) == set(theta)
        for name, value in final.items():
            t = theta[name]
            want = torch.frombuffer(bytearray(t.data), dtype=torch.float32).reshape(t.shape)
            torch.testing.assert_close(value, want, rtol=0, atol=0)
    asyncio.run(box.close())
    # Both end on the run's newest commit: the same parameters.
    seen = [json.loads(Path(o + ".json").read_text())["state"]["rounds_seen"] for o in outs]
    assert seen == [recs[-1].round] * 2


def test_ddp_learner_keeps_its_ranks_identical_after_every_apply(tmp_path: Path) -> None:
    from workers.lightning_toy import ToyModule, toy_loader

    box = tmp_path / "run"
    algorithm = DiLoCo(sync_every=4, fragments=2, in_flight=1, overlap_steps=0,
                       flush_on_close=False)
    # Another learner creates the run and commits a few rounds, so joining moves the DDP
    # learner away from its own initialisation.
    model = ToyModule(seed=0)
    creator = Learner(
        TorchAdapter(model),
        algorithm,
        str(box),
        "creator",
        options=LearnerOptions(poll_interval=0.01, lease_every=2.0, lease_timeout=6.0),
    )
    creator.start()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in toy_loader(n=32):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model.net(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        creator.step(24)
    creator.close()
    joined_at = newest_theta(LocalMailbox(box))
    before = len(all_records(LocalMailbox(box)))
    assert before == 4

    out = tmp_path / "ddp.json"
    finish(
        spawn(
            [sys.executable, str(WORKERS / "lightning_ddp.py"), str(box), str(out), "--steps", "12"]
        )
    )
    got = json.loads(out.read_text())
    points = got["points"]
    assert [p["where"] for p in points] == ["start"] + ["step"] * 12 + ["end"]
    assert all(p["diff"] == 0.0 for p in points), points
    # Rank 0 applied commits during training (2 fragments, a round every 2 steps).
    assert len(got["aligned"]) >= 4
    want = torch.cat([joined_at[n].reshape(-1) for n, _ in ToyModule().named_parameters()])
    torch.testing.assert_close(torch.tensor(got["start"]), want, rtol=0, atol=0)
    recs = all_records(LocalMailbox(box))
    mine = [p for r in recs[before:] for p in r.participants if p.learner == "ddp-group"]
    assert len(mine) == 6
    # Per step: the first tensor of rank 0's batch (4 × 6) × 2 ranks. A fragment's steps
    # run from its last alignment: 2 for the first round of each, then H = 4.
    assert [p.steps for p in mine] == [2, 4, 4, 4, 4, 4]
    assert all(p.tokens == p.steps * 24 * 2 for p in mine)


def test_a_ddp_learners_ranks_draw_disjoint_batches_of_their_part_of_the_share(
    tmp_path: Path,
) -> None:
    out = tmp_path / "hook"
    # One learner holds the whole global batch of 20; 2 ranks x 2 micro-batches per step.
    finish(
        spawn(
            [sys.executable, str(WORKERS / "lightning_share.py"), str(tmp_path / "run"),
             str(out), "--loader", "hook", "--global-batch", "20", "--accum", "2"]
        )
    )  # fmt: skip
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text())["batches"] for r in (0, 1)]
    for batches in ranks:
        assert [len(b) for b in batches] == [5] * 12  # 6 steps x 2 micro-batches of 5
    mine = [[i for b in batches for i in b] for batches in ranks]
    assert len(set(mine[0])) == len(mine[0]) == len(set(mine[1])) == 60
    assert not set(mine[0]) & set(mine[1])


def test_a_ready_made_loader_under_ddp_is_refused_before_it_ignores_the_share(
    tmp_path: Path,
) -> None:
    proc = spawn(
        [sys.executable, str(WORKERS / "lightning_share.py"), str(tmp_path / "run"),
         str(tmp_path / "direct"), "--loader", "direct"]
    )  # fmt: skip
    out, _ = proc.communicate(timeout=240)
    text = out.decode()
    assert proc.returncode != 0, text[-4000:]
    assert "global_batch_size=12 cannot resize the training batches" in text, text[-4000:]
    assert "built inside a train_dataloader() hook" in text
    assert not list(tmp_path.glob("direct.rank*.json"))


def test_tiny_recipe_through_gradientmail_train(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "gradientmail-train"
    assert script.exists(), "gradientmail-train is not installed; run pip install -e ."
    text = finish(
        spawn(
            [
                str(script),
                "fit",
                "--config",
                str(ROOT / "recipes" / "gpt2-tiny-cpu.yaml"),
                "--trainer.max_steps=6",
                "--trainer.val_check_interval=3",
                "--trainer.limit_val_batches=2",
                "--trainer.log_every_n_steps=1",
                "--trainer.enable_progress_bar=false",
                "--model.warmup_steps=2",
                "--data.max_documents=16",
                "--data.num_shards=1",
                "--data.batch_size=4",
                "--diloco.sync_every=2",
                "--diloco.poll_interval=0.05",
            ],
            cwd=tmp_path,
        )
    )
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in text
    recs = all_records(LocalMailbox(tmp_path / "runs" / "gpt2-tiny-cpu" / "mailbox"))
    # H = 2 with 2 fragments: a round due every step, at most τ = 2 of them unmerged, so
    # how many go out in 6 steps depends on how fast the commits come back.
    assert [r.round for r in recs] == list(range(len(recs)))
    assert len(recs) >= 3
    assert {p.learner for r in recs for p in r.participants} == {"learner-0"}
    (version,) = (tmp_path / "runs" / "gpt2-tiny-cpu" / "lightning_logs").iterdir()
    with open(version / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert any(r["train/loss"] for r in rows)
    assert any(r["val/ppl"] for r in rows)
    assert max(float(r["diloco/rounds_committed"] or 0) for r in rows) == len(recs)
    config = (version / "config.yaml").read_text()
    assert "diloco:" in config and "sync_every: 2" in config
