"""Row ranges of payload tensors: which bytes of a payload hold rows [start, stop) of a tensor.

A rank of a sharded learner holds rows of each parameter (FSDP2 shards dim 0). To read a
commit it needs only those rows, and a safetensors payload stores every tensor row-major
and contiguous, so rows [a, b) of tensor t are one byte range: t's data offset plus
a·row_bytes to b·row_bytes. `fetch_rows` reads the header with one ranged GET (a second
when the header is larger than the probe), checks it as `serialization.read_index` checks
a whole blob, and then GETs each wanted range, so the rank downloads its rows and the
header, not the fragment.

Framework-free: `Rows` is a slice of a full tensor as `TensorBytes`, what sharded
adapters produce and consume.

Limits of this first version (docs/design/sharded.md says how they are to be lifted):
- A `zstd` payload is one compressed frame: no range of it can be decoded alone, so
  `fetch_rows` downloads and decodes it whole, then slices.
- Ranged bytes cannot be checked against the payload's SHA-256 (that covers the whole
  blob). A payload written for ranged readers carries block digests in its header, and
  its ref the header's SHA-256 (`gradientmail.wire.sharded_blocks`): the header is checked
  against the ref, each range is rounded out to whole blocks of its tensor and every
  block checked (`CorruptPayload` naming the key, the tensor and the block). A payload
  without them (written before) is checked as before: the header for consistency with
  the declared size, every range for its exact length, nothing for content.
- An F4 tensor's rows are a byte range only when they start and end on whole bytes (an
  even number of elements before `start` and before `stop`, or `stop` at the end).
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gradientmail.errors import ConfigError, CorruptPayload
from gradientmail.mailbox.base import Mailbox
from gradientmail.wire.compression import compression_of, decode
from gradientmail.wire.serialization import MAX_HEADER_BYTES, MAX_TENSORS, Span, read_header
from gradientmail.wire.sharded_blocks import BLOCKS_KEY, BlockIndex
from gradientmail.wire.tensor_bytes import TensorBytes, _numel, dtype_bits

__all__ = [
    "HEADER_PROBE",
    "ByteRange",
    "PayloadIndex",
    "Rows",
    "coalesce",
    "cover",
    "fetch_header",
    "fetch_index",
    "fetch_rows",
    "fetch_span_rows",
    "header_length",
    "index_from_header",
    "row_range",
    "rows_of",
]

#: Bytes `fetch_rows` asks for first: the length and, for a payload without block
#: digests, usually the whole header (a fragment of a GPT-2 has a few hundred tensors,
#: about 100 bytes of JSON each). Block digests add 0.13% of the data (`wire.sharded_blocks`): a
#: payload over ~48 MiB then takes a second GET for the rest of its header.
HEADER_PROBE = 64 * 1024
#: Ranges of more bytes than this are hashed off the event loop (hashlib releases the GIL).
_HASH_INLINE = 1 << 20


@dataclass(frozen=True)
class ByteRange:
    """Bytes [start, stop) of a blob (absolute offsets)."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Rows:
    """Rows [start, stop) along dim 0 of a full tensor; `tensor` has shape
    (stop − start, *the full tensor's other dims*). A 0-d tensor counts as one row:
    `Rows(0, 1, t)` with `t` 0-d; a rank that does not own it sends nothing."""

    start: int
    stop: int
    tensor: TensorBytes

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ConfigError(f"Rows [{self.start}, {self.stop}) is not a range of rows")
        shape = self.tensor.shape
        rows = shape[0] if shape else 1
        if rows != self.stop - self.start:
            raise ConfigError(
                f"Rows [{self.start}, {self.stop}) holds a tensor of shape {list(shape)}; its "
                f"first dimension must be {self.stop - self.start}"
            )


def rows_of(tensor: TensorBytes, start: int, stop: int) -> Rows:
    """Rows [start, stop) of the full `tensor`, as a view (no copy) of its bytes."""
    shape = tensor.shape
    span = Span("tensor", tensor.dtype, shape, 0, tensor.nbytes)
    where = row_range(span, start, stop)
    view = memoryview(tensor.buffer)[where.start : where.stop]
    sliced = (stop - start, *shape[1:]) if shape else ()
    return Rows(start, stop, TensorBytes(tensor.dtype, sliced, view))


def header_length(first: bytes | memoryview, *, key: str = "payload") -> int:
    """Bytes of the header a blob starts with (the 8-byte length included), from at least
    its first 8 bytes."""
    if len(first) < 8:
        raise CorruptPayload(
            f"{key}: {len(first)} bytes is shorter than the 8-byte safetensors header length"
        )
    (n,) = struct.unpack("<Q", bytes(first[:8]))
    return 8 + int(n)


