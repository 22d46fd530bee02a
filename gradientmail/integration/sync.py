"""`RankSync`: the processes of one launch as one learner.

The main process (rank 0) builds the `Learner` and talks to the mailbox; every process
trains. After each real optimizer step every rank calls `step(tokens)`: the tokens are
summed over the ranks, rank 0's learner steps, and rank 0 broadcasts a small control
vector `[status, rounds_seen, batch_size (-1: none), one flag per fragment]`; every rank
then takes part in one broadcast per overwritten fragment, so all ranks hold rank 0's
parameters and make the same collective calls in the same order whatever rank 0 decided.
`start()` and `close()` may overwrite every synced parameter: after them everything is
broadcast. With one process (`SingleRank`) no collective runs at all.

With `sharded_ranks` (`gradientmail.integration.sharded.ShardedRanks`: FSDP2 shards, or a
DDP group splitting its upload) nothing is broadcast: every rank mails and reads its own rows, and
applies them itself. Rank 0's learner then works on handles, and each thing it does to
the model (snapshot, apply, rebase) is sent to the other ranks as it happens, and the
control vector closes that collective (`ShardedRanks.serve_ops`): a step without ops costs
the same two collectives as an unsharded one, a due step one more.

Both integrations drive this class from their hooks; `Ranks` carries the collectives out
(`TorchRanks` for either framework's process group).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradientmail.errors import GradientmailError
from gradientmail.integration.batches import BatchSizeHook
from gradientmail.integration.metrics import PREFIX, RunMetrics, traffic_values
from gradientmail.integration.ranks import Ranks
from gradientmail.integration.sharded import ShardedRanks
from gradientmail.learner.runtime import Learner

__all__ = ["RankSync"]

_OK, _FAILED = 0, 1
#: The control vector: [status, rounds_seen, batch_size], then one flag per fragment.
_CONTROL_HEAD = 3
_log = logging.getLogger("gradientmail.integration")


class RankSync:
    """One learner run by the processes `ranks` connects, over `module`'s parameters.

    Each method is a collective unless it says otherwise: call it on every rank. A failure
    on rank 0 is raised there and, on the other ranks, as a `GradientmailError` naming
    rank 0, so no rank is left waiting in a collective. `metrics` (fed by the learner's
    events, which the integration routes to it) backs `metrics()`. `on_batch_size` is
    called on every rank with the learner's share of `global_batch_size` after `start()`
    and whenever a step changes it (see `gradientmail.integration.batches`).
    """

    def __init__(
        self,
        ranks: Ranks,
        module: torch.nn.Module,
        metrics: RunMetrics | None = None,
        on_batch_size: BatchSizeHook | None = None,
        sharded_ranks: ShardedRanks | None = None,
    ) -> None:
        self.ranks = ranks
        self.sharded_ranks = sharded_ranks
        self.module = module
        self.run_metrics = metrics if metrics is not None else RunMetrics()
        self.on_batch_size = on_batch_size
        self.learner: Learner | None = None
        self.plan: tuple[tuple[str, ...], ...] = ()
        self.learner_id: str | None = None
        self.rounds_seen = -1
        self.batch_size: int | None = None
        self.steps = 0  # real optimizer steps taken through step()
        self.tokens = 0  # tokens of every rank, summed
        self._fragments: list[list[torch.Tensor]] = []

    # -- collectives ------------------------------------------------------------------------

    def start(self, make_learner: Callable[[], Learner]) -> None:
        """Rank 0 builds a learner with `make_learner()` and joins the run; every rank
        then holds the parameters rank 0 joined with."""
        failure: BaseException | None = None
        info: tuple[Any, ...] | None = None
        if self.sharded_ranks is not None:
            self.sharded_ranks.begin()
        if self.ranks.is_main:
            try:
                self.learner = make_learner()
                self.learner.start()
                learner = self.learner
                info = (learner.plan, learner.learner_id, learner.rounds_seen,
                        learner.batch_size)
            except BaseException as exc:
                failure = exc
                self.abandon(timeout=30.0)
        self._ops_done()
        if self.ranks.world_size > 1:
            info = self.ranks.broadcast_object(info)
        if info is None:
            self._raise_for_rank0(failure, "start")
        assert info is not None
        self.plan, self.learner_id, self.rounds_seen, batch_size = info
        if self.sharded_ranks is None:
            self._fragments = self._resolve(self.plan)
        if self.ranks.world_size > 1:
            self._broadcast(range(len(self.plan)))
        self._resized(batch_size)

    def step(self, tokens: int, *, same_on_every_rank: bool = False,
             loss: float | None = None) -> tuple[int, ...]:
        """After a real optimizer step: `tokens` is this rank's count since the last one
        (`same_on_every_rank`: a fixed count, multiplied by the world size without a
        collective), `loss` the step's training loss as rank 0 saw it (other ranks' is
        ignored: no collective for a number the records only report). Returns the
        fragments rank 0's learner overwrote."""
        world = self.ranks.world_size
        if world == 1:
            total = tokens
        elif same_on_every_rank:
            total = tokens * world
        else:
            total = self.ranks.sum_int(tokens)
        self.steps += 1
        self.tokens += total
        touched: tuple[int, ...] = ()
        failure: BaseException | None = None
        batch_size = self.batch_size
        carried = self.sharded_ranks is not None and world > 1  # the control closes the ops
        if carried and self.sharded_ranks is not None and self.ranks.is_main:
            self.sharded_ranks.ops_tail(_CONTROL_HEAD + len(self.plan))
        if self.learner is not None:
            try:
                touched = self.learner.step(total, loss)
                self.rounds_seen = self.learner.rounds_seen
                batch_size = self.learner.batch_size
            except BaseException as exc:
                failure = exc
        if not carried:
            self._ops_done()
        if world == 1:
            if failure is not None:
                raise failure
        else:
            touched, batch_size = self._control(failure, touched, batch_size, "step",
                                                carried=carried)
            self._broadcast(touched)
        self._resized(batch_size)
        return touched

    def close(self, flush: bool | None = None) -> None:
        """Rank 0 closes its learner (`flush` as `Learner.close`); every rank then holds
        the parameters it ended on."""
        failure: BaseException | None = None
        learner = self.learner
        if learner is not None:
            try:
                learner.close(flush=flush)
                self.rounds_seen = learner.rounds_seen
            except BaseException as exc:
                failure = exc
        self._ops_done()
        if self.sharded_ranks is not None:
            self.sharded_ranks.finish()
        if self.ranks.world_size > 1:
            everything = tuple(range(len(self.plan)))
            chosen, _ = self._control(failure, everything, self.batch_size, "close")
            self._broadcast(chosen)
        elif failure is not None:
            raise failure

    def wait_for_learners(self, count: int, timeout: float) -> None:
        """Return once `count` learners (this one included) hold a lease; after `timeout`
        seconds raise on every rank: rank 0 its learner's error (naming who is live), the
        others one naming rank 0. Nothing to wait for below 2."""
        failure: BaseException | None = None
        if self.learner is not None and count > 1:
            try:
                self.learner.wait_for_learners(count, timeout)
            except GradientmailError as exc:
                failure = exc
        if self.ranks.world_size > 1:
            if self.ranks.broadcast_ints([_FAILED if failure else _OK])[0] != _OK:
                self._raise_for_rank0(failure, "wait_for_learners")
        elif failure is not None:
            raise failure

    # -- local ------------------------------------------------------------------------------

    def abandon(self, timeout: float) -> None:
        """Not a collective (after a failure the other ranks may be gone): close rank 0's
        learner without flushing, in a daemon thread joined for at most `timeout` seconds,
        so waiting for rounds in flight cannot keep a failing process alive; an unfinished
        close leaves the lease to expire. Nothing is flushed because a run resumed from a
        checkpoint trains those steps again."""
        learner, self.learner = self.learner, None
        if learner is None:
            return

        def close() -> None:
            try:
                learner.close(flush=False)
            except Exception:
                _log.exception("closing learner %s after a failure", learner.learner_id)

        thread = threading.Thread(target=close, name="gradientmail-abort", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            _log.warning("learner %s did not close within %.0f s; its lease will expire",
                         learner.learner_id, timeout)

    def metrics(self) -> dict[str, float]:
        """The metrics of `gradientmail.integration.METRICS` known on this rank: the
        event-based ones are rank 0's; `live_learners` and the traffic (requests, bytes,
        cost: rank 0 alone talks to the mailbox) are known on rank 0 only."""
        out = self.run_metrics.values()
        out[PREFIX + "rounds_seen"] = float(self.rounds_seen)
        out[PREFIX + "rounds_committed"] = max(
            out[PREFIX + "rounds_committed"], float(self.rounds_seen + 1)
        )
        out[PREFIX + "optimizer_steps"] = float(self.steps)
        out[PREFIX + "tokens"] = float(self.tokens)
        if self.batch_size is not None:
            out[PREFIX + "batch_size"] = float(self.batch_size)
        if self.learner is not None:
            out[PREFIX + "live_learners"] = float(len(self.learner.live_learners))
            out.update(traffic_values(self.learner.traffic))
        return out

    # -- internals --------------------------------------------------------------------------

    def _resolve(self, plan: Sequence[Sequence[str]]) -> list[list[torch.Tensor]]:
        params = dict(self.module.named_parameters())
        missing = sorted({n for names in plan for n in names} - set(params))
        if missing:
            raise GradientmailError(
                f"rank 0's plan names parameters this rank's module lacks: {missing[:5]}; "
                "every rank must build the same model"
            )
        return [[params[n] for n in names] for names in plan]

    def _control(
        self,
        failure: BaseException | None,
        chosen: Sequence[int],
        batch_size: int | None,
        what: str,
        *,
        carried: bool = False,
    ) -> tuple[tuple[int, ...], int | None]:
        """Rank 0's status, rounds seen, batch share and chosen fragments on every rank;
        returns the fragments and the share. `carried`: the vector closes the sharded
        ranks' ops (one collective for both)."""
        picked = set(chosen)
        flags = [1 if p in picked else 0 for p in range(len(self.plan))]
        head = [
            _FAILED if failure is not None else _OK,
            self.rounds_seen,
            -1 if batch_size is None else batch_size,
        ]
        if carried and self.sharded_ranks is not None:
            if self.ranks.is_main:
                got = self.sharded_ranks.end_ops(head + flags)
            else:
                got = self.sharded_ranks.serve_ops(head + flags)
        else:
            got = self.ranks.broadcast_ints(head + flags)
        if got[0] != _OK:
            self._raise_for_rank0(failure, what)
        self.rounds_seen = got[1]
        flags = got[_CONTROL_HEAD:]
        return tuple(p for p, bit in enumerate(flags) if bit), None if got[2] < 0 else got[2]

    def _resized(self, batch_size: int | None) -> None:
        changed = batch_size != self.batch_size
        self.batch_size = batch_size
        if changed and batch_size is not None and self.on_batch_size is not None:
            self.on_batch_size(batch_size)

    def _ops_done(self) -> None:
        """The end of what rank 0's learner did to the model in this collective: the
        other ranks have replayed it (sharded ranks only)."""
        if self.sharded_ranks is None:
            return
        if self.ranks.is_main:
            self.sharded_ranks.end_ops()
        else:
            self.sharded_ranks.serve_ops()

    def _broadcast(self, fragments: Any) -> None:
        if self.sharded_ranks is not None:
            return  # every rank applied its own rows
        for p in fragments:
            self.ranks.broadcast_tensors(self._fragments[p])

    def _raise_for_rank0(self, failure: BaseException | None, what: str) -> None:
        if failure is not None:
            raise failure
        raise GradientmailError(
            f"the learner on the main process (rank 0) failed in {what}(); its error is in "
            "rank 0's log. This rank stops too, so no collective is left waiting"
        )
