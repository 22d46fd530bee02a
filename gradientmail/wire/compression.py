"""Payload codecs: ``off`` (the safetensors blob as is) and ``zstd`` (byte-shuffled, zstd).

`encode(tensors, compression)` returns the bytes to upload; `decode(blob, compression)`
turns them back into tensors. The key's extension names the codec (`extension`,
`compression_of`), so a reader needs no agreement with the writer.

``zstd`` byte-shuffles every tensor before packing: the k-th byte of every element is
stored side by side (all low bytes, then all second bytes, ...), so the slowly varying
sign/exponent bytes of float weights form long compressible runs. One-byte formats
(F8_E4M3, F8_E8M0, F4) are left as they are. A shuffled blob is an ordinary safetensors
file whose metadata holds ``{"gradientmail.shuffle": "1"}``; the tensors' dtype and shape
are the real ones, only the order of their data bytes differs. The encoder packs the
tensors unshuffled (no marker) when a sample of each compresses smaller that way
(`_shuffle_pays`: tensors of few distinct values, such as the merged step of 1-bit
deltas); the decoder reads both. The blob is compressed as one zstd frame that declares
its decompressed size (multi-threaded for large payloads): at level 1, and a shuffled
blob at level 1 with a 2^7-entry hash table (`_SHUFFLED_HASH_LOG`; before 2026-12-05 at
plain level 1, whose frames decode the same). Only the compressed bytes depend on these
settings, never what the frame decompresses to.

Decoding never allocates more than `max_bytes` (default `DEFAULT_MAX_BYTES`): a frame
that declares no size, or a size above the bound, is refused before decompression.
Pass the bound the schema allows (`size_bound`) wherever it is known.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from gradientmail.errors import ConfigError, CorruptPayload, MissingExtra, RemoteProtocolError
from gradientmail.wire.quantization import quantized_nbytes
from gradientmail.wire.serialization import Schema, frozen_view, pack, pack_header, read_index
from gradientmail.wire.sharded_blocks import BLOCKS_KEY, blocks_entry, digest_room
from gradientmail.wire.tensor_bytes import TensorBytes, dtype_bits, handed_over

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_MAX_BYTES",
    "SHUFFLE_KEY",
    "check_compression",
    "compression_of",
    "decode",
    "decode_with_metadata",
    "encode",
    "extension",
    "shuffle",
    "size_bound",
    "unshuffle",
]

COMPRESSIONS: tuple[str, ...] = ("off", "zstd")
_EXTENSIONS = {"off": ".safetensors", "zstd": ".safetensors.zst"}
#: Metadata entry marking a byte-shuffled blob.
SHUFFLE_KEY = "gradientmail.shuffle"
#: Decompressed-size bound used when the caller gives none.
DEFAULT_MAX_BYTES = 8 << 30
_LEVEL = 1
#: zstd's hash table (log2 of its entries) for byte-shuffled blobs, in place of level 1's
#: 2^14. The gain of shuffling floats is the entropy coding of the sign/exponent plane: a
#: few distinct bytes in random order, where a large table keeps finding short matches
#: that cost more than they save, at half of zstd's speed. With 2^7 entries those bytes
#: stay literals (GPT-2-shaped BF16 drawn N(0, 0.02), benchmarks/codec.py: the blob at
#: ~1,250 MB/s against ~610 per core, ratio 1.492 against 1.461). Runs of zeros still
#: match; repeated content matches less often than at 2^14 (a 98 KB block repeated 20
#: times: 7x the bytes; 2^6, as fast otherwise, 20x), and where that makes the shuffled
#: sample larger than the plain one, `_shuffle_pays` packs the payload unshuffled.
_SHUFFLED_HASH_LOG = 7
_THREADED_FROM = 8 << 20  # below this, starting zstd's worker threads costs more than it saves
_BLOCK = 1 << 16  # elements per step of the (un)shuffle: its reads and writes stay in cache
# Element width -> an unsigned little-endian integer of that width.
_WORDS: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def check_compression(compression: str) -> str:
    """Return `compression` if it is a codec name; `ConfigError` otherwise."""
    if compression not in COMPRESSIONS:
        raise ConfigError(f"compression {compression!r} is not one of {', '.join(COMPRESSIONS)}")
    return compression


def extension(compression: str) -> str:
    """The key extension naming the codec: ".safetensors" or ".safetensors.zst"."""
    return _EXTENSIONS[check_compression(compression)]


def compression_of(key: str) -> str:
    """The codec a key's extension names; `RemoteProtocolError` for any other key."""
    if key.endswith(_EXTENSIONS["zstd"]):
        return "zstd"
    if key.endswith(_EXTENSIONS["off"]):
        return "off"
    raise RemoteProtocolError(
        f"key {key!r} ends in neither .safetensors nor .safetensors.zst; it names no payload codec"
    )


