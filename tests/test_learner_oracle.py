"""The oracle: standard DiLoCo through learners and a mailbox equals a hand-written loop.

Two learners train a small model with plain SGD on fixed data; every H steps each mails
anchor − θ, a closer merges the mean and takes torch's own Nesterov SGD step. The same
arithmetic written as a synchronous loop must give the same parameters within 1e-6, and
so must a pipelined barrier (`stagger=False`: the fragments' rounds of a sync go out at
the same step, one after another), whose outer step is the same elementwise arithmetic.
"""

from __future__ import annotations

import functools
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_learner_runtime import in_threads
from workers.toy import inner_step, make_model

from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import Mailbox, S3Mailbox

H, ROUNDS, LEARNERS, INNER_LR = 3, 4, 2, 0.05


def oracle(learners: int = LEARNERS) -> list[torch.Tensor]:
    glob = make_model()
    params = list(glob.parameters())
    outer = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    for rnd in range(ROUNDS):
        deltas = []
        for w in range(learners):
            local = make_model()
            local.load_state_dict(glob.state_dict())
            opt = torch.optim.SGD(local.parameters(), lr=INNER_LR)
            for k in range(H):
                inner_step(local, opt, w, rnd * H + k)
            deltas.append(
                [g.detach() - p.detach() for g, p in zip(params, local.parameters(), strict=True)]
            )
        for i, p in enumerate(params):
            p.grad = sum(d[i] for d in deltas) / learners
        outer.step()
    return [p.detach().clone() for p in params]


STANDARD = DiLoCo(
    sync_every=H, fragments=1, in_flight=1, overlap_steps=0, merge=WeightedMean(),
    quorum_size=LEARNERS,
)


def run_learners(mailbox_for: Callable[[], Mailbox | str],
                 algorithm: DiLoCo = STANDARD) -> list[list[torch.Tensor]]:
    per_sync = algorithm.fragments
    results: list[list[torch.Tensor]] = [[] for _ in range(LEARNERS)]
    ready = threading.Barrier(LEARNERS)

    # Built here, one after the other: make_model seeds torch's global generator, which
    # two threads building models at once would share.
    models = [make_model() for _ in range(LEARNERS)]

    def work(w: int) -> None:
        model = models[w]
        learner = Learner(
            TorchAdapter(model),
            algorithm,
            mailbox_for(),
            f"learner-{w}",
            options=LearnerOptions(poll_interval=0.01, lease_every=5.0, lease_timeout=30.0),
        )
        learner.start()
        ready.wait(timeout=60)
        assert learner.wait_for_learners(LEARNERS, timeout=60) >= {"learner-0", "learner-1"}
        opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
        for step in range(ROUNDS * H):
            inner_step(model, opt, w, step)
            learner.step(5)
            # Behind the barrier, the step that ends a sync returns with every one of its
            # fragments' commits applied.
            assert learner.rounds_seen == (step + 1) // H * per_sync - 1
        learner.close()
        assert learner.rounds_seen == ROUNDS * per_sync - 1
        results[w] = [p.detach().clone() for p in model.parameters()]

    in_threads(*(functools.partial(work, w) for w in range(LEARNERS)))
    return results


PIPELINED = DiLoCo.standard(H, LEARNERS, fragments=2, stagger=False)


@pytest.mark.parametrize(("kind", "algorithm"), [
    ("memory", STANDARD), ("local", STANDARD), ("s3", STANDARD),
    ("memory", PIPELINED), ("s3", PIPELINED),
], ids=["memory", "local", "s3", "pipelined-memory", "pipelined-s3"])
def test_standard_diloco_equals_the_synchronous_loop(
    kind: str, algorithm: DiLoCo, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    mailbox_for: Callable[[], Mailbox | str]
    if kind == "memory":
        name = f"oracle-{secrets.token_hex(4)}"
        mailbox_for = lambda: f"memory://{name}"  # noqa: E731
    elif kind == "local":
        mailbox_for = lambda: str(tmp_path / "run")  # noqa: E731
    else:
        bucket = request.getfixturevalue("s3_bucket")
        endpoint = request.getfixturevalue("moto_endpoint")
        prefix = f"oracle-{secrets.token_hex(4)}"
        # One client per learner, as on separate machines.
        mailbox_for = lambda: S3Mailbox(bucket, prefix=prefix, endpoint_url=endpoint)  # noqa: E731
    want = oracle()
    for got in run_learners(mailbox_for, algorithm):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)

