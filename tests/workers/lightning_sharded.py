"""One sharded Lightning learner: `ModelParallelStrategy` with FSDP2, for issue #15's tests;
with `--plain`, one plain Lightning learner of the same toy model beside it (issue #27).

    torchrun --nproc_per_node N tests/workers/lightning_sharded.py MAILBOX OUT --steps S
        [--ckpt-dir DIR --ckpt-every K] [--resume CKPT] [--die-at S] [--key-log LOG]
        [--device cpu|cuda] [--algorithm streaming|standard|sparse] [--learner-id ID]
        [--seed N] [--data-seed N] [--wait-for N]
    python tests/workers/lightning_sharded.py MAILBOX OUT --plain [the same options]

Every rank builds the toy module; `configure_model` shards each linear layer and the whole
with `fully_shard` over the strategy's data-parallel mesh (N ranks, no tensor
parallelism), so each rank holds a chunk of rows (with 3 ranks the last holds an empty
shard of the 2-row layer). `--plain` trains the same module unsharded in this one
process, on Lightning's default strategy (no torchrun). `--algorithm standard` is
`STANDARD`, standard DiLoCo with a quorum of 2, whose learners the callback makes wait
for each other at train start by default; `--algorithm streaming` (the default) is
`ALGORITHM`, which waits for nobody, and `--algorithm sparse` the same with TOPK_F8
deltas and error feedback (`SPARSE`). The DiLoCoCallback is given no learner id unless
`--learner-id` names one: a run resumed from a checkpoint must find it there. `--die-at
S` SIGKILLs every rank after optimizer step S (what a preempted machine does: no hook, no
lease release). `--key-log LOG`: every rank notes the keys it writes in LOG.rank<R>.
Rank 0 writes OUT.start.json at train start (the learner id, the full parameters it
joined with and its error feedback, gathered from every rank), OUT.awaiting.json each
time its learner reports waiting for the others (the `AwaitingLearners` events so far),
and OUT.end.json after train end (the same after close, the rounds seen, the rounds it
published, the waits, and the world size).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from gradientmail import events as ev
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.mailbox import LocalMailbox
from gradientmail_lightning import DiLoCoCallback
from workers.lightning_toy import ToyModule, toy_loader

#: The run's configuration, the same in every phase of a test (a learner joining with
#: another is refused): 2 fragments, a round every 2 steps, one round in flight.
ALGORITHM = DiLoCo(sync_every=4, fragments=2, in_flight=1, overlap_steps=0,
                   merge=WeightedMean(), flush_on_close=False)
#: Standard DiLoCo, a round every 4 steps, both learners in every round (issue #27).
STANDARD = DiLoCo.standard(4, 2)
#: `ALGORITHM` with TOPK_F8 deltas at 2 values a chunk and error feedback.
SPARSE = DiLoCo(sync_every=4, fragments=2, in_flight=1, overlap_steps=0,
                merge=WeightedMean(), flush_on_close=False, delta_dtype="TOPK_F8",
                delta_density=2 / 4096)
ALGORITHMS = {"streaming": ALGORITHM, "standard": STANDARD, "sparse": SPARSE}


class KeyLog(LocalMailbox):
    """A local directory that notes every key this process writes in `log`: the sweep
    leaves no part behind, so this is how a test sees which rank uploaded what."""

    def __init__(self, root: str, log: str) -> None:
        super().__init__(root)
        self._log = log

    def _note(self, key: str) -> None:
        with open(self._log, "a") as f:
            f.write(key + "\n")

    async def create(self, key: str, data: bytes) -> bool:
        self._note(key)
        return await super().create(key, data)

    async def put(self, key: str, data: bytes) -> None:
        self._note(key)
        await super().put(key, data)


class MomentumToy(ToyModule):
    """The toy module with momentum: the optimizer has state to save and reshard."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.5)


