"""`gradientmail.load_committed`: the newest committed model, in one call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gradientmail
from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.errors import AuthenticationError, ConfigError, SchemaMismatch
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import newest_model

KEY = "a run key of sixteen bytes or more"


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def train(directory: Path, run_key: str | None = None) -> torch.nn.Module:
    """One learner, standard DiLoCo with a checkpoint every 2 versions, 5 rounds."""
    model = make_model()
    alg = DiLoCo(2, 1, in_flight=1, overlap_steps=0, merge=WeightedMean(), checkpoint_every=2,
                 flush_on_close=False)
    learner = Learner(
        TorchAdapter(model),
        alg,
        str(directory),
        "solo",
        run_key=run_key,
        on_event=lambda e: None,
        options=LearnerOptions(poll_interval=0.01),
    )
    learner.start()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(11):  # 5 rounds; the 11th step waits for the 5th commit
        opt.zero_grad()
        x = torch.randn(4, 6, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()
        learner.step(4)
    learner.close()
    return model


def test_the_newest_commit_as_tensors_and_into_a_model(tmp_path: Path) -> None:
    box = tmp_path / "run"
    trained = train(box)
    state = gradientmail.load_committed(str(box))
    import asyncio

    want, meta = asyncio.run(newest_model(Exchange(LocalMailbox(box)), str(box)))
    assert int(meta["gradientmail.round"]) == 4  # version 5: a checkpoint at 4, one step
    assert list(state) == list(want)
    for name, t in state.items():
        assert t.dtype == torch.float32 and t.device.type == "cpu"
        assert t.numpy().tobytes() == want[name].data
    # The learner ended on that commit (a barrier: nothing trained past it).
    for name, p in trained.named_parameters():
        assert torch.equal(p.detach(), state[name])
    fresh = make_model()
    loaded = gradientmail.load_committed(LocalMailbox(box), fresh)
    assert all(torch.equal(loaded[n], state[n]) for n in state)
    for name, p in fresh.named_parameters():
        assert torch.equal(p.detach(), state[name])


def test_a_model_of_another_shape_a_wrong_key_and_no_run_are_named(tmp_path: Path) -> None:
    box = tmp_path / "run"
    train(box, run_key=KEY)
    other = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(SchemaMismatch) as info:
        gradientmail.load_committed(str(box), other, run_key=KEY)
    assert str(info.value) == (
        f"this model does not match the run in file://{box}: '2.weight' is [3, 8] in the "
        "model, [2, 8] in the run; '2.bias' is [3] in the model, [2] in the run. Use the "
        "run's model definition")
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))
    with pytest.raises(AuthenticationError):
        gradientmail.load_committed(str(box))  # an authenticated run needs its key
    with pytest.raises(AuthenticationError):
        gradientmail.load_committed(str(box), run_key="another key of sixteen bytes")
    with pytest.raises(ConfigError, match="no run found in"):
        gradientmail.load_committed(str(tmp_path / "empty"))


def test_read_committed_says_which_round_and_versions(tmp_path: Path) -> None:
    box = tmp_path / "run"
    trained = train(box)
    committed = gradientmail.read_committed(str(box))
    assert isinstance(committed, gradientmail.CommittedModel)
    # 5 rounds of one fragment: round 4 is the newest, the fragment at version 5.
    assert (committed.round, committed.rounds_committed, committed.versions) == (4, 5, (5,))
    assert committed.url == f"file://{box}"
    assert committed.metadata == {"format": "pt", "gradientmail.url": f"file://{box}",
                                  "gradientmail.round": "4", "gradientmail.versions": "[5]"}
    assert list(committed.tensors) == [n for n, _ in trained.named_parameters()]
    state = committed.state_dict()
    assert all(state[n].numpy().tobytes() == committed.tensors[n].data for n in state)
    fresh = make_model()
    assert committed.load_into(fresh).keys() == state.keys()
    for name, p in fresh.named_parameters():
        assert torch.equal(p.detach(), dict(trained.named_parameters())[name].detach())
    # A mailbox object is left open for its owner, and named by its own URL.
    mailbox = LocalMailbox(box)
    again = gradientmail.read_committed(mailbox)
    assert (again.round, again.versions, again.url) == (4, (5,), f"file://{box}")
    assert gradientmail.load_committed(mailbox).keys() == state.keys()


def test_read_committed_before_any_round_is_init(tmp_path: Path) -> None:
    box = tmp_path / "run"
    model = make_model()
    learner = Learner(
        TorchAdapter(model),
        DiLoCo(2, 1, in_flight=1),
        str(box),
        "solo",
        on_event=lambda e: None,
        options=LearnerOptions(poll_interval=0.01),
    )
    learner.start()
    learner.close()
    committed = gradientmail.read_committed(str(box))
    assert (committed.round, committed.rounds_committed, committed.versions) == (-1, 0, (0,))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), committed.state_dict()[name])
