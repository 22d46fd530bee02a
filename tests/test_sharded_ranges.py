"""Range reads on every mailbox, and the byte ranges of a payload tensor's rows.

`get_range` runs against memory, a local directory and S3 (moto's HTTP server); the header
arithmetic is pinned on a payload whose every byte is written out here.
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

import numpy as np
import pytest

from gradientmail.errors import ConfigError, CorruptPayload, LocalProtocolError
from gradientmail.mailbox import (
    CountingMailbox,
    FaultPlan,
    FaultyMailbox,
    Mailbox,
    MemoryMailbox,
    S3Mailbox,
)
from gradientmail.wire.compression import encode
from gradientmail.wire.serialization import Span, pack, read_index
from gradientmail.wire.sharded_ranges import (
    ByteRange,
    Rows,
    coalesce,
    fetch_rows,
    header_length,
    index_from_header,
    row_range,
    rows_of,
)
from gradientmail.wire.tensor_bytes import TensorBytes

# -- get_range on every mailbox -------------------------------------------------------------


def test_get_range_slices_like_python(any_mailbox: Mailbox) -> None:
    async def body() -> None:
        await any_mailbox.put("p/x", b"0123456789")
        assert await any_mailbox.get_range("p/x", 0, 4) == b"0123"
        assert await any_mailbox.get_range("p/x", 3, 10) == b"3456789"
        assert await any_mailbox.get_range("p/x", 8, 20) == b"89"  # cut short at the end
        assert await any_mailbox.get_range("p/x", 5, 5) == b""
        assert await any_mailbox.get_range("p/x", 10, 12) == b""
        assert await any_mailbox.get_range("p/x", 20, 30) == b""
        assert await any_mailbox.get_range("p/absent", 0, 4) is None
        assert await any_mailbox.get_range("p/absent", 0, 0) is None
        await any_mailbox.put("p/empty", b"")
        assert await any_mailbox.get_range("p/empty", 0, 4) == b""

    asyncio.run(body())


@pytest.mark.parametrize("start, stop", [(-1, 2), (5, 3), (0.0, 2), (True, 2)])
def test_get_range_refuses_a_non_range(any_mailbox: Mailbox, start: Any, stop: Any) -> None:
    with pytest.raises(LocalProtocolError) as info:
        asyncio.run(any_mailbox.get_range("p/x", start, stop))
    assert str(info.value) == (
        f"byte range [{start!r}, {stop!r}) of key 'p/x' is not a range; need ints with "
        "0 <= start <= stop"
    )


def test_get_range_default_falls_back_to_a_full_get() -> None:
    # A mailbox that does not override get_range is served by the base class's default:
    # a full GET of the object, sliced.
    counting = CountingMailbox(MemoryMailbox())

    async def body() -> None:
        await counting.put("k", b"abcdef")
        counting.reset()
        assert await Mailbox.get_range(counting, "k", 1, 3) == b"bc"
        assert await Mailbox.get_range(counting, "gone", 1, 3) is None

    asyncio.run(body())
    counts = counting.snapshot()
    assert (counts.get, counts.bytes_down) == (2, 6)


def test_faulty_mailbox_passes_a_range_through() -> None:
    # FaultyMailbox reads a range as a range: one GET of the range's bytes inside.
    counting = CountingMailbox(MemoryMailbox())
    box = FaultyMailbox(counting, FaultPlan())

    async def body() -> None:
        await box.put("k", b"abcdef")
        counting.reset()
        assert await box.get_range("k", 1, 3) == b"bc"
        assert await box.get_range("gone", 1, 3) is None

    asyncio.run(body())
    counts = counting.snapshot()
    assert (counts.get, counts.bytes_down) == (2, 2)


def test_s3_get_range_sends_a_range_header(mailbox_factory: Any) -> None:
    mailbox = mailbox_factory("s3")
    assert isinstance(mailbox, S3Mailbox)
    seen: list[str] = []

    def spy(request: Any, **_: Any) -> None:
        seen.append(request.headers.get("Range").decode())

    async def body() -> None:
        await mailbox.put("big", bytes(range(256)) * 4)
        mailbox.client.meta.events.register("before-send.s3.GetObject", spy)
        assert await mailbox.get_range("big", 250, 260) == bytes(range(250, 256)) + bytes(range(4))

    asyncio.run(body())
    assert seen == ["bytes=250-259"]


# -- the byte ranges of rows, pinned ---------------------------------------------------------

W = np.arange(6, dtype="<f4").reshape(3, 2)  # rows [0 1] [2 3] [4 5]
TENSORS = {
    "w": TensorBytes("F32", (3, 2), W.tobytes()),
    "s": TensorBytes("F32", (), struct.pack("<f", 7.0)),
    "b": TensorBytes("BF16", (5,), bytes(range(10))),
}
HEADER_JSON = (
    '{"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},'
    '"w":{"dtype":"F32","shape":[3,2],"data_offsets":[4,28]},'
    '"b":{"dtype":"BF16","shape":[5],"data_offsets":[28,38]}}'
)


def blob_and_header() -> tuple[bytes, int]:
    text = HEADER_JSON.encode()
    text += b" " * (-len(text) % 8)
    expected = struct.pack("<Q", len(text)) + text + struct.pack("<f", 7.0) + W.tobytes()
    expected += bytes(range(10))
    blob = pack(TENSORS)
    assert blob == expected  # every byte of the payload, as the ranges below assume
    return blob, 8 + len(text)


def test_row_ranges_of_a_pinned_payload() -> None:
    blob, head = blob_and_header()
    assert head == 176 and header_length(blob[:8]) == head and len(blob) == head + 38
    spans = {s.name: s for s in index_from_header(blob[:head], len(blob))[0]}
    assert spans["w"] == Span("w", "F32", (3, 2), head + 4, head + 28)
    assert row_range(spans["w"], 1, 3) == ByteRange(head + 12, head + 28)
    assert blob[head + 12 : head + 28] == struct.pack("<4f", 2, 3, 4, 5)
    assert row_range(spans["w"], 0, 0) == ByteRange(head + 4, head + 4)
    assert row_range(spans["b"], 2, 4) == ByteRange(head + 32, head + 36)
    assert blob[head + 32 : head + 36] == bytes([4, 5, 6, 7])
    assert row_range(spans["s"], 0, 1) == ByteRange(head, head + 4)  # a 0-d tensor: one row
    with pytest.raises(ConfigError) as info:
        row_range(spans["w"], 2, 4)
    assert str(info.value) == "rows [2, 4) of tensor 'w' [3, 2]: need 0 <= start <= stop <= 3"


def test_index_from_header_agrees_with_read_index_and_checks_the_size() -> None:
    tensors = {
        "emb": TensorBytes("F32", (7, 3), np.arange(21, dtype="<f4").tobytes()),
        "q": TensorBytes("F4", (5, 3), bytes(8)),  # odd last dim: stored flat, shape in metadata
        "m": TensorBytes("F16", (4,), bytes(8)),
    }
    blob = pack(tensors, {"note": "x"})
    head = header_length(blob)
    assert index_from_header(blob[:head], len(blob)) == read_index(blob)
    assert index_from_header(memoryview(blob)[: head + 5], len(blob)) == read_index(blob)
    with pytest.raises(CorruptPayload, match="the header describes 100 data bytes but the blob"):
        index_from_header(blob[:head], len(blob) - 1)
    with pytest.raises(CorruptPayload, match="header claims"):
        index_from_header(blob[:head], head - 1)
    needs = f"read_header got 20 bytes; the header needs {head}"
    with pytest.raises(ConfigError, match=needs):
        index_from_header(blob[:20], len(blob))
    with pytest.raises(CorruptPayload, match="shorter than the 8-byte"):
        header_length(blob[:7], key="theta/0/x")


def test_f4_rows_must_fall_on_whole_bytes() -> None:
    span = Span("q", "F4", (5, 3), 100, 108)  # 15 codes in 8 bytes, the last half padding
    assert row_range(span, 0, 2) == ByteRange(100, 103)
    assert row_range(span, 2, 5) == ByteRange(103, 108)  # to the end, padding included
    assert row_range(span, 4, 4) == ByteRange(106, 106)
    for start, stop in [(1, 2), (3, 5), (0, 1)]:
        with pytest.raises(ConfigError, match="do not start and end on whole bytes"):
            row_range(span, start, stop)


def test_rows_of_views_the_full_tensor() -> None:
    full = TENSORS["w"]
    part = rows_of(full, 1, 3)
    assert part == Rows(1, 3, TensorBytes("F32", (2, 2), struct.pack("<4f", 2, 3, 4, 5)))
    assert rows_of(full, 3, 3).tensor.shape == (0, 2)
    assert rows_of(TENSORS["s"], 0, 1).tensor == TENSORS["s"]
    with pytest.raises(ConfigError, match="its first dimension must be 1"):
        Rows(0, 1, full)


def test_coalesce() -> None:
    rs = [ByteRange(30, 40), ByteRange(0, 10), ByteRange(10, 20), ByteRange(44, 50)]
    assert coalesce(rs) == [ByteRange(0, 20), ByteRange(30, 40), ByteRange(44, 50)]
    assert coalesce(rs, max_gap=4) == [ByteRange(0, 20), ByteRange(30, 50)]
    assert coalesce(rs, max_gap=10) == [ByteRange(0, 50)]


# -- fetch_rows ------------------------------------------------------------------------------


class RangeCounting(MemoryMailbox):
    """A memory mailbox that counts the bytes its ranged and full reads return."""

    def __init__(self) -> None:
        super().__init__()
        self.ranges: list[tuple[int, int]] = []
        self.full_gets = 0

    async def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        self.ranges.append((start, stop))
        return await super().get_range(key, start, stop)

    async def get(self, key: str) -> bytes | None:
        self.full_gets += 1
        return await super().get(key)


def fragment() -> dict[str, TensorBytes]:
    rng = np.random.default_rng(3)
    return {
        "wte": TensorBytes("F32", (37, 4), rng.standard_normal((37, 4), "f4").tobytes()),
        "fc.weight": TensorBytes("F32", (9, 5), rng.standard_normal((9, 5), "f4").tobytes()),
        "fc.bias": TensorBytes("BF16", (9,), rng.integers(0, 255, 18, "u1").tobytes()),
    }


def test_fetch_rows_reads_only_the_header_and_the_rows() -> None:
    tensors = fragment()
    blob = pack(tensors)
    head = header_length(blob)
    box = RangeCounting()
    ranks = [{"wte": (0, 19), "fc.weight": (0, 5), "fc.bias": (0, 5)},
             {"wte": (19, 37), "fc.weight": (5, 9), "fc.bias": (5, 9)}]

    async def body() -> list[dict[str, Rows] | None]:
        await box.put("theta/0/0000000001-000000.safetensors", blob)
        return [
            await fetch_rows(box, "theta/0/0000000001-000000.safetensors", len(blob), rows,
                             probe=16)
            for rows in ranks
        ]

    got = asyncio.run(body())
    for rows, part in zip(ranks, got, strict=True):
        assert part == {n: rows_of(tensors[n], a, b) for n, (a, b) in rows.items()}
    assert box.full_gets == 0
    row_bytes = sum(rows_of(t, 0, 1).tensor.nbytes for t in tensors.values())
    assert row_bytes == 16 + 20 + 2
    # Per rank: a 16-byte probe, the rest of the header, then its rows of each tensor.
    down = [r[1] - r[0] for r in box.ranges]
    assert sum(down) == 2 * head + 37 * 16 + 9 * 20 + 9 * 2
    assert box.ranges[:2] == [(0, 16), (16, head)]
    assert len(box.ranges) == 2 * (2 + 3)


def test_fetch_rows_of_a_zstd_payload_decodes_it_whole() -> None:
    tensors = fragment()
    blob = encode(tensors, "zstd")
    box = RangeCounting()
    key = "theta/0/0000000001-000000.safetensors.zst"

    async def body() -> dict[str, Rows] | None:
        await box.put(key, blob)
        return await fetch_rows(box, key, len(blob), {"wte": (30, 37), "fc.bias": (0, 9)})

    assert asyncio.run(body()) == {
        "wte": rows_of(tensors["wte"], 30, 37),
        "fc.bias": rows_of(tensors["fc.bias"], 0, 9),
    }
    assert (box.full_gets, box.ranges) == (1, [])


def test_fetch_rows_of_a_swept_truncated_or_mismatched_payload(any_mailbox: Mailbox) -> None:
    tensors = fragment()
    blob = pack(tensors)
    key = "theta/0/x.safetensors"

    async def body() -> None:
        assert await fetch_rows(any_mailbox, key, len(blob), {"wte": (0, 1)}) is None
        await any_mailbox.put(key, blob[:-30])  # cut short after the header was written
        with pytest.raises(CorruptPayload, match=r"came back as \d+ bytes"):
            await fetch_rows(any_mailbox, key, len(blob), {"fc.bias": (0, 9)})
        with pytest.raises(CorruptPayload, match="the header describes"):
            await fetch_rows(any_mailbox, key, len(blob) - 30, {"fc.bias": (0, 9)})
        await any_mailbox.put(key, blob)
        with pytest.raises(ConfigError, match=r"tensors \['lm_head'\] are not in the payload"):
            await fetch_rows(any_mailbox, key, len(blob), {"lm_head": (0, 1)})
        got = await fetch_rows(any_mailbox, key, len(blob), {"fc.weight": (2, 4)}, max_gap=1 << 20)
        assert got == {"fc.weight": rows_of(tensors["fc.weight"], 2, 4)}

    asyncio.run(body())


def test_header_json_is_what_pack_writes() -> None:
    # The literal above is the library's layout: F32 before BF16, then by name.
    assert list(json.loads(HEADER_JSON)) == ["s", "w", "b"]
