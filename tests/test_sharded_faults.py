"""A learner whose ranks read their rows of each commit by ranged GETs, with some of those
reads failing or coming back corrupted (`FaultyMailbox`, op "get_range"), ends where it
ends without faults: each failed read, and each corrupted one (found by the payload's
block digests or its header's digest, docs/design/sharded.md §2), fails its commit's read on
every rank, the commit is read again on a later poll, and every rank ends on the newest
commits with the oracle's parameters.

Ranks are threads, as in tests/test_sharded_ranks.py (its oracle, toy model and training loops).
"""

from __future__ import annotations

import asyncio
import functools
import re
import secrets
import threading
from typing import Any

import pytest
import torch
from test_learner_oracle import ROUNDS, H, oracle
from test_learner_runtime import Recorder, in_threads
from test_sharded_ranks import RANKS, TIMEOUT, train_plain, train_ranked
from workers.toy import make_model

from gradientmail import events as ev
from gradientmail.adapters import TorchAdapter
from gradientmail.adapters.sharded import ShardedAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.integration import RankSync, ThreadRanks
from gradientmail.integration.sharded import ShardedRanks
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import FaultPlan, FaultyMailbox, Mailbox, MemoryMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import state_at
from gradientmail.wire.sharded_ranges import rows_of

#: The payloads of versions 1-9 of a fragment (theta, outer, steps): the commits, not Θ⁰
#: (version 0), which a learner reads while it joins, where a failed read fails the join.
COMMITS = "*/000000000[1-9]-*"


def learner(adapter: Any, mailbox: Mailbox | str, name: str, alg: dict[str, Any],
            **kw: Any) -> Learner:
    return Learner(
        adapter,
        DiLoCo(sync_every=H, fragments=1, in_flight=1, overlap_steps=0,
               merge=WeightedMean(), quorum_size=2, **alg),
        mailbox,
        name,
        options=LearnerOptions(poll_interval=0.01, lease_every=5.0, lease_timeout=30.0),
        **kw,
    )


@pytest.mark.parametrize("fault", ["fail", "corrupt"])
@pytest.mark.parametrize("alg", [{"checkpoint_every": 1}, {}], ids=["rows", "replicated"])
def test_a_parted_learner_whose_ranged_reads_fail_ends_on_the_oracle(
        alg: dict[str, Any], fault: str) -> None:
    name = f"sharded-faults-{secrets.token_hex(4)}"
    url = f"memory://{name}"
    # Each rank's 2nd and 3rd ranged reads of a commit fail (or come back with bytes
    # flipped); the 2nd fails a commit's read (on both ranks: they read the same ranges,
    # each holding the whole model and splitting its upload), and so does the 3rd, the
    # first read of the retry. A flipped range is found by the payload's block digests
    # (the 2nd read, a tensor's rows) or by the header's digest in the record (the 3rd).
    plans = [FaultPlan().fail("get_range", COMMITS, nth=2, times=2) if fault == "fail" else
             FaultPlan().corrupt(COMMITS, nth=2, times=2, op="get_range")
             for _ in range(RANKS)]
    default = ThreadRanks.group(RANKS, timeout=TIMEOUT)
    side = ThreadRanks.group(RANKS, timeout=TIMEOUT)
    models = [make_model() for _ in range(RANKS + 1)]  # in turn: make_model seeds torch
    results: dict[str, list[torch.Tensor]] = {}
    ready = threading.Barrier(RANKS + 1)
    rows: dict[int, Any] = {}
    events = Recorder()

    def rank(k: int) -> None:
        model = models[k]
        box = FaultyMailbox(MemoryMailbox(name), plans[k])
        adapter = ShardedAdapter(model, group_size=RANKS, group_rank=k)
        sharded_ranks = ShardedRanks(adapter, default[k], side[k], k, box, timeout=TIMEOUT)
        sync = RankSync(default[k], model, sharded_ranks=sharded_ranks)
        sync.start(lambda: learner(sharded_ranks.learner_adapter(), box, "ranked", alg,
                                   on_event=events))
        train_ranked(sync, model, ready)
        assert sync.rounds_seen == ROUNDS - 1
        results[f"rank{k}"] = [p.detach().clone() for p in model.parameters()]
        rows[k] = (sharded_ranks.rows_state(0),
                   {n: adapter.local_rows(n) for n in adapter.schema.names})

    def plain() -> None:
        model = models[RANKS]
        one = learner(TorchAdapter(model), url, "plain", alg)
        one.start()
        results["plain"] = train_plain(one, model, ready)

    in_threads(*(functools.partial(rank, k) for k in range(RANKS)), plain, timeout=240)

    # The faults fired: two ranged reads of commits failed on each rank, in the same two
    # reads of a commit (the ranks read alike), each a failed poll of the learner's that
    # names the first rank whose share failed.
    assert [[(r.op, r.fired) for r in plan.rules] for plan in plans] == \
        [[("get_range", 2)]] * RANKS
    failed = [e.error for e in events.of(ev.PollFailed)]
    assert len(failed) == 2, failed
    if fault == "fail":
        for error in failed:
            assert "rank 0: MailboxError: injected fault: get_range of '" in error, error
    else:
        # Refused as an unsharded learner refuses a payload whose SHA-256 differs (a
        # CorruptPayload, the commit read again on the next poll), never applied.
        assert re.search(r"rank 0: CorruptPayload: \w+/0/0000000001-000000\.safetensors: "
                         r"block 0 of tensor '[\w.]+' \(bytes \[\d+, \d+\)\) has SHA-256 "
                         r"\w+\.\.\., its header says \w+\.\.\.; it was corrupted or "
                         r"replaced after it was written", failed[0]), failed[0]
        assert re.search(r"rank 0: CorruptPayload: \w+/0/0000000001-000000\.safetensors: "
                         r"the header \(bytes \[0, \d+\)\) has SHA-256 \w+\.\.\., its record "
                         r"says \w+\.\.\.; it was corrupted", failed[1]), failed[1]

    # The same parameters as without faults: the oracle's, on every rank.
    want = oracle()
    for who, got in results.items():
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6, msg=who)

    async def check_newest() -> None:
        ex = Exchange(MemoryMailbox(name))
        recs = await ex.rounds_after(-1)
        assert [sorted(p.learner for p in r.participants) for r in recs] == \
            [["plain", "ranked"]] * ROUNDS
        if "checkpoint_every" in alg:
            return
        # Each rank's rows of the outer state are the newest commit's, byte for byte: the
        # replays that failed partway were dropped, and the chain replayed again.
        whole = await state_at(ex, 0, recs[-1])
        for k, (mine, held) in rows.items():
            assert mine is not None and mine.version == whole.version == ROUNDS, k
            for part, full in ((mine.theta, whole.theta), (mine.momentum, whole.momentum)):
                for n, t in part.items():
                    assert bytes(t.buffer) == bytes(rows_of(full[n], *held[n]).tensor.buffer)

    asyncio.run(check_newest())
