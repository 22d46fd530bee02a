"""DiLoCoCallback: a Lightning `Trainer` becomes one learner of a gradientmail run.

Hooks map to the learner's calls and nothing else:

- `setup` (fit): refuse a strategy the callback cannot keep consistent (FSDP, model
  parallel, DeepSpeed, XLA) before any work is done.
- `on_train_start` (after checkpoint restore and DDP wrapping): global rank 0 builds a
  `Learner` over the unwrapped LightningModule and joins the run; the other ranks copy
  what it loaded.
- `on_train_batch_end`: a real optimizer step happened when `trainer.global_step` moved
  (gradient accumulation counts once); the tokens of the micro-batches since the last
  one go to `Learner.step()`, and whatever it overwrote is broadcast to the other ranks.
- `on_train_end` (the model is still on its device): close, or flush with
  `algorithm.flush_on_close`. `on_exception` and `teardown` close within a bound and
  never hang on a collective.
- `state_dict`: the learner id, its local step and the rounds it had seen, under the
  fixed key "DiLoCoCallback"; a run resumed from a checkpoint rejoins as that learner.

Metrics (`diloco/...`) come from the learner's events and go to the Trainer's loggers
every `log_every_n_steps` real steps, and the few in `PROGRESS_BAR` to its progress bar.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from gradientmail import events as ev
from gradientmail.adapters.torch import TorchAdapter
from gradientmail.algorithms.base import Algorithm
from gradientmail.errors import ConfigError, GradientmailError
from gradientmail.learner import Learner
from gradientmail.mailbox.base import Mailbox

__all__ = [
    "PROGRESS_BAR",
    "STATE_KEY",
    "DiLoCoCallback",
    "RunMetrics",
    "batch_tokens",
    "check_strategy",
]

#: The key of the callback's state in a checkpoint; fixed, so changed arguments keep it.
STATE_KEY = "DiLoCoCallback"
#: The metrics shown on the progress bar (every metric goes to the loggers).
PROGRESS_BAR = ("diloco/rounds_seen", "diloco/live", "diloco/staleness", "diloco/cosine")
_log = logging.getLogger("gradientmail.lightning")
# Learner keyword arguments a user may pass through `**learner_options`.
_LEARNER_OPTIONS = frozenset(inspect.signature(Learner).parameters) - {
    "adapter",
    "algorithm",
    "mailbox",
    "learner_id",
    "sync",
    "poll_interval",
    "compression",
}
# Control messages from rank 0 to the other ranks of a DDP group.
_STEP, _EVERYTHING, _ABORT = 0, 1, -1


def check_strategy(strategy: Any) -> None:
    """Raise ConfigError unless `strategy` is a single-device or a DDP strategy.

    FSDP and model parallelism shard the parameters, so rank 0 does not hold the
    fragments it would publish; DeepSpeed and XLA wrap them in ways not handled yet.
    """
    from lightning.pytorch import strategies as s
    from lightning.pytorch.strategies.single_xla import SingleDeviceXLAStrategy
    from lightning.pytorch.strategies.xla import XLAStrategy

    unsupported = (
        s.FSDPStrategy,
        s.ModelParallelStrategy,
        s.DeepSpeedStrategy,
        XLAStrategy,
        SingleDeviceXLAStrategy,
    )
    if isinstance(strategy, unsupported) or not isinstance(
        strategy, s.SingleDeviceStrategy | s.DDPStrategy
    ):
        raise ConfigError(
            f"DiLoCoCallback does not support the {type(strategy).__name__} strategy; it "
            "supports a single device and DDP (strategy='ddp', 'ddp_spawn', "
            "'ddp_notebook'), where every rank holds the whole model. Train each learner "
            "with DDP or on one device (sharded strategies are not supported yet)"
        )


def batch_tokens(batch: Any) -> int:
    """The default token count of a batch: the numel of `batch["input_ids"]`, else of the
    first tensor found in the batch (depth first); 0 when it holds no tensor."""
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return int(batch["input_ids"].numel())
    stack = [batch]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            return int(item.numel())
        if isinstance(item, Mapping):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list | tuple):
            stack.extend(reversed(item))
    return 0


class RunMetrics:
    """A thread-safe accumulator of a learner's events (fed from both of its threads),
    read as a flat dict of `diloco/...` floats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._newest_round = -1
        self._last_commit: float | None = None
        self._bytes_up = 0
        self._bytes_down = 0
        self._published = 0
        self._staleness: int | None = None
        self._cosine: float | None = None
        self._failures = 0

    def feed(self, event: ev.Event) -> None:
        with self._lock:
            if isinstance(event, ev.RoundRecorded):
                self._newest_round = max(self._newest_round, event.round)
                self._last_commit = time.monotonic()
                if event.mean_cosine is not None:
                    self._cosine = event.mean_cosine
            elif isinstance(event, ev.SnapshotPublished):
                self._bytes_up += event.bytes
                self._published += 1
            elif isinstance(event, ev.FragmentAligned):
                self._bytes_down += event.bytes
                self._staleness = event.staleness
            elif isinstance(event, ev.PublishFailed | ev.PollFailed):
                self._failures += 1

    def values(self, learner: Learner | None = None) -> dict[str, float]:
        """The current metrics; `learner` adds rounds seen, local step and live learners."""
        with self._lock:
            since = self._last_commit if self._last_commit is not None else self._started
            out = {
                "diloco/rounds_committed": float(self._newest_round + 1),
                "diloco/published": float(self._published),
                "diloco/bytes_up": float(self._bytes_up),
                "diloco/bytes_down": float(self._bytes_down),
                "diloco/since_commit": time.monotonic() - since,
                "diloco/failures": float(self._failures),
            }
            if self._staleness is not None:
                out["diloco/staleness"] = float(self._staleness)
            if self._cosine is not None:
                out["diloco/cosine"] = float(self._cosine)
        if learner is not None:
            out["diloco/rounds_seen"] = float(learner.rounds_seen)
            out["diloco/rounds_committed"] = max(
                out["diloco/rounds_committed"], float(learner.rounds_seen + 1)
            )
            out["diloco/live"] = float(len(learner.live_learners))
        return out


