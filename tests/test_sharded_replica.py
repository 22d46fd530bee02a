"""A rank's rows of a fragment's state, replayed commit by commit (`ShardedReplica`), equal
byte for byte the same rows of the whole state that an unsharded `Replica` computes: for
every step format, for ranks holding few rows, one row or none, from a checkpoint, from
Θ⁰ and from the version held. A run is written by hand on a MemoryMailbox and closed by
a `Syncer`, as in tests/test_syncer.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import numpy as np
import pytest

from gradientmail.adapters.sharded import chunk_rows
from gradientmail.algorithms.base import FragmentState
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.backends.numpy_backend import NumpyBackend
from gradientmail.errors import GradientmailError
from gradientmail.mailbox import MemoryMailbox
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.run import sharded_replica
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import state_at
from gradientmail.run.sharded_replica import ShardedReplica, plan_chain
from gradientmail.syncer.runtime import CloserSettings, Syncer
from gradientmail.testing import FakeClock
from gradientmail.wire.compression import decode
from gradientmail.wire.records import Manifest, RoundRecord
from gradientmail.wire.serialization import ParameterSpec, Schema
from gradientmail.wire.sharded_ranges import Rows, rows_of
from gradientmail.wire.tensor_bytes import TensorBytes

#: Odd row counts, a BF16 tensor (the fragment keeps an fp32 master), a 0-d scalar;
#: "wide" has rows of 32 elements: its F4 blocks end at every row, so ranks read its rows.
SCHEMA = Schema((ParameterSpec("emb", "F32", (7, 6)), ParameterSpec("w", "BF16", (5, 3)),
                 ParameterSpec("b", "F32", (3,)), ParameterSpec("s", "F32", ()),
                 ParameterSpec("wide", "F32", (5, 32))))
ROUNDS = 5
RANKS = 3


def tensors(seed: int, scale: float = 1.0, *, f32: bool = False) -> dict[str, TensorBytes]:
    """Random tensors of the schema's shapes, in its dtypes (or all F32: a delta)."""
    rng = np.random.default_rng(seed)
    out = {}
    for p in SCHEMA.params:
        t = TensorBytes.from_numpy((scale * rng.standard_normal(p.shape)).astype(np.float32))
        out[p.name] = t if f32 or p.dtype == "F32" else NumpyBackend().load(t).to_bytes(p.dtype)
    return out


async def make_run(ex: Exchange, commit_dtype: str | None) -> tuple[Manifest, list[RoundRecord]]:
    alg = DiLoCo(4, 1, in_flight=1, overlap_steps=None, quorum_size=1, merge=WeightedMean(),
                 checkpoint_every=3, commit_dtype=commit_dtype)
    plan = alg.plan(SCHEMA)
    init = tensors(1)
    ref = await ex.put_init(0, {n: init[n] for n in plan[0]}, attempt=0)
    manifest = Manifest(SCHEMA, plan, alg.to_json(), "creator", (ref,), "off")
    assert await ex.create_manifest(manifest)
    # Closed through `ex`, so that its codec is the commits' too.
    syncer = Syncer(ex, closer_id="closer", on_event=lambda e: None,
                    settings=CloserSettings(keep_versions=10, sweep=False))
    for r in range(ROUNDS):
        delta = tensors(100 + r, 0.05, f32=True)
        await ex.publish(r, "a", delta, fragment=0, base_version=r, local_step=4 * (r + 1),
                         steps=4, tokens=64, final=False, schema_digest=SCHEMA.digest(),
                         delta_format="F32")
        assert await syncer.poll(live=frozenset({"a"}))
    return manifest, await ex.rounds_after(-1)


def rank_rows(k: int) -> dict[str, tuple[int, int]]:
    return {p.name: chunk_rows(p.shape[0], RANKS, k) if p.shape else (0, 1)
            for p in SCHEMA.params}


def rows_equal(mine: Mapping[str, TensorBytes], whole: Mapping[str, TensorBytes],
               rows: Mapping[str, tuple[int, int]], what: str) -> None:
    for n, t in mine.items():
        want = rows_of(whole[n], *rows[n]).tensor
        assert (t.dtype, t.shape) == (want.dtype, want.shape), (what, n)
        assert bytes(t.buffer) == bytes(want.buffer), (what, n)


def same_state(mine: FragmentState, whole: FragmentState,
               rows: Mapping[str, tuple[int, int]]) -> None:
    assert mine.version == whole.version
    rows_equal(mine.theta, whole.theta, rows, "theta")
    rows_equal(mine.momentum, whole.momentum, rows, "momentum")
    assert (mine.master is None) == (whole.master is None)
    if mine.master is not None and whole.master is not None:
        rows_equal(mine.master, whole.master, rows, "master")


