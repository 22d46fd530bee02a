"""Contributions made of parts (docs/design/sharded.md §3): each of a learner's ranks uploads its
rows of the fragment as `parts/<round>/<learner>/<k>-of-<n><ext>`, and one record names
them all.

The record's two shapes (one payload, or parts) and their bytes; the part keys and their
sweep; the closer merging a contribution of parts to exactly the bytes it merges from the
same delta whole; every way parts can fail to tile a tensor dropped with its reason; and
`gradientmail verify` re-deriving rounds that merged parts, quantized ones included.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from test_syncer import SCHEMA, Run, algorithm, delta
from test_verify import audited, statuses, verify

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Rda, WeightedMean
from gradientmail.errors import AlreadyContributed, LocalProtocolError, RemoteProtocolError
from gradientmail.events import ContributionDropped
from gradientmail.mailbox import Mailbox, MemoryMailbox
from gradientmail.run.keyspace import part_key, plan_sweep
from gradientmail.run.protocol import Exchange
from gradientmail.wire.quantization import dequantize, quantize
from gradientmail.wire.records import SnapshotRecord
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.sharded_parts import ROWS_KEY
from gradientmail.wire.sharded_pieces import RowPieces
from gradientmail.wire.sharded_ranges import rows_of
from gradientmail.wire.sparse import SPARSE_FORMATS, densify, sparsify
from gradientmail.wire.tensor_bytes import TensorBytes

#: Rows of each tensor of SCHEMA (w: 2 rows, b: 3) per part, for two ranks.
TWO_RANKS = [{"w": (0, 1), "b": (0, 2)}, {"w": (1, 2), "b": (2, 3)}]
#: The density of sparse parts: 2 values a chunk.
DENSITY = 2 / 4096


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def mailboxes() -> Iterator[tuple[Mailbox, Mailbox]]:
    names = ("parts-test-a", "parts-test-b")
    for n in names:
        MemoryMailbox.forget(n)
    yield MemoryMailbox(names[0]), MemoryMailbox(names[1])
    for n in names:
        MemoryMailbox.forget(n)


def record(**changes: Any) -> SnapshotRecord:
    ref = PayloadRef("parts/0000000003/x/0-of-1.safetensors", 10, "a" * 64)
    fields: dict[str, Any] = dict(
        learner="x", round=3, fragment=0, base_version=1, local_step=9, steps=3, tokens=30,
        final=False, schema_digest="b" * 64, delta_format="F32", payload=None, parts=(ref,))
    fields.update(changes)
    return SnapshotRecord(**fields)


async def publish_parts(ex: Exchange, r: int, learner: str, full: Mapping[str, TensorBytes],
                        cuts: Sequence[Mapping[str, tuple[int, int]]], *, fragment: int = 0,
                        base_version: int | None = None, fmt: str = "F32",
                        tokens: int = 64) -> SnapshotRecord:
    """`learner`'s delta `full` uploaded as one part per entry of `cuts` (its rows of each
    tensor), then its record; F8/F4 parts quantized each on its own, sparse ones
    sparsified each on its own (at `DENSITY`)."""
    refs = []
    for k, rows in enumerate(cuts):
        entries: dict[str, TensorBytes] = {}
        for name, (a, b) in rows.items():
            shape = full[name].shape
            piece = rows_of(full[name], a, b).tensor if b <= shape[0] else \
                TensorBytes.from_numpy(np.zeros((b - a, *shape[1:]), np.float32))  # a liar
            entries.update({name: piece} if fmt == "F32" else
                           sparsify(name, piece, DENSITY, fmt) if fmt in SPARSE_FORMATS
                           else quantize(name, piece, fmt))
        refs.append(await ex.put_part(r, learner, k, len(cuts), entries, rows))
    draft = ex.draft(r, learner, fragment=fragment,
                     base_version=r if base_version is None else base_version,
                     local_step=4 * r + 4, steps=4, tokens=tokens, final=False,
                     schema_digest=SCHEMA.digest(), delta_format=fmt)
    return await ex.publish_parts(draft, refs)


# -- the record ---------------------------------------------------------------------------


def test_a_record_of_parts_writes_parts_and_no_payload_field_and_reads_back() -> None:
    rec = record()
    body = json.loads(rec.encode())
    assert "payload" not in body and body["parts"] == [rec.parts[0].to_json()]
    assert SnapshotRecord.decode(rec.encode(), "k") == rec
    assert rec.payload_refs() == rec.parts and rec.payload_size == 10
    assert rec.payload_key == "parts/0000000003/x/"


def test_a_record_holds_one_payload_or_parts_never_both_nor_neither() -> None:
    ref = PayloadRef("payloads/0000000003/x.safetensors", 10, "a" * 64)
    with pytest.raises(LocalProtocolError, match="never both and never neither"):
        record(payload=ref)
    with pytest.raises(LocalProtocolError, match="never both and never neither"):
        record(parts=())
    body = json.loads(record().encode())
    both = dict(body, payload=ref.to_json())
    with pytest.raises(RemoteProtocolError, match="payload"):
        SnapshotRecord.decode(json.dumps(both).encode(), "k")
    with pytest.raises(RemoteProtocolError, match="at least one part"):
        SnapshotRecord.decode(json.dumps(dict(body, parts=[])).encode(), "k")


def test_part_keys_live_apart_from_payloads_and_are_swept_with_their_round() -> None:
    assert part_key(7, "node.3", 1, 2) == "parts/0000000007/node.3/1-of-2"
    with pytest.raises(LocalProtocolError):
        part_key(7, "x", 2, 2)
    latest = {0: dataclasses.replace(_round_record(), round=4)}
    keys = ["parts/0000000004/x/0-of-2.safetensors", "parts/0000000005/x/0-of-2.safetensors"]
    assert plan_sweep(keys, latest) == keys[:1]


def _round_record() -> Any:
    from gradientmail.wire.estimates import Estimates
    from gradientmail.wire.records import RoundRecord

    ref = PayloadRef("theta/0/0000000001-000000.safetensors", 1, "c" * 64)
    return RoundRecord(round=0, fragment=0, version=1, theta=ref, outer=ref, update=None,
                       participants=(), estimates=Estimates(), mean_cosine=None, dropped=(),
                       closer="s", all_final=False)


def test_parts_carry_their_rows_and_a_record_is_published_once(
        mailboxes: tuple[Mailbox, Mailbox]) -> None:
    async def main() -> None:
        ex = Exchange(mailboxes[0])
        full = delta(0, "a", ("w", "b"))
        rec = await publish_parts(ex, 0, "a", full, TWO_RANKS)
        assert [r.key for r in rec.parts] == [
            "parts/0000000000/a/0-of-2.safetensors", "parts/0000000000/a/1-of-2.safetensors"]
        blob = await mailboxes[0].get(rec.parts[1].key)
        assert blob is not None and f'"{ROWS_KEY}":"{{\\"b\\":[2,3],\\"w\\":[1,2]}}"' in \
            blob.decode("latin-1")
        assert (await ex.contributions(0)).records == (rec,)
        with pytest.raises(AlreadyContributed):
            await ex.put_part(0, "a", 0, 2, {}, {})
        with pytest.raises(AlreadyContributed):
            await ex.publish_parts(dataclasses.replace(rec), rec.parts)
        got = await ex.fetch_delta(rec, SCHEMA, ["w", "b"])
        assert got is not None and all(isinstance(t, RowPieces) for t in got.values())
        assert {n: t.joined() for n, t in got.items() if isinstance(t, RowPieces)} == full

    run(main())


def test_a_record_naming_parts_of_another_key_is_rejected(
        mailboxes: tuple[Mailbox, Mailbox]) -> None:
    async def main() -> None:
        ex = Exchange(mailboxes[0])
        rec = await publish_parts(ex, 0, "a", delta(0, "a", ("w", "b")), TWO_RANKS)
        liar = dataclasses.replace(rec, learner="b", parts=rec.parts[::-1])
        await mailboxes[0].create("snapshots/0000000000/b.json", liar.encode())
        found = await ex.contributions(0)
        assert found.records == (rec,)
        (bad,) = found.rejected
        assert "part 0 'parts/0000000000/a/1-of-2.safetensors'; its key says learner 'b', " \
               "round 0, part 0 'parts/0000000000/b/0-of-2'" in bad.reason

    run(main())


# -- the closer ---------------------------------------------------------------------------


#: Each round's cut of the sharded learner: 2 ranks, 3 ranks with an empty part, whole.
ROUND_CUTS = [TWO_RANKS, [{"w": (0, 0), "b": (0, 1)}, {"w": (0, 2), "b": (1, 2)},
                          {"w": (2, 2), "b": (2, 3)}], [{"w": (0, 2), "b": (0, 3)}]]


def as_merged(full: Mapping[str, TensorBytes], cuts: Sequence[Mapping[str, tuple[int, int]]],
              fmt: str) -> dict[str, TensorBytes]:
    """The F32 values a closer merges from `full` mailed in parts `cuts` in `fmt`: each
    part's rows quantized (or sparsified) on their own, decoded, side by side."""
    rows: dict[str, list[tuple[int, Any]]] = {n: [] for n in full}
    for part in cuts:
        for name, (a, b) in part.items():
            piece = rows_of(full[name], a, b).tensor
            if fmt in SPARSE_FORMATS:
                piece = densify(sparsify(name, piece, DENSITY, fmt), name, piece.shape, fmt)
            elif fmt != "F32":
                piece = dequantize(quantize(name, piece, fmt), name, fmt)
            rows[name].append((a, piece.to_numpy()))
    return {n: TensorBytes.from_numpy(np.concatenate([p for _, p in sorted(
        got, key=lambda x: x[0])]).astype(np.float32)) for n, got in rows.items()}


