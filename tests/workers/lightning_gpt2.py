"""One learner training a tiny GPT-2 with Lightning, in its own OS process.

    python tests/workers/lightning_gpt2.py MAILBOX ID OUT --steps N --cache DIR

Standard DiLoCo with a quorum of 2 (a barrier each round); training starts once 2
learners hold a lease (the callback's default wait; `--start-after S` starts this learner
S seconds late). Writes OUT.json (the loss of every step, the callback's state) and
OUT.safetensors (the final parameters).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from safetensors.torch import save_file

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail_lightning import DiLoCoCallback
from gradientmail_lightning.data import TextDataModule
from gradientmail_lightning.gpt2 import GPT2Module


class Losses(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, *args: Any
    ) -> None:
        self.values.append(float(outputs["loss"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mailbox")
    ap.add_argument("learner_id")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--start-after", type=float, default=0.0)
    args = ap.parse_args()
    time.sleep(args.start_after)
    torch.set_num_threads(1)
    data = TextDataModule(
        vocab_size=1024,
        block_size=64,
        batch_size=8,
        max_documents=24,
        num_shards=2,
        learner_id=args.learner_id,
        cache_dir=args.cache,
    )
    model = GPT2Module(
        vocab_size=1024,
        block_size=64,
        n_layer=2,
        n_embd=64,
        n_head=4,
        lr=1e-2,
        warmup_steps=2,
        seed=0,
    )
    diloco = DiLoCoCallback(
        args.mailbox,
        DiLoCo.standard(4, 2),
        args.learner_id,
        poll_interval=0.02,
        lease_every=2.0,
        lease_timeout=6.0,
        keep_versions=64,  # the test compares each learner with the commit it ended on
    )
    losses = Losses()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        limit_val_batches=0,
        callbacks=[diloco, losses],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    save_file(
        {n: p.detach().contiguous() for n, p in model.named_parameters()}, args.out + ".safetensors"
    )
    Path(args.out + ".json").write_text(
        json.dumps({"losses": losses.values, "state": diloco.state_dict()})
    )


if __name__ == "__main__":
    main()
