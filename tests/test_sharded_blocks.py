"""Block digests (`gradientmail.wire.sharded_blocks`): what a ranged reader of a payload checks.

A payload written for ranged readers carries the SHA-256 of every block of each tensor's
data in its header, and its ref the header's SHA-256. These tests read rows of such
payloads with `fetch_rows` and `ShardedReplica`, flip bytes inside and outside the rows read,
forge headers, read refs and payloads written without digests (older records), and check
the writers (`Exchange`) put digests exactly where ranged readers read.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_sharded_replica import make_run, rank_rows, same_state

from gradientmail.errors import ConfigError, CorruptPayload, RemoteProtocolError
from gradientmail.mailbox import FaultPlan, FaultyMailbox, MemoryMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import state_at
from gradientmail.run.sharded_part import PartBlob, put_init_blob
from gradientmail.run.sharded_replica import ShardedReplica, plan_chain
from gradientmail.testing import FakeClock
from gradientmail.wire.compression import decode_with_metadata, encode
from gradientmail.wire.records import Manifest, RoundRecord
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.serialization import ParameterSpec, pack, pack_header, read_index
from gradientmail.wire.sharded_blocks import (
    BLOCK_BYTES,
    BLOCKS_KEY,
    BlockIndex,
    blocks_entry,
    blocks_placeholder,
)
from gradientmail.wire.sharded_parts import part_metadata
from gradientmail.wire.sharded_ranges import Rows, fetch_rows, header_length, rows_of
from gradientmail.wire.tensor_bytes import TensorBytes

KEY = "theta/0/0000000001-000000.safetensors"
BLOCK = 64  # small blocks, so that every tensor here spans several


class Ranges(MemoryMailbox):
    """A memory mailbox that records the ranges read, and can hold bytes as given."""

    def __init__(self) -> None:
        super().__init__()
        self.ranges: list[tuple[int, int]] = []

    async def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        self.ranges.append((start, stop))
        return await super().get_range(key, start, stop)


def fragment() -> dict[str, TensorBytes]:
    rng = np.random.default_rng(7)
    return {
        "wte": TensorBytes("F32", (50, 4), rng.standard_normal((50, 4), "f4").tobytes()),
        "fc.weight": TensorBytes("BF16", (12, 10), rng.integers(0, 255, 240, "u1").tobytes()),
        "fc.bias": TensorBytes("BF16", (12,), rng.integers(0, 255, 24, "u1").tobytes()),
    }


def ref_of(blob: bytes, *, header: bool = True) -> PayloadRef:
    return PayloadRef.of(KEY, blob, header=header)


def read(box: MemoryMailbox, ref: PayloadRef, rows: dict[str, tuple[int, int]],
         blob: bytes | None = None) -> dict[str, Rows] | None:
    async def body() -> dict[str, Rows] | None:
        if blob is not None:
            await box.put(KEY, blob)
        return await fetch_rows(box, KEY, ref.size, rows, header_sha256=ref.header_sha256,
                                probe=16)
    return asyncio.run(body())


def flipped(blob: bytes, at: int) -> bytes:
    out = bytearray(blob)
    out[at] ^= 0x01
    return bytes(out)


def test_the_entry_is_the_sha256_of_each_block_of_each_tensor() -> None:
    tensors = fragment()
    entry = json.loads(blocks_entry(tensors, BLOCK))
    assert set(entry) == {"block", "sha256"} and entry["block"] == BLOCK
    raw = base64.b64decode(entry["sha256"])
    # Data order: F32 first, then BF16 by name; each tensor cut from its own first byte.
    want = b""
    for name in ("wte", "fc.bias", "fc.weight"):
        data = tensors[name].data
        want += b"".join(hashlib.sha256(data[i:i + BLOCK]).digest()
                         for i in range(0, len(data), BLOCK))
    assert raw == want
    assert len(raw) == 32 * (800 // 64 + 1 + 1 + 240 // 64 + 1)  # 13 + 1 + 4 blocks
    blob = encode(tensors, "off", blocks=BLOCK)
    tensors_back, meta = decode_with_metadata(blob, "off")
    assert tensors_back == tensors and meta == {BLOCKS_KEY: blocks_entry(tensors, BLOCK)}


def test_a_ranged_read_of_a_payload_with_digests_returns_the_same_rows() -> None:
    tensors = fragment()
    plain, digested = pack(tensors), encode(tensors, "off", blocks=BLOCK)
    for ranks in (2, 3, 5):
        for k in range(ranks):
            rows = {n: (t.shape[0] * k // ranks, t.shape[0] * (k + 1) // ranks)
                    for n, t in tensors.items()}
            want = {n: rows_of(tensors[n], a, b) for n, (a, b) in rows.items()}
            assert read(Ranges(), ref_of(plain, header=False), rows, plain) == want
            assert read(Ranges(), ref_of(digested), rows, digested) == want


def test_ranges_are_rounded_out_to_whole_blocks_of_the_tensor() -> None:
    tensors = fragment()
    blob = encode(tensors, "off", blocks=BLOCK)
    head = header_length(blob)
    spans = {s.name: s for s in read_index(blob)[0]}
    box = Ranges()
    # wte rows [17, 20): bytes [272, 320) of it, in block 4 ([256, 320)); fc.weight rows
    # [5, 7): bytes [100, 140), blocks 1 and 2 ([64, 192)); fc.bias whole: its one block.
    got = read(box, ref_of(blob), {"wte": (17, 20), "fc.weight": (5, 7), "fc.bias": (0, 12)},
               blob)
    assert got == {"wte": rows_of(tensors["wte"], 17, 20),
                   "fc.weight": rows_of(tensors["fc.weight"], 5, 7),
                   "fc.bias": rows_of(tensors["fc.bias"], 0, 12)}
    assert spans["wte"].start == head
    w, f, b = spans["wte"].start, spans["fc.weight"].start, spans["fc.bias"].start
    assert box.ranges == [(0, 16), (16, head), (w + 256, w + 320), (b, b + 24),
                          (f + 64, f + 192)]


def test_a_flipped_byte_inside_the_rows_is_found_and_named() -> None:
    tensors = fragment()
    blob = encode(tensors, "off", blocks=BLOCK)
    spans = {s.name: s for s in read_index(blob)[0]}
    w = spans["fc.weight"]
    bad = flipped(blob, w.start + 130)  # fc.weight row 6, in its block 2 ([128, 192))
    with pytest.raises(CorruptPayload) as info:
        read(Ranges(), ref_of(blob), {"fc.weight": (5, 7)}, bad)
    got = hashlib.sha256(bad[w.start + 128:w.start + 192]).hexdigest()
    want = hashlib.sha256(blob[w.start + 128:w.start + 192]).hexdigest()
    assert str(info.value) == (
        f"{KEY}: block 2 of tensor 'fc.weight' (bytes [{w.start + 128}, {w.start + 192})) has "
        f"SHA-256 {got[:16]}..., its header says {want[:16]}...; it was corrupted or "
        "replaced after it was written")
    # A flip in the rounding, outside the rows but inside a block read, is found too.
    with pytest.raises(CorruptPayload, match=r"block 1 of tensor 'fc\.weight'"):
        read(Ranges(), ref_of(blob), {"fc.weight": (5, 7)}, flipped(blob, w.start + 64))
    # And in a tensor's short last block.
    s = spans["wte"]
    with pytest.raises(CorruptPayload, match=r"block 12 of tensor 'wte' \(bytes \[\d+, "
                                             rf"{s.end}\)\)"):
        read(Ranges(), ref_of(blob), {"wte": (49, 50)}, flipped(blob, s.end - 1))
    # A ref without the header digest (an older record) still gets its blocks checked.
    with pytest.raises(CorruptPayload, match=r"block 2 of tensor 'fc\.weight'"):
        read(Ranges(), ref_of(blob, header=False), {"fc.weight": (5, 7)}, bad)


def test_a_flipped_byte_outside_the_ranks_blocks_is_not_read() -> None:
    tensors = fragment()
    blob = encode(tensors, "off", blocks=BLOCK)
    spans = {s.name: s for s in read_index(blob)[0]}
    rows = {"wte": (0, 10), "fc.weight": (0, 3), "fc.bias": (0, 6)}
    # Past the blocks these rows lie in: wte [0, 160) -> blocks 0-2 ([0, 192)), fc.weight
    # [0, 60) -> block 0, fc.bias its one block (the flip in fc.bias's second half is in
    # it, so it is not among these).
    for at in (spans["wte"].start + 192, spans["wte"].end - 1, spans["fc.weight"].start + 64,
               spans["fc.weight"].end - 1):
        box = Ranges()
        got = read(box, ref_of(blob), rows, flipped(blob, at))
        assert got == {n: rows_of(tensors[n], a, b) for n, (a, b) in rows.items()}
        assert not any(a <= at < b for a, b in box.ranges[2:]), at


def test_a_forged_header_is_refused_by_its_digest() -> None:
    tensors = fragment()
    blob = encode(tensors, "off", blocks=BLOCK)
    ref = ref_of(blob)
    head = header_length(blob)
    header = json.loads(blob[8:head])

    def forged(change: dict[str, object], data: bytes | None = None) -> bytes:
        h = {**header, **change}
        text = json.dumps(h, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text + (blob[head:] if data is None else data)

    # The two BF16 tensors trade places in the data, and the header their offsets: a
    # well-formed payload whose block digests no longer fit it, pinned by the record.
    spans = {s.name: s for s in read_index(blob)[0]}
    bias, weight = spans["fc.bias"], spans["fc.weight"]
    swapped = blob[head:bias.start] + blob[weight.start:weight.end] + blob[bias.start:bias.end]
    at = bias.start - head  # after wte's 800 bytes
    offsets = forged({"fc.bias": {**header["fc.bias"], "data_offsets": [at + 240, at + 264]},
                      "fc.weight": {**header["fc.weight"], "data_offsets": [at, at + 240]}},
                     swapped)
    assert read_index(offsets)  # a well-formed payload; only its record says otherwise
    # Forged data whose digests were rewritten to match it.
    other = {**tensors, "wte": TensorBytes("F32", (50, 4), bytes(800))}
    rewritten = encode(other, "off", blocks=BLOCK)
    for bad in (offsets, rewritten):
        box = Ranges()
        with pytest.raises(CorruptPayload) as info:
            read(box, dataclasses.replace(ref, size=len(bad)),
                 {"fc.bias": (0, 12), "wte": (0, 50)}, bad)
        got = hashlib.sha256(bad[:header_length(bad)]).hexdigest()
        assert str(info.value) == (
            f"{KEY}: the header (bytes [0, {header_length(bad)})) has SHA-256 {got[:16]}..., "
            f"its record says {ref.header_sha256[:16]}...; it was corrupted or replaced "
            "after the record was written")
        assert box.ranges == [(0, 16), (16, header_length(bad))]  # no data was read


def test_a_payload_and_ref_without_digests_read_as_before() -> None:
    tensors = fragment()
    blob = pack(tensors)
    ref = ref_of(blob, header=False)
    assert ref.header_sha256 is None
    box = Ranges()
    got = read(box, ref, {"wte": (3, 4)}, blob)
    assert got == {"wte": rows_of(tensors["wte"], 3, 4)}
    w = read_index(blob)[0][0]
    assert box.ranges[2:] == [(w.start + 48, w.start + 64)]  # the row, no rounding
    # A ref that pins the header of a payload without block digests: the header is
    # checked, the data as before.
    assert read(Ranges(), ref_of(blob), {"wte": (3, 4)}, blob) == got
    with pytest.raises(CorruptPayload, match="the header"):
        read(Ranges(), ref_of(blob), {"wte": (3, 4)}, flipped(blob, 20))


def test_payload_ref_json_with_and_without_the_header_digest() -> None:
    old = {"key": KEY, "sha256": "a" * 64, "size": 10}
    ref = PayloadRef.from_json(old, "rounds/0000000001.json")
    assert ref == PayloadRef(KEY, 10, "a" * 64) and ref.header_sha256 is None
    assert ref.to_json() == old  # an older record keeps its bytes
    new = {**old, "header_sha256": "b" * 64}
    ref2 = PayloadRef.from_json(new, "rounds/0000000001.json")
    assert ref2.header_sha256 == "b" * 64 and ref2.to_json() == new
    with pytest.raises(RemoteProtocolError, match="header_sha256"):
        PayloadRef.from_json({**old, "header_sha256": "XYZ"}, "rounds/0000000001.json")
    with pytest.raises(RemoteProtocolError, match="must be a string"):
        PayloadRef.from_json({**old, "header_sha256": None}, "rounds/0000000001.json")


def test_round_records_round_trip_with_and_without_the_header_digest() -> None:
    async def main() -> tuple[Manifest, list[RoundRecord]]:
        return await make_run(Exchange(MemoryMailbox("blocks-records"), clock=FakeClock(1.0)),
                              None)

    manifest, recs = asyncio.run(main())
    assert manifest.init[0].header_sha256 is not None
    assert Manifest.decode(manifest.encode(), "manifest.json") == manifest
    for rec in recs:
        refs = [r for r in (rec.theta, rec.outer, None if rec.step is None else
                            rec.step.payload) if r is not None]
        assert refs and all(r.header_sha256 is not None for r in refs)
        assert RoundRecord.decode(rec.encode(), "rounds/x.json") == rec
        # The same record as an older closer wrote it: no header digests anywhere.
        text = json.loads(rec.encode())
        for ref in (text.get("theta"), text.get("outer"),
                    (text.get("step") or {}).get("payload")):
            if ref is not None:
                del ref["header_sha256"]
        older = RoundRecord.decode(json.dumps(text).encode(), "rounds/x.json")
        assert older == dataclasses.replace(
            rec, theta=strip(rec.theta), outer=strip(rec.outer),
            step=None if rec.step is None else dataclasses.replace(
                rec.step, payload=strip(rec.step.payload)))
        assert json.loads(older.encode()) == text


def strip(ref: PayloadRef | None) -> PayloadRef | None:
    return None if ref is None else dataclasses.replace(ref, header_sha256=None)


def test_the_writers_put_digests_where_ranged_readers_read() -> None:
    tensors = fragment()

    async def main() -> None:
        ex = Exchange(MemoryMailbox("blocks-writers"), clock=FakeClock(1.0))
        for ref in (await ex.put_theta(0, 1, tensors, attempt=0),
                    await ex.put_step(0, 1, tensors, attempt=0),
                    await ex.put_outer(0, 1, tensors, attempt=0),
                    await ex.put_init(0, tensors, attempt=0)):
            blob = await ex.store.fetch_payload(ref)
            assert blob is not None
            assert ref.header_sha256 == \
                hashlib.sha256(blob[:header_length(blob)]).hexdigest()
            assert decode_with_metadata(blob, "off")[1] == \
                {BLOCKS_KEY: blocks_entry(tensors, BLOCK_BYTES)}
        # Contributions and updates are read whole: no digests.
        for ref in (await ex.store.put_payload("payloads/0000000000/a", tensors),
                    await ex.put_update(0, 1, tensors, attempt=0)):
            assert ref is not None and ref.header_sha256 is None
            blob = await ex.store.fetch_payload(ref)
            assert blob is not None and decode_with_metadata(blob, "off")[1] == {}
        # A zstd payload cannot be read by ranges: none either.
        zex = Exchange(MemoryMailbox("blocks-writers-zstd"), compression="zstd")
        ref = await zex.put_theta(0, 1, tensors, attempt=0)
        assert ref.header_sha256 is None

    asyncio.run(main())
    with pytest.raises(ConfigError, match="no range of a zstd frame decodes alone"):
        encode(tensors, "zstd", blocks=BLOCK)
    with pytest.raises(ConfigError, match=r"'gradientmail\.blocks' is reserved"):
        encode(tensors, "off", {BLOCKS_KEY: "x"})


@pytest.mark.parametrize("entry, problem", [
    ("{", "must be"),
    ('{"block":0,"sha256":""}', "must be"),
    ('{"block":true,"sha256":""}', "must be"),
    ('{"block":64,"sha256":"","x":1}', "must be"),
    ('{"block":64,"sha256":""}', "holds 0 base64 characters; 18 blocks of 64 bytes need 768"),
    ('{"block":64,"sha256":"' + "!" * 768 + '"}', "is not base64"),
])
def test_a_malformed_entry_is_refused(entry: str, problem: str) -> None:
    spans = read_index(pack(fragment()))[0]
    with pytest.raises(CorruptPayload, match=problem):
        BlockIndex.parse(entry, spans, key=KEY)


def test_a_sharded_replica_refuses_a_corrupted_range_and_reads_it_again() -> None:
    async def main() -> None:
        name = "blocks-replica"
        ex = Exchange(MemoryMailbox(name), clock=FakeClock(100.0))
        manifest, recs = await make_run(ex, None)
        rows = rank_rows(1)
        # The 2nd ranged read of version 1's step (the first after its header) comes back
        # with bytes flipped.
        plan = FaultPlan().corrupt("steps/0/0000000001-*", nth=2, times=1, op="get_range")
        bad = Exchange(FaultyMailbox(MemoryMailbox(name), plan), clock=FakeClock(100.0))
        follower = ShardedReplica(bad, rows)

        async def nothing(name: str, r: Rows) -> None:
            pass

        assert await follower.reach(await plan_chain(ex, manifest, 0, None, None), nothing)
        chain = await plan_chain(ex, manifest, 0, recs[0], follower.held(0))
        with pytest.raises(CorruptPayload, match=r"steps/0/0000000001-000000\.safetensors: "
                                                 r"block 0 of tensor '\w+'"):
            await follower.reach(chain, nothing)
        assert follower.held(0) is None  # dropped: read again from a checkpoint or Θ⁰
        assert plan.rules[0].fired == 1
        for rec in recs:
            chain = await plan_chain(ex, manifest, 0, rec, follower.held(0))
            assert await follower.reach(chain, nothing)
        mine = follower.state(0)
        assert mine is not None
        same_state(mine, await state_at(ex, 0, recs[-1], manifest), rows)

    asyncio.run(main())


def test_a_zstd_payload_read_whole_is_checked_against_its_sha256() -> None:
    tensors = fragment()
    blob = encode(tensors, "zstd")
    key = KEY + ".zst"
    ref = PayloadRef.of(key, blob)

    async def body(data: bytes) -> dict[str, Rows] | None:
        box = MemoryMailbox()
        await box.put(key, data)
        return await fetch_rows(box, key, ref.size, {"wte": (0, 5)}, sha256=ref.sha256)

    assert asyncio.run(body(blob)) == {"wte": rows_of(tensors["wte"], 0, 5)}
    bad = flipped(blob, len(blob) // 2)
    with pytest.raises(CorruptPayload) as info:
        asyncio.run(body(bad))
    assert str(info.value) == (
        f"{key}: SHA-256 {hashlib.sha256(bad).hexdigest()[:16]}..., its record says "
        f"{ref.sha256[:16]}...; it was corrupted or replaced after the record was written")


def test_a_part_written_in_place_carries_the_digests_encode_writes() -> None:
    # A creator's rank writes its part of Θ⁰ in place (`PartBlob`): the header reserves
    # the digests' room and `data` fills it, so the bytes are `encode`'s with blocks.
    tensors = fragment()
    rows = {"wte": (0, 50), "fc.weight": (0, 12), "fc.bias": (0, 12)}  # one rank: all
    specs = [ParameterSpec(n, t.dtype, t.shape) for n, t in tensors.items()]
    for blocks in (None, BLOCK):
        blob = PartBlob(specs, rows, blocks=blocks)
        for n, t in tensors.items():
            blob.slot(n)[:] = t.buffer
        assert bytes(blob.data) == encode(tensors, "off", part_metadata(rows), blocks=blocks)

    async def main() -> None:
        ex = Exchange(MemoryMailbox("blocks-init-part"))
        ref = await put_init_blob(ex, 0, 0, 1, blob, attempt=0)
        assert ref.header_sha256 is not None
        got = await fetch_rows(ex.mailbox, ref.key, ref.size, {"wte": (0, 50)},
                               header_sha256=ref.header_sha256)
        assert got == {"wte": rows_of(tensors["wte"], 0, 50)}

    asyncio.run(main())


@pytest.mark.slow
def test_the_benchmark_counts_the_bytes_a_rank_reads_beyond_its_rows() -> None:
    # benchmarks/sharded_blocks.py on a small shape: one layer of width 64 in BF16, 2 ranks,
    # blocks of 1 KiB. Without digests a rank reads its rows exactly; with them the header
    # grows by the entry (one digest per block) and each range by its rounding, less than
    # two blocks per tensor.
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "sharded_blocks.py"), "--layers", "1", "--embd",
         "64", "--ranks", "2", "--blocks", "1", "--no-append"],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "PYTHONPATH": str(root)})
    table = [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines()
             if line.startswith("| ") and line[2:3] != "b"]
    assert [row[:2] for row in table] == [["none", "2"], ["1 KiB", "2"]]
    none, one = table
    assert none[2].endswith("(+0)") and none[4:] == ["0 KiB (0 KiB)", "0 KiB", "0.00%"]
    # The entry for the benchmark's shapes (c_attn 24 KiB, c_proj 8 KiB, c_fc and the
    # MLP's c_proj 32 KiB each, 8 vectors of one block each: 104 blocks), as pack_header
    # writes it, padding and all.
    spec = importlib.util.spec_from_file_location("blocks_bench", root / "benchmarks" /
                                                  "sharded_blocks.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    specs = {n: ParameterSpec(n, "BF16", sh) for n, sh in bench.gpt2_blocks(1, 64).items()}
    assert sum(-(-p.nbytes // 1024) for p in specs.values()) == 104
    entry = blocks_placeholder([p.nbytes for p in specs.values()], 1024)
    want = len(pack_header(specs, {BLOCKS_KEY: entry})[0]) - len(pack_header(specs)[0])
    assert one[2].endswith(f"(+{want:,})"), (one[2], want)
    mean, worst = (float(x.strip("()").replace(",", "")) for x in
                   one[4].replace(" KiB", "").split())
    assert 0 < mean <= worst < 2 * len(specs)  # KiB: under two 1 KiB blocks per tensor
    assert "Command: `python benchmarks/sharded_blocks.py --layers 1 --embd 64 --ranks 2 " \
           "--blocks 1`" in proc.stdout
