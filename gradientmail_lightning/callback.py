"""DiLoCoCallback: a Lightning `Trainer` becomes one learner of a gradientmail run.

Hooks map to the learner's calls and nothing else:

- `setup` (fit): refuse a strategy the callback cannot keep consistent (FSDP1's
  `FSDPStrategy`, DeepSpeed, XLA) before any work is done.
- `on_train_start` (after checkpoint restore and DDP wrapping or `configure_model`'s
  sharding): global rank 0 builds a `Learner` over the unwrapped LightningModule and joins
  the run; the other ranks copy what it loaded (`gradientmail.integration.RankSync`, as
  for Accelerate). Under `ModelParallelStrategy` (FSDP2: `fully_shard` in
  `configure_model`) every rank mails and reads its own rows instead
  (`gradientmail.integration.ShardedRanks`), and no rank holds a full fragment.
- `on_train_batch_end`: a real optimizer step happened when `trainer.global_step` moved
  (gradient accumulation counts once); the tokens every rank counted in the
  micro-batches since the last one (`gradientmail.integration.count_tokens`) are summed
  and go to `Learner.step()` with rank 0's mean training loss over them (from `outputs`),
  and whatever it overwrote is broadcast to the other ranks.
- `on_train_end` (the model is still on its device): close, or flush with
  `algorithm.flush_on_close`. `on_exception` and `teardown` close within a bound and
  never hang on a collective.
- `state_dict`: the learner id, its local step, the rounds it had seen and its error
  feedback (`Learner.state_dict`: the residuals of sparse deltas), under the fixed key
  "DiLoCoCallback"; a run resumed from a checkpoint rejoins as that learner, with those
  residuals.

Metrics (`gradientmail.integration.METRICS`, the same names as for Accelerate) go to the
Trainer's loggers every `log_every_n_steps` real steps, and the few in `PROGRESS_BAR` to
its progress bar. With `global_batch_size`, the learner's share of it goes to the
batch-size hook: `on_batch_size`, else the datamodule's `resize_batches(share)` when it
has one (`TextDataModule` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from gradientmail import events as ev
from gradientmail.adapters.torch import TorchAdapter
from gradientmail.algorithms.base import Algorithm
from gradientmail.errors import ConfigError
from gradientmail.integration import (
    PREFIX,
    BatchSizeHook,
    LossMean,
    RankSync,
    RunMetrics,
    ShardedRanks,
    ShareBatchSampler,
    SingleRank,
    TorchRanks,
    count_tokens,
    learners_to_await,
    output_loss,
)
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox.base import Mailbox

__all__ = [
    "PROGRESS_BAR",
    "STATE_KEY",
    "DiLoCoCallback",
    "RunMetrics",
    "batch_tokens",
    "check_share_samplers",
    "check_strategy",
]

#: The key of the callback's state in a checkpoint; fixed, so changed arguments keep it.
STATE_KEY = "DiLoCoCallback"
#: The metrics shown on the progress bar (every metric goes to the loggers).
PROGRESS_BAR = tuple(
    PREFIX + name for name in ("rounds_seen", "live_learners", "staleness", "mean_cosine")
)
# The Learner's runtime objects a user may pass beside the settings.
_RUNTIME = frozenset({"backend", "clock", "on_event", "run_key"})


def check_strategy(strategy: Any) -> None:
    """Raise ConfigError unless `strategy` is a single-device, a DDP or a
    `ModelParallelStrategy` (FSDP2) strategy.

    FSDP1 (`FSDPStrategy`) flattens the parameters and cuts them at arbitrary element
    offsets, so no rank holds rows of a tensor it could mail; DeepSpeed and XLA wrap them
    in ways not handled. FSDP2 shards by rows, which the ranks mail one part each.
    """
    from lightning.pytorch import strategies as s
    from lightning.pytorch.strategies.single_xla import SingleDeviceXLAStrategy
    from lightning.pytorch.strategies.xla import XLAStrategy

    unsupported = (s.FSDPStrategy, s.DeepSpeedStrategy, XLAStrategy, SingleDeviceXLAStrategy)
    supported = s.SingleDeviceStrategy | s.DDPStrategy | s.ModelParallelStrategy
    if isinstance(strategy, unsupported) or not isinstance(strategy, supported):
        raise ConfigError(
            f"DiLoCoCallback does not support the {type(strategy).__name__} strategy; it "
            "supports a single device, DDP (strategy='ddp', 'ddp_spawn', 'ddp_notebook') "
            "and sharded learners under ModelParallelStrategy with FSDP2. To shard a "
            "learner, use strategy=ModelParallelStrategy(data_parallel_size=N, "
            "tensor_parallel_size=1) and call torch.distributed.fsdp.fully_shard in your "
            "LightningModule's configure_model (FSDPStrategy is FSDP1, whose flat "
            "parameters cannot be mailed by rows)"
        )


def _sharded(strategy: Any) -> bool:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy)


def _counts_its_batches(strategy: Any) -> tuple[bool, bool]:
    """Under a `ModelParallelStrategy`: whether this rank counts its batches' tokens, and
    whether every rank does. The ranks of one tensor-parallel group all see the same
    batches, and only the first of them counts."""
    group = strategy.device_mesh["tensor_parallel"]
    return int(group.get_local_rank()) == 0, int(group.size()) == 1


def check_share_samplers(loaders: Any, global_batch_size: int | None) -> None:
    """Raise ConfigError when `global_batch_size` is set and a DataLoader in `loaders` (a
    loader or a collection of them, as `Trainer.train_dataloader`) has a
    `ShareBatchSampler` without `size=`: its batches would keep their size.

    Under DDP, Lightning re-creates a custom batch sampler to put its DistributedSampler
    in. Only for a DataLoader built inside a `*_dataloader()` hook does it know every
    argument; for one passed to `fit()` ready-made it calls
    `ShareBatchSampler(sampler, batch_size=, drop_last=)`, and `size=` is lost.
    """
    if global_batch_size is None:
        return
    for loader in _loaders(loaders):
        sampler = getattr(loader, "batch_sampler", None)
        if isinstance(sampler, ShareBatchSampler) and sampler.size is None:
            raise ConfigError(
                f"global_batch_size={global_batch_size} cannot resize the training batches: "
                f"the DataLoader's ShareBatchSampler has no size= (batches of "
                f"{sampler.batch_size}). Under DDP Lightning re-creates a custom batch "
                "sampler to put its DistributedSampler in, and keeps size= only when the "
                "DataLoader is built inside a train_dataloader() hook. Build it in your "
                "LightningModule's or LightningDataModule's train_dataloader(), or pass "
                "Trainer(use_distributed_sampler=False) and give the ShareBatchSampler a "
                "DistributedSampler yourself"
            )


def _loaders(obj: Any) -> Iterator[Any]:
    if isinstance(obj, Mapping):
        for value in obj.values():
            yield from _loaders(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _loaders(value)
    elif obj is not None:
        yield obj


#: Kept for code written against earlier versions: the integrations' one token rule.
batch_tokens = count_tokens


class DiLoCoCallback(Callback):
    """Makes the Trainer one learner of the run in `mailbox` (a Mailbox or a URL).

    `tokens_per_step`: an int per batch, or `callable(batch) -> int`; by default
    `gradientmail.integration.count_tokens(batch)` (non-padding tokens where the batch has
    an attention mask, else the elements of its input_ids or first tensor). Each rank
    counts its own micro-batches; a real step sums them over the ranks (one all-reduce;
    none for an int, which every rank counts alike).
    `log_every_n_steps` defaults to the Trainer's. `on_batch_size(share)` is the
    batch-size hook of a custom loader (see `gradientmail.integration.batches`).
    `options` are the learner's settings (`LearnerOptions`); the same settings may be
    given by name instead (`poll_interval=0.5, wait_for_learners=0`, as a recipe's
    `diloco:` section spells them), and `backend`, `clock`, `on_event`, `run_key` (by
    default `GRADIENTMAIL_RUN_KEY`) go to the `Learner` as they are.
    `abort_timeout` bounds how long closing after an exception may take before the
    process moves on. At train start the learner waits up to `wait_timeout` seconds for
    `wait_for_learners` learners of the run (itself included) to hold a lease — by
    default those a barrier needs (`quorum_size` when `overlap_steps=0`, as in standard
    DiLoCo, whose learners then train every round together; else none); 0 starts at
    once — and raises naming who is live when they do not come.
    """

    abort_timeout: float = 30.0

    def __init__(
        self,
        mailbox: Mailbox | str,
        algorithm: Algorithm,
        learner_id: str | None = None,
        tokens_per_step: int | Callable[[Any], int] | None = None,
        *,
        log_every_n_steps: int | None = None,
        on_batch_size: BatchSizeHook | None = None,
        options: LearnerOptions | None = None,
        **learner_options: Any,
    ) -> None:
        runtime = {k: v for k, v in learner_options.items() if k in _RUNTIME}
        settings = {k: v for k, v in learner_options.items() if k not in _RUNTIME}
        unknown = sorted(set(settings) - set(LearnerOptions.names()))
        if unknown:
            raise ConfigError(
                f"DiLoCoCallback got unknown options {unknown}; Learner options are "
                f"{sorted((*LearnerOptions.names(), *_RUNTIME))}"
            )
        if options is not None and settings:
            raise ConfigError(
                f"DiLoCoCallback got options= and {sorted(settings)}; put them in the "
                "LearnerOptions, or pass them all by name"
            )
        if options is None:
            options = LearnerOptions.from_mapping(settings, source="DiLoCoCallback")
        if tokens_per_step is not None and not callable(tokens_per_step):
            if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int):
                raise ConfigError(
                    f"tokens_per_step={tokens_per_step!r} must be an int, a callable(batch) "
                    "-> int, or None (count the batch's input_ids)"
                )
            if tokens_per_step < 0:
                raise ConfigError(f"tokens_per_step={tokens_per_step} must be >= 0")
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool)
            or not isinstance(log_every_n_steps, int)
            or log_every_n_steps < 1
        ):
            raise ConfigError(
                f"log_every_n_steps={log_every_n_steps!r} must be an int >= 1, or None "
                "for the Trainer's"
            )
        self.mailbox = mailbox
        self.algorithm = algorithm
        self.options = options
        self.learner_id = learner_id
        self.tokens_per_step = tokens_per_step
        self.log_every_n_steps = log_every_n_steps
        self.on_batch_size = on_batch_size
        self._user_sink: ev.EventSink = runtime.pop("on_event", ev.log_events)
        #: The Learner's runtime objects (backend, clock, run_key) given by name.
        self.learner_options = runtime
        self.metrics = RunMetrics()
        self._ranks: RankSync | None = None
        self._known_id: str | None = None  # from a checkpoint, or the last learner's
        self._last_global_step = 0
        self._tokens = 0
        self._losses = LossMean()  # rank 0's micro-batch losses since the last step
        self._last_local_step = 0
        self._last_rounds_seen = -1
        # The error feedback a checkpoint restored (or the last learner left), for the
        # next learner built.
        self._feedback: dict[str, Any] | None = None
        self._counting = self._all_count = True  # this rank's / every rank's tokens count

    @property
    def learner(self) -> Learner | None:
        """The learner while training, on global rank 0 (None elsewhere)."""
        return self._ranks.learner if self._ranks is not None else None

    # -- checkpoint state ------------------------------------------------------------------

    @property
    def state_key(self) -> str:
        return STATE_KEY

    def state_dict(self) -> dict[str, Any]:
        """The learner id, its local step, the rounds it had seen and its error feedback
        (`Learner.state_dict()["error_feedback"]`: None while it holds no residuals, and
        before a learner ran); only global rank 0's learner has residuals, and only rank
        0's checkpoint is written. A sharded learner's ranks each keep their own rows'
        residuals; rank 0's `Learner.state_dict` gathers them into whole tensors (a side
        command the other ranks serve from their own thread)."""
        learner = self.learner
        return {
            "learner_id": learner.learner_id if learner is not None else self._resolved_id(),
            "local_step": learner.local_step if learner is not None else self._last_local_step,
            "rounds_seen": learner.rounds_seen if learner is not None else self._last_rounds_seen,
            "error_feedback": (learner.state_dict()["error_feedback"] if learner is not None
                               else self._feedback),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (a checkpoint of a version before error
        feedback lacks it: the learner then starts with no residuals). The residuals go
        to the learner built at train start (`Learner.load_state_dict`, which checks them
        against the model and the run)."""
        expected = {"learner_id", "local_step", "rounds_seen"}
        if set(state_dict) not in (expected, expected | {"error_feedback"}):
            raise ConfigError(
                f"the checkpoint's {STATE_KEY} state has keys {sorted(state_dict)}, "
                f"expected {sorted(expected | {'error_feedback'})}; was it written by "
                "another version?"
            )
        restored = state_dict["learner_id"]
        self._known_id = str(restored) if restored is not None else None
        self._last_local_step = int(state_dict["local_step"])
        self._last_rounds_seen = int(state_dict["rounds_seen"])
        self._feedback = state_dict.get("error_feedback")

    def _resolved_id(self) -> str | None:
        # An explicit id wins; otherwise a resumed (or refitted) run keeps its identity.
        return self.learner_id if self.learner_id is not None else self._known_id

    # -- hooks -----------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            check_strategy(trainer.strategy)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        check_strategy(trainer.strategy)
        if trainer.world_size > 1:
            check_share_samplers(trainer.train_dataloader, self.algorithm.global_batch_size)
        self._last_global_step = trainer.global_step
        self._tokens = 0
        self._losses = LossMean()
        strategy = trainer.strategy
        sharded = _sharded(strategy) and torch.distributed.is_initialized()
        if (trainer.world_size > 1 or sharded) and torch.distributed.is_initialized():
            ranks: Any = TorchRanks(
                strategy.root_device, lambda obj: strategy.broadcast(obj, src=0)
            )
        else:
            ranks = SingleRank()
        self._counting, self._all_count = _counts_its_batches(strategy) if sharded else (
            True, True)
        # FSDP2's shards: every rank mails and reads its own rows (a collective: the
        # side group). The mailbox is opened again by the other ranks' side threads.
        sharded_ranks = ShardedRanks.create(
            pl_module, self.mailbox, prefix=self.options.prefix,
            compression=self.options.compression, ranks=ranks,
        ) if sharded else None
        self._ranks = RankSync(ranks, pl_module, self.metrics, self._batch_hook(trainer),
                               sharded_ranks=sharded_ranks)
        try:
            self._ranks.start(lambda: self._make_learner(pl_module, sharded_ranks))
        except BaseException:
            self._ranks = None
            raise
        try:
            self._ranks.wait_for_learners(
                learners_to_await(self.options.wait_for_learners, self.algorithm),
                self.options.wait_timeout)
        except BaseException:
            self._abandon()
            raise

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        sync = self._ranks
        if sync is None:
            return
        if self._counting:
            self._tokens += self._count(batch)
        if sync.learner is not None:
            self._losses.add(output_loss(outputs))
        step = trainer.global_step
        if step == self._last_global_step:
            return
        self._last_global_step = step
        tokens, self._tokens = self._tokens, 0
        sync.step(tokens, loss=self._losses.take(),
                  same_on_every_rank=isinstance(self.tokens_per_step, int) and self._all_count)
        learner = sync.learner
        if learner is not None:
            self._last_local_step = learner.local_step
            self._last_rounds_seen = learner.rounds_seen
        # The Trainer sets log_every_n_steps at runtime (untyped): its default is 50.
        every = self.log_every_n_steps or getattr(trainer, "log_every_n_steps", 50)
        if learner is not None and every and step % every == 0:
            self._report(trainer, pl_module, sync)

    def _report(self, trainer: Trainer, pl_module: LightningModule, sync: RankSync) -> None:
        values = sync.metrics()
        # Straight to the loggers: LightningModule.log costs about half a millisecond per
        # value (its result collection), which the progress bar alone pays, for a few.
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)
        if trainer.progress_bar_callback is not None:
            for name in PROGRESS_BAR:
                if name in values:
                    pl_module.log(
                        name,
                        values[name],
                        prog_bar=True,
                        logger=False,
                        on_step=True,
                        on_epoch=False,
                        rank_zero_only=True,
                        batch_size=1,
                    )

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        sync = self._ranks
        if sync is None:
            return
        learner = sync.learner
        try:
            sync.close()
        finally:
            if learner is not None:
                self._forget(learner)
            self._ranks = None
        if learner is not None:
            values = sync.metrics()
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._abandon()  # no collective here: the other ranks may be gone

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._abandon()

    # -- internals -------------------------------------------------------------------------

    def _make_learner(self, pl_module: LightningModule,
                      sharded_ranks: ShardedRanks | None) -> Learner:
        learner = Learner(
            TorchAdapter(pl_module) if sharded_ranks is None else sharded_ranks.learner_adapter(),
            self.algorithm,
            self.mailbox,
            self._resolved_id(),
            options=self.options,
            on_event=self._on_event,
            **self.learner_options,
        )
        learner.load_state_dict({"error_feedback": self._feedback})
        return learner

    def _batch_hook(self, trainer: Trainer) -> BatchSizeHook | None:
        if self.on_batch_size is not None:
            return self.on_batch_size
        # Set at fit time (untyped): None without a datamodule.
        resize = getattr(getattr(trainer, "datamodule", None), "resize_batches", None)
        return resize if callable(resize) else None

    def _on_event(self, event: ev.Event) -> None:
        self.metrics.feed(event)
        self._user_sink(event)

    def _count(self, batch: Any) -> int:
        n = self.tokens_per_step
        if n is None:
            return count_tokens(batch)
        if callable(n):
            got = n(batch)
            if isinstance(got, bool) or not isinstance(got, int) or got < 0:
                raise ConfigError(f"tokens_per_step(batch) returned {got!r}; need an int >= 0")
            return got
        return n

    def _forget(self, learner: Learner) -> None:
        self._last_local_step = learner.local_step
        self._last_rounds_seen = learner.rounds_seen
        self._known_id = learner.learner_id
        self._feedback = learner.state_dict()["error_feedback"]

    def _abandon(self) -> None:
        sync, self._ranks = self._ranks, None
        if sync is None:
            return
        if sync.learner is not None:
            self._forget(sync.learner)
        sync.abandon(self.abort_timeout)
