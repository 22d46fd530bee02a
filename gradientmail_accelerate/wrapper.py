"""`DiLoCo`: one gradientmail learner per `accelerate launch`, driven by `optimizer.step()`.

    with DiLoCo(accelerator, model, optimizer, plugin) as diloco:
        for batch in loader:
            diloco.count(batch)            # optional: weight this learner by its tokens
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                diloco.report_loss(loss)   # optional: the run's history shows it
                optimizer.step()
                optimizer.zero_grad()

All the processes of one launch are ONE learner. Only the main process (global rank 0)
builds a `Learner` and talks to the mailbox. The learner is stepped by a post-hook on the
*inner* optimizer (`AcceleratedOptimizer.optimizer`), which runs only on real, synced
steps, so gradient accumulation counts once per optimizer step. Tokens counted per
process (`count_tokens`, the same rule as Lightning's) are summed over the launch (one
all-reduce per step, none for an int `tokens_per_step`) before rank 0's learner steps;
then every rank takes rank 0's overwritten parameters. That synchronisation, the token
rule and the metric names are `gradientmail.integration`'s, shared with
`gradientmail_lightning`. With `global_batch_size`, `batch_sampler()` makes the loader
whose batches follow this learner's share of it.

A sharded model (FSDP2: Accelerate's FSDP plugin with `fsdp_version: 2`, or a module the
script shards itself with `torch.distributed.fsdp.fully_shard`) makes every rank mail and
read its own rows (`gradientmail.integration.ShardedRanks`); no rank holds a full fragment.
FSDP1 (`fsdp_version: 1`) is refused: its flat parameters cut tensors at arbitrary offsets.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

import torch
from torch.utils.data import Sampler

from gradientmail.adapters.torch import TorchAdapter
from gradientmail.errors import ConfigError, GradientmailError
from gradientmail.events import Event, EventSink, log_events
from gradientmail.integration import (
    BatchSizeHook,
    BatchSizes,
    LossMean,
    RankSync,
    RunMetrics,
    ShardedRanks,
    ShareBatchSampler,
    SingleRank,
    TorchRanks,
    count_tokens,
)
from gradientmail.integration.sharded import is_sharded
from gradientmail.integration.together import learners_to_await
from gradientmail.learner.runtime import Learner
from gradientmail_accelerate.plugin import DiLoCoPlugin

__all__ = ["STATE_VERSION", "DiLoCo", "count_tokens"]

#: The version of the wrapper's checkpoint state (`state_dict`).
STATE_VERSION = 2
_STATE_KEYS = frozenset({"version", "learner_id", "optimizer_steps", "tokens", "rounds_seen",
                         "error_feedback"})
# Version 1 (before error feedback) is read too: its learner starts with no residuals.
_STATE_KEYS_V1 = _STATE_KEYS - {"error_feedback"}
_SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_HPU",
              "FSDP")


class DiLoCo:
    """Runs this launch as one gradientmail learner (see the module docstring).

    `model` and `optimizer` are what `accelerator.prepare` returned; `plugin` defaults to
    `DiLoCoPlugin.from_env()`. The constructor does no I/O: it registers the wrapper for
    `accelerator.save_state` / `load_state` (so load a checkpoint before `start()`, and
    the learner joins from the run's newest commits). `start()` (or `with`) joins the run;
    `close()` (or leaving the `with`, also on an exception) waits for the rounds in flight,
    ends on the newest commits (or flushes, with `flush_on_close`) and releases the lease.
    `on_batch_size(share)` is the batch-size hook of a custom loader (see
    `gradientmail.integration.batches`); `batch_sampler()` needs none.
    """

    #: After an exception, how long closing the learner may take before the process
    #: moves on (its lease then expires).
    abort_timeout: float = 30.0

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        optimizer: Any,
        plugin: DiLoCoPlugin | None = None,
        *,
        on_event: EventSink = log_events,
        on_batch_size: BatchSizeHook | None = None,
    ) -> None:
        self.plugin = plugin if plugin is not None else DiLoCoPlugin.from_env()
        dist_type = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
        if dist_type not in _SUPPORTED:
            raise ConfigError(
                f"accelerator.distributed_type={dist_type} is not supported; the wrapper "
                f"runs single-process, DDP and FSDP2 training ({', '.join(_SUPPORTED)})"
            )
        if dist_type == "FSDP" and not getattr(accelerator, "is_fsdp2", False):
            raise ConfigError(
                "Accelerate's FSDP plugin runs FSDP1 here (fsdp_version: 1), whose flat "
                "parameters cut tensors at arbitrary element offsets, which gradientmail "
                "cannot mail by rows. Use FSDP2: fsdp_version: 2 in the accelerate config "
                "(fsdp_config), `accelerate launch --use_fsdp --fsdp_version 2`, or "
                "FullyShardedDataParallelPlugin(fsdp_version=2)"
            )
        inner = getattr(optimizer, "optimizer", optimizer)
        if not isinstance(inner, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer {type(optimizer).__name__} is neither a torch optimizer nor an "
                "AcceleratedOptimizer wrapping one; pass what accelerator.prepare returned"
            )
        self.accelerator = accelerator
        self._dist_type = dist_type
        self.module: torch.nn.Module = accelerator.unwrap_model(model)
        self._inner = inner
        self._on_event = on_event
        self._on_batch_size = on_batch_size
        world = int(accelerator.num_processes)
        self._sizes = BatchSizes(default=1)
        self._accumulation = int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
        ranks: Any = TorchRanks(accelerator.device) if world > 1 else SingleRank()
        self._metrics = RunMetrics()
        self._sync = RankSync(ranks, self.module, self._metrics, self._resized)
        self._sync.learner_id = self.plugin.learner_id
        self._hook: Any = None
        self._started = False
        self._closed = False
        self._pending_tokens = 0
        self._losses = LossMean()
        self._feedback: dict[str, Any] | None = None  # a checkpoint's, for the learner
        accelerator.register_for_checkpointing(self)

    # -- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> DiLoCo:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(failed=exc is not None)

    def start(self) -> None:
        """Join the run on rank 0 (creating it if nobody has), give every rank rank 0's
        parameters, and hook the inner optimizer. A collective: call it on every rank."""
        if self._started:
            raise ConfigError("this DiLoCo wrapper was started already; start it once")
        self._started = True
        try:
            if is_sharded(self.module):
                # A collective (the side group); the other ranks open the mailbox again.
                p, ranks = self.plugin, self._sync.ranks
                self._sync.sharded_ranks = ShardedRanks.create(
                    self.module, p.mailbox, prefix=p.options.prefix,
                    compression=p.options.compression,
                    ranks=ranks if ranks.world_size > 1 else SingleRank())
            elif self._dist_type == "FSDP":
                raise ConfigError(
                    "the model has no FSDP2-sharded (DTensor) parameters under Accelerate's "
                    "FSDP plugin; pass the model accelerator.prepare returned"
                )
            self._sync.start(self._build_learner)
        except BaseException:
            self._closed = True
            raise
        p = self.plugin
        try:
            self._sync.wait_for_learners(
                learners_to_await(p.options.wait_for_learners, p.resolved_algorithm),
                p.options.wait_timeout)
        except BaseException:
            self._closed = True
            self._sync.abandon(self.abort_timeout)
            raise
        self._hook = self._inner.register_step_post_hook(self._after_step)

    def close(self, failed: bool = False) -> None:
        """Unhook the optimizer and close the learner; then (not after a failure, when a
        rank may be gone and a collective would hang) give every rank rank 0's final
        parameters. After a failure nothing is flushed (a run resumed from a checkpoint
        trains those steps again) and closing takes at most `abort_timeout` seconds.
        Idempotent."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if failed:
            self._sync.abandon(self.abort_timeout)
        else:
            self._sync.close()

    # -- counting -----------------------------------------------------------------------

    def count(self, batch: Any) -> int:
        """Count the tokens of one micro-batch of this process (see `count_tokens`); they
        go to the learner with the next real optimizer step. Returns the count."""
        if self.plugin.tokens_per_step is not None:
            raise ConfigError(
                f"count() called while tokens_per_step={self.plugin.tokens_per_step!r} "
                "counts the tokens already; use one of the two"
            )
        n = count_tokens(batch)
        self._pending_tokens += n
        return n

    count_tokens = count

    def report_loss(self, loss: Any) -> None:
        """Report the training loss of one micro-batch (a one-element tensor or a number;
        None is ignored). The mean over those since the last optimizer step goes to the
        learner with it, as rank 0 saw it, and from its contributions into the run's
        history (`gradientmail log`). Optional; costs no device synchronisation."""
        if self._sync.ranks.is_main:
            self._losses.add(loss)

    # -- batches ------------------------------------------------------------------------

    def batch_sampler(
        self, sampler: Sampler[int] | Iterable[int], batch_size: int, drop_last: bool = False
    ) -> ShareBatchSampler:
        """A batch sampler for this process's `DataLoader(batch_sampler=...)` (before
        `accelerator.prepare`): batches of `batch_size` until the run's
        `global_batch_size` gives this learner a share, then of this process's part of
        it, ⌈share / (processes × gradient accumulation steps)⌉, from the next batch on."""
        if self._sizes.share is None:
            self._sizes.default = self._sizes.current = batch_size
        return ShareBatchSampler(sampler, batch_size, drop_last, size=self._sizes)

    # -- what the training loop can read ------------------------------------------------

    @property
    def learner(self) -> Learner | None:
        """The Learner on the main process; None on the others and before `start()`."""
        return self._sync.learner

    @property
    def learner_id(self) -> str | None:
        return self._sync.learner_id

    @property
    def rounds_seen(self) -> int:
        """The newest round applied (the same on every rank)."""
        return self._sync.rounds_seen

    @property
    def optimizer_steps(self) -> int:
        """Real optimizer steps counted since the wrapper was created (or checkpointed)."""
        return self._sync.steps

    @property
    def tokens(self) -> int:
        """Tokens of the whole launch counted so far."""
        return self._sync.tokens

    @property
    def batch_size(self) -> int | None:
        """This learner's share of `global_batch_size` (None without one), every rank."""
        return self._sync.batch_size

    @property
    def live_learners(self) -> frozenset[str]:
        """The learners whose leases are fresh (known on the main process only)."""
        learner = self._sync.learner
        return learner.live_learners if learner is not None else frozenset()

    def metrics(self) -> dict[str, float]:
        """Numbers for `accelerator.log`: `gradientmail.integration.METRICS`, the same
        names as the Lightning callback's (rank 0 knows them all)."""
        return self._sync.metrics()

    def wait_for_learners(self, count: int, timeout: float | None = None) -> bool:
        """Wait until `count` learners (this one included) hold fresh leases, or `timeout`
        seconds (None: the plugin's `wait_timeout`); True when they do. A collective: call
        it on every rank after `start()` (which waits for the plugin's `wait_for_learners`
        already)."""
        try:
            self._sync.wait_for_learners(
                count, self.plugin.options.wait_timeout if timeout is None else timeout)
        except GradientmailError:
            return False
        return True

    # -- checkpointing ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The wrapper's counters and learner id, the same on every rank, and the main
        process's error feedback (`Learner.state_dict()["error_feedback"]`: the residuals
        of sparse deltas, None while it holds none; None on the other processes, whose
        state `save_state` does not write)."""
        learner = self._sync.learner
        return {
            "version": STATE_VERSION,
            "learner_id": self._sync.learner_id,
            "optimizer_steps": self._sync.steps,
            "tokens": self._sync.tokens,
            "rounds_seen": self._sync.rounds_seen,
            "error_feedback": (learner.state_dict()["error_feedback"] if learner is not None
                               else self._feedback),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters; before `start()`, also the learner id (unless the plugin
        names one), so a resumed launch rejoins as the same learner, and its error
        feedback, which the learner `start()` builds takes (`Learner.load_state_dict`,
        checked against the model and the run there). Reads version 1 states too."""
        keys = set(state) if isinstance(state, Mapping) else None
        if keys not in (_STATE_KEYS, _STATE_KEYS_V1):
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ConfigError(
                f"not a gradientmail_accelerate.DiLoCo state: keys {got}, expected "
                f"{sorted(_STATE_KEYS)}"
            )
        if state["version"] != (STATE_VERSION if keys == _STATE_KEYS else 1):
            raise ConfigError(
                f"wrapper state version {state['version']!r} is not {STATE_VERSION}; the "
                "checkpoint was written by another gradientmail version"
            )
        self._sync.steps = int(state["optimizer_steps"])
        self._sync.tokens = int(state["tokens"])
        if self._started:
            warnings.warn(
                "accelerator.load_state() after DiLoCo.start() put the checkpoint's (older) "
                "weights over the run's newest commits; load checkpoints before start()",
                stacklevel=2,
            )
        else:
            self._feedback = state.get("error_feedback")
            if self.plugin.learner_id is None and state["learner_id"] is not None:
                self._sync.learner_id = str(state["learner_id"])
                self._sync.rounds_seen = int(state["rounds_seen"])

    # -- internals ----------------------------------------------------------------------

    def _build_learner(self) -> Learner:
        p = self.plugin
        sharded_ranks = self._sync.sharded_ranks
        learner = Learner(
            TorchAdapter(self.module) if sharded_ranks is None else sharded_ranks.learner_adapter(),
            p.resolved_algorithm,
            p.mailbox,
            self._sync.learner_id,
            options=p.options,
            on_event=self._event,
            run_key=p.run_key,
        )
        learner.load_state_dict({"error_feedback": self._feedback})
        return learner

    def _event(self, event: Event) -> None:
        self._metrics.feed(event)
        self._on_event(event)

    def _resized(self, share: int) -> None:
        self._sizes.set(share, self._sync.ranks.world_size, self._accumulation)
        if self._on_batch_size is not None:
            self._on_batch_size(share)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        per_step = self.plugin.tokens_per_step
        loss = self._losses.take()
        if isinstance(per_step, int):
            self._sync.step(per_step, same_on_every_rank=True, loss=loss)
            return
        if per_step is not None:
            mine = per_step()
            if isinstance(mine, bool) or not isinstance(mine, int) or mine < 0:
                raise ConfigError(
                    f"tokens_per_step() returned {mine!r}; it must return an int >= 0"
                )
        else:
            mine, self._pending_tokens = self._pending_tokens, 0
        self._sync.step(mine, loss=loss)
