"""One Accelerate launch as one learner, for the wrapper's multi-process tests.

    torchrun --nproc_per_node 2 tests/workers/accelerate_worker.py MAILBOX ID --out DIR ...
    python tests/workers/accelerate_worker.py MAILBOX ID --out DIR ...      # one process

Every rank trains the toy model on its own batches (gradient accumulation optional), counts
its tokens with `diloco.count(x)`, and after every real optimizer step records the step,
the rounds seen and a SHA-256 of its parameters. At the end each rank writes
DIR/<ID>.rank<R>.json (those records, its final parameters, and on rank 0 the learner's
local step and the launch's token count).

`--fsdp`: the launch is a sharded learner. Accelerate applies its FSDP plugin only on
accelerator devices (on CPU `distributed_type` stays MULTI_CPU and the plugin is
ignored), so on CPU the script shards the model itself with `fully_shard` and prepares the
optimizer alone; `--fsdp-plugin` (a GPU launch with `--use_fsdp --fsdp_version 2`) lets
`accelerator.prepare` shard it. Parameters are then gathered whole (`full_tensor`, a
collective) for the checksums and the output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from gradientmail.algorithms.diloco import DiLoCo as Config
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.learner.options import LearnerOptions
from gradientmail_accelerate import DiLoCo, DiLoCoPlugin


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batch(stream: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * stream + i)
    return torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)


def whole(p: torch.Tensor) -> torch.Tensor:
    """`p` gathered whole when it is a DTensor (a collective), on the host."""
    full = p.full_tensor() if hasattr(p, "full_tensor") else p
    return full.detach().to("cpu").contiguous()


def checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(whole(p).reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mailbox")
    ap.add_argument("learner_id")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--quorum", type=int, default=0, help="standard DiLoCo with this quorum")
    ap.add_argument("--wait-for", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="data stream of this learner")
    ap.add_argument("--fsdp", action="store_true", help="shard with fully_shard (FSDP2)")
    ap.add_argument("--delta-dtype", default=None, help="the run's delta_dtype (e.g. TOPK_F8)")
    ap.add_argument("--fsdp-plugin", action="store_true",
                    help="Accelerate's FSDP2 plugin shards it (an accelerator launch)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=not args.fsdp_plugin, gradient_accumulation_steps=args.accum)
    dtype = {} if args.delta_dtype is None else {"delta_dtype": args.delta_dtype}
    if args.quorum:
        alg = Config.standard(args.sync_every, args.quorum, **dtype)
    else:
        alg = Config(
            sync_every=args.sync_every,
            fragments=args.fragments,
            in_flight=min(2, args.fragments),
            merge=WeightedMean(),
            **dtype,
        )
    plugin = DiLoCoPlugin(
        args.mailbox,
        alg,
        learner_id=args.learner_id,
        options=LearnerOptions(poll_interval=0.02, lease_every=1.0, lease_timeout=5.0),
    )
    # Every rank starts from a different model: start() must give them rank 0's.
    model = make_model(seed=accelerator.process_index + 7 * args.seed)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        opt = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.05))
    else:
        if args.fsdp_plugin:
            model = model.to(accelerator.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt = accelerator.prepare(model, opt)
    rank = accelerator.process_index
    records = []
    micro = 0
    with DiLoCo(accelerator, model, opt, plugin) as diloco:
        assert diloco.wait_for_learners(args.wait_for, timeout=60), "peers never came"
        net = accelerator.unwrap_model(model)
        records.append({"step": 0, "rounds_seen": diloco.rounds_seen, "sum": checksum(net)})
        while diloco.optimizer_steps < args.steps:
            x, y = (t.to(accelerator.device) for t in batch(100 * args.seed + rank, micro))
            micro += 1
            diloco.count(x)  # before the step that consumes it
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                before = diloco.optimizer_steps
                opt.step()
                opt.zero_grad()
            if diloco.optimizer_steps != before:
                records.append(
                    {
                        "step": diloco.optimizer_steps,
                        "rounds_seen": diloco.rounds_seen,
                        "sum": checksum(net),
                    }
                )
        learner = diloco.learner
    records.append({"step": "closed", "rounds_seen": diloco.rounds_seen, "sum": checksum(net)})
    out = {
        "rank": rank,
        "world": accelerator.num_processes,
        "distributed_type": getattr(accelerator.distributed_type, "name", ""),
        "fsdp2": bool(getattr(accelerator, "is_fsdp2", False)),
        "micro_batches": micro,
        "records": records,
        "params": {n: whole(p).reshape(-1).tolist() for n, p in net.named_parameters()},
        "local_step": learner.local_step if learner is not None else None,
        "tokens": diloco.tokens,
        "state": jsonable(diloco.state_dict()),
    }
    path = Path(args.out) / f"{args.learner_id}.rank{rank}.json"
    path.write_text(json.dumps(out))
    # What an Accelerate script ends with. It is not what keeps a rank from aborting at
    # exit ("terminate called without an active exception", exit -6): gloo has no
    # shutdown and DDP still holds the group, so its worker threads live on; TorchRanks
    # waits until they let go of each collective's tensors (gradientmail.integration.ranks).
    accelerator.end_training()
    if args.fsdp:
        from ending import leave  # FSDP2's own gloo collectives: see ending.py

        leave()


def jsonable(state: dict[str, Any]) -> dict[str, Any]:
    """The wrapper's state with its error feedback's arrays as their sizes (fragment ->
    tensor name -> elements) and the rounds it holds in flight."""
    feedback = state["error_feedback"]
    if feedback is not None:
        feedback = {
            "residuals": {str(f): {n: int(a.numel()) if hasattr(a, "numel") else int(a.size)
                                   for n, a in arrays.items()}
                          for f, arrays in feedback["residuals"].items()},
            "in_flight": sorted(int(r) for r in feedback["in_flight"]),
        }
    return {**state, "error_feedback": feedback}


if __name__ == "__main__":
    main()
