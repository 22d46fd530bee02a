"""A toy model and fixed data shared by in-process tests and learner subprocesses."""

from __future__ import annotations

import torch


def make_model(seed: int = 0, width: int = 8) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)
    )


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)


def inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, worker: int, step: int) -> float:
    x, y = batch(worker, step)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())
