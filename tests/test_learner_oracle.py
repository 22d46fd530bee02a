"""The oracle: standard DiLoCo through learners and a mailbox equals a hand-written loop.

Two learners train a small model with plain SGD on fixed data; every H steps each mails
anchor − θ, a closer merges the mean and takes torch's own Nesterov SGD step. The same
arithmetic written as a synchronous loop must give the same parameters within 1e-6.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo, WeightedMean
from gradientmail.learner import Learner
from gradientmail.mailbox import MemoryMailbox

H, ROUNDS, LEARNERS, INNER_LR = 3, 4, 2, 0.05


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)


def inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, worker: int, step: int) -> None:
    x, y = batch(worker, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def oracle() -> list[torch.Tensor]:
    glob = make_model()
    params = list(glob.parameters())
    outer = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    for rnd in range(ROUNDS):
        deltas = []
        for w in range(LEARNERS):
            local = make_model()
            local.load_state_dict(glob.state_dict())
            opt = torch.optim.SGD(local.parameters(), lr=INNER_LR)
            for k in range(H):
                inner_step(local, opt, w, rnd * H + k)
            deltas.append(
                [g.detach() - p.detach() for g, p in zip(params, local.parameters(), strict=True)]
            )
        for i, p in enumerate(params):
            p.grad = (deltas[0][i] + deltas[1][i]) / 2
        outer.step()
    return [p.detach().clone() for p in params]


def run_learners(mailbox_url: str) -> list[list[torch.Tensor]]:
    algorithm = DiLoCo(
        sync_every=H,
        fragments=1,
        in_flight=1,
        overlap_steps=0,
        merge=WeightedMean(),
        quorum_size=LEARNERS,
    )
    results: list[list[torch.Tensor]] = [[] for _ in range(LEARNERS)]
    errors: list[BaseException] = []
    ready = threading.Barrier(LEARNERS)

    def work(w: int) -> None:
        try:
            model = make_model()
            learner = Learner(
                TorchAdapter(model),
                algorithm,
                mailbox_url,
                f"learner-{w}",
                poll_interval=0.01,
                lease_every=5.0,
                lease_timeout=30.0,
            )
            learner.start()
            ready.wait(timeout=60)
            opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
            for step in range(ROUNDS * H):
                inner_step(model, opt, w, step)
                learner.step(5)
            learner.close()
            assert learner.rounds_seen == ROUNDS - 1
            results[w] = [p.detach().clone() for p in model.parameters()]
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(LEARNERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_standard_diloco_equals_the_synchronous_loop(kind: str, tmp_path: Path) -> None:
    url = "memory://oracle" if kind == "memory" else str(tmp_path / "run")
    if kind == "memory":
        MemoryMailbox.forget("oracle")
    want = oracle()
    for got in run_learners(url):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
