"""`DiLoCo`: one gradientmail learner per `accelerate launch`, driven by `optimizer.step()`.

    with DiLoCo(accelerator, model, optimizer, plugin) as diloco:
        for batch in loader:
            diloco.count(batch)            # optional: weight this learner by its tokens
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()

All the processes of one launch are ONE learner. Only the main process (global rank 0)
builds a `Learner` and talks to the mailbox. The learner is stepped by a post-hook on the
*inner* optimizer (`AcceleratedOptimizer.optimizer`), which runs only on real, synced
steps, so gradient accumulation counts once per optimizer step. Tokens counted per
process are summed over the launch (one all-reduce per step, none for an int
`tokens_per_step`) before rank 0's learner steps. After each step rank 0
broadcasts a small control tensor (an error flag, rounds seen, the batch size, and which
fragments its learner overwrote); every rank then joins one broadcast per overwritten
fragment and dtype, so all ranks hold rank 0's parameters and make the same collective
calls in the same order. `start()` and `close()` may overwrite every synced parameter:
after them everything is broadcast. With one process no collective runs at all.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch

from gradientmail.adapters.torch import TorchAdapter
from gradientmail.errors import ConfigError, GradientmailError
from gradientmail.events import (
    Event,
    EventSink,
    FragmentAligned,
    RoundRecorded,
    SnapshotPublished,
    log_events,
)
from gradientmail.learner import Learner
from gradientmail_accelerate.plugin import DiLoCoPlugin

__all__ = ["STATE_VERSION", "DiLoCo", "count_tokens"]

#: The version of the wrapper's checkpoint state (`state_dict`).
STATE_VERSION = 1
_STATE_KEYS = frozenset({"version", "learner_id", "optimizer_steps", "tokens", "rounds_seen"})
# Control tensor layout: [status, rounds_seen, batch_size (-1: none), mask of fragments...]
_OK, _FAILED = 0, 1
_SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_HPU")


def count_tokens(batch: Any) -> int:
    """The tokens in `batch`: an int; a tensor's element count; for a mapping, the sum of
    its `attention_mask` or else the size of `input_ids`; for a list or tuple, its first
    element's count."""
    if isinstance(batch, bool):
        raise ConfigError(f"cannot count tokens in {batch!r}; pass an int, a tensor or a batch")
    if isinstance(batch, int):
        if batch < 0:
            raise ConfigError(f"a token count must be >= 0, got {batch}")
        return batch
    if isinstance(batch, torch.Tensor):
        return int(batch.numel())
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum().item())
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return int(ids.numel())
        raise ConfigError(
            f"cannot count tokens in a batch with keys {sorted(map(str, batch))}; it needs "
            "'attention_mask' or 'input_ids' tensors (or pass the count as an int)"
        )
    if isinstance(batch, list | tuple) and batch:
        return count_tokens(batch[0])
    raise ConfigError(
        f"cannot count tokens in a {type(batch).__name__}; pass an int, a tensor, a list or "
        "tuple whose first element is the inputs, or a mapping with input_ids"
    )


