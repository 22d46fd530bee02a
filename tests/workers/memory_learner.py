"""One rank of an FSDP2 learner (`ShardedRanks` under `RankSync`) whose publish and apply
are measured: what it allocates, on any of its threads, while it mails its part and while
it reads a commit and applies it.

    torchrun --nproc_per_node N tests/workers/memory_learner.py MAILBOX OUT
        [--checkpoint-every K] [--rounds R] [--layers L]

A GPT-2 of many small blocks (so that the largest tensor is small next to a shard) is
sharded block by block, trained R rounds of standard DiLoCo with a quorum of 1 (a
`gradientmail sync` process closes them; this learner closes nothing, so its ranks hold
no closer's state), and each rank writes OUT.rank<R>.json: its shard and largest tensor in
F32, and the peak of each window (`SharedMeter`): "publish" (its part: delta and upload),
"apply" (reading a commit's rows, replaying a replicated step on them, loading them, and
the training thread's apply or rebase), "snapshot" (the due step's copy), "join" (the
same as "apply" for what the learner joins with, which with a replicated outer step also
makes the rank's rows of the outer state it keeps).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from gradientmail.learner.options import LearnerOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from alloc_meter import SharedMeter

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.integration import RankSync, TorchRanks
from gradientmail.integration.sharded import ShardedRanks
from gradientmail.learner.runtime import Learner


def build(layers: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=257, n_positions=16, n_embd=64, n_layer=layers, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def measure(meter: SharedMeter, *, tap_snapshot: bool = True) -> None:
    """Open and close the windows around the learner's own code (test instrumentation:
    the library has no hooks for it). Without `tap_snapshot` a snapshot's torch ops are
    not watched (a benchmark timing it)."""
    upload, reach, replay = ShardedRanks._upload, ShardedRanks._reach, ShardedRanks._replay
    trained: list[bool] = []  # a snapshot was taken: the join is behind

    async def measured_upload(self: ShardedRanks, *args: Any) -> Any:
        meter.begin("publish")
        try:
            return await upload(self, *args)
        finally:
            meter.end("publish")

    async def measured_reach(self: ShardedRanks, *args: Any) -> Any:
        # Ended by the apply or rebase that uses what it loads. Before the first snapshot
        # it is the join, which also makes the rank's rows of the outer state.
        meter.begin("apply" if trained else "join")
        return await reach(self, *args)

    def measured_replay(self: ShardedRanks, kind: str, *args: Any) -> None:
        if kind == "snapshot":
            trained.append(True)
            meter.begin("snapshot")
        if kind == "snapshot" and not tap_snapshot:
            replay(self, kind, *args)
        else:
            with meter.tap():
                replay(self, kind, *args)
        if kind == "snapshot":
            meter.end("snapshot")
        elif kind in ("apply", "rebase") and meter.window is not None:
            meter.end(meter.window)

    ShardedRanks._upload = measured_upload  # type: ignore[method-assign]
    ShardedRanks._reach = measured_reach  # type: ignore[method-assign]
    ShardedRanks._replay = measured_replay  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mailbox")
    ap.add_argument("out")
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--sync-every", type=int, default=2)
    args = ap.parse_args()

    meter = SharedMeter()
    meter.install()  # before any thread starts
    measure(meter)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(args.layers)
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    alg = DiLoCo(sync_every=args.sync_every, fragments=1, in_flight=1, overlap_steps=0,
                 merge=WeightedMean(), quorum_size=1, checkpoint_every=args.checkpoint_every)
    sharded_ranks = ShardedRanks.create(model, args.mailbox, timeout=300.0)
    sync = RankSync(TorchRanks("cpu"), model, sharded_ranks=sharded_ranks)
    sync.start(lambda: Learner(
        sharded_ranks.learner_adapter(),
        alg,
        args.mailbox,
        "sharded",
        options=LearnerOptions(sync=False, poll_interval=0.01, lease_every=2.0, lease_timeout=30.0),
    ))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = torch.arange(16).reshape(1, 16) % 257
    for _ in range(args.rounds * args.sync_every):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sync.step(16)
    sync.close()
    a = sharded_ranks.adapter
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps({
        "rank": rank,
        "rounds_seen": sync.rounds_seen,
        "shard_f32": a.local_nbytes(dtype="F32"),
        "largest_f32": max(4 * math.prod(p.shape) for p in a.schema.params),
        "model_f32": sum(4 * math.prod(p.shape) for p in a.schema.params),
        "peaks": meter.peaks,
    }))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from ending import leave  # FSDP2's own gloo collectives: see ending.py

    leave()
