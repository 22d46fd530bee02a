"""The recipe pieces in this process: the LR schedule, GPT2Module, TextDataModule's
shards / held-out split / streaming path, and the three YAML recipes through the CLI's
parser (offline: no recipe is instantiated against the hub)."""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# Before any Hugging Face import: they read it once. Tests never download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

import yaml
from lightning.pytorch import Trainer

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Rda, WeightedMean
from gradientmail.algorithms.partition import ByBytes, Strided
from gradientmail.errors import ConfigError
from gradientmail.learner.options import LearnerOptions
from gradientmail.traffic import Prices
from gradientmail_lightning import DiLoCoCallback
from gradientmail_lightning.cli import GradientmailCLI, diloco_callback, main
from gradientmail_lightning.data import TextDataModule, learner_shard
from gradientmail_lightning.gpt2 import GPT2Module, lr_factor

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "mu"]


def documents(n: int) -> list[str]:
    """n distinct documents of random words (seeded), so no two blocks coincide."""
    import random

    out = []
    for i in range(n):
        rng = random.Random(i)
        out.append(" ".join(rng.choice(WORDS) + str(rng.randrange(50)) for _ in range(40)))
    return out


def test_lr_factor_warms_up_then_decays_along_a_cosine() -> None:
    assert [lr_factor(s, 4, 14, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 4, 14, 0.1) == 1.0
    assert lr_factor(9, 4, 14, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(14, 4, 14, 0.1) == pytest.approx(0.1)
    assert lr_factor(100, 4, 14, 0.1) == pytest.approx(0.1)
    assert lr_factor(100, 4, math.inf, 0.1) == 1.0
    assert lr_factor(0, 0, 10, 0.0) == 1.0


def test_learner_shard_from_the_id() -> None:
    assert [learner_shard(f"learner-{i}", 3) for i in range(5)] == [0, 1, 2, 0, 1]
    assert learner_shard("host-a", 1) == 0
    # No trailing number: CRC-32 of the id (pinned).
    assert learner_shard("alice", 7) == 0x278EBC47 % 7  # zlib.crc32(b"alice")
    with pytest.raises(ConfigError, match=r"num_shards=0 must be >= 1"):
        learner_shard("x", 0)


def test_shards_are_disjoint_and_share_tokenizer_and_validation(tmp_path: Path) -> None:
    docs = documents(60)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    made = []
    for i in range(2):
        dm = TextDataModule(
            files=[str(path)],
            vocab_size=300,
            block_size=16,
            batch_size=4,
            val_fraction=0.2,
            num_shards=2,
            learner_id=f"learner-{i}",
            cache_dir=str(tmp_path),
        )
        dm.setup("fit")
        made.append(dm)
    a, b = made
    assert (a.shard, b.shard) == (0, 1)
    assert a.tokenizer.get_vocab() == b.tokenizer.get_vocab()
    ta, tb = a.train_dataloader().dataset, b.train_dataloader().dataset
    rows_a = {tuple(ta[i]["input_ids"].tolist()) for i in range(len(ta))}  # type: ignore[arg-type]
    rows_b = {tuple(tb[i]["input_ids"].tolist()) for i in range(len(tb))}  # type: ignore[arg-type]
    assert rows_a and rows_b and not rows_a & rows_b
    va = torch.cat([x["input_ids"] for x in a.val_dataloader()])
    vb = torch.cat([x["input_ids"] for x in b.val_dataloader()])
    assert torch.equal(va, vb) and va.shape[1] == 16
    # The shuffle differs per learner: the seed is offset by the shard.
    assert (a.seed, b.seed) == (0, 1)
    batch = next(iter(a.train_dataloader()))
    assert batch["input_ids"].shape == (4, 16)


def test_data_module_refusals(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"num_shards=2 but neither shard nor learner_id"):
        TextDataModule(num_shards=2)
    with pytest.raises(ConfigError, match=r"shard=2 is out of range; need 0 <= shard < 2"):
        TextDataModule(num_shards=2, shard=2)
    with pytest.raises(ConfigError, match=r"pass either files=.* or dataset=.*, not both"):
        TextDataModule(files=["a.txt"], dataset="org/name")
    (tmp_path / "a.txt").write_text(" ".join(documents(30)))
    dm = TextDataModule(
        files=[str(tmp_path / "a.txt")],
        vocab_size=300,
        block_size=8,
        val_fraction=0.0,
        cache_dir=str(tmp_path),
    )
    dm.setup("fit")
    too_small = TextDataModule(
        files=[str(tmp_path / "a.txt")],
        vocab_size=300,
        block_size=8,
        tokenizer=str(next(tmp_path.glob("bpe-*"))),
        val_fraction=0.0,
    )
    too_small.vocab_size = 200
    with pytest.raises(ConfigError, match=r"has \d+ tokens but vocab_size=200; set data"):
        too_small.setup("fit")


def test_streaming_local_jsonl_packs_blocks_per_shard(tmp_path: Path) -> None:
    docs = documents(80)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    dm = TextDataModule(
        files=[str(path)],
        streaming=True,
        vocab_size=300,
        block_size=32,
        batch_size=2,
        val_fraction=0.1,
        val_blocks=3,
        num_shards=2,
        shard=1,
        tokenizer_documents=50,
        cache_dir=str(tmp_path),
    )
    dm.setup("fit")
    train = [b["input_ids"] for b in dm.train_dataloader()]
    assert train and all(b.shape[1] == 32 for b in train)
    val = torch.cat([b["input_ids"] for b in dm.val_dataloader()])
    assert val.shape == (3, 32)
    # Shard 1 of 2 holds every other document: about half of the tokens.
    tok = dm.tokenizer
    kept = [d for d in docs if not dm_val(d)]
    total = sum(len(tok(d)["input_ids"]) + 1 for d in kept)
    got = sum(b.numel() for b in train)
    assert 0.3 * total < got < 0.7 * total


def dm_val(text: str) -> bool:
    from gradientmail.integration.textdata import held_out
    from gradientmail_lightning.data import _doc_key

    return held_out(_doc_key(text), 0.1)


def test_gpt2_module_trains_validates_and_groups_weight_decay(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("\n".join(documents(40)))
    dm = TextDataModule(
        files=[str(tmp_path / "a.txt")],
        vocab_size=320,
        block_size=16,
        batch_size=4,
        val_fraction=0.0,
        cache_dir=str(tmp_path),
    )
    model = GPT2Module(
        vocab_size=320,
        block_size=16,
        n_layer=1,
        n_embd=32,
        n_head=2,
        warmup_steps=2,
        lr=1e-2,
        seed=0,
    )
    trainer = Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=dm)
    m = trainer.callback_metrics
    assert float(m["train/ppl"]) == pytest.approx(math.exp(float(m["train/loss"])), rel=1e-5)
    dm._val = dm._train  # validate on training blocks: this set has no held-out document
    (out,) = trainer.validate(model, dataloaders=dm.val_dataloader(), verbose=False)
    assert out["val/ppl"] == pytest.approx(math.exp(out["val/loss"]), rel=1e-4)
    opt = model.configure_optimizers()["optimizer"]
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    with pytest.raises(ConfigError, match=r"min_lr_ratio=2.0 is out of range"):
        GPT2Module(min_lr_ratio=2.0)


@pytest.mark.parametrize("name", ["gpt2-tiny-cpu", "gpt2-124m", "gpt2-350m", "gpt2-xl"])
def test_recipes_parse_and_their_diloco_sections_are_valid(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["gradientmail-train"])
    path = RECIPES / f"{name}.yaml"
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(path), "--print_config"])
    assert info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    raw = yaml.safe_load(path.read_text())
    assert printed["diloco"]["mailbox"] == raw["diloco"]["mailbox"]
    assert printed["trainer"]["max_steps"] == raw["trainer"]["max_steps"]
    cb = diloco_callback(**raw["diloco"])
    assert isinstance(cb, DiLoCoCallback)
    alg: Any = cb.algorithm
    assert isinstance(alg, DiLoCo)
    assert alg.sync_every == raw["diloco"]["sync_every"]
    assert isinstance(alg.merge, Rda) and alg.merge.direct_pattern == "transformer.w"
    assert isinstance(alg.partition, Strided)
    if name != "gpt2-tiny-cpu":
        assert raw["trainer"]["precision"] == "bf16-mixed"
        assert raw["data"]["streaming"] is True and raw["data"]["dataset"]
        assert raw["diloco"]["mailbox"].startswith("s3://")
        sizes = {"gpt2-124m": (12, 768, 12), "gpt2-350m": (24, 1024, 16),
                 "gpt2-xl": (48, 1600, 25)}[name]
        model = raw["model"]
        assert (model["n_layer"], model["n_embd"], model["n_head"]) == sizes
    if name == "gpt2-xl":  # sharded learners: FSDP2, commits read by rows (uncompressed)
        strategy = raw["trainer"]["strategy"]
        assert strategy["class_path"].endswith("ModelParallelStrategy")
        assert strategy["init_args"] == {"data_parallel_size": 8, "tensor_parallel_size": 1}
        assert raw["diloco"]["compression"] == "off"
        # A fixed count (no all-reduce of the ranks' counts per step) that must be what
        # every packed batch holds.
        per_batch = raw["data"]["batch_size"] * raw["data"]["block_size"]
        assert raw["diloco"]["tokens_per_step"] == per_batch == 4096
        assert cb.tokens_per_step == per_batch
        assert printed["diloco"]["tokens_per_step"] == per_batch