def index_from_header(
    head: bytes | memoryview,
    size: int,
    *,
    key: str = "payload",
    max_tensors: int = MAX_TENSORS,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> tuple[list[Span], dict[str, str]]:
    """Where each tensor lies in a blob of `size` bytes, from its first bytes `head` (at
    least the whole header), without the data: `serialization.read_header`, the checks of
    `read_index` on a whole blob, so that a ranged reader and a whole-blob reader cannot
    come to disagree about what a valid payload is."""
    return read_header(head, size, key=key, max_tensors=max_tensors,
                       max_header_bytes=max_header_bytes)


def row_range(span: Span, start: int, stop: int) -> ByteRange:
    """The bytes of rows [start, stop) (along dim 0) of the tensor at `span`.

    A 0-d tensor is one row. `ConfigError` when the rows are outside the tensor, or
    when they do not start and end on whole bytes (only possible for F4).
    """
    rows = span.shape[0] if span.shape else 1
    if not 0 <= start <= stop <= rows:
        raise ConfigError(
            f"rows [{start}, {stop}) of tensor {span.name!r} {list(span.shape)}: need "
            f"0 <= start <= stop <= {rows}"
        )
    row_bits = _numel(span.shape[1:]) * dtype_bits(span.dtype)
    lo_bits, hi_bits = start * row_bits, stop * row_bits
    if lo_bits % 8 or (hi_bits % 8 and stop != rows):
        raise ConfigError(
            f"rows [{start}, {stop}) of {span.dtype} tensor {span.name!r} "
            f"{list(span.shape)} do not start and end on whole bytes; fetch the whole tensor"
        )
    end = span.end if stop == rows else span.start + hi_bits // 8  # F4 pads its last byte
    return ByteRange(span.start + lo_bits // 8, end)


def coalesce(ranges: Sequence[ByteRange], max_gap: int = 0) -> list[ByteRange]:
    """`ranges` sorted and merged where at most `max_gap` bytes separate them: fewer GETs
    for at most `max_gap` wasted bytes per merge."""
    out: list[ByteRange] = []
    for r in sorted(ranges, key=lambda r: (r.start, r.stop)):
        if out and r.start - out[-1].stop <= max_gap:
            out[-1] = ByteRange(out[-1].start, max(out[-1].stop, r.stop))
        else:
            out.append(r)
    return out


@dataclass(frozen=True)
class PayloadIndex:
    """What a ranged reader knows of a payload from its header: where each tensor lies,
    its metadata (a part's rows, `wire.sharded_parts`), and the block digests that check its data
    (None for a payload written without)."""

    key: str
    spans: Mapping[str, Span]
    metadata: Mapping[str, str]
    blocks: BlockIndex | None


def cover(span: Span, want: ByteRange, blocks: BlockIndex | None) -> ByteRange:
    """The bytes a reader fetches for `want`, bytes of the tensor at `span`: `want`
    itself, or rounded out to whole blocks of the tensor when the payload has digests."""
    if blocks is None:
        return want
    return ByteRange(*blocks.cover(span, want.start, want.stop))


async def fetch_header(
    mailbox: Mailbox, key: str, size: int, *, header_sha256: str | None = None,
    probe: int = HEADER_PROBE,
) -> PayloadIndex | None:
    """The `PayloadIndex` of the uncompressed payload at `key` (of `size` bytes) from its
    header alone (one ranged GET, a second when the header is larger than `probe`); None
    when the payload is gone. Checked as `index_from_header` checks and, when the ref
    pins it (`header_sha256`), against that digest before anything in it is believed."""
    head = await mailbox.get_range(key, 0, min(size, probe))
    if head is None:
        return None
    total = header_length(head, key=key)
    if total > size or total - 8 > MAX_HEADER_BYTES:
        index_from_header(head, size, key=key)  # raises CorruptPayload, naming the bound
    if len(head) < total:
        rest = await mailbox.get_range(key, len(head), total)
        if rest is None:
            return None
        head += rest
    if header_sha256 is not None:
        digest = hashlib.sha256(memoryview(head)[:total]).hexdigest()
        if digest != header_sha256:
            raise CorruptPayload(
                f"{key}: the header (bytes [0, {total})) has SHA-256 {digest[:16]}..., its "
                f"record says {header_sha256[:16]}...; it was corrupted or replaced after "
                "the record was written")
    spans, meta = index_from_header(head, size, key=key)
    entry = meta.get(BLOCKS_KEY)
    blocks = None if entry is None else BlockIndex.parse(entry, spans, key=key)
    return PayloadIndex(key, {s.name: s for s in spans}, meta, blocks)


async def fetch_index(
    mailbox: Mailbox, key: str, size: int, *, header_sha256: str | None = None,
    probe: int = HEADER_PROBE,
) -> dict[str, Span] | None:
    """Where each tensor of the uncompressed payload at `key` (of `size` bytes) lies, by
    name: `fetch_header`'s spans."""
    index = await fetch_header(mailbox, key, size, header_sha256=header_sha256, probe=probe)
    return None if index is None else dict(index.spans)


async def _check(blocks: BlockIndex | None, span: Span, start: int,
                 data: bytes | memoryview) -> None:
    if blocks is None:
        return
    if len(data) > _HASH_INLINE:
        await asyncio.to_thread(blocks.check, span, start, data)
    else:
        blocks.check(span, start, data)


def _short(key: str, r: ByteRange, got: int) -> CorruptPayload:
    return CorruptPayload(
        f"{key}: bytes [{r.start}, {r.stop}) came back as {got} bytes; the object is shorter "
        "than its header says, or was replaced")


async def fetch_span_rows(mailbox: Mailbox, key: str, span: Span, start: int,
                          stop: int, *, blocks: BlockIndex | None = None) -> Rows | None:
    """Rows [start, stop) of the tensor at `span` of the payload at `key` (one ranged GET,
    none for no rows; rounded out to whole blocks and checked when the payload has
    `blocks`, `fetch_header`'s); None when the payload is gone."""
    want = row_range(span, start, stop)
    data: bytes | memoryview = b""
    if want.size:
        r = cover(span, want, blocks)
        got = await mailbox.get_range(key, r.start, r.stop)
        if got is None:
            return None
        if len(got) != r.size:
            raise _short(key, r, len(got))
        await _check(blocks, span, r.start, got)
        data = got if r == want else memoryview(got)[want.start - r.start:want.stop - r.start]
    shape = (stop - start, *span.shape[1:]) if span.shape else ()
    return Rows(start, stop, TensorBytes(span.dtype, shape, data))


async def fetch_rows(
    mailbox: Mailbox,
    key: str,
    size: int,
    rows: Mapping[str, tuple[int, int]],
    *,
    max_gap: int = 0,
    probe: int = HEADER_PROBE,
    header_sha256: str | None = None,
    sha256: str | None = None,
) -> dict[str, Rows] | None:
    """Rows [start, stop) of each named tensor of the payload at `key` (of `size` bytes,
    as its reference says), or None when the payload is gone (swept).

    An uncompressed payload is read by ranges: the header (checked against
    `header_sha256`, the ref's, when given), then each tensor's rows (rounded out to
    whole blocks of the tensor and every block checked, when the payload carries block
    digests; ranges closer than `max_gap` bytes fetched as one). A `zstd` payload is
    fetched whole, checked against `sha256` (the ref's) when given, decoded, and sliced.
    `CorruptPayload` names the key when the header, a block or a whole payload does not
    match its digest, the header is bad, or the store returns fewer bytes than the header
    promises; `ConfigError` when a name is not in the payload or its rows are not a byte
    range.
    """
    if compression_of(key) != "off":
        blob = await mailbox.get(key)
        if blob is None:
            return None
        if len(blob) != size:
            raise CorruptPayload(f"{key}: {len(blob)} bytes, its reference says {size}")
        if sha256 is not None:
            digest = hashlib.sha256(blob).hexdigest()
            if digest != sha256:
                raise CorruptPayload(
                    f"{key}: SHA-256 {digest[:16]}..., its record says {sha256[:16]}...; it "
                    "was corrupted or replaced after the record was written")
        tensors = decode(blob, "zstd")
        missing = sorted(set(rows) - set(tensors))
        if missing:
            raise ConfigError(f"{key}: tensors {missing} are not in the payload")
        return {n: rows_of(tensors[n], a, b) for n, (a, b) in rows.items()}
    index = await fetch_header(mailbox, key, size, header_sha256=header_sha256, probe=probe)
    if index is None:
        return None
    by_name, blocks = index.spans, index.blocks
    missing = sorted(set(rows) - set(by_name))
    if missing:
        raise ConfigError(f"{key}: tensors {missing} are not in the payload")
    wanted = {n: row_range(by_name[n], a, b) for n, (a, b) in rows.items()}
    fetched = {n: cover(by_name[n], r, blocks) for n, r in wanted.items()}
    merged = coalesce([r for r in fetched.values() if r.size], max_gap)
    got = await asyncio.gather(*(mailbox.get_range(key, r.start, r.stop) for r in merged))
    pieces: list[tuple[ByteRange, memoryview]] = []
    for r, data in zip(merged, got, strict=True):
        if data is None:
            return None
        if len(data) != r.size:
            raise _short(key, r, len(data))
        pieces.append((r, memoryview(data)))
    out: dict[str, Rows] = {}
    for name, (a, b) in rows.items():
        span, want, have = by_name[name], wanted[name], fetched[name]
        piece = memoryview(b"")
        for r, view in pieces:
            if r.start <= have.start and have.stop <= r.stop:
                await _check(blocks, span, have.start, view[have.start - r.start:
                                                            have.stop - r.start])
                piece = view[want.start - r.start : want.stop - r.start]
                break
        shape = (b - a, *span.shape[1:]) if span.shape else ()
        out[name] = Rows(a, b, TensorBytes(span.dtype, shape, piece))
    return out
