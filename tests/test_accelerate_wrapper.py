"""The Accelerate wrapper in this process (one process, Accelerator(cpu=True)): the hook on
the inner optimizer counts real steps only, tokens reach the commit records, the wrapper's
state survives save_state/load_state, and the `with` block closes on an exception."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from gradientmail.algorithms.diloco import DiLoCo as Config
from gradientmail.errors import AuthenticationError, ConfigError, SchemaMismatch
from gradientmail.events import Event, LeaseReleased
from gradientmail.learner.options import LearnerOptions
from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.traffic import S3_STANDARD
from gradientmail.wire.records import RoundRecord
from gradientmail_accelerate import DiLoCo, DiLoCoPlugin

STANDARD = Config.standard(sync_every=4, learners=1)


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    # Accelerate keeps process-wide singletons; each test builds its own Accelerator.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def plugin(box: Path, prices: Any = S3_STANDARD, **kw: Any) -> DiLoCoPlugin:
    kw.setdefault("algorithm", STANDARD)
    options = LearnerOptions(poll_interval=0.02, lease_every=1.0, lease_timeout=5.0,
                             prices=prices)
    return DiLoCoPlugin(str(box), options=options, **kw)


def setup(accum: int = 1, width: int = 8) -> tuple[Accelerator, Any, Any]:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt


def train(
    accelerator: Accelerator, model: Any, opt: Any, diloco: DiLoCo, micro_batches: int, count: bool
) -> list[float]:
    """Train; with `count`, count the tokens and report the losses, which it returns."""
    losses = []
    for i in range(micro_batches):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
        if count:
            diloco.count(x)
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if count:
                diloco.report_loss(loss)
                losses.append(float(loss))
            opt.step()
            opt.zero_grad()
    return losses


def records(box: Path) -> list[RoundRecord]:
    return list(asyncio.run(Exchange(LocalMailbox(box)).rounds_after(-1)))


def test_gradient_accumulation_counts_real_steps_and_tokens(tmp_path: Path) -> None:
    accelerator, model, opt = setup(accum=2)
    with DiLoCo(accelerator, model, opt, plugin(tmp_path / "run")) as diloco:
        losses = train(accelerator, model, opt, diloco, micro_batches=16, count=True)
        learner = diloco.learner
        assert learner is not None
        assert learner.local_step == diloco.optimizer_steps == 8
        assert diloco.tokens == 16 * 30
    recs = records(tmp_path / "run")
    # H = 4 optimizer steps (8 micro-batches) per round; 2 micro-batches of 5x6 per step.
    assert [(r.round, [(p.steps, p.tokens) for p in r.participants]) for r in recs] == [
        (0, [(4, 240)]),
        (1, [(4, 240)]),
    ]
    # Each contribution carries the mean of the losses reported over its 8 micro-batches.
    assert [r.participants[0].loss for r in recs] == [
        pytest.approx(sum(losses[:8]) / 8), pytest.approx(sum(losses[8:]) / 8)]
    assert diloco.rounds_seen == 1
    assert diloco.metrics()["diloco/rounds_seen"] == 1.0
    assert diloco.metrics()["diloco/published"] == 2.0
    # alone, each contribution completed its round: its own closer merged it from memory
    assert diloco.metrics()["diloco/bytes_sent"] == 0.0
    # ... yet its mailbox saw requests and bytes both ways (the lease, Θ⁰, its commits),
    # metered and priced as the learner's own `traffic` says.
    from gradientmail.integration.metrics import TRAFFIC_METRICS

    metrics = diloco.metrics()
    assert set(TRAFFIC_METRICS) <= set(metrics)
    traffic = learner.traffic
    assert metrics["diloco/requests_create"] == traffic.counts.create > 0
    assert metrics["diloco/requests_list"] == traffic.counts.list > 0
    assert metrics["diloco/mailbox_bytes_up"] == traffic.bytes_up > 0
    assert metrics["diloco/cost_usd"] == pytest.approx(traffic.usd) and traffic.usd > 0
    assert metrics["diloco/cost_usd_per_hour"] == pytest.approx(
        traffic.usd * 3600 / traffic.seconds)


@pytest.mark.parametrize("per_step", [7, "callable"])
def test_tokens_per_step_as_an_int_or_a_callable(tmp_path: Path, per_step: Any) -> None:
    calls = []

    def tokens() -> int:
        calls.append(1)
        return 7

    accelerator, model, opt = setup()
    p = plugin(tmp_path / "run", tokens_per_step=tokens if per_step == "callable" else 7)
    with DiLoCo(accelerator, model, opt, p) as diloco:
        train(accelerator, model, opt, diloco, micro_batches=4, count=False)
        with pytest.raises(ConfigError, match=r"count\(\) called while tokens_per_step="):
            diloco.count(3)
    assert [[(q.steps, q.tokens) for q in r.participants] for r in records(tmp_path / "run")] == [
        [(4, 28)]
    ]
    assert len(calls) == (4 if per_step == "callable" else 0)


def test_checkpoint_round_trip_of_the_wrapper_state(tmp_path: Path) -> None:
    box, ckpt = tmp_path / "run", tmp_path / "ckpt"
    accelerator, model, opt = setup()
    diloco = DiLoCo(accelerator, model, opt, plugin(box, learner_id="first-run"))
    with diloco:
        train(accelerator, model, opt, diloco, micro_batches=6, count=True)
        accelerator.save_state(str(ckpt))
        saved = diloco.state_dict()
    assert saved == {
        "version": 2,
        "learner_id": "first-run",
        "optimizer_steps": 6,
        "tokens": 180,
        "rounds_seen": 0,
        "error_feedback": None,  # no sparse deltas: nothing kept
    }

    # A resumed job: a new wrapper without a learner id loads the checkpoint before start.
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator, model, opt = setup()
    seen: list[Event] = []
    again = DiLoCo(accelerator, model, opt, plugin(box), on_event=seen.append)
    assert again.learner_id is None
    accelerator.load_state(str(ckpt))
    assert again.state_dict() == saved
    with again:
        # It rejoins as the same learner, not as a new <host>-<pid>.
        assert again.learner is not None and again.learner.learner_id == "first-run"
        train(accelerator, model, opt, again, micro_batches=2, count=True)
        assert again.optimizer_steps == 8 and again.tokens == 240
        with pytest.warns(UserWarning, match=r"load_state\(\) after DiLoCo.start\(\)"):
            accelerator.load_state(str(ckpt))
    assert any(isinstance(e, LeaseReleased) and e.learner == "first-run" for e in seen)


def test_sparse_deltas_keep_their_residuals_across_save_state_and_load_state(
        tmp_path: Path) -> None:
    box, ckpt = tmp_path / "run", tmp_path / "ckpt"
    sparse = Config.standard(sync_every=4, learners=1, delta_dtype="TOPK_F8",
                             delta_density=1 / 4096)
    accelerator, model, opt = setup(width=64)
    with DiLoCo(accelerator, model, opt, plugin(box, learner_id="sparse", algorithm=sparse)
                ) as diloco:
        train(accelerator, model, opt, diloco, micro_batches=4, count=True)
        accelerator.save_state(str(ckpt))
        assert diloco.learner is not None
        saved = {n: t.clone() for n, t in
                 diloco.learner.state_dict()["error_feedback"]["residuals"][0].items()}
    assert len(saved) == 4 and all(t.count_nonzero() > 0 for t in saved.values())

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator, model, opt = setup(width=64)
    again = DiLoCo(accelerator, model, opt, plugin(box, algorithm=sparse))
    accelerator.load_state(str(ckpt))
    with again:
        assert again.learner is not None and again.learner.learner_id == "sparse"
        state = again.learner.state_dict()["error_feedback"]
        assert sorted(state["residuals"][0]) == sorted(saved)
        assert all(torch.equal(state["residuals"][0][n], saved[n]) for n in saved)


def test_bad_states_are_refused_with_the_reason(tmp_path: Path) -> None:
    accelerator, model, opt = setup()
    diloco = DiLoCo(accelerator, model, opt, plugin(tmp_path / "run", learner_id="pinned"))
    with pytest.raises(
        ConfigError, match=r"not a gradientmail_accelerate.DiLoCo state: keys \['x'\]"
    ):
        diloco.load_state_dict({"x": 1})
    state = {**diloco.state_dict(), "version": 9}
    with pytest.raises(ConfigError, match="wrapper state version 9 is not 2; the checkpoint was"):
        diloco.load_state_dict(state)
    # A learner id named by the plugin wins over the checkpoint's.
    diloco.load_state_dict({**diloco.state_dict(), "learner_id": "other", "optimizer_steps": 5})
    assert diloco.learner_id == "pinned" and diloco.optimizer_steps == 5


def test_an_exception_in_the_block_closes_the_learner_and_propagates(tmp_path: Path) -> None:
    box = tmp_path / "run"
    accelerator, model, opt = setup()
    seen: list[Event] = []
    diloco = DiLoCo(accelerator, model, opt, plugin(box, learner_id="crash"), on_event=seen.append)
    with pytest.raises(RuntimeError, match="boom"), diloco:
        train(accelerator, model, opt, diloco, micro_batches=3, count=True)
        raise RuntimeError("boom")
    assert any(isinstance(e, LeaseReleased) and e.learner == "crash" for e in seen)
    assert asyncio.run(LocalMailbox(box).list("leases/")) == []
    # Unhooked: more optimizer steps no longer reach the closed learner.
    train(accelerator, model, opt, diloco, micro_batches=2, count=False)
    assert diloco.optimizer_steps == 3
    diloco.close()  # idempotent


def test_joining_a_run_of_another_model_fails_in_start(tmp_path: Path) -> None:
    box = tmp_path / "run"
    accelerator, model, opt = setup(width=8)
    with DiLoCo(accelerator, model, opt, plugin(box, learner_id="a")) as diloco:
        train(accelerator, model, opt, diloco, micro_batches=1, count=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator, model, opt = setup(width=9)
    other = DiLoCo(accelerator, model, opt, plugin(box, learner_id="b"))
    with pytest.raises(SchemaMismatch), other:
        pass
    train(accelerator, model, opt, other, micro_batches=1, count=False)
    assert other.optimizer_steps == 0  # never hooked
    with pytest.raises(ConfigError, match="was started already; start it once"):
        other.start()


def test_unsupported_setups_are_refused(tmp_path: Path) -> None:
    accelerator, model, opt = setup()
    with pytest.raises(ConfigError, match="neither a torch optimizer nor an AcceleratedOptimizer"):
        DiLoCo(accelerator, model, object(), plugin(tmp_path))

    class FsdpAccelerator:
        distributed_type = "FSDP"
        is_fsdp2 = False

    with pytest.raises(ConfigError, match=r"FSDP plugin runs FSDP1 here \(fsdp_version: 1\)"
                       r".* Use FSDP2: fsdp_version: 2 in the accelerate config"):
        DiLoCo(FsdpAccelerator(), model, opt, plugin(tmp_path))

    class DeepSpeedAccelerator:
        distributed_type = "DEEPSPEED"

    with pytest.raises(ConfigError, match=r"distributed_type=DEEPSPEED is not supported; the "
                       r"wrapper runs single-process, DDP and FSDP2 training"):
        DiLoCo(DeepSpeedAccelerator(), model, opt, plugin(tmp_path))


def test_plugin_defaults_to_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADIENTMAIL_MAILBOX", str(tmp_path / "env-run"))
    monkeypatch.setenv("GRADIENTMAIL_SYNC_EVERY", "3")
    accelerator, model, opt = setup()
    diloco = DiLoCo(accelerator, model, opt)
    assert diloco.plugin.mailbox == str(tmp_path / "env-run")
    assert diloco.plugin.resolved_algorithm.sync_every == 3


def test_the_run_key_variable_seals_the_run_and_stays_out_of_the_repr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    box = tmp_path / "sealed"
    key = "a run key of thirty-two characters!"
    monkeypatch.setenv("GRADIENTMAIL_MAILBOX", str(box))
    monkeypatch.setenv("GRADIENTMAIL_SYNC_EVERY", "4")
    monkeypatch.setenv("GRADIENTMAIL_FRAGMENTS", "1")
    monkeypatch.setenv("GRADIENTMAIL_IN_FLIGHT", "1")
    monkeypatch.setenv("GRADIENTMAIL_OVERLAP_STEPS", "0")
    monkeypatch.setenv("GRADIENTMAIL_POLL_INTERVAL", "0.02")
    monkeypatch.setenv("GRADIENTMAIL_RUN_KEY", key)
    accelerator, model, opt = setup()
    with DiLoCo(accelerator, model, opt) as diloco:
        assert diloco.plugin.run_key == key
        assert key not in repr(diloco.plugin)
        train(accelerator, model, opt, diloco, micro_batches=8, count=False)
    sealed = asyncio.run(Exchange(LocalMailbox(box), run_key=key).rounds_after(-1))
    assert [r.round for r in sealed] == [0, 1]
    with pytest.raises(AuthenticationError):
        asyncio.run(Exchange(LocalMailbox(box)).rounds_after(-1))


def test_the_wrappers_loader_follows_the_global_batch_size(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

    accelerator, model, opt = setup(accum=2)
    shares: list[int] = []
    alg = Config.standard(sync_every=4, learners=1, global_batch_size=10)
    diloco = DiLoCo(accelerator, model, opt, plugin(tmp_path / "run", algorithm=alg),
                    on_batch_size=shares.append)
    data = TensorDataset(torch.randn(60, 6), torch.randn(60, 2))
    loader = accelerator.prepare(
        DataLoader(data, batch_sampler=diloco.batch_sampler(SequentialSampler(data), 3))
    )
    assert [len(x) for x, _ in loader][:2] == [3, 3]  # before start: batch_size
    sizes = []
    with diloco:
        for x, y in loader:
            sizes.append(len(x))
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
    # A share of 10 over 1 process and 2 accumulation steps: micro-batches of 5.
    assert shares == [10] and diloco.batch_size == 10
    assert sizes == [5] * 12


def test_the_plugin_prices_the_learners_traffic(tmp_path: Path) -> None:
    from gradientmail.traffic import Prices

    free = Prices(put_per_1000=0.0, get_per_1000=0.0, egress_per_gb=0.0)
    accelerator, model, opt = setup(accum=1)
    p = plugin(tmp_path / "run", prices=free)
    with DiLoCo(accelerator, model, opt, p) as diloco:
        train(accelerator, model, opt, diloco, micro_batches=4, count=True)
        learner = diloco.learner
        assert learner is not None
        assert learner.traffic.counts.put > 0 and learner.traffic.usd == 0.0
        assert diloco.metrics()["diloco/cost_usd"] == 0.0
    with pytest.raises(ConfigError, match=r"prices=0\.1 must be a gradientmail\.traffic\.Prices"):
        plugin(tmp_path / "run", prices=0.1)