class _RankSync:
    """Carries rank 0's decisions out on every rank of a DDP group.

    Every real step each rank takes part in one broadcast of a small control tensor
    `[code, n, fragment ids..., -1 padding]` on a CPU (gloo) group, then in one broadcast
    per tensor of each fragment it names, so all ranks make the same collective calls in
    the same order whatever rank 0 decided.
    """

    def __init__(
        self, module: torch.nn.Module, plan: Sequence[Sequence[str]], group: Any, zero: bool
    ) -> None:
        params = dict(module.named_parameters())
        missing = sorted({n for names in plan for n in names} - set(params))
        if missing:
            raise GradientmailError(
                f"rank 0's plan names parameters this rank's module lacks: {missing[:5]}"
            )
        self._fragments = [[params[n] for n in names] for names in plan]
        self._ctrl = torch.zeros(len(plan) + 2, dtype=torch.int64)
        self._group = group
        self._zero = zero

    def exchange(self, code: int, fragments: Sequence[int] = ()) -> None:
        import torch.distributed as dist

        ctrl = self._ctrl
        if self._zero:
            ctrl.fill_(-1)
            ctrl[0] = code
            ctrl[1] = len(fragments)
            if fragments:
                ctrl[2 : 2 + len(fragments)] = torch.tensor(list(fragments), dtype=torch.int64)
        dist.broadcast(ctrl, src=0, group=self._group)
        got = ctrl.tolist()
        if got[0] == _ABORT:
            raise GradientmailError(
                "global rank 0 stopped the learner (see its log); this rank stops too"
            )
        chosen = range(len(self._fragments)) if got[0] == _EVERYTHING else got[2 : 2 + got[1]]
        with torch.no_grad():
            for p in chosen:
                for tensor in self._fragments[p]:
                    dist.broadcast(tensor.detach(), src=0)