@pytest.mark.parametrize("commit_dtype", [None, "BF16", "F8_E4M3", "F4"])
def test_each_ranks_replayed_rows_equal_the_whole_replicas_rows(
        commit_dtype: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharded_replica, "CHUNK_BYTES", 8)  # a row or two per apply_step

    async def main() -> None:
        box = MemoryMailbox(f"rows-{commit_dtype}")
        ex = Exchange(box, clock=FakeClock(100.0))
        manifest, recs = await make_run(ex, commit_dtype)
        assert [r.checkpoint for r in recs] == [False, False, True, False, False]
        for k in range(RANKS):
            rows = rank_rows(k)
            follower = ShardedReplica(ex, rows)
            for rec in [None, *recs]:  # joined at Θ⁰, then commit by commit
                got: dict[str, Rows] = {}

                async def each(name: str, r: Rows, got: dict[str, Rows] = got) -> None:
                    got[name] = r

                chain = await plan_chain(ex, manifest, 0, rec, follower.held(0))
                # Every commit carries its step, a checkpoint too: the held version + 1.
                assert chain.steps == (() if rec is None else ((rec.round, rec.step),))
                assert await follower.reach(chain, each)
                whole = await state_at(ex, 0, rec, manifest)
                mine = follower.state(0)
                assert mine is not None
                same_state(mine, whole, rows)
                rows_equal({n: r.tensor for n, r in got.items()}, whole.theta, rows, "out")
            # A rank that joins late: from the checkpoint (version 3), then the steps.
            late = ShardedReplica(ex, rows)
            chain = await plan_chain(ex, manifest, 0, recs[-1], None)
            assert (chain.base_version, len(chain.steps)) == (3, 2)

            async def nothing(name: str, r: Rows) -> None:
                pass

            assert await late.reach(chain, nothing)
            mine = late.state(0)
            assert mine is not None
            same_state(mine, await state_at(ex, 0, recs[-1], manifest), rows)

    asyncio.run(main())


def test_a_rank_reads_only_its_rows_and_a_wrong_held_version_is_refused() -> None:
    async def main() -> None:
        box = CountingMailbox(MemoryMailbox("rows-bytes"))
        ex = Exchange(box, clock=FakeClock(100.0))
        manifest, recs = await make_run(ex, None)
        rows = {"emb": (0, 1), "w": (4, 5), "b": (2, 3), "s": (0, 1), "wide": (1, 2)}
        follower = ShardedReplica(ex, rows)

        async def nothing(name: str, r: Rows) -> None:
            pass

        for rec in [None, *recs[:2]]:
            chain = await plan_chain(ex, manifest, 0, rec, follower.held(0))
            assert await follower.reach(chain, nothing)
        # Θ⁰ and two F32 steps, one row of each tensor rounded out to whole blocks of
        # it: every tensor here is smaller than a 32 KiB block, so its rows cost it whole
        # (tests/test_sharded_blocks.py reads rows of tensors of many blocks).
        assert follower.bytes_down == 168 + 30 + 12 + 4 + 640 + 2 * (168 + 60 + 12 + 4 + 640)
        stale = await plan_chain(ex, manifest, 0, recs[0], 0)  # this rank holds 2
        assert (stale.theta, stale.base_version) == (None, 0)
        with pytest.raises(GradientmailError, match="holds version 2 of fragment 0, not 0"):
            await follower.reach(stale, nothing)
        assert follower.held(0) is None  # dropped: the next chain starts from a checkpoint

    asyncio.run(main())


def test_a_rank_reading_zstd_payloads_whole_warns_once_naming_the_codec_and_the_fix(
        caplog: pytest.LogCaptureFixture) -> None:
    # No range of a zstd frame decodes alone: a rank downloads each payload whole for its
    # rows, and says so once; a rank holding every row (a DDP learner) reads no more than
    # it needs, and says nothing.
    mine = rank_rows(1)
    every = {p.name: (0, p.shape[0] if p.shape else 1) for p in SCHEMA.params}

    async def main() -> tuple[Manifest, list[RoundRecord], ShardedReplica, ShardedReplica,
                              dict[str, TensorBytes]]:
        ex = Exchange(MemoryMailbox("rows-zstd"), clock=FakeClock(100.0), compression="zstd")
        manifest, recs = await make_run(ex, None)
        follower, whole = ShardedReplica(ex, mine), ShardedReplica(ex, every)
        for replica in (follower, whole):
            for rec in [None, *recs]:
                chain = await plan_chain(ex, manifest, 0, rec, replica.held(0))
                assert await replica.reach(chain, nothing)
        state = follower.state(0)
        assert state is not None
        same_state(state, await state_at(ex, 0, recs[-1], manifest), mine)
        blob = await ex.store.fetch_payload(manifest.init[0])
        assert blob is not None
        return manifest, recs, follower, whole, decode(blob, "zstd")

    async def nothing(name: str, r: Rows) -> None:
        pass

    with caplog.at_level(logging.WARNING, logger="gradientmail.run"):
        manifest, recs, follower, whole, init = asyncio.run(main())
    # Θ⁰ and each commit's step, every one read whole, by both.
    keys = [manifest.init[0].key, *(r.step.payload.key for r in recs if r.step is not None)]
    assert len(keys) == 1 + ROUNDS and all(k.endswith(".safetensors.zst") for k in keys)
    read = manifest.init[0].size + sum(r.step.payload.size for r in recs if r.step)
    assert follower.bytes_down == follower.bytes_whole == read
    assert whole.bytes_down == read and whole.bytes_whole == 0
    # Reported once, at the first payload (Θ⁰), with what the rank read and needed of it.
    warnings = [r for r in caplog.records if r.name == "gradientmail.run"]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    decoded = sum(t.nbytes for t in init.values())
    rows = sum(rows_of(t, *mine[n]).tensor.nbytes for n, t in init.items())
    assert rows < manifest.init[0].size and rows < decoded
    assert warnings[0].getMessage() == (
        f"{keys[0]} is zstd-compressed, and no range of a zstd frame decodes alone: this "
        f"rank downloaded all {manifest.init[0].size:,} bytes of it ({decoded:,} decoded) "
        f"for {rows:,} bytes of its rows, and every rank of this sharded learner reads "
        "every compressed payload whole. Set compression: \"off\" on every learner of "
        "the run (their closers write the commits; recipes/gpt2-xl.yaml does), so that "
        "each rank downloads its rows alone (reported once; ShardedReplica.bytes_whole counts "
        "these bytes)")