def test_the_recipe_leaves_the_run_key_to_the_learner(monkeypatch: pytest.MonkeyPatch) -> None:
    # A secret does not belong in a recipe: the Learner reads GRADIENTMAIL_RUN_KEY itself
    # (test_lightning_callback trains a keyed run that way).
    monkeypatch.setenv("GRADIENTMAIL_RUN_KEY", "the key of this run, 32 bytes long")
    assert "run_key" not in diloco_callback("runs/x").learner_options


def test_cli_links_data_sizes_and_learner_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["gradientmail-train"])
    cli = GradientmailCLI(
        GPT2Module,
        TextDataModule,
        run=False,
        args=[
            "--config",
            str(RECIPES / "gpt2-tiny-cpu.yaml"),
            "--data.vocab_size=512",
            "--data.block_size=32",
            "--diloco.learner_id=learner-5",
            f"--diloco.mailbox={tmp_path / 'box'}",
            "--trainer.logger=false",
        ],
    )
    model, data = cli.model, cli.datamodule
    assert isinstance(model, GPT2Module) and isinstance(data, TextDataModule)
    assert (model.hparams["vocab_size"], model.hparams["block_size"]) == (512, 32)
    assert model.model.config.vocab_size == 512
    assert (data.learner_id, data.shard) == ("learner-5", 1)
    callbacks = cli.trainer.callbacks  # type: ignore[attr-defined]
    (cb,) = [c for c in callbacks if isinstance(c, DiLoCoCallback)]
    assert cb.learner_id == "learner-5" and cb.mailbox == str(tmp_path / "box")


