"""One rank's rows of each fragment's state, followed commit by commit (docs/design/sharded.md §4).

A learner whose ranks each hold a shard (FSDP2) reads commits by rows: no rank may hold a
fragment whole. With a replicated outer step (`checkpoint_every` K > 1) a commit carries
the merged Δ, not theta, so every rank keeps its own rows of the fragment's theta, fp32
master and momentum, and applies each step to them: the outer step is elementwise, so
a rank's rows come out byte for byte as the same rows of the whole state a `Replica`
computes (the same `Algorithm.apply_step`, on slices).

The work is split as `Replica._reach` splits it, across ranks: rank 0 (which holds the
authenticated records) walks the records back to a base (`plan_chain`, on the walk every
reader of a chain shares, `gradientmail.run.replica.walk_back`: the state the
ranks hold, a checkpoint, or Θ⁰) and sends the `ShardedChain`; every rank then reads its rows
of the base and of each step by ranged GETs and replays (`ShardedReplica.reach`).

Memory: the state's rows are this rank's, held in writable buffers the steps update in
place, a few rows at a time; what a replay allocates on top is one tensor's rows of the
step (for an F4 step whose 32-element blocks cross this rank's first or last row, that
tensor whole). A zstd payload cannot be
read by ranges and is decoded whole: sharded runs should commit uncompressed. A rank that
reads one whole for a part of its rows logs a warning saying so, once, with the bytes it
downloaded and those of its rows, and counts those bytes (`ShardedReplica.bytes_whole`).

Checked on rows: the header of each payload against its ref's `header_sha256`, and every
block of the rows read against the header's block digests (`gradientmail.wire.sharded_blocks`;
a mismatch is a `CorruptPayload`, as for a whole payload whose SHA-256 differs), when the
payload was written with them. Not checked: the record's `theta_sha256` (it covers the
whole theta; the block digests of the step and of the base stand for it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from gradientmail.algorithms.base import Algorithm, FragmentState
from gradientmail.backends.numpy_backend import NumpyBackend
from gradientmail.errors import GradientmailError, RemoteProtocolError
from gradientmail.mailbox.base import Mailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import walk_back
from gradientmail.wire.compression import compression_of, decode_with_metadata
from gradientmail.wire.quantization import dequantize, scale_name
from gradientmail.wire.records import Manifest, RoundRecord
from gradientmail.wire.refs import PayloadRef, StepRef
from gradientmail.wire.serialization import Span
from gradientmail.wire.sharded_blocks import BlockIndex
from gradientmail.wire.sharded_parts import ROWS_KEY, rows_in
from gradientmail.wire.sharded_ranges import (
    Rows,
    cover,
    fetch_header,
    fetch_span_rows,
    row_range,
    rows_of,
)
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["CHUNK_BYTES", "ShardedChain", "ShardedReplica", "plan_chain"]

#: Bytes of F32 rows a replay hands `apply_step` at once: its temporaries (a few buffers
#: this size) stay small next to a shard; ~60 µs of overhead per call, ~1 ms per 1 MiB.
CHUNK_BYTES = 1 << 16

#: What `ShardedReplica.reach` calls with each tensor's theta rows, one tensor at a time.
Each = Callable[[str, Rows], Awaitable[None]]

_log = logging.getLogger("gradientmail.run")


@dataclasses.dataclass(frozen=True)
class ShardedChain:
    """How to reach `version` of `fragment`: from the base (the state held at
    `base_version` when `theta` is None and there are no `theta_parts`; else `theta` and
    `outer`, the outer state, or Θ⁰ when `outer` is None and `base_version` is 0), then
    each step in order. Without `replicated`, theta alone is read (a run that uploads
    theta with every commit). Θ⁰ a sharded creator uploaded in parts is `theta_parts`
    (in k order), `theta` None."""

    fragment: int
    names: tuple[str, ...]
    version: int
    replicated: bool
    base_version: int
    theta: PayloadRef | None
    outer: PayloadRef | None
    steps: tuple[tuple[int, StepRef], ...]
    algorithm: Mapping[str, Any]
    theta_parts: tuple[PayloadRef, ...] = ()

    @property
    def from_held(self) -> bool:
        """Whether the base is the state the ranks hold (no payload to read)."""
        return self.theta is None and not self.theta_parts


async def plan_chain(ex: Exchange, manifest: Manifest, fragment: int,
                     rec: RoundRecord | None, held: int | None) -> ShardedChain:
    """The chain to `rec`'s version of `fragment` (Θ⁰ for None) for ranks that hold
    version `held` of it (None: nothing). `RemoteProtocolError` when the records do not
    form a chain, as `Replica.at`."""
    names = manifest.plan[fragment]
    alg = dict(manifest.algorithm)
    replicated = _algorithm(alg).replicated
    init_parts = manifest.init_parts[fragment] if manifest.init[fragment] is None else ()
    if rec is None:
        return ShardedChain(fragment, names, 0, replicated, 0, manifest.init[fragment], None, (),
                        alg, init_parts)
    if not replicated:
        if rec.theta is None:
            raise RemoteProtocolError(f"round {rec.round}'s record carries no theta and this "
                                      "run does not replicate its outer step")
        return ShardedChain(fragment, names, rec.version, False, rec.version, rec.theta, None, (),
                        alg)
    if held == rec.version:
        return ShardedChain(fragment, names, rec.version, True, held, None, None, (), alg)
    chain = await walk_back(ex, len(manifest.plan), fragment, rec, held)
    steps = tuple((r.round, r.step) for r in chain.steps if r.step is not None)
    if chain.held:
        return ShardedChain(fragment, names, rec.version, True, chain.base_version, None, None,
                        steps, alg)
    if chain.checkpoint is not None:
        return ShardedChain(fragment, names, rec.version, True, chain.base_version,
                        chain.checkpoint.theta, chain.checkpoint.outer, steps, alg)
    return ShardedChain(fragment, names, rec.version, True, 0, manifest.init[fragment], None,
                    steps, alg, init_parts)


class _Buf:
    """Rows of one tensor in a writable buffer (`rows` of them; a 0-d tensor is one)."""

    def __init__(self, dtype: str, shape: tuple[int, ...], data: Any) -> None:
        self.dtype, self.shape = dtype, shape
        self.a: npt.NDArray[np.uint8] = np.array(np.frombuffer(data, np.uint8), copy=True)
        self.rows = shape[0] if shape else 1
        self.row_bytes = self.a.size // self.rows if self.rows else 0

    def view(self, r0: int, r1: int) -> TensorBytes:
        """Rows [r0, r1) (of this buffer), read-only, without a copy."""
        v = self.a[r0 * self.row_bytes : r1 * self.row_bytes]
        v.flags.writeable = False
        return TensorBytes(self.dtype, (r1 - r0, *self.shape[1:]) if self.shape else (), v)

    def write(self, r0: int, t: TensorBytes) -> None:
        np.copyto(self.a[r0 * self.row_bytes : r0 * self.row_bytes + t.nbytes],
                  np.frombuffer(t.buffer, np.uint8))


@dataclasses.dataclass
class _State:
    version: int
    theta: dict[str, _Buf]
    master: dict[str, _Buf] | None
    momentum: dict[str, _Buf]


class _Reader:
    """One payload read tensor by tensor: by ranges when uncompressed; a zstd one is
    fetched and decoded once (no range of one frame decodes alone)."""

    def __init__(self, mailbox: Mailbox, key: str, spans: Mapping[str, Span] | None,
                 whole: Mapping[str, TensorBytes] | None,
                 metadata: Mapping[str, str] | None = None,
                 blocks: BlockIndex | None = None) -> None:
        self._mailbox, self.key, self._spans, self._whole = mailbox, key, spans, whole
        self.metadata = dict(metadata or {})
        self._blocks = blocks
        self.bytes = 0
        self.codec = compression_of(key)

    @classmethod
    async def open(cls, ex: Exchange, ref: PayloadRef) -> _Reader | None:
        key = ex.prefix + ref.key
        if compression_of(key) == "off":
            index = await fetch_header(ex.mailbox, key, ref.size,
                                       header_sha256=ref.header_sha256)
            return None if index is None else cls(ex.mailbox, key, index.spans, None,
                                                  index.metadata, index.blocks)
        blob = await ex.store.fetch_payload(ref)
        if blob is None:
            return None
        whole, metadata = decode_with_metadata(blob, compression_of(key), key=key)
        reader = cls(ex.mailbox, key, None, whole, metadata)
        reader.bytes = ref.size
        return reader

    @property
    def names(self) -> set[str]:
        return set(self._spans if self._spans is not None else self._whole or {})

    @property
    def ranged(self) -> bool:
        """Whether it reads by ranges (else it holds the decoded payload)."""
        return self._spans is not None

    def decoded(self) -> Mapping[str, TensorBytes]:
        """The decoded payload of a reader that is not `ranged`."""
        assert self._whole is not None
        return self._whole

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.names:
            raise RemoteProtocolError(f"{self.key}: the payload has no tensor {name!r}")
        if self._whole is not None:
            return self._whole[name].shape
        assert self._spans is not None
        return self._spans[name].shape

    def dtype(self, name: str) -> str:
        if name not in self.names:
            raise RemoteProtocolError(f"{self.key}: the payload has no tensor {name!r}")
        if self._whole is not None:
            return self._whole[name].dtype
        assert self._spans is not None
        return self._spans[name].dtype

    async def rows(self, name: str, a: int, b: int) -> Rows | None:
        if name not in self.names:
            raise RemoteProtocolError(f"{self.key}: the payload has no tensor {name!r}")
        if self._whole is not None:
            return rows_of(self._whole[name], a, b)
        assert self._spans is not None
        span = self._spans[name]
        got = await fetch_span_rows(self._mailbox, self.key, span, a, b, blocks=self._blocks)
        if got is not None:  # the bytes fetched: the rows, rounded out to whole blocks
            self.bytes += cover(span, row_range(span, a, b), self._blocks).size
        return got

    async def whole(self, name: str) -> TensorBytes | None:
        if name not in self.names:
            raise RemoteProtocolError(f"{self.key}: the payload has no tensor {name!r}")
        if self._whole is not None:
            return self._whole[name]
        assert self._spans is not None
        span = self._spans[name]
        got = await self.rows(name, 0, span.shape[0] if span.shape else 1)
        return None if got is None else TensorBytes(span.dtype, span.shape, got.tensor.buffer)


class _PartsReader:
    """Θ⁰ of a fragment in parts (`wire.sharded_parts`), read as `_Reader` reads one payload:
    each part's header once, and a tensor's rows from the parts that hold them, each
    part's own rows by ranges. A rank whose rows lie in one part gets them without a
    copy; rows across parts are joined (this rank's rows, nothing more)."""

    def __init__(self, key: str, readers: list[_Reader]) -> None:
        self.key = key
        self._readers = readers
        # name -> the parts holding rows of it: (first row, past the last row, reader)
        self._pieces: dict[str, list[tuple[int, int, _Reader]]] = {}
        for r in readers:
            for name, (a, b) in rows_in(r.metadata, r.key).items():
                if name not in r.names:
                    raise RemoteProtocolError(f"{r.key}: metadata names rows of {name!r}, "
                                              "which the part does not hold")
                shape = r.shape(name)
                if (shape[0] if shape else 1) != b - a:
                    raise RemoteProtocolError(
                        f"{r.key}: {name!r} is {list(shape)}, its metadata says rows "
                        f"[{a}, {b})")
                self._pieces.setdefault(name, []).append((a, b, r))
        for name, pieces in self._pieces.items():
            pieces.sort(key=lambda p: p[:2])
            held = [p for p in pieces if p[1] > p[0]]
            ends = [0] + [b for _, b, _ in held]
            if any(a != end for (a, _, _), end in zip(held, ends, strict=False)):
                raise RemoteProtocolError(
                    f"{key}: the parts do not tile {name!r}: rows "
                    f"{[[a, b] for a, b, _ in held]}")

    @classmethod
    async def open(cls, ex: Exchange, refs: tuple[PayloadRef, ...],
                   opener: Callable[[PayloadRef], Awaitable[_Reader | None]]
                   ) -> _PartsReader | None:
        readers = []
        for ref in refs:
            r = await opener(ref)
            if r is None:
                return None
            readers.append(r)
        return cls(ex.prefix + refs[0].key.rsplit("/", 1)[0] + "/", readers)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self._readers)

    @property
    def names(self) -> set[str]:
        return set(self._pieces)

    @property
    def ranged(self) -> bool:
        return all(r.ranged for r in self._readers)

    def _of(self, name: str) -> list[tuple[int, int, _Reader]]:
        if name not in self._pieces:
            raise RemoteProtocolError(f"{self.key}: no part holds rows of {name!r}")
        return self._pieces[name]

    def shape(self, name: str) -> tuple[int, ...]:
        pieces = self._of(name)
        first = pieces[0][2].shape(name)
        return (pieces[-1][1], *first[1:]) if first else ()

    def dtype(self, name: str) -> str:
        return self._of(name)[0][2].dtype(name)

    async def rows(self, name: str, a: int, b: int) -> Rows | None:
        got: list[TensorBytes] = []
        at = a
        for pa, pb, r in self._of(name):
            lo, hi = max(a, pa), min(b, pb)
            if lo >= hi:
                continue
            one = await r.rows(name, lo - pa, hi - pa)
            if one is None:
                return None
            got.append(one.tensor)
            at = hi
        if at != b:
            raise RemoteProtocolError(f"{self.key}: rows [{at}, {b}) of {name!r} are in no "
                                      "part")
        if len(got) == 1 and (got[0].shape[0] if got[0].shape else 1) == b - a:
            return Rows(a, b, got[0])
        trailing = self.shape(name)[1:]
        data = b"".join(bytes(t.buffer) for t in got)
        return Rows(a, b, TensorBytes(self.dtype(name), (b - a, *trailing), data))

    async def whole(self, name: str) -> TensorBytes | None:
        shape = self.shape(name)
        got = await self.rows(name, 0, shape[0] if shape else 1)
        return None if got is None else TensorBytes(got.tensor.dtype, shape, got.tensor.buffer)