def size_bound(schema: Schema, names: Iterable[str] | None = None, fmt: str | None = None) -> int:
    """An upper bound on the encoded (uncompressed) blob of `names` of `schema`.

    `fmt` is the transfer format (None: each parameter's storage dtype); the bound covers
    the data, the scales and a generous header, so a `decode` with this `max_bytes`
    accepts every honest payload and refuses anything much larger.
    """
    total = 0
    for name in schema.names if names is None else names:
        spec = schema[name]
        data = spec.nbytes if fmt is None else quantized_nbytes(fmt, spec.numel)
        # Header room for up to three entries per parameter (codes, scale, F4 shape
        # metadata), each naming it, JSON-escaped at worst 6 bytes per byte.
        total += data + 3 * (6 * len(name.encode()) + 100 + 24 * len(spec.shape))
        total += digest_room(data)  # a payload a ranged reader reads carries digests
    return total + 4096


def shuffle(tensor: TensorBytes) -> TensorBytes:
    """The same tensor with byte k of every element stored together, k = 0, 1, ..."""
    width = dtype_bits(tensor.dtype) // 8
    if width <= 1 or not tensor.nbytes:
        return tensor
    out = np.empty(tensor.nbytes, np.uint8)
    _shuffle_into(tensor.buffer, width, out)
    return TensorBytes(tensor.dtype, tensor.shape, handed_over(out))


def unshuffle(tensor: TensorBytes) -> TensorBytes:
    """Inverse of `shuffle`."""
    width = dtype_bits(tensor.dtype) // 8
    if width <= 1 or not tensor.nbytes:
        return tensor
    return TensorBytes(tensor.dtype, tensor.shape, _interleave(memoryview(tensor.buffer), width))


def _shuffle_into(data: bytes | memoryview, width: int, out: npt.NDArray[np.uint8]) -> None:
    """Write the shuffled bytes of `data` into `out` (same length)."""
    source = np.frombuffer(data, np.uint8)
    if width <= 1:
        out[:] = source
        return
    planes = out.reshape(width, -1)
    words = _WORDS.get(width)
    if words is None:  # no such dtype today: a byte transpose, a block at a time
        elements = source.reshape(-1, width)
        for i in range(0, elements.shape[0], _BLOCK):
            planes[:, i : i + _BLOCK] = elements[i : i + _BLOCK].T
        return
    # Byte k of each little-endian word is (word >> 8k) cast to uint8: contiguous integer
    # loops, 2-3x faster than numpy's strided byte transpose.
    values = source.view(words)
    for i in range(0, values.size, _BLOCK):
        part = values[i : i + _BLOCK]
        np.copyto(planes[0, i : i + _BLOCK], part, casting="unsafe")
        for k in range(1, width):
            np.right_shift(part, 8 * k, out=planes[k, i : i + _BLOCK], casting="unsafe")


