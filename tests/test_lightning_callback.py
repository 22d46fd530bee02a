"""DiLoCoCallback on a real Trainer in this process (CPU, a toy module): real steps under
accumulation, token counts, metrics, checkpoint state, crash and resume, refusals."""

from __future__ import annotations

import asyncio
import csv
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

# Before any Hugging Face import: they read it once. Tests never download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lightning")

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from workers.lightning_toy import ToyModule, flat_params, toy_loader

from gradientmail import events as ev
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.errors import AuthenticationError, ConfigError, RunConfigMismatch
from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import state_at
from gradientmail.wire.records import RoundRecord
from gradientmail_lightning import DiLoCoCallback
from gradientmail_lightning.callback import (
    PROGRESS_BAR,
    STATE_KEY,
    check_share_samplers,
    check_strategy,
)

FAST: dict[str, Any] = {"poll_interval": 0.01, "lease_every": 2.0, "lease_timeout": 6.0}
#: A learner's error feedback without sparse deltas: nothing kept.
NO_FEEDBACK = None
STANDARD = DiLoCo.standard(3, 1)


class Recorder:
    def __init__(self) -> None:
        self.events: list[ev.Event] = []
        self.lock = threading.Lock()

    def __call__(self, event: ev.Event) -> None:
        with self.lock:
            self.events.append(event)

    def of(self, cls: type[Any]) -> list[Any]:
        with self.lock:
            return [e for e in self.events if isinstance(e, cls)]


def trainer(**kw: Any) -> Trainer:
    base: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    base.update(kw)
    return Trainer(**base)


def records(box: Path) -> list[RoundRecord]:
    return list(asyncio.run(Exchange(LocalMailbox(box)).rounds_after(-1)))


def test_accumulation_counts_real_steps_and_tokens(tmp_path: Path) -> None:
    box = tmp_path / "run"
    cb = DiLoCoCallback(str(box), STANDARD, "acc-0", **FAST)
    t = trainer(max_steps=6, accumulate_grad_batches=2, callbacks=[cb])
    t.fit(ToyModule(), toy_loader(batch_size=4))
    assert t.global_step == 6
    assert cb.state_dict() == {"learner_id": "acc-0", "local_step": 6, "rounds_seen": 1,
                               "error_feedback": NO_FEEDBACK}
    recs = records(box)
    assert [r.round for r in recs] == [0, 1]
    for r in recs:
        (p,) = r.participants
        # 3 real steps of 2 micro-batches of x[4, 6]: the first tensor of each batch.
        assert (p.learner, p.steps, p.tokens) == ("acc-0", 3, 3 * 2 * 24)
        # ... and the mean of the training losses its micro-batches returned.
        assert p.loss is not None and 0 < p.loss < 10


@pytest.mark.parametrize(
    ("tokens", "per_step"), [(5, 5), (lambda batch: int(batch[1].shape[0]), 4)]
)
def test_tokens_per_step_int_or_callable(tmp_path: Path, tokens: Any, per_step: int) -> None:
    box = tmp_path / "run"
    cb = DiLoCoCallback(str(box), STANDARD, "tok-0", tokens_per_step=tokens, **FAST)
    trainer(max_steps=3, callbacks=[cb]).fit(ToyModule(), toy_loader())
    (rec,) = records(box)
    assert rec.participants[0].tokens == 3 * per_step


