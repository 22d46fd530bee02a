"""A received commit is checked against the model's schema: one that does not fit is
reported as an event and passed over, never raised from `step()`, and the fragment's next
good commit is taken as usual."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import torch
from test_learner_runtime import FAST, Recorder, make_model

from gradientmail import events as ev
from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.learner import Learner
from gradientmail.learner.options import LearnerOptions
from gradientmail.mailbox import MemoryMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.records import Participant, RoundRecord
from gradientmail.wire.tensor_bytes import TensorBytes


def _commit(mailbox: MemoryMailbox, round_: int, version: int,
            theta: dict[str, np.ndarray]) -> None:
    """Commit round `round_` (fragment 0 at `version`) as a closer would, with `theta`."""

    async def go() -> None:
        ex = Exchange(mailbox)
        tensors = {n: TensorBytes.from_numpy(a) for n, a in theta.items()}
        theta_ref = await ex.put_theta(0, version, tensors, attempt=0)
        outer = {f"momentum/{n}": t for n, t in tensors.items()}
        outer_ref = await ex.put_outer(0, version, outer, attempt=0)
        rec = RoundRecord(
            round=round_, fragment=0, version=version, theta=theta_ref, outer=outer_ref,
            update=None, participants=(Participant("solo", 4 * (round_ + 1), 4, 0, 1.0),),
            estimates=Estimates(), mean_cosine=None, dropped=(), closer="closer",
            all_final=False,
        )
        assert await ex.commit(rec)

    asyncio.run(go())


def _step_until(learner: Learner, done: Any, limit: int = 4000) -> None:
    for _ in range(limit):
        learner.step()
        if done():
            return
        time.sleep(0.005)  # the mailman fetches on its own thread
    raise AssertionError("the learner never got there")


def test_a_commit_that_does_not_fit_is_reported_and_passed_over() -> None:
    mailbox = MemoryMailbox()
    # The outer state travels with each commit (no replicated step): the theta path.
    alg = DiLoCo(sync_every=4, fragments=1, in_flight=1, overlap_steps=None,
                 merge=WeightedMean(), checkpoint_every=1)
    model, rec = make_model(), Recorder()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    learner = Learner(
        TorchAdapter(model),
        alg,
        mailbox,
        "solo",
        on_event=rec,
        options=LearnerOptions(**FAST, sync=False),
    )
    learner.start()
    try:
        for _ in range(4):
            learner.step()  # round 0 published; nothing trained, so θ stays θ⁰
        good = {n: np.full(tuple(p.shape), 0.5, np.float32) for n, p in before.items()}
        bad = dict(good, **{"0.weight": np.zeros((3, 3), np.float32)})
        _commit(mailbox, 0, 1, bad)
        _step_until(learner, lambda: learner.rounds_seen == 0)

        rejected = rec.of(ev.CommitRejected)
        assert [(e.round, e.fragment) for e in rejected] == [(0, 0)]
        assert "'0.weight' has shape [3, 3], the schema says [8, 6]" in rejected[0].reason
        assert not rec.of(ev.FragmentAligned)
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), before[n]), n

        _commit(mailbox, 1, 2, good)
        _step_until(learner, lambda: learner.rounds_seen == 1)
        assert [e.round for e in rec.of(ev.FragmentAligned)] == [1]
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), torch.full_like(p, 0.5)), n
    finally:
        learner.close(flush=False)