class DiLoCoCallback(Callback):
    """Makes the Trainer one learner of the run in `mailbox` (a Mailbox or a URL).

    `tokens_per_step`: an int per batch, or `callable(batch) -> int`; by default the
    numel of `batch["input_ids"]` or of the batch's first tensor. It is summed over the
    micro-batches of a real step; under DDP rank 0's count is multiplied by the world
    size (ranks are assumed to see equal batches). `log_every_n_steps` defaults to the
    Trainer's. `learner_options` go to `Learner` (lease_every, lease_timeout, on_event,
    prefix, keep_versions, backend, clock). `abort_timeout` bounds how long closing after
    an exception may take before the process moves on.
    """

    abort_timeout: float = 30.0

    def __init__(
        self,
        mailbox: Mailbox | str,
        algorithm: Algorithm,
        learner_id: str | None = None,
        tokens_per_step: int | Callable[[Any], int] | None = None,
        sync: bool = True,
        poll_interval: float = 1.0,
        compression: str = "off",
        log_every_n_steps: int | None = None,
        **learner_options: Any,
    ) -> None:
        unknown = sorted(set(learner_options) - _LEARNER_OPTIONS)
        if unknown:
            raise ConfigError(
                f"DiLoCoCallback got unknown options {unknown}; Learner options are "
                f"{sorted(_LEARNER_OPTIONS)}"
            )
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
        self.learner_id = learner_id
        self.tokens_per_step = tokens_per_step
        self.sync = sync
        self.poll_interval = poll_interval
        self.compression = compression
        self.log_every_n_steps = log_every_n_steps
        self._user_sink: ev.EventSink = learner_options.pop("on_event", ev.log_events)
        self.learner_options = learner_options
        self.metrics = RunMetrics()
        self.learner: Learner | None = None
        self._known_id: str | None = None  # from a checkpoint, or the last learner's
        self._rank_sync: _RankSync | None = None
        self._last_global_step = 0
        self._tokens = 0
        self._world = 1
        self._last_local_step = 0
        self._last_rounds_seen = -1

    # -- checkpoint state ------------------------------------------------------------------

    @property
    def state_key(self) -> str:
        return STATE_KEY

    def state_dict(self) -> dict[str, Any]:
        learner = self.learner
        return {
            "learner_id": learner.learner_id if learner is not None else self._resolved_id(),
            "local_step": learner.local_step if learner is not None else self._last_local_step,
            "rounds_seen": learner.rounds_seen if learner is not None else self._last_rounds_seen,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        expected = {"learner_id", "local_step", "rounds_seen"}
        if set(state_dict) != expected:
            raise ConfigError(
                f"the checkpoint's {STATE_KEY} state has keys {sorted(state_dict)}, "
                f"expected {sorted(expected)}; was it written by another version?"
            )
        restored = state_dict["learner_id"]
        self._known_id = str(restored) if restored is not None else None
        self._last_local_step = int(state_dict["local_step"])
        self._last_rounds_seen = int(state_dict["rounds_seen"])

    def _resolved_id(self) -> str | None:
        # An explicit id wins; otherwise a resumed (or refitted) run keeps its identity.
        return self.learner_id if self.learner_id is not None else self._known_id

    # -- hooks -----------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            check_strategy(trainer.strategy)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        check_strategy(trainer.strategy)
        self._last_global_step = trainer.global_step
        self._tokens = 0
        self._world = trainer.world_size
        distributed = self._world > 1 and torch.distributed.is_initialized()
        plan: tuple[tuple[str, ...], ...] | None = None
        failure: BaseException | None = None
        if trainer.is_global_zero:
            try:
                self.learner = self._make_learner(pl_module)
                self.learner.start()
                plan = self.learner.plan
            except BaseException as exc:
                failure = exc
                self._abandon()
        if distributed:
            plan = trainer.strategy.broadcast(plan, src=0)
            if plan is None:
                if failure is not None:
                    raise failure
                raise GradientmailError(
                    "global rank 0 could not start its learner (see its log); this rank stops"
                )
            import torch.distributed as dist

            group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            self._rank_sync = _RankSync(pl_module, plan, group, trainer.is_global_zero)
            # start() loaded the run's newest commits on rank 0: every synced tensor.
            self._rank_sync.exchange(_EVERYTHING)
        elif failure is not None:
            raise failure

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        learner = self.learner
        if learner is not None:
            self._tokens += self._count(batch)
        step = trainer.global_step
        if step == self._last_global_step:
            return
        self._last_global_step = step
        touched: tuple[int, ...] = ()
        if learner is not None:
            try:
                touched = learner.step(self._tokens * self._world)
            except BaseException:
                if self._rank_sync is not None:
                    self._rank_sync.exchange(_ABORT)
                raise
            finally:
                self._tokens = 0
            self._last_local_step = learner.local_step
            self._last_rounds_seen = learner.rounds_seen
        if self._rank_sync is not None:
            self._rank_sync.exchange(_STEP, touched)
        # The Trainer sets log_every_n_steps at runtime (untyped): its default is 50.
        every = self.log_every_n_steps or getattr(trainer, "log_every_n_steps", 50)
        if learner is not None and every and step % every == 0:
            self._report(trainer, pl_module, learner)

    def _report(self, trainer: Trainer, pl_module: LightningModule, learner: Learner) -> None:
        values = self.metrics.values(learner)
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
        learner = self.learner
        if learner is not None:
            try:
                learner.close()
            except BaseException:
                if self._rank_sync is not None:
                    self._rank_sync.exchange(_ABORT)
                raise
            finally:
                self._forget(learner)
            values = self.metrics.values(learner)
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)
        if self._rank_sync is not None:
            # close() reset the model to the newest commits (or flushed): every tensor.
            self._rank_sync.exchange(_EVERYTHING)
            self._rank_sync = None

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        # No collective here: the other ranks may be gone.
        self._rank_sync = None
        self._abandon()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._rank_sync = None
        self._abandon()

    # -- internals -------------------------------------------------------------------------

    def _make_learner(self, pl_module: LightningModule) -> Learner:
        return Learner(
            TorchAdapter(pl_module),
            self.algorithm,
            self.mailbox,
            self._resolved_id(),
            sync=self.sync,
            poll_interval=self.poll_interval,
            compression=self.compression,
            on_event=self._on_event,
            **self.learner_options,
        )

    def _on_event(self, event: ev.Event) -> None:
        self.metrics.feed(event)
        self._user_sink(event)

    def _count(self, batch: Any) -> int:
        n = self.tokens_per_step
        if n is None:
            return batch_tokens(batch)
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
        self.learner = None

    def _abandon(self) -> None:
        """Close the learner, if one is open, in a daemon thread joined for at most
        `abort_timeout` seconds: its waits for rounds in flight must not keep a failing
        process alive. An unfinished close leaves the lease to expire."""
        learner = self.learner
        if learner is None:
            return
        self._forget(learner)

        def close() -> None:
            try:
                # Training failed: a run resumed from a checkpoint trains these steps
                # again, so flushing them now would count them twice.
                learner.close(flush=False)
            except Exception:
                _log.exception("closing learner %s after a failure", learner.learner_id)

        thread = threading.Thread(target=close, name="gradientmail-abort", daemon=True)
        thread.start()
        thread.join(self.abort_timeout)
        if thread.is_alive():
            _log.warning(
                "learner %s did not close within %.0f s; its lease will expire",
                learner.learner_id,
                self.abort_timeout,
            )