@pytest.mark.parametrize("fmt", ["F32", "F8_E4M3", "F4", *SPARSE_FORMATS])
def test_a_round_merges_parts_to_the_bytes_it_merges_from_the_same_delta_whole(
        fmt: str) -> None:
    async def close(mailbox: Mailbox, parted: bool, merge: Any) -> list[str]:
        r = Run(mailbox, DiLoCo(4, 1, in_flight=1, overlap_steps=None, quorum_size=3,
                                merge=merge))
        await r.create()
        s = r.syncer()
        for rnd in range(3):
            await r.contribute(rnd, "whole", tokens=40)
            full = delta(rnd, "sharded", ("w", "b"))
            if parted:
                rec = await publish_parts(r.ex, rnd, "sharded", full, ROUND_CUTS[rnd],
                                          tokens=90, fmt=fmt)
                # The closer reads the parts where they lie: a tensor cut in two or more
                # is never joined (`RowPieces`), one held by a single part is that part's;
                # quantized rows stay quantized, decoded by the merge a window at a time.
                got = await r.ex.fetch_delta(rec, SCHEMA, ("w", "b"))
                assert got is not None
                assert [type(got[n]) for n in ("w", "b")] == ([
                    [RowPieces, RowPieces], [TensorBytes, RowPieces],
                    [TensorBytes, TensorBytes]][rnd] if fmt in ("F32", *SPARSE_FORMATS)
                    else [RowPieces] * 2)
            else:
                await r.contribute(rnd, "sharded", tokens=90,
                                   tensors=as_merged(full, ROUND_CUTS[rnd], fmt))
            await r.contribute(rnd, "third", tokens=10)
            assert await s.poll(live=frozenset({"whole", "sharded", "third"}))
        recs = await r.records()
        assert [len(rec.participants) for rec in recs] == [3, 3, 3]
        return [ref.sha256 for rec in recs for ref in rec.payload_refs()]

    for i, merge in enumerate((WeightedMean(), Rda(direct_pattern=None))):
        boxes = [MemoryMailbox(f"parts-merge-{i}-{parted}") for parted in (0, 1)]
        try:
            assert run(close(boxes[1], True, merge)) == run(close(boxes[0], False, merge))
        finally:
            for parted in (0, 1):
                MemoryMailbox.forget(f"parts-merge-{i}-{parted}")