class ShardedReplica:
    """This rank's rows (`rows`: name -> [start, stop) of the full tensor) of each
    fragment's state, reached chain by chain (`reach`); `bytes_down` counts what it read.
    One per rank, used from one thread at a time."""

    def __init__(self, exchange: Exchange, rows: Mapping[str, tuple[int, int]]) -> None:
        self.exchange = exchange
        self.rows = dict(rows)
        self.bytes_down = 0
        #: Bytes of compressed payloads downloaded whole for a part of their rows (no
        #: range of a zstd frame decodes alone): uncompressed, this rank reads its rows.
        self.bytes_whole = 0
        self._warned = False
        self._states: dict[int, _State] = {}
        self._backend = NumpyBackend(threads=1, pool_bytes=0)

    def held(self, fragment: int) -> int | None:
        """The version of `fragment` whose rows this rank holds, if any."""
        state = self._states.get(fragment)
        return None if state is None else state.version

    def state(self, fragment: int) -> FragmentState | None:
        """This rank's rows of `fragment`'s state, as views (None: none held)."""
        st = self._states.get(fragment)
        if st is None:
            return None
        return FragmentState(
            fragment, st.version, {n: b.view(0, b.rows) for n, b in st.theta.items()},
            None if st.master is None else {n: b.view(0, b.rows) for n, b in st.master.items()},
            {n: b.view(0, b.rows) for n, b in st.momentum.items()})

    async def _open_base(self, chain: ShardedChain) -> _Reader | _PartsReader | None:
        """The reader of the chain's base theta: one payload, or Θ⁰ in parts."""
        if chain.theta is not None:
            return await self._open(chain.theta)
        return await _PartsReader.open(self.exchange, chain.theta_parts, self._open)

    async def _open(self, ref: PayloadRef) -> _Reader | None:
        """A reader of the payload `ref`; one read whole for a part of its rows (its codec
        cannot serve ranges) is counted in `bytes_whole`, and the first is reported."""
        reader = await _Reader.open(self.exchange, ref)
        if reader is None or reader.ranged:
            return reader
        tensors = reader.decoded()
        decoded = sum(t.nbytes for t in tensors.values())
        mine = self._rows_bytes(tensors, rows_in(reader.metadata, reader.key)
                                if ROWS_KEY in reader.metadata else {})
        if mine >= decoded:  # this rank holds every row (one rank, or a DDP learner)
            return reader
        self.bytes_whole += reader.bytes
        if not self._warned and reader.bytes > mine:
            self._warned = True
            _log.warning(
                "%s is %s-compressed, and no range of a %s frame decodes alone: this rank "
                "downloaded all %s bytes of it (%s decoded) for %s bytes of its rows, and "
                "every rank of this sharded learner reads every compressed payload whole. "
                "Set compression: \"off\" on every learner of the run (their closers write "
                "the commits; recipes/gpt2-xl.yaml does), so that each rank downloads its "
                "rows alone (reported once; ShardedReplica.bytes_whole counts these bytes)",
                reader.key, reader.codec, reader.codec, f"{reader.bytes:,}", f"{decoded:,}",
                f"{mine:,}")
        return reader

    def _rows_bytes(self, tensors: Mapping[str, TensorBytes],
                    parts: Mapping[str, tuple[int, int]]) -> int:
        """Bytes of this rank's rows of `tensors`: `momentum/w` and `master/w` by w's rows,
        a tensor of no parameter's name (a scale) whole; a part's tensor (`parts`: the
        rows it holds) by the rows this rank shares with it."""
        total = 0
        for name, t in tensors.items():
            param = name.split("/", 1)[1] if name.startswith(("momentum/", "master/")) \
                else name
            held = self.rows.get(param)
            rows = t.shape[0] if t.shape else 1
            if held is None or not rows:
                total += t.nbytes
                continue
            a, b = parts.get(name, (0, rows))
            total += t.nbytes * max(0, min(held[1], b) - max(held[0], a)) // rows
        return total

    async def reach(self, chain: ShardedChain, each: Each) -> bool:
        """Follow `chain`, then hand `each` this rank's theta rows of every tensor, one at a
        time. False when a payload was swept (a newer commit exists). The state is dropped
        when a replay fails partway, so that the next chain starts from a checkpoint."""
        try:
            done = await self._reach(chain, each)
        except BaseException:
            self._states.pop(chain.fragment, None)
            raise
        if not done:
            self._states.pop(chain.fragment, None)
        return done

    async def _reach(self, chain: ShardedChain, each: Each) -> bool:
        alg = _algorithm(chain.algorithm)
        if not chain.replicated:
            assert not chain.from_held
            reader = await self._open_base(chain)
            if reader is None:
                return False
            try:
                for n in chain.names:
                    got = await reader.rows(n, *self.rows[n])
                    if got is None:
                        return False
                    await each(n, got)
            finally:
                self.bytes_down += reader.bytes
            return True
        if chain.from_held:
            state = self._states.get(chain.fragment)
            if state is None or state.version != chain.base_version:
                raise GradientmailError(
                    f"this rank holds version {None if state is None else state.version} of "
                    f"fragment {chain.fragment}, not {chain.base_version}; read it again")
        else:
            base = await self._base(alg, chain)
            if base is None:
                return False
            state = base
            self._states[chain.fragment] = state
        for round_, step in chain.steps:
            if not await self._step(alg, chain.fragment, state, round_, step):
                return False
        for n in chain.names:
            a, b = self.rows[n]
            await each(n, Rows(a, b, state.theta[n].view(0, state.theta[n].rows)))
        return True

    async def _base(self, alg: Algorithm, chain: ShardedChain) -> _State | None:
        assert not chain.from_held
        theta_in = await self._open_base(chain)
        outer_in = None if chain.outer is None else await self._open(chain.outer)
        if theta_in is None or (chain.outer is not None and outer_in is None):
            return None
        state = _State(chain.base_version, {}, None, {})
        # Whether the fragment keeps a master apart from theta is the algorithm's choice
        # over all its dtypes: asked once, of zero rows of each tensor.
        keep = outer_in is not None and any(k.startswith("master/") for k in outer_in.names)
        if outer_in is None:
            empty = {n: TensorBytes(theta_in.dtype(n), (0,), b"") for n in chain.names}
            keep = alg.initial_state(chain.fragment, empty).master is not None
        state.master = {} if keep else None
        try:
            for n in chain.names:
                a, b = self.rows[n]
                got = await theta_in.rows(n, a, b)
                if got is None:
                    return None
                t = got.tensor
                state.theta[n] = _Buf(t.dtype, t.shape, t.buffer)
                del got, t
                if outer_in is None:
                    one = alg.initial_state(chain.fragment, {n: state.theta[n].view(
                        0, state.theta[n].rows)})
                    mom = one.momentum[n]
                    master = None if not keep else (one.master or one.theta)[n]
                else:
                    m_rows = await outer_in.rows("momentum/" + n, a, b)
                    w_rows = await outer_in.rows("master/" + n, a, b) if keep else None
                    if m_rows is None or (keep and w_rows is None):
                        return None
                    mom = m_rows.tensor
                    master = None if w_rows is None else w_rows.tensor
                state.momentum[n] = _Buf("F32", mom.shape, mom.buffer)
                if state.master is not None:
                    assert master is not None
                    state.master[n] = _Buf("F32", master.shape, master.buffer)
        finally:
            self.bytes_down += theta_in.bytes + (outer_in.bytes if outer_in else 0)
        return state

    async def _step(self, alg: Algorithm, fragment: int, state: _State, round_: int,
                    step: StepRef) -> bool:
        reader = await self._open(step.payload)
        if reader is None:
            return False
        try:
            for n in state.theta:
                d = await self._delta_rows(reader, n, step.format)
                if d is None:
                    return False
                await asyncio.to_thread(self._apply_rows, alg, fragment, state, n, d, step.rule)
        finally:
            self.bytes_down += reader.bytes
        state.version += 1
        return True

    async def _delta_rows(self, reader: _Reader, name: str, fmt: str) -> TensorBytes | None:
        """This rank's rows of the step's Δ of `name`, in F32 (dequantized exactly)."""
        a, b = self.rows[name]
        if fmt == "F4":
            # Blocks of 32 elements: rows that start and end on a block boundary are read
            # with their blocks' scales; otherwise the tensor whole, then its rows.
            shape = reader.shape(name)
            per_row, rows = math.prod(shape[1:]), shape[0] if shape else 1
            if reader.ranged and (a * per_row) % 32 == 0 and \
                    ((b * per_row) % 32 == 0 or b == rows):
                codes = await reader.rows(name, a, b)
                scale = await reader.rows(scale_name(name), a * per_row // 32,
                                          -(-b * per_row // 32))
                if codes is None or scale is None:
                    return None
                return dequantize({name: codes.tensor, scale_name(name): scale.tensor}, name,
                                  fmt, key=reader.key)
            whole = await reader.whole(name)
            scales = await reader.whole(scale_name(name))
            if whole is None or scales is None:
                return None
            full = dequantize({name: whole, scale_name(name): scales}, name, fmt,
                              key=reader.key)
            return rows_of(full, a, b).tensor
        got = await reader.rows(name, a, b)
        if got is None:
            return None
        if fmt == "F32":
            return got.tensor
        entries = {name: got.tensor}
        if fmt != "BF16":
            s = await reader.whole(scale_name(name))
            if s is None:
                return None
            entries[scale_name(name)] = s
        return dequantize(entries, name, fmt, key=reader.key)

    def _apply_rows(self, alg: Algorithm, fragment: int, state: _State, name: str,
                    delta: TensorBytes, rule: str) -> None:
        """The step on this rank's rows of `name`, a chunk of rows at a time, written back
        in place: `apply_step` on a slice is the same slice of `apply_step` on the whole."""
        th = state.theta[name]
        mo = state.momentum[name]
        ma = None if state.master is None else state.master[name]
        per_row = max(mo.row_bytes, 1)
        chunk = max(1, CHUNK_BYTES // per_row)
        d = np.frombuffer(delta.buffer, np.uint8)
        for r0 in range(0, th.rows, chunk):
            r1 = min(th.rows, r0 + chunk)
            one = FragmentState(fragment, state.version, {name: th.view(r0, r1)},
                                None if ma is None else {name: ma.view(r0, r1)},
                                {name: mo.view(r0, r1)})
            piece = d[r0 * mo.row_bytes : r1 * mo.row_bytes]
            piece.flags.writeable = False
            dd = TensorBytes("F32", one.theta[name].shape, piece)
            new = alg.apply_step(one, {name: dd}, "F32", rule, self._backend)
            th.write(r0, new.theta[name])
            mo.write(r0, new.momentum[name])
            if ma is not None:
                # A tensor of F32 alone keeps no master apart: its theta is the master.
                ma.write(r0, (new.master or new.theta)[name])


def _algorithm(obj: Mapping[str, Any]) -> Algorithm:
    from gradientmail.algorithms.registry import algorithm_from_json

    return algorithm_from_json(dict(obj))