def test_flat_cli_settings_build_the_algorithm() -> None:
    cb = diloco_callback(
        "runs/x",
        merge="mean",
        partition="bytes",
        sync_every=8,
        fragments=2,
        in_flight=2,
        quorum_size=3,
        lease_every=5.0,
        lease_timeout=11.0,
    )
    alg: Any = cb.algorithm
    assert alg == DiLoCo(
        sync_every=8,
        fragments=2,
        in_flight=2,
        quorum_size=3,
        merge=WeightedMean(),
        partition=ByBytes(),
    )
    assert cb.options == LearnerOptions(lease_every=5.0, lease_timeout=11.0)
    assert cb.learner_options == {}  # no runtime objects: the run key is the Learner's
    with pytest.raises(ConfigError, match=r"in_flight=2 exceeds fragments=1"):
        diloco_callback("runs/x", in_flight=2)
    cb = diloco_callback("runs/x", prices={"egress_per_gb": 0.0}, wait_for_learners=0)
    assert cb.options == LearnerOptions(prices=Prices(egress_per_gb=0.0), wait_for_learners=0)


def test_the_outlier_factor_is_set_from_the_recipe_and_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["gradientmail-train"])

    def outlier_factor(config: Path, *extra: str) -> Any:
        cli = GradientmailCLI(
            GPT2Module,
            TextDataModule,
            run=False,
            args=["--config", str(config), f"--diloco.mailbox={tmp_path / 'box'}",
                  "--trainer.logger=false", *extra],
        )
        (cb,) = [c for c in cli.trainer.callbacks  # type: ignore[attr-defined]
                 if isinstance(c, DiLoCoCallback)]
        return cb.algorithm.outlier_factor  # type: ignore[attr-defined]

    tiny = RECIPES / "gpt2-tiny-cpu.yaml"
    recipe = yaml.safe_load(tiny.read_text())
    assert "outlier_factor" in recipe["diloco"] and recipe["diloco"]["outlier_factor"] is None
    assert outlier_factor(tiny) is None
    assert outlier_factor(tiny, "--diloco.outlier_factor=4.0") == 4.0
    own = tmp_path / "recipe.yaml"
    own.write_text(yaml.safe_dump({**recipe, "diloco": {**recipe["diloco"], "outlier_factor": 3}}))
    assert outlier_factor(own) == 3.0


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streaming"])
def test_global_batch_size_sizes_the_data_modules_batches(
    tmp_path: Path, streaming: bool
) -> None:
    from lightning.pytorch import LightningModule, Trainer

    from gradientmail.algorithms.diloco import DiLoCo as Config

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(120)))
    data = TextDataModule(files=[str(path)], vocab_size=300, block_size=8, batch_size=4,
                          val_fraction=0.0, cache_dir=str(tmp_path), streaming=streaming)

    class Sizes(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(300, 4)
            self.seen: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen.append(int(batch["input_ids"].shape[0]))
            return self.emb(batch["input_ids"]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    alg = Config.standard(2, 1, global_batch_size=12)
    cb = DiLoCoCallback(str(tmp_path / "run"), alg, "gbs-0", poll_interval=0.01,
                        lease_every=2.0, lease_timeout=6.0)
    module = Sizes()
    Trainer(accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=2,
            callbacks=[cb], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False).fit(module, data)
    # One live learner holds the whole global batch of 12: 2 micro-batches of 6 per step.
    # Lightning draws a stream's first batch before on_train_start, where the learner
    # joins and learns its share: that one keeps data.batch_size.
    assert module.seen == ([4] + [6] * 7 if streaming else [6] * 8)
    assert data.batch_sizes.share == 12


@pytest.mark.slow
def test_a_streams_batches_follow_a_new_share_although_workers_pack_the_blocks(
    tmp_path: Path,
) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(60)))
    data = TextDataModule(files=[str(path)], streaming=True, vocab_size=300, block_size=8,
                          batch_size=4, val_fraction=0.0, tokenizer_documents=60,
                          cache_dir=str(tmp_path), num_workers=1)
    data.setup("fit")
    batches = iter(data.train_dataloader())
    assert next(batches)["input_ids"].shape == (4, 8)
    data.resize_batches(6)  # no Trainer: one process, no accumulation
    assert [b["input_ids"].shape for b in itertools.islice(batches, 3)] == [(6, 8)] * 3
    data.resize_batches(2)
    assert next(batches)["input_ids"].shape == (2, 8)