@pytest.mark.parametrize("cuts, reason", [
    ([{"w": (0, 1), "b": (0, 3)}, {"w": (1, 2)}], None),
    ([{"w": (0, 1), "b": (0, 2)}, {"w": (1, 2)}],
     "parts do not tile 'b': rows 2..3 are in no part"),
    ([{"w": (0, 2), "b": (0, 2)}, {"w": (1, 2), "b": (2, 3)}], "parts do not tile 'w': overlap"),
    ([{"w": (0, 1), "b": (0, 3)}, {"w": (1, 3)}], "rows [1, 3) of 'w' run past its shape"),
    ([{"w": (0, 2), "b": (0, 3), "x": (0, 1)}], "holds rows of ['x'], not in the fragment"),
])
def test_parts_that_do_not_tile_every_tensor_once_are_dropped_naming_why(
        mailboxes: tuple[Mailbox, Mailbox], cuts: list[dict[str, tuple[int, int]]],
        reason: str | None) -> None:
    async def main() -> None:
        r = Run(mailboxes[0], algorithm(fragments=1, quorum_size=2))
        await r.create()
        full = dict(delta(0, "p", ("w", "b")))
        full["x"] = TensorBytes.from_numpy(np.zeros((1,), np.float32))
        await publish_parts(r.ex, 0, "p", full, cuts, base_version=0)
        await r.contribute(0, "q")
        s = r.syncer()
        assert await s.poll(live=frozenset({"p", "q"}))
        rec = await r.ex.read_round(0)
        assert rec is not None
        if reason is None:
            assert [p.learner for p in rec.participants] == ["p", "q"]
            return
        assert [p.learner for p in rec.participants] == ["q"]
        (dropped,) = rec.dropped
        assert dropped.learner == "p" and reason in dropped.reason, dropped.reason
        (event,) = r.of(ContributionDropped)
        assert event.key == "parts/0000000000/p/"

    run(main())


