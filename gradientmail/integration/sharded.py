"""The ranks of one learner that each mail their own rows (docs/design/sharded.md §3).

Every rank holds a `ShardedAdapter` (FSDP2 shards, or a DDP group splitting its upload);
rank 0 runs the `Learner` over a `RankAdapter`, whose values are `Handle`s: an id that
names, on every rank, that rank's own rows of the same values. Two channels keep the
ranks' rows in step, each ordered by rank 0:

- The training channel, on the default group: what the training thread does to the model
  (snapshot, apply, rebase) is broadcast by rank 0 as it happens, inside `RankSync`'s
  collectives, and replayed by every other rank on its training thread on the same step.
- The side channel, on a gloo group of its own (so its collectives never interleave with
  FSDP's): what the communication thread does (upload a part; reach a fragment's
  version, joining or following commits, each rank reading its own rows and, with a
  replicated outer step, replaying it on its rows of the state: `ShardedReplica`; upload
  its rows of Θ⁰ as its part when the learner creates the run). Rank 0 sends a command;
  every rank, rank 0 included,
  carries out its share; the results are gathered. The other ranks serve it from a
  thread of their own (`begin`). No rank holds a fragment whole.

A handle rank 0 no longer holds is released on every rank with the next training-channel
message: the one channel whose order follows every use of it.

With a sparse `delta_dtype` every rank keeps the error feedback of its own rows
(`learner.feedback.Residuals`, on its device) and sparsifies them into its part. What
settles a payload (a failed upload, a commit that left it out, a sweep) is learned by
rank 0's mailman; its `RankResiduals` (`integration.sharded_feedback`) queues it, and
every side command carries the queue, which every rank applies, in order, before its
share: so every rank's residuals go through the same settlements in the same order
relative to its encodes. A checkpoint gathers them into an unsharded learner's layout
(`feedback.join_states`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import itertools
import math
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gradientmail.adapters.sharded import ShardedAdapter
from gradientmail.algorithms.base import FragmentState
from gradientmail.errors import (
    ConfigError,
    GradientmailError,
    RemoteProtocolError,
    SchemaMismatch,
)
from gradientmail.integration.ranks import Ranks, TorchRanks
from gradientmail.integration.sharded_feedback import RankResiduals, rank_restored, rank_share
from gradientmail.integration.sharded_ops import END, HEAD, OBJECT, OP, OpMessages
from gradientmail.learner.feedback import Residuals
from gradientmail.learner.sharded import Sparse
from gradientmail.mailbox.base import Mailbox
from gradientmail.mailbox.url import open_mailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.sharded_part import PartBlob, put_init_blob, put_part_blob
from gradientmail.run.sharded_replica import ShardedChain, ShardedReplica, plan_chain
from gradientmail.wire.quantization import quantize
from gradientmail.wire.records import Manifest, RoundRecord
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.sharded_blocks import BLOCK_BYTES
from gradientmail.wire.sharded_parts import assemble
from gradientmail.wire.sharded_ranges import Rows
from gradientmail.wire.sparse import SPARSE_FORMATS
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["Handle", "RankAdapter", "ShardedRanks", "SideGroup", "check_meshes", "is_sharded"]

#: Errors another rank reports that say the data is bad, not the store unreachable: a
#: commit that fails with one of them is passed over, not retried forever.
_PERMANENT = {cls.__name__: cls for cls in (ConfigError, SchemaMismatch, RemoteProtocolError)}
#: Side commands that do no I/O, served without an event loop.
_SYNC = ("stop", "load_full", "read", "feedback_state", "feedback_load")


class SideGroup(Protocol):
    """The side channel's collectives (`TorchRanks` on a gloo group, or `ThreadRanks`)."""

    @property
    def world_size(self) -> int: ...

    def broadcast_object(self, obj: Any) -> Any: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...


@dataclasses.dataclass(eq=False, frozen=True)
class Handle:
    """Values every rank of the learner holds its own rows of, under `id` (rank 0's
    view: the adapter handle the `Learner` keeps)."""

    id: int