class ShardedToy(MomentumToy):
    """The toy module, sharded by rows over the strategy's data-parallel ranks."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=mesh)
        fully_shard(self.net[2], mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def full_params(module: torch.nn.Module) -> dict[str, list[float]]:
    """Every parameter gathered whole (a collective: every rank calls it)."""
    out = {}
    for name, p in module.named_parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = whole.detach().float().reshape(-1).cpu().tolist()
    return out


def feedback_lists(state: dict[str, Any]) -> dict[str, Any] | None:
    """The callback state's error feedback as JSON: residuals by fragment and name, and
    the rounds in flight."""
    fb = state["error_feedback"]
    if fb is None:
        return None
    return {"residuals": {str(f): {n: torch.as_tensor(a).reshape(-1).tolist()
                                   for n, a in arrays.items()}
                          for f, arrays in fb["residuals"].items()},
            "in_flight": sorted(fb["in_flight"])}


class Probe(Callback):
    """After the DiLoCoCallback in the list: sees what it joined with and ended on."""

    def __init__(self, out: str, diloco: DiLoCoCallback, die_at: int | None) -> None:
        self.out, self.diloco, self.die_at = out, diloco, die_at
        self.published: list[int] = []
        self.awaited: list[dict[str, Any]] = []  # rank 0's AwaitingLearners events

    def _write(self, trainer: Trainer, what: str, data: dict[str, Any]) -> None:
        if trainer.is_global_zero:
            Path(f"{self.out}.{what}.json").write_text(json.dumps(data))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        params = full_params(pl_module)
        state = self.diloco.state_dict()  # rank 0: its learner's, gathered from every rank
        self._write(trainer, "start", {
            "learner_id": state["learner_id"], "params": params,
            "global_step": trainer.global_step, "feedback": feedback_lists(state)})

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule,
                           *args: Any) -> None:
        if self.die_at is not None and trainer.global_step >= self.die_at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        params = full_params(pl_module)
        state = self.diloco.state_dict()
        self._write(trainer, "end", {
            "learner_id": state["learner_id"], "params": params,
            "rounds_seen": state["rounds_seen"], "published": self.published,
            "awaited": self.awaited, "world": trainer.world_size,
            "global_step": trainer.global_step})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mailbox")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ckpt-dir")
    ap.add_argument("--ckpt-every", type=int, default=6)
    ap.add_argument("--resume")
    ap.add_argument("--die-at", type=int)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--key-log", help="note the keys each rank writes in KEY_LOG.rank<R>")
    ap.add_argument("--plain", action="store_true",
                    help="one unsharded process on Lightning's default strategy (no torchrun)")
    ap.add_argument("--algorithm", choices=sorted(ALGORITHMS), default="streaming")
    ap.add_argument("--learner-id")
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--wait-for", type=int,
                    help="wait_for_learners (default: the callback's, those a barrier needs)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = 1 if args.plain else int(os.environ["WORLD_SIZE"])
    rank = 0 if args.plain else int(os.environ["RANK"])
    mailbox = KeyLog(args.mailbox, f"{args.key_log}.rank{rank}") if args.key_log \
        else args.mailbox

    probe: Probe

    def on_event(e: ev.Event) -> None:
        if isinstance(e, ev.SnapshotPublished):
            probe.published.append(e.round)
        elif isinstance(e, ev.AwaitingLearners):
            probe.awaited.append({"live": list(e.live), "wanted": e.wanted})
            Path(f"{args.out}.awaiting.json").write_text(json.dumps(probe.awaited))

    # Without --wait-for the callback's default decides whom to wait for.
    diloco = DiLoCoCallback(mailbox, ALGORITHMS[args.algorithm], args.learner_id,
                            poll_interval=0.01, lease_every=1.0, lease_timeout=6.0,
                            on_event=on_event, wait_for_learners=args.wait_for)
    probe = Probe(args.out, diloco, args.die_at)
    callbacks: list[Callback] = [diloco, probe]
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every,
                                         save_top_k=-1))
    trainer = Trainer(
        accelerator=args.device,
        devices=world,
        strategy="auto" if args.plain else
        ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # Not the run's initialisation: joining must overwrite it on every rank.
    module = MomentumToy(seed=args.seed) if args.plain else ShardedToy(seed=args.seed)
    trainer.fit(module, toy_loader(n=512, seed=args.data_seed), ckpt_path=args.resume)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from workers.ending import leave  # FSDP2's own gloo collectives: see ending.py

    leave()