def test_a_missing_part_drops_the_contribution_as_swept(
        mailboxes: tuple[Mailbox, Mailbox]) -> None:
    async def main() -> None:
        r = Run(mailboxes[0], algorithm(fragments=1, quorum_size=2))
        await r.create()
        rec = await publish_parts(r.ex, 0, "p", delta(0, "p", ("w", "b")), TWO_RANKS,
                                  base_version=0)
        await mailboxes[0].delete(rec.parts[1].key)
        await r.contribute(0, "q")
        assert await r.syncer().poll(live=frozenset({"p", "q"}))
        done = await r.ex.read_round(0)
        assert done is not None and [(d.learner, d.reason) for d in done.dropped] == [
            ("p", "payload swept")]

    run(main())


# -- verify -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["F32", "F8_E4M3", "F4", *SPARSE_FORMATS])
def test_rounds_that_merged_parts_verify(mailboxes: tuple[Mailbox, Mailbox], fmt: str) -> None:
    alg = audited(Rda(direct_pattern=None), delta_dtype=None if fmt == "F32" else fmt)

    async def main() -> None:
        r = Run(mailboxes[0], alg)
        await r.create()
        s = r.syncer()
        for rnd in range(4):
            names = r.plan[r.schedule.fragment_of(rnd)]
            for learner in ("a", "b"):
                full = delta(rnd, learner, names)
                cuts = [{n: v for n, v in rows.items() if n in names} for rows in TWO_RANKS]
                await publish_parts(r.ex, rnd, learner, full, cuts,
                                    fragment=r.schedule.fragment_of(rnd),
                                    base_version=rnd // 2, fmt=fmt)
            assert await s.poll(live=frozenset({"a", "b"}))
        assert all(len(rec.participants) == 2 for rec in await r.records())

    run(main())
    report = verify(mailboxes[0])
    assert report.ok and statuses(report) == ["verified"] * 4