class ShardedRanks:
    """One learner's ranks, each mailing and reading its own rows of `adapter`'s model.

    Build one on every rank, at the same point (`create` makes the side group, a
    collective); `ranks` is the default group `RankSync` uses, `side` the side group,
    `rank` this process's rank. `mailbox`, `prefix` and `compression` are the learner's
    (the other ranks open the mailbox themselves: give a URL, not an in-process object).
    `timeout`: seconds a rank waits for values another rank is still making.
    """

    def __init__(self, adapter: ShardedAdapter, ranks: Ranks, side: SideGroup, rank: int,
                 mailbox: Mailbox | str, *, prefix: str = "", compression: str = "off",
                 timeout: float = 600.0) -> None:
        self.adapter = adapter
        self.ranks = ranks
        self.side = side
        self.rank = rank
        self.size = side.world_size
        self.timeout = timeout
        self._mailbox, self._prefix, self._compression = mailbox, prefix, compression
        self._store: dict[int, Any] = {}  # this rank's rows of every live handle
        self._changed = threading.Condition()
        self._ids = itertools.count()
        self._released: list[int] = []  # rank 0: ids to release with the next message
        self._messages = OpMessages()  # the training channel's encoding
        self._tail = 0  # rank 0: the width of the tail the next `end_ops` closes with
        self._command = threading.Lock()  # rank 0: one side command at a time
        self._thread: threading.Thread | None = None
        self._replica: ShardedReplica | None = None  # this rank's rows of each fragment's state
        self._versions: dict[int, int] = {}  # rank 0: the version every rank's replica holds
        self.failure: BaseException | None = None  # what ended a member's serving thread
        self._feedback: Residuals | None = None  # this rank's error feedback, once needed
        self._view: RankResiduals | None = None  # rank 0: what its mailman holds
        self._settlements: list[tuple[Any, ...]] = []  # rank 0: not sent to the ranks yet
        self._settling = threading.Lock()
        self._stopped = False  # rank 0: the other ranks no longer serve side commands
        self._kept_any = False  # rank 0: a sparse upload or a restore made residuals

    @classmethod
    def create(cls, module: Any, mailbox: Mailbox | str, *, prefix: str = "",
               compression: str = "off", timeout: float = 600.0,
               ranks: Ranks | None = None) -> ShardedRanks:
        """For a `torch.distributed` launch (every rank calls it): a `ShardedAdapter` of
        `module` (after `fully_shard`), the default group, and a new gloo side group.

        `ranks`: the default group's collectives, by default `TorchRanks("cpu")` (gloo);
        under NCCL pass `TorchRanks` on the rank's CUDA device (the integrations pass the
        one `RankSync` uses)."""
        import torch.distributed as dist

        world = dist.get_world_size()
        check_meshes(module, world)
        side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        return cls(ShardedAdapter(module), ranks if ranks is not None else TorchRanks("cpu"),
                   TorchRanks("cpu", group=side), dist.get_rank(), mailbox, prefix=prefix,
                   compression=compression, timeout=timeout)

    @property
    def held(self) -> int:
        """How many handles' values this rank holds (rank 0's learner keeps the anchors,
        and the snapshots of rounds in flight; the rest are released)."""
        with self._changed:
            return len(self._store)

    def rows_state(self, fragment: int) -> FragmentState | None:
        """This rank's rows of `fragment`'s outer state as it last replayed it (a run with
        a replicated outer step; None before, or in other runs)."""
        return None if self._replica is None else self._replica.state(fragment)

    def learner_adapter(self) -> RankAdapter:
        """The adapter rank 0's `Learner` is built with."""
        return RankAdapter(self)

    # -- lifetime ----------------------------------------------------------------------------

    def begin(self) -> None:
        """Every rank but 0: serve side commands from a thread, until `finish`."""
        if self.rank != 0 and self._thread is None:
            self._thread = threading.Thread(target=self._serve_side, daemon=True,
                                            name=f"gradientmail-rank{self.rank}")
            self._thread.start()

    def finish(self) -> None:
        """Rank 0: tell the other ranks' threads to stop (keeping the ranks' error
        feedback, gathered, for a checkpoint taken after: `RankResiduals.state_dict`);
        the others: wait for it."""
        if self.rank == 0:
            if self._view is not None and self.holds_feedback:
                self._view.keep_final()
            self._stopped = True
            self._side_command(("stop",))
        elif self._thread is not None:
            self._thread.join(self.timeout)

    # -- the training channel --------------------------------------------------------------

    def op(self, kind: str, *args: Any) -> None:
        """Rank 0: do `kind` to the model's rows on every rank (training thread)."""
        with self._changed:
            released, self._released = self._released, []
        ints = self._messages.encode(kind, args, released)
        if ints is None:
            head = [OBJECT] + [0] * (HEAD - 1) + [0] * self._tail
            new = self._messages.is_new(kind, args)
            self.ranks.broadcast_ints(head)
            self.ranks.broadcast_object((kind, args, released, new))
            if new:
                self._messages.learn(args[1])
        else:
            self.ranks.broadcast_ints(ints + [0] * self._tail)
        self._replay(kind, args, released)

    def end_ops(self, tail: Sequence[int] = ()) -> list[int]:
        """Rank 0: no more ops for now (the other ranks leave `serve_ops`); `tail` rides
        on the closing message, and is returned."""
        assert len(tail) == self._tail, "ops_tail() names the width of end_ops' tail"
        if self._released:
            self.op("release")
        got = self.ranks.broadcast_ints(OpMessages.closing(tail))
        self._tail = 0
        return got[HEAD:]

    def serve_ops(self, tail: Sequence[int] = ()) -> list[int]:
        """Every rank but 0: replay rank 0's ops until it says there are no more; returns
        the tail rank 0 closed with (`tail`: this rank's, of the same length)."""
        mine = OpMessages.closing(tail)
        while True:
            got = self.ranks.broadcast_ints(mine)
            if got[0] == END:
                return got[HEAD:]
            if got[0] == OP:
                kind, args, released = self._messages.decode(got[:HEAD])
            else:
                kind, args, released, new = self.ranks.broadcast_object(None)
                if new:
                    self._messages.learn(args[1])
            self._replay(kind, args, released)

    def ops_tail(self, n: int) -> None:
        """Rank 0, before the learner acts: the next `end_ops` closes with `n` ints (every
        op message before it is as wide, so the other ranks can receive either)."""
        self._tail = n

    def _replay(self, kind: str, args: tuple[Any, ...], released: Sequence[int]) -> None:
        # Released first: rank 0 dropped them before this op, which names only handles it
        # holds, and what they free is then there for the op's own buffers.
        with self._changed:
            for i in released:
                self._store.pop(i, None)
        a = self.adapter
        if kind == "snapshot":
            self._keep(args[0], a.snapshot(args[1]))
        elif kind == "apply":
            a.apply(self._get(args[0]), args[1])
        elif kind == "rebase":
            a.rebase(self._get(args[0]), self._get(args[1]))

    def _keep(self, i: int, value: Any) -> None:
        with self._changed:
            self._store[i] = value
            self._changed.notify_all()

    def _get(self, i: int) -> Any:
        """This rank's values of handle `i`, waiting while the other channel makes them."""
        with self._changed:
            if not self._changed.wait_for(lambda: i in self._store, self.timeout):
                raise GradientmailError(f"rank {self.rank}: values {i} never arrived within "
                                        f"{self.timeout:.0f} s; rank 0 and this rank disagree")
            return self._store[i]

    def handle(self, value: Any) -> Handle:
        """Rank 0: a new handle for its own `value`, released on every rank when dropped."""
        h = Handle(next(self._ids))
        self._keep(h.id, value)
        weakref.finalize(h, self._drop, h.id)
        return h

    def _drop(self, i: int) -> None:
        with self._changed:
            self._store.pop(i, None)
            self._released.append(i)

    def new_id(self) -> int:
        return next(self._ids)

    def local(self, h: Handle) -> Any:
        return self._get(h.id)

    # -- the side channel: rank 0 ----------------------------------------------------------

    def _side_command(self, cmd: tuple[Any, ...]) -> Any:
        """Rank 0, blocking: send `cmd` (one without I/O: stop, load_full, read), do its
        share, gather every rank's results."""
        with self._command:
            settled = self._take_settlements()
            self.side.broadcast_object((cmd, settled))
            own = _outcome(self._settled_share, cmd, settled)
            return _results(self.side.all_gather_object(own))

    async def _side_command_async(self, cmd: tuple[Any, ...], exchange: Exchange) -> Any:
        """`_side_command` from the communication thread's loop (its own share on it)."""
        await asyncio.to_thread(self._command.acquire)
        try:
            settled = self._take_settlements()
            await asyncio.to_thread(self.side.broadcast_object, (cmd, settled))
            try:
                self._settle(settled)
                own: tuple[Any, ...] = ("ok", await self._serve(cmd, exchange))
            except Exception as exc:
                own = ("error", type(exc).__name__, str(exc))
            return _results(await asyncio.to_thread(self.side.all_gather_object, own))
        finally:
            self._command.release()

    def load_full(self, values: Mapping[str, TensorBytes]) -> Handle:
        """Rank 0: full `values` loaded by every rank, each its own rows (the adapter's
        `load`; sent whole over the side group, so the learner does not use it: it joins
        and follows commits by rows, `load`)."""
        i = self.new_id()
        plain = {n: TensorBytes(t.dtype, t.shape, t.data) for n, t in values.items()}
        self._side_command(("load_full", i, plain))
        h = Handle(i)
        weakref.finalize(h, self._drop, i)
        return h

    def read(self, names: Sequence[str] | None) -> dict[str, TensorBytes]:
        """Rank 0: the full parameters `names`, each rank's owned rows gathered and joined
        (the adapter's `read`; a creating learner no longer uses it: it uploads Θ⁰ by
        parts, `upload_init`)."""
        wanted = list(self.adapter.schema.names if names is None else names)
        got: list[dict[str, Rows]] = self._side_command(("read", wanted))
        parts = [(f"rank {k}", {n: r.tensor for n, r in rows.items()},
                  {n: (r.start, r.stop) for n, r in rows.items()})
                 for k, rows in enumerate(got)]
        return assemble(parts, self.adapter.schema, wanted, None)

    async def upload(self, exchange: Exchange, round_: int, learner: str, anchor: Any,
                     snapshot: Any, delta_format: str, sparse: Sparse | None = None
                     ) -> list[PayloadRef]:
        """`Ranks.upload`: every rank's part, in rank order (sparse: each rank's rows
        sparsified with its own error feedback)."""
        if (delta_format in SPARSE_FORMATS) != (sparse is not None):
            raise ConfigError(f"delta_format={delta_format!r} with sparse={sparse!r}: a "
                              "sparse format needs its Sparse, a dense one none")
        self._kept_any |= sparse is not None
        cmd = ("upload", round_, learner, anchor.id, snapshot.id, delta_format, sparse)
        refs: list[PayloadRef] = await self._side_command_async(cmd, exchange)
        return refs

    async def upload_init(self, exchange: Exchange, fragment: int, names: tuple[str, ...],
                          attempt: int) -> list[PayloadRef]:
        """`Ranks.upload_init`: every rank's owned rows of Θ⁰ of `fragment` (tensors
        `names`) uploaded as its part, in rank order. No rank gathers or joins them."""
        cmd = ("init", fragment, list(names), attempt)
        refs: list[PayloadRef] = await self._side_command_async(cmd, exchange)
        return refs

    async def load(self, exchange: Exchange, manifest: Manifest, fragment: int,
                   record: RoundRecord | None) -> tuple[Any, int]:
        """`Ranks.load`: every rank's rows of `fragment`'s theta at `record` (Θ⁰ for
        None), each read by ranges and, with a replicated outer step, replayed on the
        rank's own rows of the state; (None, 0) when a payload was swept. Rank 0 walks
        the records (it alone holds the run key), the ranks read and replay."""
        held = self._versions.get(fragment)
        chain = await plan_chain(exchange, manifest, fragment, record, held)
        i = self.new_id()
        h = Handle(i)
        # Also what releases the rows of a swept one, or those some ranks loaded when
        # another failed.
        weakref.finalize(h, self._drop, i)
        # Forgotten until every rank says it holds the new version: a rank that failed
        # partway dropped its state, and the next chain must start from a checkpoint.
        self._versions.pop(fragment, None)
        got: list[int | None] = await self._side_command_async(("reach", i, chain), exchange)
        if any(n is None for n in got):
            return None, 0
        if chain.replicated:
            self._versions[fragment] = chain.version
        return h, sum(n or 0 for n in got)

    # -- error feedback ---------------------------------------------------------------------

    def feedback(self, learner: str) -> RankResiduals:
        """`Ranks.feedback`: rank 0's view of the ranks' error feedback (one per learner)."""
        if self._view is None:
            sizes = {p.name: p.numel for p in self.adapter.schema.params}
            self._view = RankResiduals(self, learner, sizes)
        return self._view

    @property
    def holds_feedback(self) -> bool:
        """Rank 0: the other ranks still serve side commands, and a sparse upload or a
        restore made residuals on them."""
        return self._kept_any and not self._stopped

    def gather_feedback(self) -> list[Any]:
        """Rank 0: every rank's spans and residuals' state on the host (None from a rank
        that keeps none)."""
        return list(self._side_command(("feedback_state",)))

    def load_feedback(self, learner: str, state: Mapping[str, Any]) -> None:
        """Rank 0: every rank keeps its rows of the full residuals' `state`."""
        self._side_command(("feedback_load", learner, state))
        self._kept_any = True

    def residuals(self, learner: str) -> Residuals:
        """This rank's error feedback: its own rows' residuals (made when first needed)."""
        if self._feedback is None:
            self._feedback = Residuals(learner)
        return self._feedback

    def settle(self, *event: Any) -> None:
        """Rank 0: a settlement (`Residuals.failed`/`recorded`/`swept`, by name and
        arguments) for every rank to apply before its share of the next side command."""
        with self._settling:
            self._settlements.append(event)

    def pending_settlements(self) -> list[tuple[Any, ...]]:
        with self._settling:
            return list(self._settlements)

    def _take_settlements(self) -> list[tuple[Any, ...]]:
        with self._settling:
            out, self._settlements = self._settlements, []
            return out

    def _settle(self, settled: Sequence[tuple[Any, ...]]) -> None:
        """Apply rank 0's settlements to this rank's residuals, in order (none kept yet:
        nothing to settle)."""
        mine = self._feedback
        if mine is None:
            return
        for kind, *args in settled:
            getattr(mine, kind)(*args)

    def _spans(self) -> dict[str, tuple[int, int]]:
        """The flat elements [start, stop) of each tensor whose rows this rank mails."""
        a = self.adapter
        return {n: (r0 * math.prod(a.schema[n].shape[1:]), r1 * math.prod(a.schema[n].shape[1:]))
                for n, (r0, r1) in a.mailed(list(a.schema.names)).items()}

    def _feedback_state(self) -> tuple[Mapping[str, tuple[int, int]], dict[str, Any]] | None:
        """This rank's share of `feedback_state` (`sharded_feedback.rank_share`)."""
        return rank_share(self._feedback, self._spans())

    def _feedback_load(self, learner: str, state: Mapping[str, Any]) -> None:
        """This rank's share of `feedback_load`: its rows of the full `state`, on its
        device."""
        a = self.adapter

        def place(name: str, piece: Any) -> Any:
            import torch

            device = a.local(name).device
            return torch.as_tensor(piece).to(device=device, dtype=torch.float32, copy=True)

        self._feedback = rank_restored(learner, state, self._spans(), place)

    # -- the side channel: every rank's share ----------------------------------------------

    def _serve_side(self) -> None:
        """A member's thread: carry out rank 0's commands until it says stop."""
        loop = asyncio.new_event_loop()
        ex = Exchange(open_mailbox(self._mailbox), prefix=self._prefix,
                      compression=self._compression)
        try:
            while True:
                cmd, settled = self.side.broadcast_object(None)
                if cmd[0] in _SYNC:
                    out = _outcome(self._settled_share, cmd, settled)
                else:
                    def run(c: tuple[Any, ...], settled: Any = settled) -> Any:
                        self._settle(settled)
                        return loop.run_until_complete(self._serve(c, ex))

                    out = _outcome(run, cmd)
                self.side.all_gather_object(out)
                if cmd[0] == "stop":
                    return
        except BaseException as exc:
            self.failure = exc
        finally:
            loop.run_until_complete(ex.mailbox.close())
            loop.close()

    def _settled_share(self, cmd: tuple[Any, ...], settled: Sequence[tuple[Any, ...]]) -> Any:
        self._settle(settled)
        return self._share(cmd)

    def _share(self, cmd: tuple[Any, ...]) -> Any:
        """This rank's share of a command without I/O."""
        kind = cmd[0]
        if kind == "feedback_state":
            return self._feedback_state()
        if kind == "feedback_load":
            self._feedback_load(cmd[1], cmd[2])
            return None
        if kind == "load_full":
            self._keep(cmd[1], self.adapter.load(cmd[2]))
        elif kind == "read":
            return {n: _portable(r) for n, r in self.adapter.read(cmd[1]).items()}
        return None

    async def _serve(self, cmd: tuple[Any, ...], ex: Exchange) -> Any:
        """This rank's share of a command that reads or writes the mailbox."""
        kind = cmd[0]
        if kind == "upload":
            round_, learner, anchor, snapshot, fmt, sparse = cmd[1:]
            if sparse is not None:
                return await self._upload_sparse(ex, round_, learner, self._get(anchor),
                                                 self._get(snapshot), fmt, sparse)
            return await self._upload(ex, round_, learner, self._get(anchor),
                                      self._get(snapshot), fmt)
        if kind == "reach":
            i, chain = cmd[1:]
            return await self._reach(ex, i, chain)
        if kind == "init":
            fragment, names, attempt = cmd[1:]
            return await self._upload_init(ex, fragment, names, attempt)
        raise ConfigError(f"unknown side command {kind!r}")

    async def _upload_init(self, ex: Exchange, fragment: int, names: Sequence[str],
                           attempt: int) -> PayloadRef:
        """This rank's part of Θ⁰: its owned rows of `names`, in their storage dtypes,
        each tensor's rows read and copied straight into the part's buffer (the rank
        holds the part and one tensor's rows). Uncompressed whatever the learner's codec:
        every rank of a sharded learner that joins at version 0 reads its rows of Θ⁰ by
        ranges, which no zstd frame serves (and initial weights compress little)."""
        a = self.adapter
        rows = a.mailed(names)
        blob = PartBlob(a.part_schema(list(rows)).params, rows, blocks=BLOCK_BYTES)
        for name in rows:
            one = (await asyncio.to_thread(a.read, [name]))[name].tensor
            blob.slot(name)[:] = one.buffer
            del one  # before the next tensor's rows
        return await put_init_blob(ex, fragment, self.rank, self.size, blob, attempt=attempt)

    async def _upload(self, ex: Exchange, round_: int, learner: str, anchor: Any,
                      snapshot: Any, fmt: str) -> PayloadRef:
        """This rank's part: anchor − θ over its owned rows. Uncompressed F32 is written
        straight into the part's buffer (the rank holds the part, nothing more); other
        formats are computed a tensor at a time and quantized before the next."""
        a = self.adapter
        rows = a.mailed(list(snapshot))
        if fmt == "F32" and ex.store.compression == "off":
            specs = [dataclasses.replace(p, dtype="F32") for p in a.part_schema(list(rows)).params]
            blob = PartBlob(specs, rows)
            await asyncio.to_thread(a.delta_into, anchor, snapshot,
                                    {n: blob.slot(n) for n in rows})
            return await put_part_blob(ex, round_, learner, self.rank, self.size, blob)
        entries: dict[str, TensorBytes] = {}
        for name in rows:
            one = await asyncio.to_thread(a.delta, {name: anchor[name]}, {name: snapshot[name]})
            t = one[name].tensor
            entries.update({name: t} if fmt == "F32" else quantize(name, t, fmt))
            del one, t  # before the next tensor's delta
        return await ex.put_part(round_, learner, self.rank, self.size, entries, rows)

    async def _upload_sparse(self, ex: Exchange, round_: int, learner: str, anchor: Any,
                             snapshot: Any, fmt: str, sparse: Sparse) -> PayloadRef:
        """This rank's part in a sparse `fmt`: anchor − θ over its owned rows (float32,
        on its device) plus its residual, sparsified on its own (chunks counted from the
        part's first element; SIGN1 seeded to select the whole tensor's elements), the
        rest kept as its residual (`Residuals.encode`, settled as rank 0 says)."""
        a = self.adapter
        rows = a.mailed(list(snapshot))
        mine = self.residuals(learner)

        def encode() -> dict[str, TensorBytes]:
            delta = a.delta_tensors(anchor, snapshot)
            return mine.encode(round_, sparse.fragment, delta, sparse.density, sparse.decay,
                               fmt, sparse.momentum,
                               offsets={n: a.owned_offset(n) for n in rows})

        entries = await asyncio.to_thread(encode)
        return await ex.put_part(round_, learner, self.rank, self.size, entries, rows)

    async def _reach(self, ex: Exchange, i: int, chain: ShardedChain) -> int | None:
        """This rank's share of `load`: its rows of the chain's theta, loaded onto its
        device one tensor at a time (the bytes read, or None when swept)."""
        a = self.adapter
        if self._replica is None:
            self._replica = ShardedReplica(ex, {n: a.local_rows(n) for n in a.schema.names})
        replica = self._replica
        loaded: dict[str, Any] = {}

        async def each(name: str, rows: Rows) -> None:
            spec, t = a.schema[name], rows.tensor
            if t.dtype != spec.dtype or tuple(t.shape[1:]) != spec.shape[1:]:
                raise SchemaMismatch(
                    f"fragment {chain.fragment} v{chain.version} does not fit the model: "
                    f"{name!r} is {t.dtype} {list(t.shape[1:])} per row, the model's "
                    f"{spec.dtype} {list(spec.shape[1:])}")
            loaded.update(await asyncio.to_thread(a.load, {name: rows}))

        before = replica.bytes_down
        if not await replica.reach(chain, each):
            return None
        self._keep(i, loaded)
        return replica.bytes_down - before


