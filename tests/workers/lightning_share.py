"""One learner that is a 2-process DDP group (gloo, CPU) whose batches follow its share of
`global_batch_size`, for the batch-sampler test.

    python tests/workers/lightning_share.py MAILBOX OUT --loader hook|direct [--accum N]

Lightning re-launches this script for rank 1 and re-creates the loader's
`ShareBatchSampler` to put its `DistributedSampler` in. `--loader hook` builds the loader
in a LightningDataModule's `train_dataloader()`; `--loader direct` passes a loader built
beforehand to `fit()`. Every sample is its own index; each rank writes the indices of
every batch it trained on to OUT.rank<R>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.integration import BatchSizes, ShareBatchSampler
from gradientmail_lightning import DiLoCoCallback

SAMPLES, DEFAULT_BATCH = 240, 4


class Recording(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(1, 1)
        self.batches: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, x = batch
        self.batches.append([int(i) for i in index])
        return self.net(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def dataset() -> TensorDataset:
    return TensorDataset(torch.arange(SAMPLES), torch.randn(SAMPLES, 1))


def loader(sizes: BatchSizes) -> DataLoader[Any]:
    data = dataset()
    order = RandomSampler(data, generator=torch.Generator().manual_seed(3))
    return DataLoader(data, batch_sampler=ShareBatchSampler(order, DEFAULT_BATCH, True, sizes))


class Data(LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.sizes = BatchSizes(default=DEFAULT_BATCH)

    def train_dataloader(self) -> DataLoader[Any]:
        return loader(self.sizes)

    def resize_batches(self, share: int) -> None:
        trainer = self.trainer
        assert trainer is not None
        self.sizes.set(share, trainer.world_size, trainer.accumulate_grad_batches)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mailbox")
    ap.add_argument("out")
    ap.add_argument("--loader", choices=["hook", "direct"], required=True)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)

    algorithm = DiLoCo.standard(2, 1, global_batch_size=args.global_batch)
    sizes = BatchSizes(default=DEFAULT_BATCH)
    hook = None if args.loader == "hook" else sizes.resize(2, args.accum)
    diloco = DiLoCoCallback(
        args.mailbox,
        algorithm,
        "share-group",
        poll_interval=0.01,
        lease_every=2.0,
        lease_timeout=6.0,
        on_batch_size=hook,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=args.steps,
        accumulate_grad_batches=args.accum,
        callbacks=[diloco],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Recording()
    if args.loader == "hook":
        trainer.fit(module, datamodule=Data())
    else:
        trainer.fit(module, loader(sizes))
    out = Path(f"{args.out}.rank{trainer.global_rank}.json")
    out.write_text(json.dumps({"batches": module.batches}))
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