SHARD_GPT2 = """
import os, tempfile
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from gradientmail.adapters import TorchAdapter
from gradientmail.adapters.sharded import ShardedAdapter
from gradientmail_lightning.gpt2 import GPT2Module

store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
kw = dict(vocab_size=96, block_size=16, n_layer=2, n_embd=32, n_head=2, seed=0)
plain, module = GPT2Module(**kw), GPT2Module(**kw)
module.configure_model()  # no device mesh: nothing happens
assert not any(isinstance(p, DTensor) for p in module.parameters())
module._device_mesh = init_device_mesh("cpu", (1, 1),
                                       mesh_dim_names=("data_parallel", "tensor_parallel"))
module.configure_model()
module.configure_model()  # once only
assert all(isinstance(p, DTensor) for p in module.parameters())
assert ShardedAdapter(module.model).schema == TorchAdapter(plain.model).schema
dist.destroy_process_group()
print("sharded")
"""


@pytest.mark.slow
def test_gpt2_module_shards_itself_under_a_device_mesh() -> None:
    """`GPT2Module.configure_model` (what `ModelParallelStrategy` calls) puts FSDP2 on every
    block and the model, and the result has the unsharded model's schema; in a process of
    its own, since it sets up a process group."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", SHARD_GPT2], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("sharded")