def is_sharded(module: Any) -> bool:
    """Whether any parameter of `module` is a DTensor (FSDP2's `fully_shard`, or a device
    mesh placement of the user's own)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def check_meshes(module: Any, world: int) -> None:
    """`ConfigError` unless every DTensor parameter of `module` spans the `world` ranks of
    the learner: the ranks' rows must tile each tensor once, and a mesh over a subset (say
    Lightning's `device_mesh["data_parallel"]` of size 1 when 2 processes form its
    `tensor_parallel` dimension) leaves several ranks holding and mailing the same rows
    as if each were the whole learner."""
    from torch.distributed.tensor import DTensor

    for name, p in module.named_parameters():
        if isinstance(p, DTensor) and p.device_mesh.size() != world:
            raise ConfigError(
                f"parameter {name!r} is sharded over a device mesh of "
                f"{p.device_mesh.size()} ranks (shape {list(p.device_mesh.shape)}), but the "
                f"learner has {world}: shard over all of its ranks, e.g. fully_shard(module) "
                "with the default mesh, or with Lightning's ModelParallelStrategy("
                "data_parallel_size=N, tensor_parallel_size=1) fully_shard(module, "
                "mesh=self.device_mesh['data_parallel'])"
            )


class RankAdapter:
    """The adapter of rank 0's `Learner` when every rank mails its own rows: each call
    reaches every rank (see the module), each value is a `Handle`, and `ranks` is the
    `ShardedRanks` the learner's mailman uploads and reads through."""

    def __init__(self, sharded_ranks: ShardedRanks) -> None:
        self.ranks = sharded_ranks
        self._inner = sharded_ranks.adapter

    @property
    def schema(self) -> Any:
        return self._inner.schema

    @property
    def direct_names(self) -> frozenset[str]:
        return self._inner.direct_names

    def read(self, names: Sequence[str] | None = None) -> dict[str, TensorBytes]:
        return self.ranks.read(names)

    def snapshot(self, names: Sequence[str]) -> Handle:
        i = self.ranks.new_id()
        self.ranks.op("snapshot", i, list(names))
        h = Handle(i)
        weakref.finalize(h, self.ranks._drop, i)
        return h

    def load(self, values: Mapping[str, TensorBytes]) -> Handle:
        return self.ranks.load_full(values)

    def delta(self, anchor: Handle, snapshot: Handle) -> dict[str, Any]:
        """Rank 0's own rows only (`Rows`, not the full tensors `Adapter.delta` promises,
        hence `Any`): a learner with a `ranks` uploads through it, never through this."""
        return self._inner.delta(self.ranks.local(anchor), self.ranks.local(snapshot))

    def apply(self, values: Handle, mixing: float = 0.0) -> None:
        self.ranks.op("apply", values.id, float(mixing))

    def rebase(self, values: Handle, base: Handle) -> None:
        self.ranks.op("rebase", values.id, base.id)


def _portable(rows: Rows) -> Rows:
    """`rows` with its own bytes (a view of torch memory does not pickle)."""
    t = rows.tensor
    return Rows(rows.start, rows.stop, TensorBytes(t.dtype, t.shape, t.data))


def _outcome(fn: Any, *args: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn(*args))
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc))


def _results(outcomes: Sequence[tuple[Any, ...]]) -> list[Any]:
    """The ranks' results, in rank order; the first rank's error raised (a bad commit's
    as the error it is, so the fetcher passes it over)."""
    for rank, out in enumerate(outcomes):
        if out[0] == "error":
            cls = _PERMANENT.get(out[1], GradientmailError)
            raise cls(f"rank {rank}: {out[1]}: {out[2]}")
    return [out[1] for out in outcomes]