def _interleave(shuffled: memoryview, width: int) -> npt.NDArray[np.uint8]:
    """Inverse of the shuffle: `shuffled` holds `width` byte planes one after another.
    Returns a new read-only array (no further copy into bytes)."""
    planes = np.frombuffer(shuffled, np.uint8).reshape(width, -1)
    words = _WORDS.get(width)
    if words is None:
        out = np.empty((planes.shape[1], width), np.uint8)
        for i in range(0, planes.shape[1], _BLOCK):
            out[i : i + _BLOCK] = planes[:, i : i + _BLOCK].T
        return handed_over(out)
    # Each word is the OR of its bytes shifted into place, built in the output a block
    # at a time (the block's shifted plane in a small reused buffer).
    values = np.empty(planes.shape[1], words)
    shifted = np.empty(min(_BLOCK, values.size), words)
    for i in range(0, values.size, _BLOCK):
        word = values[i : i + _BLOCK]
        np.copyto(word, planes[0, i : i + _BLOCK])
        for k in range(1, width):
            t = shifted[: word.size]
            np.left_shift(planes[k, i : i + _BLOCK], 8 * k, out=t, dtype=words)
            word |= t
    return handed_over(values.view(np.uint8))


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise MissingExtra("zstd", "compression='zstd'") from None
    return zstandard


