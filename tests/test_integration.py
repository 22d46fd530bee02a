"""The integration core both frameworks use (gradientmail.integration): the token rule,
the metric names, rank synchronisation over the `ThreadRanks` fake (ranks as threads,
each with its own copy of the model), and batches sized to a share of the global batch."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gradientmail import events as ev
from gradientmail.adapters.torch import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.errors import ConfigError, GradientmailError
from gradientmail.integration import (
    METRICS,
    BatchSizes,
    RankSync,
    RunMetrics,
    ShareBatchSampler,
    ThreadRanks,
    count_tokens,
    per_process_batch,
)
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import MemoryMailbox
from gradientmail.run.protocol import Exchange

FAST: dict[str, Any] = {"poll_interval": 0.01, "lease_every": 2.0, "lease_timeout": 6.0}

# -- tokens ------------------------------------------------------------------------------


def test_count_tokens_excludes_padding_wherever_there_is_a_mask() -> None:
    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    assert count_tokens(12) == 12
    assert count_tokens(ids) == 10
    assert count_tokens({"input_ids": ids}) == 10
    assert count_tokens({"input_ids": ids, "attention_mask": mask}) == 7
    assert count_tokens({"input_ids": ids, "attention_mask": mask.bool()}) == 7
    assert count_tokens(({"input_ids": ids, "attention_mask": mask}, ids)) == 7
    assert count_tokens((torch.ones(4, 6), torch.ones(4, 2))) == 24
    with pytest.raises(ConfigError, match=r"keys \['labels'\]; it needs 'attention_mask' or"):
        count_tokens({"labels": ids})
    with pytest.raises(ConfigError, match="a token count must be >= 0, got -1"):
        count_tokens(-1)
    with pytest.raises(ConfigError, match="cannot count tokens in a str"):
        count_tokens("text")


def test_both_integrations_count_with_the_one_rule() -> None:
    from gradientmail_accelerate import count_tokens as accelerate_count
    from gradientmail_lightning.callback import batch_tokens

    assert accelerate_count is count_tokens and batch_tokens is count_tokens


# -- metrics -----------------------------------------------------------------------------


def test_run_metrics_accumulate_events_under_the_documented_names() -> None:
    now = [100.0]
    m = RunMetrics(now=lambda: now[0])
    m.feed(ev.SnapshotPublished("me", 0, 0, 3, 30, 1000, 0.1))
    m.feed(ev.SnapshotPublished("me", 1, 1, 3, 30, 500, 0.1))
    now[0] = 104.0
    m.feed(ev.RoundRecorded(4, 0, 2, ("me", "you"), 0.25, "you"))
    m.feed(ev.RoundRecorded(3, 1, 1, ("me",), None, "me"))
    m.feed(ev.FragmentAligned("me", 4, 0, 2, 7, 800))
    m.feed(ev.PublishFailed("me", 5, "oops"))
    m.feed(ev.PollFailed("me", "oops"))
    now[0] = 106.5
    assert m.values() == {
        "diloco/rounds_committed": 5.0,
        "diloco/published": 2.0,
        "diloco/bytes_sent": 1500.0,
        "diloco/bytes_received": 800.0,
        "diloco/since_commit": 2.5,
        "diloco/failures": 2.0,
        "diloco/staleness": 7.0,
        "diloco/mean_cosine": 0.25,
    }
    assert set(m.values()) <= set(METRICS)


# -- rank synchronisation ----------------------------------------------------------------


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def on_ranks(n: int, body: Callable[[int, ThreadRanks], Any]) -> list[Any]:
    """Run `body(rank, ranks)` on n threads; each result, or the exception it raised."""
    group = ThreadRanks.group(n, timeout=20.0)
    out: list[Any] = [None] * n

    def run(rank: int) -> None:
        try:
            out[rank] = body(rank, group[rank])
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


def test_ranks_hold_rank0s_parameters_and_their_tokens_are_summed() -> None:
    box = MemoryMailbox()
    alg = DiLoCo.standard(2, 1, global_batch_size=96)

    def body(rank: int, ranks: ThreadRanks) -> dict[str, Any]:
        net = model(seed=rank)  # every rank starts elsewhere
        shares: list[int] = []
        sync = RankSync(ranks, net, on_batch_size=shares.append)
        sync.start(lambda: Learner(TorchAdapter(net), alg, box, "dp",
                                   options=LearnerOptions(**FAST)))
        sums = [flat(net).clone()]
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(4):
            # DDP all-reduces gradients: every rank takes the same step between syncs.
            g = torch.Generator().manual_seed(step)
            loss = net(torch.randn(5, 4, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sync.step(tokens=3 + rank)  # ranks count different tokens
            sums.append(flat(net).clone())
        sync.close()
        sums.append(flat(net).clone())
        return {"sums": sums, "shares": shares, "sync": sync, "metrics": sync.metrics()}

    r0, r1 = on_ranks(2, body)
    for i, (a, b) in enumerate(zip(r0["sums"], r1["sums"], strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"ranks differ at point {i}")
    rounds = asyncio.run(Exchange(box).rounds_after(-1))
    assert [r.round for r in rounds] == [0, 1]
    assert [(p.learner, p.steps, p.tokens) for r in rounds for p in r.participants] == [
        ("dp", 2, 2 * (3 + 4)),
        ("dp", 2, 2 * (3 + 4)),
    ]
    for r in (r0, r1):
        assert (r["sync"].steps, r["sync"].tokens, r["sync"].rounds_seen) == (4, 28, 1)
        assert r["shares"] == [96]  # one live learner: the whole global batch, every rank
        assert set(r["metrics"]) <= set(METRICS)
    assert r0["metrics"]["diloco/live_learners"] == 1.0
    assert "diloco/live_learners" not in r1["metrics"]  # rank 0 alone knows the leases
    assert r1["metrics"]["diloco/rounds_seen"] == 1.0 and r1["metrics"]["diloco/tokens"] == 28


def test_a_failure_on_rank0_stops_every_rank_instead_of_hanging() -> None:
    def body(rank: int, ranks: ThreadRanks) -> None:
        def make() -> Learner:
            raise ConfigError("no such bucket")

        RankSync(ranks, model(rank)).start(make)

    r0, r1 = on_ranks(2, body)
    assert isinstance(r0, ConfigError) and str(r0) == "no such bucket"
    assert isinstance(r1, GradientmailError)
    assert str(r1) == (
        "the learner on the main process (rank 0) failed in start(); its error is in rank 0's "
        "log. This rank stops too, so no collective is left waiting"
    )


class LateReleasingGloo:
    """`torch.distributed` as gloo behaves: a collective returns when its work is done,
    and a worker thread lets go of the work's tensor a moment later."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.let_go: list[threading.Event] = []  # set as the worker drops its reference

    def get_world_size(self) -> int:
        return 2

    def get_rank(self) -> int:
        return self.rank

    def _collective(self, t: torch.Tensor) -> None:
        holder = [t.view(-1)]  # a C++ reference to t, as gloo's work holds
        released = threading.Event()
        self.let_go.append(released)

        def worker() -> None:
            time.sleep(0.05)  # a worker thread that gets its turn late
            released.set()  # first: once the reference is gone, this is set
            holder.clear()

        threading.Thread(target=worker, daemon=True).start()

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        self._collective(t)

    def all_reduce(self, t: torch.Tensor) -> None:
        self._collective(t)


