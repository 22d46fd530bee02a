"""Θ⁰ in parts (docs/design/sharded.md §3): a creator whose ranks each hold a shard uploads its
rows of each fragment's Θ⁰ as `init/<attempt>/<fragment>/<k>-of-<n><ext>`, and the
manifest names them (`Manifest.init_parts`, `init[p]` None).

The manifest's two shapes and their bytes (an older manifest keeps its bytes and reads
as before); the keys, never swept; every reader of Θ⁰ reading the parts: a whole reader
(`Replica`, `read_committed`), ranks reading their own rows under another layout
(`ShardedReplica`, replicated outer step or not), the closer's first merge of each fragment
(byte for byte the commits of the same run created with one payload per fragment), and
`gradientmail verify`. A learner whose ranks create the run: tests/test_sharded_ranks.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from test_sharded_replica import RANKS, SCHEMA, make_run, rank_rows, rows_equal, same_state, tensors
from test_syncer import SCHEMA as SMALL
from test_syncer import Run, init_tensors
from test_verify import audited, statuses, verify

from gradientmail.adapters.sharded import chunk_rows
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.app.cli import read_status
from gradientmail.errors import LocalProtocolError, RemoteProtocolError, SchemaMismatch
from gradientmail.mailbox import Mailbox, MemoryMailbox
from gradientmail.run.committed import read_committed
from gradientmail.run.keyspace import init_key, init_part_key, plan_sweep
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import state_at
from gradientmail.run.sharded_replica import ShardedReplica, plan_chain
from gradientmail.testing import FakeClock
from gradientmail.wire.compression import decode_with_metadata
from gradientmail.wire.records import Manifest, RoundRecord
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.serialization import Schema
from gradientmail.wire.sharded_parts import ROWS_KEY
from gradientmail.wire.sharded_ranges import Rows, rows_of
from gradientmail.wire.tensor_bytes import TensorBytes

A, B, C = "a" * 64, "b" * 64, "c" * 64


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def boxes() -> Iterator[tuple[Mailbox, Mailbox]]:
    names = ("init-parts-a", "init-parts-b")
    for n in names:
        MemoryMailbox.forget(n)
    yield MemoryMailbox(names[0]), MemoryMailbox(names[1])
    for n in names:
        MemoryMailbox.forget(n)


def owned(schema: Schema, names: tuple[str, ...], k: int, n: int) -> dict[str, tuple[int, int]]:
    """Rank k of n's owned rows, as `ShardedAdapter.mailed` gives them: `torch.chunk`'s
    split, a 0-d tensor from rank 0 alone."""
    out = {}
    for name in names:
        shape = schema[name].shape
        if shape:
            out[name] = chunk_rows(shape[0], n, k)
        elif k == 0:
            out[name] = (0, 1)
    return out


async def put_parts(ex: Exchange, schema: Schema, plan: tuple[tuple[str, ...], ...],
                    init: Mapping[str, TensorBytes], ranks: Sequence[int], *,
                    attempt: int = 0) -> tuple[tuple[PayloadRef | None, ...],
                                               tuple[tuple[PayloadRef, ...], ...]]:
    """Θ⁰ of fragment p as `ranks[p]` parts (each rank's owned rows), or as one payload
    where `ranks[p]` is 0: the manifest's `init` and `init_parts`."""
    refs: list[PayloadRef | None] = []
    parts: list[tuple[PayloadRef, ...]] = []
    for p, (names, n) in enumerate(zip(plan, ranks, strict=True)):
        if not n:
            refs.append(await ex.put_init(p, {m: init[m] for m in names}, attempt=attempt))
            parts.append(())
            continue
        mine = []
        for k in range(n):
            rows = owned(schema, names, k, n)
            mine.append(await ex.put_init_part(
                p, k, n, {m: rows_of(init[m], a, b).tensor for m, (a, b) in rows.items()},
                rows, attempt=attempt))
        refs.append(None)
        parts.append(tuple(mine))
    return tuple(refs), tuple(parts)


# -- the manifest ---------------------------------------------------------------------------

PLAN = (("w",), ("b",))
OLD = Manifest(SMALL, PLAN, {"name": "diloco"}, "node-1",
               (PayloadRef("init/000000/0.safetensors", 123, A),
                PayloadRef("init/000000/1.safetensors", 123, B)), "off")
PARTED = dataclasses.replace(
    OLD, init=(None, OLD.init[1]),
    init_parts=((PayloadRef("init/000000/0/0-of-2.safetensors", 60, A),
                 PayloadRef("init/000000/0/1-of-2.safetensors", 61, C)), ()))


def test_a_manifest_with_init_parts_has_these_bytes_and_reads_back() -> None:
    data = PARTED.encode()
    assert data == (
        b'{"algorithm":{"name":"diloco"},"codec":"off","creator":"node-1","init":[null,'
        b'{"key":"init/000000/1.safetensors","sha256":"' + B.encode() + b'","size":123}],'
        b'"init_parts":[[{"key":"init/000000/0/0-of-2.safetensors","sha256":"'
        + A.encode() + b'","size":60},{"key":"init/000000/0/1-of-2.safetensors","sha256":"'
        + C.encode() + b'","size":61}],[]],"key_fingerprint":null,"plan":[["w"],["b"]],'
        b'"schema":' + json.dumps(SMALL.to_dict(), sort_keys=True,
                                   separators=(",", ":")).encode() + b',"v":1}'
    )
    back = Manifest.decode(data, "manifest.json")
    assert back == PARTED
    assert back.init_refs(0) == PARTED.init_parts[0] and back.init_size(0) == 121
    assert back.init_refs(1) == (OLD.init[1],) and back.init_size(1) == 123


def test_a_manifest_without_parts_keeps_its_bytes_and_reads_as_before() -> None:
    body = json.loads(OLD.encode())
    assert "init_parts" not in body  # an older reader's exact field set
    back = Manifest.decode(OLD.encode(), "manifest.json")
    assert back == OLD and back.init_parts == ()
    assert back.init_refs(0) == (OLD.init[0],) and back.init_size(1) == 123


def test_each_fragment_has_one_payload_or_parts_never_both_nor_neither() -> None:
    with pytest.raises(LocalProtocolError, match="fragment 1's Θ⁰ must be one payload"):
        dataclasses.replace(PARTED, init=(None, None))
    with pytest.raises(LocalProtocolError, match="fragment 0's Θ⁰ must be one payload"):
        dataclasses.replace(PARTED, init=OLD.init)
    with pytest.raises(LocalProtocolError, match="init_parts has 1 lists"):
        dataclasses.replace(PARTED, init_parts=PARTED.init_parts[:1])
    with pytest.raises(LocalProtocolError, match=r"need one per fragment .* and some part"):
        dataclasses.replace(OLD, init_parts=((), ()))
    body = json.loads(PARTED.encode())
    # A null payload in a manifest without parts (what no creator writes).
    no_parts = {k: v for k, v in body.items() if k != "init_parts"}
    with pytest.raises(RemoteProtocolError, match=r"field 'init\[0\]'"):
        Manifest.decode(json.dumps(no_parts).encode(), "manifest.json")
    with pytest.raises(RemoteProtocolError, match="fragment 1's Θ⁰ must be one payload"):
        Manifest.decode(json.dumps(dict(body, init=[None, None])).encode(), "manifest.json")
    with pytest.raises(RemoteProtocolError, match=r"init_parts\[0\]' must be an array"):
        Manifest.decode(json.dumps(dict(body, init_parts=[{}, []])).encode(), "manifest.json")


def test_init_part_keys_sit_beside_the_whole_payloads_and_are_never_swept() -> None:
    assert init_key(1, 3) == "init/000001/3"
    assert init_part_key(1, 3, 0, 2) == "init/000001/3/0-of-2"
    with pytest.raises(LocalProtocolError, match="part 2 of 2"):
        init_part_key(1, 3, 2, 2)
    ref = PayloadRef("theta/0/0000000009-000000.safetensors", 1, C)
    from gradientmail.wire.estimates import Estimates

    latest = {0: RoundRecord(round=20, fragment=0, version=9, theta=ref, outer=ref,
                             update=None, participants=(), estimates=Estimates(),
                             mean_cosine=None, dropped=(), closer="s", all_final=False)}
    keys = ["init/000000/0/0-of-2.safetensors", "init/000000/0/1-of-2.safetensors",
            "init/000000/0.safetensors"]
    assert plan_sweep(keys, latest, keep_versions=1) == []


# -- readers of Θ⁰ --------------------------------------------------------------------------


def test_a_whole_reader_joins_the_parts_to_theta0_and_refuses_parts_that_do_not_tile(
        boxes: tuple[Mailbox, Mailbox]) -> None:
    async def main() -> None:
        ex = Exchange(boxes[0])
        plan = ("emb", "w", "b", "s", "wide")
        plan_t = (plan,)
        init = tensors(1)
        refs, parts = await put_parts(ex, SCHEMA, plan_t, init, [3])
        alg = DiLoCo(4, 1, in_flight=1, merge=WeightedMean())
        m = Manifest(SCHEMA, plan_t, alg.to_json(), "c", refs, "off", init_parts=parts)
        assert [ref.key for ref in m.init_parts[0]] == [
            f"init/000000/0/{k}-of-3.safetensors" for k in range(3)]
        # Each part holds rank k's rows in the schema's dtypes, named in its metadata.
        blob = await ex.store.fetch_payload(m.init_parts[0][1])
        entries, meta = decode_with_metadata(blob, "off")
        assert json.loads(meta[ROWS_KEY]) == {n: list(r) for n, r in
                                              owned(SCHEMA, plan, 1, 3).items()}
        assert entries["w"].dtype == "BF16" and entries["w"].shape == (2, 3)
        got = await ex.fetch_init(m, 0)
        assert got == {n: init[n] for n in plan}
        assert (await state_at(ex, 0, None, m)).theta == got
        # Two parts that miss rows of a tensor: refused, naming it.
        bad = dataclasses.replace(m, init_parts=(m.init_parts[0][:2],))
        with pytest.raises(SchemaMismatch, match="parts do not tile 'emb'"):
            await ex.fetch_init(bad, 0)
        # A part gone: no Θ⁰, and a reader says which.
        await ex.mailbox.delete(m.init_parts[0][2].key)
        assert await ex.fetch_init(m, 0) is None
        with pytest.raises(RemoteProtocolError, match="an init payload of fragment 0 is gone"):
            await state_at(ex, 0, None, m)

    run(main())


async def _parted_copy(src: Exchange, dst: Exchange, manifest: Manifest, n: int) -> Manifest:
    """`manifest`'s run, its Θ⁰ uploaded to `dst` in n parts per fragment instead."""
    init = {}
    for p in range(len(manifest.plan)):
        got = await src.fetch_init(manifest, p)
        assert got is not None
        init.update(got)
    refs, parts = await put_parts(dst, manifest.schema, manifest.plan, init,
                                  [n] * len(manifest.plan))
    out = dataclasses.replace(manifest, init=refs, init_parts=parts)
    assert await dst.create_manifest(out)
    return out


@pytest.mark.parametrize("checkpoint_every", [1, 3], ids=["rows", "replicated"])
def test_ranks_of_another_layout_read_their_rows_of_theta0_from_the_parts(
        boxes: tuple[Mailbox, Mailbox], checkpoint_every: int) -> None:
    """Θ⁰ uploaded by 2 ranks, read by each of 3 (one row, or none, of some tensors), at
    version 0 and, with a replicated outer step, replayed from it to every version."""
    async def main() -> None:
        whole_ex = Exchange(boxes[0], clock=FakeClock(100.0))
        manifest, recs = await make_run(whole_ex, None)
        if checkpoint_every == 1:
            alg = {k: v for k, v in manifest.algorithm.items() if k != "checkpoint_every"}
            manifest = dataclasses.replace(manifest, algorithm=alg)
            recs = []
        ex = Exchange(boxes[1], clock=FakeClock(100.0))
        parted = await _parted_copy(whole_ex, ex, manifest, 2)
        for key in await boxes[0].list(""):  # the same commits, over Θ⁰ in parts
            if key.startswith(("rounds/", "theta/", "outer/", "steps/")):
                data = await boxes[0].get(key)
                assert data is not None
                await boxes[1].create(key, data)
        for k in range(RANKS):
            rows = rank_rows(k)
            # Versions 0, 1 and 2 (version 3 is a checkpoint of its own).
            for rec in [None, *recs[:2]]:
                follower = ShardedReplica(ex, rows)  # joining: from Θ⁰ and the steps since
                got: dict[str, Rows] = {}

                async def each(name: str, r: Rows, got: dict[str, Rows] = got) -> None:
                    got[name] = r

                chain = await plan_chain(ex, parted, 0, rec, None)
                assert chain.theta is None and chain.theta_parts == parted.init_parts[0]
                assert len(chain.steps) == (0 if rec is None else rec.version)
                assert await follower.reach(chain, each)
                whole = await state_at(whole_ex, 0, rec, manifest)
                assert [(r.start, r.stop) for r in got.values()] == [rows[n] for n in got]
                rows_equal({n: r.tensor for n, r in got.items()}, whole.theta, rows, "theta")
                mine = follower.state(0)
                assert (mine is None) == (checkpoint_every == 1)
                if mine is not None:
                    same_state(mine, whole, rows)
        # Parts that leave rows out: refused by the rank that needs them, naming them.
        async def nothing(name: str, r: Rows) -> None:
            pass

        for kept, needle in ((0, r"rows \[6, 7\) of 'emb' are in no part"),
                             (1, r"init/000000/0/: the parts do not tile 'b': rows \[\[2, 3\]\]")):
            one = dataclasses.replace(parted, init_parts=((parted.init_parts[0][kept],),))
            chain = await plan_chain(ex, one, 0, None, None)
            with pytest.raises(RemoteProtocolError, match=needle):
                await ShardedReplica(ex, rank_rows(2)).reach(chain, nothing)

    run(main())


@pytest.mark.parametrize("checkpoint_every", [1, 2], ids=["theta", "replicated"])
def test_the_closer_merges_from_theta0_in_parts_as_from_one_payload_and_verify_passes(
        boxes: tuple[Mailbox, Mailbox], checkpoint_every: int) -> None:
    """Two fragments, w (2 rows) in 2 parts and b (3 rows) in 4, the last empty; each
    fragment's first merge from Θ⁰ and the rounds after, swept as a run sweeps: the
    commits are byte for byte those of the same run created with one payload per
    fragment, and every round verifies."""
    alg = audited(checkpoint_every=checkpoint_every)

    async def close(box: Mailbox, parted: bool) -> list[tuple[str, ...]]:
        r = Run(box, alg)
        if parted:
            refs, parts = await put_parts(r.ex, SMALL, r.plan, init_tensors(), [2, 4])
            m = Manifest(SMALL, r.plan, alg.to_json(), "creator", refs, "off",
                         init_parts=parts)
            assert await r.ex.create_manifest(m)
        else:
            await r.create()
        s = r.syncer(sweep=True)
        for rnd in range(4):
            for learner in ("a", "b"):
                await r.contribute(rnd, learner)
            assert await s.poll(live=frozenset({"a", "b"}))
        recs = await r.records()
        assert [len(rec.participants) for rec in recs] == [2, 2, 2, 2]
        return [tuple(ref.sha256 for ref in rec.payload_refs()) for rec in recs]

    parted = run(close(boxes[1], True))
    assert parted == run(close(boxes[0], False))
    report = verify(boxes[1])
    assert report.ok and statuses(report) == ["verified"] * 4
    keys = run(boxes[1].list("init/"))
    assert keys == [f"init/000000/0/{k}-of-2.safetensors" for k in range(2)] + \
        [f"init/000000/1/{k}-of-4.safetensors" for k in range(4)]  # never swept
    a, b = read_committed(boxes[0]), read_committed(boxes[1])
    assert a.tensors == b.tensors and a.versions == b.versions == (2, 2)


def test_read_committed_and_status_before_any_commit_read_theta0_from_the_parts(
        boxes: tuple[Mailbox, Mailbox]) -> None:
    """Fragment 0 in 2 parts, fragment 1 one payload: `read_committed` (and so `export`)
    gives Θ⁰, `status` the bytes of each fragment's Θ⁰, every part counted."""
    async def main() -> None:
        r = Run(boxes[0], audited())
        init = init_tensors()
        refs, parts = await put_parts(r.ex, SMALL, r.plan, init, [2, 0])
        m = Manifest(SMALL, r.plan, r.alg.to_json(), "creator", refs, "off",
                     init_parts=parts)
        assert await r.ex.create_manifest(m)
        status = await read_status(r.ex, "test-run")
        assert refs[0] is None and refs[1] is not None
        assert [f["theta_bytes"] for f in status["fragments"]] == [
            sum(ref.size for ref in parts[0]), refs[1].size]

    run(main())
    got = read_committed(boxes[0])
    assert got.round == -1 and got.versions == (0, 0)
    assert dict(got.tensors) == init_tensors()