class DiLoCo:
    """Runs this launch as one gradientmail learner (see the module docstring).

    `model` and `optimizer` are what `accelerator.prepare` returned; `plugin` defaults to
    `DiLoCoPlugin.from_env()`. The constructor does no I/O: it registers the wrapper for
    `accelerator.save_state` / `load_state` (so load a checkpoint before `start()`, and
    the learner joins from the run's newest commits). `start()` (or `with`) joins the run;
    `close()` (or leaving the `with`, also on an exception) waits for the rounds in flight,
    ends on the newest commits (or flushes, with `flush_on_close`) and releases the lease.
    """

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        optimizer: Any,
        plugin: DiLoCoPlugin | None = None,
        *,
        on_event: EventSink = log_events,
    ) -> None:
        self.plugin = plugin if plugin is not None else DiLoCoPlugin.from_env()
        dist_type = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
        if dist_type not in _SUPPORTED:
            raise ConfigError(
                f"accelerator.distributed_type={dist_type} is not supported; the wrapper "
                "broadcasts whole parameters, which needs single-process or DDP training "
                f"({', '.join(_SUPPORTED)}), not sharded parameters"
            )
        inner = getattr(optimizer, "optimizer", optimizer)
        if not isinstance(inner, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer {type(optimizer).__name__} is neither a torch optimizer nor an "
                "AcceleratedOptimizer wrapping one; pass what accelerator.prepare returned"
            )
        self.accelerator = accelerator
        self.module: torch.nn.Module = accelerator.unwrap_model(model)
        self._inner = inner
        self._on_event = on_event
        self._world = int(accelerator.num_processes)
        self._main = bool(accelerator.is_main_process)
        self._device = torch.device(accelerator.device)
        self._learner: Learner | None = None
        self._plan: tuple[tuple[str, ...], ...] = ()
        self._hook: Any = None
        self._started = False
        self._closed = False
        self._pending_tokens = 0
        self._learner_id = self.plugin.learner_id
        self._steps = 0
        self._tokens = 0
        self._rounds_seen = -1
        self._batch_size: int | None = None
        self._lock = threading.Lock()
        self._metrics: dict[str, float] = {}
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
            self._start()
        except BaseException:
            if self._learner is not None:
                self._learner.close(flush=False)
            self._closed = True
            raise
        self._hook = self._inner.register_step_post_hook(self._after_step)

    def _start(self) -> None:
        failure: BaseException | None = None
        if self._main:
            try:
                self._learner = self._build_learner()
                self._learner.start()
                self._plan = self._learner.plan
                self._learner_id = self._learner.learner_id
                self._rounds_seen = self._learner.rounds_seen
                self._batch_size = self._learner.batch_size
            except BaseException as exc:
                failure = exc
        if self._world > 1:
            import torch.distributed as dist

            box: list[Any] = [
                None if failure is not None else (self._plan, self._learner_id, self._rounds_seen)
            ]
            dist.broadcast_object_list(box, src=0, device=self._device)
            if box[0] is None:
                self._raise_for_rank0(failure, "start")
            self._plan, self._learner_id, self._rounds_seen = box[0]
            self._broadcast_fragments(range(len(self._plan)))
        elif failure is not None:
            raise failure

    def close(self, failed: bool = False) -> None:
        """Unhook the optimizer and close the learner; then (not after a failure, when a
        rank may be gone and a collective would hang) give every rank rank 0's final
        parameters. Idempotent."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        failure: BaseException | None = None
        if self._learner is not None:
            try:
                # After a failure nothing is flushed: a run resumed from a checkpoint
                # trains those steps again.
                self._learner.close(flush=False if failed else None)
                self._rounds_seen = self._learner.rounds_seen
            except BaseException as exc:
                failure = exc
        if self._world > 1 and not failed:
            everything = [1] * len(self._plan)
            ok = self._exchange_control(failure, everything)
            if not ok:
                self._raise_for_rank0(failure, "close")
            self._broadcast_fragments(range(len(self._plan)))
        elif failure is not None:
            raise failure

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

    # -- what the training loop can read ------------------------------------------------

    @property
    def learner(self) -> Learner | None:
        """The Learner on the main process; None on the others and before `start()`."""
        return self._learner

    @property
    def learner_id(self) -> str | None:
        return self._learner_id

    @property
    def rounds_seen(self) -> int:
        """The newest round applied (the same on every rank)."""
        return self._rounds_seen

    @property
    def optimizer_steps(self) -> int:
        """Real optimizer steps counted since the wrapper was created (or checkpointed)."""
        return self._steps

    @property
    def tokens(self) -> int:
        """Tokens of the whole launch counted so far."""
        return self._tokens

    @property
    def batch_size(self) -> int | None:
        """This learner's share of `global_batch_size` (None without one), every rank."""
        return self._batch_size

    @property
    def live_learners(self) -> frozenset[str]:
        """The learners whose leases are fresh (known on the main process only)."""
        return self._learner.live_learners if self._learner is not None else frozenset()

    def metrics(self) -> dict[str, float]:
        """Numbers for `accelerator.log`: rounds seen, optimizer steps, tokens, live
        learners, bytes sent and received, the last staleness and mean cosine."""
        with self._lock:
            out = dict(self._metrics)
        out["diloco/rounds_seen"] = float(self._rounds_seen)
        out["diloco/optimizer_steps"] = float(self._steps)
        out["diloco/tokens"] = float(self._tokens)
        if self._learner is not None:
            out["diloco/live_learners"] = float(len(self._learner.live_learners))
        return out

    def wait_for_learners(self, count: int, timeout: float = 300.0) -> bool:
        """Wait until `count` learners (this one included) hold fresh leases, or `timeout`
        seconds; True when they do. A collective: call it on every rank after `start()`."""
        import time

        ok = False
        if self._learner is not None:
            deadline = time.monotonic() + timeout
            while len(self._learner.live_learners) < count and time.monotonic() < deadline:
                time.sleep(min(0.05, self.plugin.poll_interval))
            ok = len(self._learner.live_learners) >= count
        if self._world > 1:
            import torch.distributed as dist

            flag = torch.tensor([int(ok)], dtype=torch.int64, device=self._device)
            dist.broadcast(flag, src=0)
            ok = bool(flag.item())
        return ok

    # -- checkpointing ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The wrapper's counters and learner id: tiny, plain, the same on every rank."""
        return {
            "version": STATE_VERSION,
            "learner_id": self._learner_id,
            "optimizer_steps": self._steps,
            "tokens": self._tokens,
            "rounds_seen": self._rounds_seen,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters; before `start()`, also the learner id (unless the plugin
        names one), so a resumed launch rejoins as the same learner."""
        if not isinstance(state, Mapping) or set(state) != _STATE_KEYS:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ConfigError(
                f"not a gradientmail_accelerate.DiLoCo state: keys {got}, expected "
                f"{sorted(_STATE_KEYS)}"
            )
        if state["version"] != STATE_VERSION:
            raise ConfigError(
                f"wrapper state version {state['version']!r} is not {STATE_VERSION}; the "
                "checkpoint was written by another gradientmail version"
            )
        self._steps = int(state["optimizer_steps"])
        self._tokens = int(state["tokens"])
        if self._started:
            warnings.warn(
                "accelerator.load_state() after DiLoCo.start() put the checkpoint's (older) "
                "weights over the run's newest commits; load checkpoints before start()",
                stacklevel=2,
            )
        elif self.plugin.learner_id is None and state["learner_id"] is not None:
            self._learner_id = str(state["learner_id"])
            self._rounds_seen = int(state["rounds_seen"])

    # -- internals ----------------------------------------------------------------------

    def _build_learner(self) -> Learner:
        p = self.plugin
        return Learner(
            TorchAdapter(self.module),
            p.resolved_algorithm,
            p.mailbox,
            self._learner_id,
            sync=p.sync,
            poll_interval=p.poll_interval,
            lease_every=p.lease_every,
            lease_timeout=p.lease_timeout,
            compression=p.compression,
            on_event=self._event,
            prefix=p.prefix,
            run_key=p.run_key,
        )

    def _event(self, event: Event) -> None:
        with self._lock:
            m = self._metrics
            if isinstance(event, SnapshotPublished):
                m["diloco/bytes_sent"] = m.get("diloco/bytes_sent", 0.0) + event.bytes
            elif isinstance(event, FragmentAligned):
                m["diloco/bytes_received"] = m.get("diloco/bytes_received", 0.0) + event.bytes
                m["diloco/staleness"] = float(event.staleness)
            elif isinstance(event, RoundRecorded) and event.mean_cosine is not None:
                m["diloco/mean_cosine"] = float(event.mean_cosine)
        self._on_event(event)

    def _step_tokens(self) -> int:
        """This process's tokens for the step just taken, summed over the launch."""
        per_step = self.plugin.tokens_per_step
        if isinstance(per_step, int):
            return per_step * self._world
        if per_step is not None:
            mine = per_step()
            if isinstance(mine, bool) or not isinstance(mine, int) or mine < 0:
                raise ConfigError(
                    f"tokens_per_step() returned {mine!r}; it must return an int >= 0"
                )
        else:
            mine, self._pending_tokens = self._pending_tokens, 0
        if self._world == 1:
            return mine
        import torch.distributed as dist

        total = torch.tensor([mine], dtype=torch.int64, device=self._device)
        dist.all_reduce(total)
        return int(total.item())

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        tokens = self._step_tokens()
        self._steps += 1
        self._tokens += tokens
        touched: tuple[int, ...] = ()
        failure: BaseException | None = None
        if self._learner is not None:
            try:
                touched = self._learner.step(tokens)
                self._rounds_seen = self._learner.rounds_seen
                self._batch_size = self._learner.batch_size
            except BaseException as exc:
                failure = exc
        if self._world == 1:
            if failure is not None:
                raise failure
            return
        mask = [1 if p in touched else 0 for p in range(len(self._plan))]
        if not self._exchange_control(failure, mask):
            self._raise_for_rank0(failure, "step")
        self._broadcast_fragments([p for p, bit in enumerate(mask) if bit])

    def _exchange_control(self, failure: BaseException | None, mask: list[int]) -> bool:
        """Rank 0's decision to every rank; False when rank 0 failed. Rewrites `mask`."""
        import torch.distributed as dist

        head = [
            _FAILED if failure is not None else _OK,
            self._rounds_seen,
            -1 if self._batch_size is None else self._batch_size,
        ]
        control = torch.tensor(head + mask, dtype=torch.int64, device=self._device)
        dist.broadcast(control, src=0)
        values = control.tolist()
        if values[0] != _OK:
            return False
        self._rounds_seen = values[1]
        self._batch_size = None if values[2] < 0 else values[2]
        mask[:] = values[3:]
        return True

    def _raise_for_rank0(self, failure: BaseException | None, what: str) -> None:
        if failure is not None:
            raise failure
        raise GradientmailError(
            f"the learner on the main process (rank 0) failed in {what}(); its error is in "
            "rank 0's log. This rank stops too, so no collective is left waiting"
        )

    @torch.no_grad()
    def _broadcast_fragments(self, fragments: Any) -> None:
        """Rank 0's values of the fragments' parameters to every rank: one broadcast per
        fragment and dtype, in plan order, so every rank issues the same calls."""
        import torch.distributed as dist

        params = dict(self.module.named_parameters())
        for p in fragments:
            groups: dict[torch.dtype, list[torch.nn.Parameter]] = {}
            for name in self._plan[p]:
                param = params[name]
                groups.setdefault(param.dtype, []).append(param)
            for dtype in sorted(groups, key=str):
                group = groups[dtype]
                flat = torch.cat([t.detach().reshape(-1).to(self._device) for t in group])
                dist.broadcast(flat, src=0)
                if self._main:
                    continue
                offset = 0
                for t in group:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view_as(t))
                    offset += n
