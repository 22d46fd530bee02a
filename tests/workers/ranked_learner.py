"""One learner run by the ranks of a torchrun launch, each mailing its own rows.

    torchrun --nproc_per_node N tests/workers/ranked_learner.py MAILBOX ID --worker W
        --out OUT.json [--fsdp] [--steps S] [--sync-every H] [--learners L]
        [--checkpoint-every K] [--compression off|zstd] [--delta-dtype F --density D]
        [--keep-rounds K]

Every rank builds the toy model (the same seed), shards it with FSDP2 (`--fsdp`) or keeps
it whole (a DDP group splitting its upload), and runs it through `RankSync` with
`ShardedRanks`: standard DiLoCo with a quorum of L learners. Every rank trains on worker W's
batches, so the gradient every rank sees (FSDP2 averages identical ones) is the one a
single process would. Rank 0 writes OUT.json: the full parameters (gathered from the
shards), the rounds seen and the rounds it published; rank k > 0 writes OUT.json.rank<k>.
With a sparse `--delta-dtype`, rank 0 also writes the learner's error feedback gathered
from every rank after close (`Learner.state_dict`), and every rank its own residuals.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from gradientmail.learner.options import LearnerOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from toy import inner_step, make_model

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.events import Event, SnapshotPublished
from gradientmail.integration import RankSync, TorchRanks
from gradientmail.integration.sharded import ShardedRanks
from gradientmail.learner.runtime import Learner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mailbox")
    ap.add_argument("learner_id")
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--sync-every", type=int, default=3)
    ap.add_argument("--learners", type=int, default=3)
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--compression", default="off")
    ap.add_argument("--delta-dtype", default=None)
    ap.add_argument("--density", type=float, default=None)
    ap.add_argument("--keep-rounds", type=int, default=None)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    model = make_model()
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
    alg = DiLoCo(sync_every=args.sync_every, fragments=1, in_flight=1, overlap_steps=0,
                 merge=WeightedMean(), quorum_size=args.learners,
                 checkpoint_every=args.checkpoint_every, delta_dtype=args.delta_dtype,
                 delta_density=args.density, keep_rounds=args.keep_rounds)
    published: list[int] = []

    def on_event(e: Event) -> None:
        if isinstance(e, SnapshotPublished):
            published.append(e.round)

    sharded_ranks = ShardedRanks.create(model, args.mailbox, timeout=300.0,
                                compression=args.compression)
    sync = RankSync(TorchRanks("cpu"), model, sharded_ranks=sharded_ranks)
    sync.start(lambda: Learner(
        sharded_ranks.learner_adapter(),
        alg,
        args.mailbox,
        args.learner_id,
        on_event=on_event,
        options=LearnerOptions(
            poll_interval=0.01,
            lease_every=2.0,
            lease_timeout=30.0,
            compression=args.compression,
        ),
    ))
    sync.wait_for_learners(args.learners, timeout=240)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        inner_step(model, opt, args.worker, step)
        sync.step(5)
    sync.close()
    params = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # a collective
        params[name] = full.detach().reshape(-1).tolist()
    rank = dist.get_rank()
    state = sharded_ranks.rows_state(0)  # this rank's rows of the replayed outer state, if any
    rows = None if state is None else {
        "version": state.version,
        "held": {n: list(sharded_ranks.adapter.local_rows(n)) for n in state.theta},
        "sha256": {f"{kind}/{n}": hashlib.sha256(t.buffer).hexdigest()
                   for kind, part in (("theta", state.theta), ("momentum", state.momentum),
                                      ("master", state.master or {}))
                   for n, t in part.items()}}
    feedback = None
    if args.delta_dtype is not None:
        def flat(arrays: dict[str, Any]) -> dict[str, list[float]]:
            return {n: torch.as_tensor(a).reshape(-1).tolist() for n, a in arrays.items()}

        mine = sharded_ranks._feedback  # this rank's own rows' residuals
        gathered = sync.learner.state_dict()["error_feedback"] if sync.learner else None
        feedback = {
            "own": None if mine is None else flat(dict(mine.residual(0))),
            "spans": {n: list(s) for n, s in sharded_ranks._spans().items()},
            "gathered": None if gathered is None else {
                "residuals": flat(gathered["residuals"][0]),
                "in_flight": sorted(gathered["in_flight"])},
        }
    Path(args.out if rank == 0 else f"{args.out}.rank{rank}").write_text(json.dumps({
        "params": params, "rounds_seen": sync.rounds_seen, "published": published,
        "world": dist.get_world_size(), "rows": rows, "feedback": feedback}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from ending import leave  # FSDP2's own gloo collectives: see ending.py

    leave()