def test_torch_ranks_keep_a_collectives_tensor_until_the_backend_let_go_of_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    # A tensor dropped here first is freed by gloo's worker thread, which needs the GIL:
    # at interpreter exit that aborted the rank (SIGABRT, "terminate called without an
    # active exception"). Every collective returns only once the backend let go.
    import torch.distributed as dist

    from gradientmail.integration import TorchRanks

    for rank in (0, 1):
        fake = LateReleasingGloo(rank)
        for name in ("get_world_size", "get_rank", "broadcast", "all_reduce"):
            monkeypatch.setattr(dist, name, getattr(fake, name))
        ranks = TorchRanks("cpu")
        assert ranks.broadcast_ints([3, 4]) == [3, 4]
        assert ranks.sum_int(5) == 5
        params = [torch.ones(2), torch.zeros(3, dtype=torch.int64)]
        ranks.broadcast_tensors(params)
        assert [e.is_set() for e in fake.let_go] == [True] * 4  # two dtypes: two
    assert "still held" not in caplog.text


def test_rank_0_takes_its_own_ints_without_reading_the_tensor_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On a GPU, reading a collective's tensor back waits for every kernel queued before
    # it; rank 0 sent the values and needs nothing back. The other ranks read theirs.
    import torch.distributed as dist

    from gradientmail.integration import TorchRanks

    def overwrite(t: torch.Tensor, src: int) -> None:
        t.fill_(7)  # what a receiver's tensor holds after the broadcast

    for rank, want in ((0, [3, 4]), (1, [7, 7])):
        monkeypatch.setattr(dist, "get_world_size", lambda: 2)
        monkeypatch.setattr(dist, "get_rank", lambda rank=rank: rank)
        monkeypatch.setattr(dist, "broadcast", overwrite)
        assert TorchRanks("cpu").broadcast_ints([3, 4]) == want


def test_released_waits_for_the_other_holder_and_gives_up_after_its_sleeps() -> None:
    from gradientmail.integration.ranks import _released

    t = torch.zeros(4)
    other = [t.view(4)]  # a view holds its base, as a backend's work holds the tensor
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 2:
            other.clear()

    assert _released(t, sleeps=[0.1, 0.2, 0.3], sleep=sleep)
    assert slept == [0.1, 0.2]
    stuck = t.view(4)
    assert not _released(t, sleeps=[0.1, 0.2], sleep=lambda s: None)
    del stuck
    assert _released(t, sleeps=[], sleep=sleep)


# -- batches -----------------------------------------------------------------------------


def test_per_process_batch_splits_a_share_over_processes_and_accumulation() -> None:
    assert per_process_batch(96) == 96
    assert per_process_batch(96, processes=2) == 48
    assert per_process_batch(96, processes=2, accumulation=4) == 12
    assert per_process_batch(7, processes=2) == 4  # rounded up: never below the share
    assert per_process_batch(1, processes=8) == 1
    with pytest.raises(ConfigError, match="processes=0 must be an int >= 1"):
        per_process_batch(8, processes=0)


def test_a_share_batch_sampler_follows_the_share_from_the_next_batch() -> None:
    sizes = BatchSizes(default=4)
    sampler = ShareBatchSampler(range(20), 4, drop_last=True, size=sizes)
    assert len(sampler) == 5
    it = iter(sampler)
    assert next(it) == [0, 1, 2, 3]
    sizes.resize(processes=2, accumulation=1)(6)  # a share of 6 over 2 processes: 3 each
    assert (sizes.share, sizes()) == (6, 3)
    assert list(it) == [[4, 5, 6], [7, 8, 9], [10, 11, 12], [13, 14, 15], [16, 17, 18]]
    loose = ShareBatchSampler(range(5), 2, drop_last=False)
    assert list(loose) == [[0, 1], [2, 3], [4]] and len(loose) == 3
