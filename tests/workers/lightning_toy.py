"""A toy LightningModule and data shared by the in-process Lightning tests and the
DDP subprocess worker: small enough that a Trainer step costs a millisecond."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset


class ToyModule(LightningModule):
    """Two linear layers regressing random targets with plain SGD."""

    def __init__(self, seed: int = 0, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
        )
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss, batch_size=x.shape[0])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def toy_loader(n: int = 64, batch_size: int = 4, seed: int = 0) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])