def test_metrics_reach_the_progress_bar_and_the_loggers(tmp_path: Path) -> None:
    box = tmp_path / "run"
    cb = DiLoCoCallback(str(box), STANDARD, "log-0", **FAST)
    logger = CSVLogger(tmp_path / "logs", name="m", version=0)
    t = trainer(
        max_steps=9, callbacks=[cb], logger=logger, log_every_n_steps=1, enable_progress_bar=True
    )
    t.fit(ToyModule(), toy_loader())
    bar = t.progress_bar_metrics
    assert set(bar) >= set(PROGRESS_BAR) - {"diloco/mean_cosine"}  # one learner: no cosine
    assert (bar["diloco/rounds_seen"], bar["diloco/live_learners"]) == (2.0, 1.0)
    logger.finalize("success")
    with open(tmp_path / "logs" / "m" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["diloco/rounds_committed"]]
    # Every step (rounds close at steps 3, 6, 9), then once more by on_train_end.
    assert [int(r["step"]) for r in rows] == [*range(1, 10), 9]
    assert [float(r["diloco/rounds_committed"]) for r in rows] == [
        0.0,
        0.0,
        1.0,
        1.0,
        1.0,
        2.0,
        2.0,
        2.0,
        3.0,
        3.0,
    ]
    # Alone, each contribution completes its round: its closer merges it from memory, and
    # nothing goes up (held); the commits' steps are its own, so nothing comes down either.
    assert {float(r["diloco/bytes_sent"]) for r in rows} == {0.0}
    assert [float(r["diloco/published"]) for r in rows][-1] == 3.0
    assert float(rows[-1]["diloco/staleness"]) == 0.0  # the barrier: applied at once
    assert float(rows[-1]["diloco/live_learners"]) == 1.0
    # The learner's meter: every request of its own and of its closer, and their price.
    from gradientmail.integration.metrics import TRAFFIC_METRICS

    last = {k: float(v) for k, v in rows[-1].items() if k in TRAFFIC_METRICS}
    assert set(last) == set(TRAFFIC_METRICS)
    assert min(last[f"diloco/requests_{kind}"]
               for kind in ("get", "put", "create", "list", "delete")) > 0
    assert last["diloco/requests"] == sum(
        last[f"diloco/requests_{kind}"] for kind in ("get", "put", "list", "delete"))
    # the creator: Θ⁰, the manifest, each commit's payloads and records went up
    assert last["diloco/mailbox_bytes_up"] > 0 < last["diloco/mailbox_bytes_down"]
    assert last["diloco/cost_usd"] == pytest.approx(
        ((last["diloco/requests_put"] + last["diloco/requests_list"]) * 0.005
         + last["diloco/requests_get"] * 0.0004) / 1000
        + last["diloco/mailbox_bytes_down"] * 0.09 / 2**30, rel=1e-6)
    assert last["diloco/cost_usd_per_hour"] > last["diloco/cost_usd"]  # ran under an hour
    counted = [float(r["diloco/requests"]) for r in rows]
    assert counted == sorted(counted)


def test_log_every_n_steps_spaces_the_metrics(tmp_path: Path) -> None:
    cb = DiLoCoCallback(str(tmp_path / "run"), STANDARD, "log-1", log_every_n_steps=4, **FAST)
    logger = CSVLogger(tmp_path / "logs", name="m", version=0)
    t = trainer(max_steps=9, callbacks=[cb], logger=logger, log_every_n_steps=1)
    t.fit(ToyModule(), toy_loader())
    logger.finalize("success")
    with open(tmp_path / "logs" / "m" / "version_0" / "metrics.csv") as f:
        seen = [
            (int(r["step"]), float(r["diloco/rounds_seen"]))
            for r in csv.DictReader(f)
            if r["diloco/rounds_seen"]
        ]
    # Global steps 4 and 8, then on_train_end at step 9.
    assert seen == [(4, 0.0), (8, 1.0), (9, 2.0)]


def test_crash_then_resume_from_checkpoint_rejoins_as_the_same_learner(tmp_path: Path) -> None:
    box = tmp_path / "run"
    ckpts = tmp_path / "ckpt"
    seen = Recorder()

    class Crash(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            if trainer.global_step == 5:
                raise RuntimeError("boom at step 5")

    cb = DiLoCoCallback(str(box), STANDARD, "crashy-7", on_event=seen, **FAST)
    saver = ModelCheckpoint(dirpath=ckpts, every_n_train_steps=4, save_top_k=-1)
    t1 = trainer(max_steps=30, callbacks=[cb, Crash(), saver], enable_checkpointing=True)
    with pytest.raises(RuntimeError, match="boom at step 5"):
        t1.fit(ToyModule(), toy_loader())
    # on_exception closed the learner: its lease is released, nothing left running.
    assert cb.learner is None
    assert [e.learner for e in seen.of(ev.LeaseReleased)] == ["crashy-7"]
    before = records(box)
    assert [r.round for r in before] == [0]
    # Read now: the sweep deletes old versions once the run moves on.
    theta = asyncio.run(state_at(Exchange(LocalMailbox(box)), 0, before[0])).theta
    want = torch.cat(
        [
            torch.frombuffer(bytearray(theta[n].data), dtype=torch.float32)
            for n, _ in ToyModule().named_parameters()
        ]
    )
    ckpt = torch.load(ckpts / "epoch=0-step=4.ckpt", weights_only=False)
    assert ckpt["callbacks"][STATE_KEY] == {
        "learner_id": "crashy-7",
        "local_step": 4,
        "rounds_seen": 0,
        "error_feedback": NO_FEEDBACK,
    }
    # One step past round 0's commit, so the checkpoint's weights are not the run's.
    saved = torch.cat([t.reshape(-1) for t in ckpt["state_dict"].values()])
    assert not torch.equal(saved, want)

    # A fresh process would build a fresh callback with no id: the checkpoint supplies it.
    resumed = DiLoCoCallback(str(box), STANDARD, None, **FAST)
    model = ToyModule(seed=1)

    class AtStart(Callback):
        params: torch.Tensor | None = None

        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            self.params = flat_params(pl_module)

    at_start = AtStart()
    t2 = trainer(max_steps=10, callbacks=[resumed, at_start])
    t2.fit(model, toy_loader(), ckpt_path=ckpts / "epoch=0-step=4.ckpt")
    assert t2.global_step == 10
    # A restart is a join: local steps count from it, rounds continue the run's.
    assert resumed.state_dict() == {"learner_id": "crashy-7", "local_step": 6, "rounds_seen": 2,
                                    "error_feedback": NO_FEEDBACK}
    after = records(box)
    assert [r.round for r in after] == [0, 1, 2]
    assert [p.learner for r in after for p in r.participants] == ["crashy-7"] * 3
    # Joining aligned the restored model with the run's newest commit (round 0).
    assert at_start.params is not None
    torch.testing.assert_close(at_start.params, want, rtol=0, atol=0)


def test_sparse_deltas_keep_their_residuals_across_a_checkpoint_and_resume(
        tmp_path: Path) -> None:
    box, ckpts = tmp_path / "run", tmp_path / "ckpt"
    # One value of each tensor travels a round: most of each delta stays behind.
    sparse = DiLoCo.standard(3, 1, delta_dtype="TOPK_F8", delta_density=1 / 4096)

    class Crash(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            if trainer.global_step == 5:
                raise RuntimeError("boom at step 5")

    cb = DiLoCoCallback(str(box), sparse, "sparse-1", **FAST)
    saver = ModelCheckpoint(dirpath=ckpts, every_n_train_steps=4, save_top_k=-1)
    t1 = trainer(max_steps=30, callbacks=[cb, Crash(), saver], enable_checkpointing=True)
    with pytest.raises(RuntimeError, match="boom at step 5"):
        t1.fit(ToyModule(), toy_loader())
    # Tensors and plain containers only: a weights-only load reads it.
    ckpt = torch.load(ckpts / "epoch=0-step=4.ckpt", weights_only=True)
    feedback = ckpt["callbacks"][STATE_KEY]["error_feedback"]
    assert feedback["in_flight"] == {}  # round 0 was committed before the checkpoint
    saved = feedback["residuals"][0]
    names = [n for n, _ in ToyModule().named_parameters()]
    assert sorted(saved) == sorted(names)
    assert all(t.dtype == torch.float32 and t.count_nonzero() > 0 for t in saved.values())

    resumed = DiLoCoCallback(str(box), sparse, None, **FAST)

    class AtStart(Callback):
        def __init__(self) -> None:
            self.residuals: dict[str, torch.Tensor] = {}

        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            assert resumed.learner is not None
            state = resumed.learner.state_dict()["error_feedback"]
            self.residuals = {n: t.clone() for n, t in state["residuals"][0].items()}

    at_start = AtStart()
    t2 = trainer(max_steps=10, callbacks=[resumed, at_start])
    t2.fit(ToyModule(seed=1), toy_loader(), ckpt_path=ckpts / "epoch=0-step=4.ckpt")
    # The learner that rejoined holds the checkpoint's residuals, bit for bit ...
    assert sorted(at_start.residuals) == sorted(saved)
    assert all(torch.equal(at_start.residuals[n], saved[n]) for n in saved)
    # ... and its rounds since carried them on: its residuals are the rounds' now.
    after = [r.round for r in records(box)]
    assert after == [0, 1, 2]
    final = resumed.state_dict()["error_feedback"]["residuals"][0]
    assert any(not torch.equal(final[n], saved[n]) for n in saved)


def test_a_learner_that_cannot_join_fails_fit_without_hanging(tmp_path: Path) -> None:
    box = tmp_path / "run"
    trainer(max_steps=3, callbacks=[DiLoCoCallback(str(box), STANDARD, "a-0", **FAST)]).fit(
        ToyModule(), toy_loader()
    )
    other = DiLoCo.standard(4, 1, merge=WeightedMean())
    cb = DiLoCoCallback(str(box), other, "b-0", **FAST)
    with pytest.raises(RunConfigMismatch):
        trainer(max_steps=3, callbacks=[cb]).fit(ToyModule(), toy_loader())
    assert cb.learner is None


def test_fixed_state_key_and_state_round_trip() -> None:
    a = DiLoCoCallback("unused", STANDARD, "x-1")
    b = DiLoCoCallback("elsewhere", DiLoCo.standard(5, 2), "y-2", log_every_n_steps=3)
    assert a.state_key == b.state_key == STATE_KEY == "DiLoCoCallback"
    assert a.state_dict() == {"learner_id": "x-1", "local_step": 0, "rounds_seen": -1,
                              "error_feedback": None}
    fresh = DiLoCoCallback("unused", STANDARD)
    # A checkpoint from before error feedback is read (its learner starts with none).
    fresh.load_state_dict({"learner_id": "x-1", "local_step": 12, "rounds_seen": 3})
    assert fresh.state_dict() == {"learner_id": "x-1", "local_step": 12, "rounds_seen": 3,
                                  "error_feedback": None}
    with pytest.raises(ConfigError, match=r"keys \['learner_id'\], expected"):
        fresh.load_state_dict({"learner_id": "x-1"})


def test_constructor_refuses_bad_arguments() -> None:
    with pytest.raises(ConfigError, match=r"unknown options \['lease_evry'\]; Learner options"):
        DiLoCoCallback("run", STANDARD, lease_evry=3)
    with pytest.raises(ConfigError, match=r"tokens_per_step='many' must be an int, a callable"):
        DiLoCoCallback("run", STANDARD, tokens_per_step="many")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"tokens_per_step=-1 must be >= 0"):
        DiLoCoCallback("run", STANDARD, tokens_per_step=-1)
    with pytest.raises(ConfigError, match=r"log_every_n_steps=0 must be an int >= 1"):
        DiLoCoCallback("run", STANDARD, log_every_n_steps=0)


def test_sharded_strategies_are_refused_by_name() -> None:
    from lightning.pytorch.strategies import (
        DDPStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )

    check_strategy(SingleDeviceStrategy("cpu"))
    check_strategy(DDPStrategy())
    check_strategy(ModelParallelStrategy())  # FSDP2: tests/test_lightning_sharded.py
    with pytest.raises(ConfigError) as info:
        check_strategy(FSDPStrategy())
    assert str(info.value).startswith(
        "DiLoCoCallback does not support the FSDPStrategy strategy; it supports a single "
        "device, DDP"
    )


def test_a_share_sampler_that_lost_its_size_is_refused_when_a_global_batch_is_set() -> None:
    from torch.utils.data import DataLoader

    from gradientmail.integration import BatchSizes, ShareBatchSampler

    data = list(range(8))
    sized = DataLoader(data, batch_sampler=ShareBatchSampler(data, 4, False, BatchSizes(4)))
    # What Lightning's DDP makes of a ready-made loader: ShareBatchSampler(sampler,
    # batch_size=, drop_last=), without size=.
    lost = DataLoader(data, batch_sampler=ShareBatchSampler(data, batch_size=4, drop_last=False))
    check_share_samplers([sized, {"b": sized}], 12)
    check_share_samplers(lost, None)  # no global batch: a fixed size is what was asked
    for loaders in (lost, [sized, {"b": lost}]):
        with pytest.raises(ConfigError) as info:
            check_share_samplers(loaders, 12)
        assert str(info.value).startswith(
            "global_batch_size=12 cannot resize the training batches: the DataLoader's "
            "ShareBatchSampler has no size= (batches of 4). Under DDP Lightning re-creates"
        )
        assert "inside a train_dataloader() hook" in str(info.value)


def test_without_run_key_the_callback_takes_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    box = tmp_path / "run"
    key = "the key of this run, 32 bytes long"
    monkeypatch.setenv("GRADIENTMAIL_RUN_KEY", key)
    cb = DiLoCoCallback(str(box), STANDARD, "keyed-0", **FAST)
    trainer(max_steps=3, callbacks=[cb]).fit(ToyModule(), toy_loader())
    sealed = asyncio.run(Exchange(LocalMailbox(box), run_key=key).rounds_after(-1))
    assert [r.round for r in sealed] == [0]
    with pytest.raises(AuthenticationError, match="but this process has no run key"):
        asyncio.run(Exchange(LocalMailbox(box)).read_manifest())
