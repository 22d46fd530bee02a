"""One learner that is a 2-process DDP group (gloo, CPU), for the DDP test.

    python tests/workers/lightning_ddp.py MAILBOX OUT.json --steps N

Lightning re-launches this script for rank 1. A checking callback placed after the
DiLoCoCallback gathers every rank's parameters at train start, after every batch and at
train end; rank 0 writes the largest difference between ranks seen at each point, the
parameters at train start, and the fragments its learner applied, to OUT.json.
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
from lightning.pytorch import Callback, LightningModule, Trainer

from gradientmail import events as ev
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail_lightning import DiLoCoCallback
from workers.lightning_toy import ToyModule, flat_params, toy_loader


class RankCheck(Callback):
    def __init__(self) -> None:
        self.points: list[dict[str, Any]] = []
        self.start: list[float] = []

    def _check(self, where: str, trainer: Trainer, module: LightningModule) -> None:
        mine = flat_params(module)
        every = [torch.empty_like(mine) for _ in range(trainer.world_size)]
        dist.all_gather(every, mine)
        diff = max(float((t - every[0]).abs().max()) for t in every)
        self.points.append({"where": where, "step": trainer.global_step, "diff": diff})

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check("start", trainer, pl_module)
        self.start = flat_params(pl_module).tolist()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *a: Any) -> None:
        self._check("step", trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check("end", trainer, pl_module)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mailbox")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    aligned: list[int] = []

    def on_event(e: ev.Event) -> None:
        if isinstance(e, ev.FragmentAligned):
            aligned.append(e.fragment)

    algorithm = DiLoCo(sync_every=4, fragments=2, in_flight=1, overlap_steps=0,
                       flush_on_close=False)
    diloco = DiLoCoCallback(
        args.mailbox,
        algorithm,
        "ddp-group",
        poll_interval=0.01,
        lease_every=2.0,
        lease_timeout=6.0,
        on_event=on_event,
    )
    check = RankCheck()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=args.steps,
        callbacks=[diloco, check],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # Not the run's initialisation: joining must overwrite it, on every rank.
    trainer.fit(ToyModule(seed=100), toy_loader(n=256))
    if trainer.is_global_zero:
        Path(args.out).write_text(
            json.dumps({"points": check.points, "start": check.start, "aligned": aligned})
        )
    # Lightning leaves the process group up. The abort at exit once blamed on that
    # ("terminate called without an active exception", exit -6) came from gloo's worker
    # threads freeing a collective's tensor during interpreter finalization; TorchRanks
    # now waits until they let go of its tensors (gradientmail.integration.ranks).
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
