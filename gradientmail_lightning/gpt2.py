"""GPT2Module: GPT-2 pretraining as a LightningModule (the recipes' model).

The network is `GPT2LMHeadModel(GPT2Config(...))`
(`gradientmail.integration.textdata.tiny_gpt2`), so nothing is downloaded; every size is
an argument (the recipes hold the real GPT-2 sizes).
The inner optimizer is AdamW (weight decay on matrices only) with a linear warmup and a
cosine decay to `min_lr_ratio`·lr, stepped every optimizer step. Logs `train/loss`,
`train/ppl`, `val/loss` and `val/ppl`. Batches are `{"input_ids": LongTensor[B, T]}` (or
the tensor itself); the labels are the inputs, shifted inside the model.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import LightningModule

from gradientmail.errors import ConfigError
from gradientmail.integration.textdata import tiny_gpt2

__all__ = ["GPT2Module", "lr_factor"]


def lr_factor(step: int, warmup_steps: int, total_steps: float, min_lr_ratio: float) -> float:
    """The learning-rate multiplier at optimizer step `step` (0-based): linear warmup over
    `warmup_steps`, then a cosine from 1 down to `min_lr_ratio` at `total_steps`, flat
    after it. An infinite `total_steps` (an unbounded run) keeps 1 after the warmup."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if not math.isfinite(total_steps):
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPT2Module(LightningModule):
    """GPT-2 trained from scratch. `total_steps` of the cosine defaults to the Trainer's
    estimate (`max_steps`, or epochs × batches); `seed` fixes the initialisation."""

    def __init__(
        self,
        vocab_size: int = 50304,
        block_size: int = 1024,
        n_layer: int = 12,
        n_embd: int = 768,
        n_head: int = 12,
        dropout: float = 0.0,
        lr: float = 6e-4,
        min_lr_ratio: float = 0.1,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        total_steps: int | None = None,
        eos_token_id: int = 0,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if not (math.isfinite(lr) and lr > 0):
            raise ConfigError(f"lr={lr!r} must be a finite number > 0")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio={min_lr_ratio!r} is out of range; need 0 <= r <= 1")
        if warmup_steps < 0:
            raise ConfigError(f"warmup_steps={warmup_steps} must be >= 0")
        if total_steps is not None and total_steps < 1:
            raise ConfigError(f"total_steps={total_steps} must be >= 1, or None")
        self.save_hyperparameters()
        self.model = tiny_gpt2(
            vocab_size,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_positions=block_size,
            dropout=dropout,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            seed=seed,
        )
        self.block_size = block_size
        self._val_sum = torch.zeros(())
        self._val_count = torch.zeros(())

    def configure_model(self) -> None:
        """Under Lightning's `ModelParallelStrategy`, shard every transformer block and
        then the whole model with FSDP2 (`fully_shard`) over the data-parallel mesh: each
        rank holds its rows of every parameter, and the `DiLoCoCallback` mails and reads
        only those (a learner whose model does not fit one GPU with full replicas, as in
        recipes/gpt2-xl.yaml). Nothing under any other strategy."""
        mesh = self.device_mesh
        if mesh is None or getattr(self, "_sharded", False):
            return
        from torch.distributed.fsdp import fully_shard

        data = mesh["data_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=data)
        fully_shard(self.model, mesh=data)
        self._sharded = True

    @staticmethod
    def _ids(batch: Any) -> torch.Tensor:
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ConfigError(
                "GPT2Module expects batches {'input_ids': LongTensor[batch, tokens]}; got "
                f"{type(ids).__name__}"
            )
        return ids

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy of `input_ids`."""
        out = self.model(input_ids=input_ids, labels=input_ids)
        loss: torch.Tensor = out.loss
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = self._ids(batch)
        loss: torch.Tensor = self(ids)
        n = ids.shape[0]
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=n)
        self.log("train/ppl", torch.exp(loss.detach()), on_step=True, on_epoch=False, batch_size=n)
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_sum = torch.zeros((), device=self.device)
        self._val_count = torch.zeros((), device=self.device)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = self._ids(batch)
        loss: torch.Tensor = self(ids)
        n = ids.shape[0]
        self._val_sum = self._val_sum + loss.detach().float() * n
        self._val_count = self._val_count + n
        self.log("val/loss", loss, prog_bar=True, on_epoch=True, sync_dist=True, batch_size=n)
        return loss

    def on_validation_epoch_end(self) -> None:
        totals = torch.stack([self._val_sum, self._val_count])
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        if float(totals[1]) > 0:
            self.log("val/ppl", torch.exp(totals[0] / totals[1]), prog_bar=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": float(hp["weight_decay"])},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=float(hp["lr"]),
            betas=(float(hp["betas"][0]), float(hp["betas"][1])),
        )
        total = hp["total_steps"] or self.trainer.estimated_stepping_batches
        warmup, ratio = int(hp["warmup_steps"]), float(hp["min_lr_ratio"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, warmup, float(total), ratio)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }
