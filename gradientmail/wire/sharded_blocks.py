"""Block digests: what lets a reader of a payload's byte ranges check the bytes it reads.

A record pins a payload by its SHA-256, which only a reader of the whole payload can
check. A writer that expects ranged readers (the closer's theta, steps and outer state,
Θ⁰: docs/design/sharded.md §2) also puts into the payload's metadata the SHA-256 of every block
of every tensor's data, and the record's `PayloadRef` pins the header by its own SHA-256
(`header_sha256`). A ranged reader then checks the header against the record, rounds
each range out to whole blocks of its tensor, and checks every block it read.

The metadata entry ``gradientmail.blocks`` is canonical JSON
``{"block":B,"sha256":"<base64>"}``: B the block size in bytes, and the standard base64
(padded) of the 32-byte SHA-256 digests concatenated. Blocks are cut per tensor: each
tensor's data, in the order the payload stores it, is split into ⌈nbytes / B⌉ blocks of B
bytes from the tensor's first byte, the last one short; an empty tensor has none. Cut per
tensor, not across the data section, so that a small tensor (a bias, a norm's weight)
costs a reader at most its own bytes and a block never spans two tensors.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gradientmail.errors import ConfigError, CorruptPayload
from gradientmail.wire.serialization import Span, read_index, write_order
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = [
    "BLOCKS_KEY",
    "BLOCK_BYTES",
    "MAX_BLOCK_BYTES",
    "BlockIndex",
    "blocks_entry",
    "blocks_placeholder",
    "digest_room",
    "ranged_problem",
]

#: The metadata entry holding the block digests.
BLOCKS_KEY = "gradientmail.blocks"
#: The block size writers use: 32 KiB, 32 bytes of digest (43 of base64) per block, 0.13%
#: of the data in the header, which every rank reads whole; a rank's range of a tensor
#: grows by less than 2 blocks. Smaller blocks grow the header, larger ones the ranges:
#: for GPT-2 XL-shaped BF16 fragments at 2-16 ranks the sum is least at 16-32 KiB
#: (benchmarks/sharded_blocks.py; docs/design/sharded.md §2 has the numbers).
BLOCK_BYTES = 1 << 15
#: Bound on the block size a reader accepts (a block is hashed as one buffer).
MAX_BLOCK_BYTES = 1 << 30
_DIGEST = 32


def _digests(data: memoryview, block: int) -> bytes:
    return b"".join(hashlib.sha256(data[i : i + block]).digest()
                    for i in range(0, len(data), block))


def blocks_entry(tensors: Mapping[str, TensorBytes], block: int = BLOCK_BYTES) -> str:
    """The value of ``gradientmail.blocks`` for a payload of `tensors` (as `pack` lays
    them out) with blocks of `block` bytes."""
    if isinstance(block, bool) or not isinstance(block, int) or \
            not 1 <= block <= MAX_BLOCK_BYTES:
        raise ConfigError(f"block={block!r} must be an int in [1, {MAX_BLOCK_BYTES}] "
                          f"(bytes per digested block; the default is {BLOCK_BYTES})")
    raw = b"".join(_digests(memoryview(tensors[n].buffer).cast("B"), block)
                   for n in write_order(tensors))
    return _entry(raw, block)


def blocks_placeholder(nbytes: Sequence[int], block: int = BLOCK_BYTES) -> str:
    """An entry of exactly the length `blocks_entry` gives tensors of `nbytes` bytes each
    (digests zero): what a writer that fills the data in place after the header reserves
    (`gradientmail.run.sharded_part.PartBlob`)."""
    return _entry(bytes(_DIGEST * sum(_blocks_of(n, block) for n in nbytes)), block)


def _entry(raw: bytes, block: int) -> str:
    return json.dumps({"block": block, "sha256": base64.b64encode(raw).decode("ascii")},
                      sort_keys=True, separators=(",", ":"))


def _blocks_of(nbytes: int, block: int) -> int:
    return -(-nbytes // block)


def digest_room(nbytes: int) -> int:
    """Header bytes the block digests of a tensor of `nbytes` take at most, as this
    version writes them (`BLOCK_BYTES`), with room for the entry's own JSON: what a bound
    on a payload's size adds per tensor."""
    return 44 * (_blocks_of(nbytes, BLOCK_BYTES) + 1) + 64


@dataclass(frozen=True)
class BlockIndex:
    """The block digests of one payload, checked against its spans: where each tensor's
    blocks lie and what they must hash to."""

    key: str
    block: int
    digests: bytes
    first: Mapping[str, int]  # index of each tensor's first block

    @classmethod
    def parse(cls, entry: str, spans: Sequence[Span], *, key: str = "payload") -> BlockIndex:
        """The index from the metadata `entry` of a payload whose tensors lie at `spans`
        (in data order); `CorruptPayload` naming `key` unless it is well formed and holds
        exactly one digest per block."""
        try:
            obj = json.loads(entry)
        except (ValueError, RecursionError):
            obj = None
        block = obj.get("block") if isinstance(obj, dict) else None
        text = obj.get("sha256") if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or set(obj) != {"block", "sha256"} \
                or isinstance(block, bool) or not isinstance(block, int) \
                or not 1 <= block <= MAX_BLOCK_BYTES or not isinstance(text, str):
            raise CorruptPayload(
                f"{key}: metadata {BLOCKS_KEY} must be {{\"block\": B, \"sha256\": base64}} "
                f"with 1 <= B <= {MAX_BLOCK_BYTES}; got {entry[:100]!r}")
        first: dict[str, int] = {}
        count = 0
        for span in spans:
            first[span.name] = count
            count += _blocks_of(span.end - span.start, block)
        # Checked by length before decoding: a hostile entry costs no more than its size.
        if len(text) != 4 * -(-count * _DIGEST // 3):
            raise CorruptPayload(
                f"{key}: metadata {BLOCKS_KEY} holds {len(text)} base64 characters; "
                f"{count} blocks of {block} bytes need {4 * -(-count * _DIGEST // 3)}")
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise CorruptPayload(f"{key}: metadata {BLOCKS_KEY} is not base64") from None
        return cls(key, block, raw, first)

    def cover(self, span: Span, start: int, stop: int) -> tuple[int, int]:
        """Bytes [start, stop) of the tensor at `span` (absolute offsets) rounded out to
        whole blocks of that tensor: what a reader must fetch to check them."""
        if start == stop:
            return start, stop
        lo = span.start + (start - span.start) // self.block * self.block
        hi = span.start + -(-(stop - span.start) // self.block) * self.block
        return lo, min(hi, span.end)

    def check(self, span: Span, start: int, data: bytes | memoryview) -> None:
        """Check `data`, bytes [start, start + len) of the tensor at `span` (a `cover`ed
        range), block by block; `CorruptPayload` naming the key, the tensor and the
        first block whose bytes do not match their digest."""
        view = memoryview(data).cast("B")
        if not len(view):
            return
        offset = start - span.start
        if offset % self.block or not (len(view) % self.block == 0
                                       or start + len(view) == span.end):
            raise ConfigError(f"{self.key}: bytes [{start}, {start + len(view)}) of tensor "
                              f"{span.name!r} are not whole blocks of {self.block} bytes")
        index = self.first[span.name] + offset // self.block
        for i in range(0, len(view), self.block):
            got = hashlib.sha256(view[i : i + self.block]).digest()
            at = (index + i // self.block) * _DIGEST
            want = self.digests[at : at + _DIGEST]
            if got != want:
                n = offset // self.block + i // self.block
                a = span.start + offset + i
                raise CorruptPayload(
                    f"{self.key}: block {n} of tensor {span.name!r} (bytes [{a}, "
                    f"{a + len(view[i : i + self.block])})) has SHA-256 {got.hex()[:16]}..., "
                    f"its header says {want.hex()[:16]}...; it was corrupted or replaced "
                    "after it was written")


def ranged_problem(blob: bytes | memoryview, *, key: str,
                   header_sha256: str | None) -> str | None:
    """What a ranged reader would refuse in the whole uncompressed payload `blob` (whose
    bytes its ref's SHA-256 vouches for): a header that differs from `header_sha256`, or
    a block that differs from its digest; None when every range would read. A closer
    that wrote wrong digests would have every sharded learner refuse its commit while
    unsharded learners accept it: `gradientmail verify` asks this of every commit."""
    view = memoryview(blob).cast("B")
    try:
        spans, meta = read_index(view, key=key)
    except CorruptPayload as exc:
        return str(exc)
    head = spans[0].start if spans else len(view)
    if header_sha256 is not None:
        digest = hashlib.sha256(view[:head]).hexdigest()
        if digest != header_sha256:
            return (f"{key}: the header (bytes [0, {head})) has SHA-256 {digest[:16]}..., "
                    f"its record says {header_sha256[:16]}...")
    entry = meta.get(BLOCKS_KEY)
    if entry is None:
        return None
    try:
        index = BlockIndex.parse(entry, spans, key=key)
        for span in spans:
            index.check(span, span.start, view[span.start : span.end])
    except CorruptPayload as exc:
        return str(exc)
    return None