def encode(
    tensors: Mapping[str, TensorBytes],
    compression: str = "off",
    metadata: Mapping[str, str] | None = None,
    *,
    blocks: int | None = None,
) -> bytes:
    """The payload bytes of `tensors` under `compression` (deterministic for equal input).

    `blocks` (bytes per block; uncompressed payloads only) adds the block digests a
    ranged reader checks (`gradientmail.wire.sharded_blocks`).

    Under ``zstd`` the decompressed frame is exactly ``pack`` of the shuffled tensors with
    the shuffle marker in the metadata, built in one buffer and compressed in one call
    (measured faster than streaming the shuffled pieces into zstd).
    """
    check_compression(compression)
    meta = dict(metadata or {})
    for reserved in (SHUFFLE_KEY, BLOCKS_KEY):
        if reserved in meta:
            raise ConfigError(f"payload metadata key {reserved!r} is reserved for the codec")
    if blocks is not None:
        if compression != "off":
            raise ConfigError(f"blocks={blocks} with compression={compression!r}: block "
                              "digests serve ranged reads, and no range of a zstd frame "
                              "decodes alone; write the payload uncompressed")
        meta[BLOCKS_KEY] = blocks_entry(tensors, blocks)
    zstandard = None if compression == "off" else _zstd()
    if zstandard is None or not _shuffle_pays(tensors, zstandard):
        raw = pack(tensors, meta)
        if zstandard is None:
            return raw
        plain: bytes = _compressor(zstandard, len(raw), shuffled=False).compress(raw)
        return plain
    meta[SHUFFLE_KEY] = "1"
    header, order = pack_header(tensors, meta)  # shuffling keeps every length
    blob = np.empty(len(header) + sum(tensors[n].nbytes for n in order), np.uint8)
    blob[: len(header)] = np.frombuffer(header, np.uint8)
    pos = len(header)
    for name in order:
        tensor = tensors[name]
        end = pos + tensor.nbytes
        _shuffle_into(tensor.buffer, dtype_bits(tensor.dtype) // 8, blob[pos:end])
        pos = end
    out: bytes = _compressor(zstandard, blob.size, shuffled=True).compress(blob)
    return out


def _compressor(zstandard: Any, size: int, *, shuffled: bool) -> Any:
    """zstd at level 1 for a blob of `size` bytes; with a small hash table when `shuffled`
    (`_SHUFFLED_HASH_LOG`). The frame is an ordinary one: any zstd decoder reads it."""
    # zstd's multi-threaded frames are the same for any number of workers >= 1, so the
    # bytes depend on the payload's size alone, never on the machine.
    threads = min(os.cpu_count() or 1, 4) if size >= _THREADED_FROM else 0
    if not shuffled:
        return zstandard.ZstdCompressor(level=_LEVEL, threads=threads, write_content_size=True)
    params = zstandard.ZstdCompressionParameters.from_level(
        _LEVEL, hash_log=_SHUFFLED_HASH_LOG, threads=threads, write_content_size=True
    )
    return zstandard.ZstdCompressor(compression_params=params)


#: Bytes of each tensor, and in all, that `_shuffle_pays` compresses both ways (zstd's
#: level 1 finds the shuffled planes' gain from ~256 KiB of input on, not in 64 KiB).
_SAMPLE, _SAMPLE_ALL = 1 << 18, 1 << 20


def _shuffle_pays(tensors: Mapping[str, TensorBytes], zstandard: Any) -> bool:
    """Whether byte-shuffling makes the frame smaller, judged on the first `_SAMPLE`
    bytes of the multi-byte tensors, largest first, up to `_SAMPLE_ALL` in all, compressed
    both ways with the settings `encode` would use (deterministic for equal input). Float
    tensors of trained values shuffle to ~0.85 of their size, against ~0.93 plain; a
    tensor of few distinct values (a merged step of 1-bit deltas: a sum of signs times one
    magnitude per chunk) compresses to ~0.26 unshuffled and ~0.71 shuffled."""
    plain, shuffled = bytearray(), bytearray()
    for name in sorted(tensors, key=lambda n: (-tensors[n].nbytes, n)):
        tensor = tensors[name]
        width = dtype_bits(tensor.dtype) // 8
        room = min(_SAMPLE, _SAMPLE_ALL - len(plain))
        if room < width:
            break
        if width <= 1 or not tensor.nbytes:
            continue
        head = bytes(memoryview(tensor.buffer).cast("B")[: room - room % width])
        out = np.empty(len(head), np.uint8)
        _shuffle_into(head, width, out)
        plain += head
        shuffled += out.tobytes()
    if not plain:
        return True
    as_shuffled = _compressor(zstandard, 0, shuffled=True).compress(bytes(shuffled))
    as_plain = _compressor(zstandard, 0, shuffled=False).compress(bytes(plain))
    return len(as_shuffled) <= len(as_plain)


def decode(
    blob: bytes,
    compression: str,
    *,
    key: str = "payload",
    max_bytes: int | None = None,
) -> dict[str, TensorBytes]:
    """Tensors of a payload; `CorruptPayload` naming `key` (and the tensor) on bad input."""
    return decode_with_metadata(blob, compression, key=key, max_bytes=max_bytes)[0]


def decode_with_metadata(
    blob: bytes,
    compression: str,
    *,
    key: str = "payload",
    max_bytes: int | None = None,
) -> tuple[dict[str, TensorBytes], dict[str, str]]:
    """Like `decode`, also returning the metadata given to `encode`."""
    check_compression(compression)
    limit = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    if compression == "off":
        raw = blob
        if len(raw) > limit:
            raise CorruptPayload(
                f"{key}: {len(raw)} bytes exceed the bound of {limit} for this payload"
            )
    else:
        raw = _decompress(blob, key, limit)
    spans, meta = read_index(raw, key=key)
    flag = meta.pop(SHUFFLE_KEY, None)
    if flag not in (None, "1"):
        raise CorruptPayload(f"{key}: metadata {SHUFFLE_KEY}={flag!r}; the only layout is '1'")
    # Unshuffled tensors are views into the payload (read-only, no copy); shuffled ones
    # are interleaved once into their own arrays.
    view = frozen_view(raw)
    out: dict[str, TensorBytes] = {}
    for span in spans:
        data = view[span.start : span.end]
        width = dtype_bits(span.dtype) // 8
        held = _interleave(data, width) if flag and width > 1 and data else data
        out[span.name] = TensorBytes(span.dtype, span.shape, held)
    return out, meta


def _decompress(blob: bytes, key: str, limit: int) -> bytes:
    zstandard = _zstd()
    try:
        size = zstandard.get_frame_parameters(blob).content_size
    except zstandard.ZstdError as exc:
        raise CorruptPayload(f"{key}: not a zstd frame ({exc})") from None
    if size == zstandard.CONTENTSIZE_UNKNOWN or size == zstandard.CONTENTSIZE_ERROR:
        raise CorruptPayload(
            f"{key}: the zstd frame does not declare its decompressed size; "
            "gradientmail payloads always do"
        )
    if size > limit:
        raise CorruptPayload(
            f"{key}: the zstd frame would decompress to {size} bytes, past the bound of "
            f"{limit} for this payload"
        )
    try:
        out: bytes = zstandard.ZstdDecompressor().decompress(
            blob, max_output_size=max(size, 1), allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise CorruptPayload(f"{key}: the zstd frame is corrupt ({exc})") from None
    if len(out) != size:
        raise CorruptPayload(f"{key}: the zstd frame declared {size} bytes but held {len(out)}")
    return out
