"""The decoders under hostile input (STYLE.md §7).

Truncated, bit-flipped and hand-crafted hostile payloads must raise a `GradientmailError`
subclass whose message names the payload's key, never another exception, never a hang,
and never an allocation beyond the bound the caller gave.
"""

from __future__ import annotations

import json
import random
import struct
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradientmail.errors import CorruptPayload, GradientmailError
from gradientmail.wire.compression import COMPRESSIONS, SHUFFLE_KEY, decode, encode
from gradientmail.wire.quantization import FORMATS, dequantize, quantize
from gradientmail.wire.serialization import unpack
from gradientmail.wire.tensor_bytes import TensorBytes

KEY = "payloads/00000042/learner-7.safetensors"


def small_payload() -> dict[str, TensorBytes]:
    w = TensorBytes.from_numpy(np.array([[0.5, -1.0, 2.0], [3.0, 0.25, -0.125]], np.float32))
    out = {
        "w": w,
        "b": TensorBytes.from_numpy(np.array([1.5, -2.0, 0.0], ml_dtypes.bfloat16)),
        "h": TensorBytes.from_numpy(np.array(7.0, np.float16)),
    }
    out.update(quantize("q4", TensorBytes.from_numpy(np.arange(35, dtype=np.float32)), "F4"))
    out.update(quantize("q8", w, "F8_E4M3"))
    return out


def decode_or_error(blob: bytes, compression: str, **kwargs: Any) -> dict[str, TensorBytes] | None:
    """Decode; on failure, check the failure is ours and names the key. None if it failed."""
    try:
        return decode(blob, compression, key=KEY, **kwargs)
    except GradientmailError as exc:
        assert KEY in str(exc), str(exc)
        return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_every_truncation_is_refused(compression: str) -> None:
    blob = encode(small_payload(), compression, {"round": "42"})
    assert decode(blob, compression) == small_payload()
    for n in range(len(blob)):
        with pytest.raises(CorruptPayload) as info:
            decode(blob[:n], compression, key=KEY)
        assert str(info.value).startswith(KEY + ": ")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_random_byte_flips_decode_or_raise_ours(compression: str) -> None:
    blob = encode(small_payload(), compression, {"round": "42"})
    rng = random.Random(1234)
    refused = 0
    for _ in range(3000):
        corrupt = bytearray(blob)
        for _ in range(rng.choice([1, 1, 2, 8])):
            corrupt[rng.randrange(len(corrupt))] ^= 1 << rng.randrange(8)
        out = decode_or_error(bytes(corrupt), compression)
        if out is None:
            refused += 1
        else:
            assert all(isinstance(t, TensorBytes) for t in out.values())
    assert refused > 100  # the header is most of this payload: most flips must be caught


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blob=st.binary(max_size=300), compression=st.sampled_from(COMPRESSIONS))
def test_arbitrary_bytes(blob: bytes, compression: str) -> None:
    decode_or_error(blob, compression)


# -- hand-crafted hostile headers ------------------------------------------------------------


def blob_of(header: object, data: bytes = b"", raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def entry(dtype: object, shape: object, begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


HOSTILE = [
    pytest.param(
        struct.pack("<Q", 2**63) + b"{}", "header claims 9223372036854775808 bytes", id="huge-len"
    ),
    pytest.param(
        blob_of({"a": entry("F32", [2], 0, 8)}, bytes(4)),
        "the header describes 8 data bytes but the blob holds 4",
        id="offsets-past-end",
    ),
    pytest.param(
        blob_of({"a": entry("F32", [1], 0, 4)}, bytes(8)),
        "the header describes 4 data bytes but the blob holds 8",
        id="trailing-bytes",
    ),
    pytest.param(
        blob_of({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12)),
        "tensor 'b' starts at data offset 4, expected 8; it overlaps the previous tensor",
        id="overlap",
    ),
    pytest.param(
        blob_of({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12)),
        "tensor 'b' starts at data offset 8, expected 4; it leaves a gap",
        id="gap",
    ),
    pytest.param(
        blob_of({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 0, 4)}, bytes(4)),
        "expected 4; it overlaps",
        id="same-span",
    ),
    pytest.param(
        blob_of({"a": entry("F64", [1], 0, 8)}, bytes(8)),
        "tensor 'a' has dtype 'F64'; allowed: F32, F16, BF16, F8_E4M3, F8_E8M0, F4, U16",
        id="dtype-f64",
    ),
    pytest.param(
        blob_of({"a": entry(["F32"], [1], 0, 4)}, bytes(4)), "tensor 'a' has dtype", id="dtype-list"
    ),
    pytest.param(
        blob_of({"a": entry("F32", [3], 0, 8)}, bytes(8)),
        "tensor 'a' is F32[3] but spans 8 bytes",
        id="shape-size",
    ),
    pytest.param(
        blob_of({"a": entry("F4", [3], 0, 2)}, bytes(2)),
        "tensor 'a' is F4[3] but spans 2 bytes",
        id="f4-odd-without-metadata",
    ),
    pytest.param(
        blob_of({"a": entry("F32", [2**62] * 500, 0, 4)}, bytes(4)),
        "tensor 'a' is F32",
        id="huge-dims",
    ),
    pytest.param(blob_of({"a": entry("F32", [-1], 0, 4)}, bytes(4)), "non-negative", id="neg-dim"),
    pytest.param(blob_of({"a": entry("F32", [True], 0, 4)}, bytes(4)), "non-negative", id="bool"),
    pytest.param(blob_of({"a": entry("F32", [1.0], 0, 4)}, bytes(4)), "non-negative", id="float"),
    pytest.param(blob_of({"a": entry("F32", 4, 0, 4)}, bytes(4)), "need a list", id="shape-int"),
    pytest.param(
        blob_of({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, bytes(4)),
        "need [begin, end] with 0 <= begin <= end",
        id="reversed-offsets",
    ),
    pytest.param(
        blob_of({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4)),
        "has data_offsets [0]",
        id="one-offset",
    ),
    pytest.param(
        blob_of({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}, bytes(4)),
        "must have exactly dtype, shape and data_offsets",
        id="extra-field",
    ),
    pytest.param(blob_of({"a": "F32"}), "must have exactly", id="entry-not-object"),
    pytest.param(blob_of(None, raw=b"{not json"), "not valid JSON", id="not-json"),
    pytest.param(blob_of(None, raw=b"\xff\xfe{}"), "not valid JSON", id="not-utf8"),
    pytest.param(blob_of([1, 2]), "must be a JSON object", id="json-list"),
    pytest.param(blob_of(None, raw=b"[" * 200_000), "not valid JSON", id="deep-nesting"),
    pytest.param(
        blob_of(
            None,
            raw=b'{"a":'
            + json.dumps(entry("F32", [1], 0, 4)).encode() * 1
            + b","
            + b'"a":'
            + json.dumps(entry("F32", [1], 4, 8)).encode()
            + b"}",
            data=bytes(8),
        ),
        "the header names 'a' twice",
        id="duplicate-name",
    ),
    pytest.param(
        blob_of({"__metadata__": {"a": 1}}), "__metadata__ must map strings to strings", id="meta"
    ),
    pytest.param(blob_of({"__metadata__": []}), "__metadata__ must map", id="meta-list"),
    pytest.param(
        blob_of(
            {"__metadata__": {"gradientmail.f4shape.a": "[5]"}, "a": entry("F4", [4], 0, 2)},
            bytes(2),
        ),
        "F4 shape metadata '[5]' does not match the stored F4[4]",
        id="f4-shape-mismatch",
    ),
    pytest.param(
        blob_of(
            {"__metadata__": {"gradientmail.f4shape.a": "[1]"}, "a": entry("F32", [1], 0, 4)},
            bytes(4),
        ),
        "F4 shape metadata '[1]' does not match the stored F32[1]",
        id="f4-shape-on-f32",
    ),
    pytest.param(
        blob_of(
            {"__metadata__": {"gradientmail.f4shape.a": "{"}, "a": entry("F4", [2], 0, 1)}, bytes(1)
        ),
        "F4 shape metadata '{' does not match",
        id="f4-shape-not-json",
    ),
    pytest.param(
        blob_of({"__metadata__": {"gradientmail.f4shape.zz": "[1]"}}),
        "F4 shape metadata names tensors ['zz'] that are absent",
        id="f4-shape-stray",
    ),
    pytest.param(
        blob_of({"__metadata__": {SHUFFLE_KEY: "2"}}),
        "metadata gradientmail.shuffle='2'; the only layout is '1'",
        id="bad-shuffle-flag",
    ),
    pytest.param(b"\x01\x00", "2 bytes is shorter than the 8-byte", id="tiny"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("blob", "message"), HOSTILE)
def test_hostile_headers(blob: bytes, message: str) -> None:
    start = time.monotonic()
    with pytest.raises(CorruptPayload) as info:
        decode(blob, "off", key=KEY)
    assert str(info.value).startswith(KEY + ": ")
    assert message in str(info.value)
    # The same inner blob inside a valid zstd frame fails the same way.
    framed = zstandard.ZstdCompressor(level=1).compress(blob)
    with pytest.raises(CorruptPayload, match=message.replace("[", r"\[").replace("(", r"\(")):
        decode(framed, "zstd", key=KEY)
    assert time.monotonic() - start < 10


def test_limits_on_header_size_and_tensor_count() -> None:
    blob = encode(small_payload(), "off")
    with pytest.raises(CorruptPayload, match="limit 64"):
        unpack(blob, key=KEY, max_header_bytes=64)
    with pytest.raises(CorruptPayload, match="7 tensors exceed the limit of 3"):
        unpack(blob, key=KEY, max_tensors=3)


# -- hostile zstd frames -------------------------------------------------------------------


def _bomb() -> bytes:
    """256 MiB of zeros in a few kilobytes, streamed so the test never holds 256 MiB."""
    stream = zstandard.ZstdCompressor(level=1).compressobj(size=256 << 20)
    zeros = bytes(1 << 20)
    frame = b"".join(stream.compress(zeros) for _ in range(256)) + stream.flush()
    assert len(frame) < 100_000
    return frame


def _frame(size_field: int) -> bytes:
    frame = bytearray(zstandard.ZstdCompressor(level=1).compress(b"x" * 100))
    assert frame[4] == 0x20 and frame[5] == 100  # single segment, 1-byte content size
    frame[5] = size_field
    return bytes(frame)


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        pytest.param(b"", "not a zstd frame", id="empty"),
        pytest.param(b"PK\x03\x04 not zstd", "not a zstd frame", id="not-zstd"),
        pytest.param(
            zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(1000)),
            "does not declare its decompressed size",
            id="no-content-size",
        ),
        pytest.param(_frame(50), "the zstd frame is corrupt", id="declares-less"),
        pytest.param(_frame(200), "the zstd frame", id="declares-more"),
        pytest.param(
            zstandard.ZstdCompressor(level=1).compress(b"ab") + b"trailing",
            "the zstd frame is corrupt",
            id="trailing",
        ),
        pytest.param(
            _bomb,
            "would decompress to 268435456 bytes, past the bound of 1048576",
            id="bomb",
        ),
    ],
)
def test_hostile_zstd_frames(blob: bytes | Callable[[], bytes], message: str) -> None:
    if callable(blob):
        blob = blob()
    start = time.monotonic()
    with pytest.raises(CorruptPayload) as info:
        decode(blob, "zstd", key=KEY, max_bytes=1 << 20)
    assert str(info.value).startswith(KEY + ": ")
    assert message in str(info.value)
    assert time.monotonic() - start < 5


# -- dequantize on corrupt entries -----------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    codes=st.binary(min_size=70, max_size=70),
    scale=st.binary(min_size=4, max_size=4),
)
def test_dequantize_random_entries(fmt: str, codes: bytes, scale: bytes) -> None:
    entries = quantize("t", TensorBytes.from_numpy(np.ones(35, np.float32)), fmt)
    entries["t"] = TensorBytes(entries["t"].dtype, (35,), codes[: entries["t"].nbytes])
    if fmt != "BF16":
        old = entries["t.scale"]
        entries["t.scale"] = TensorBytes(old.dtype, old.shape, scale[: old.nbytes])
    try:
        out = dequantize(entries, "t", fmt, key=KEY)
    except CorruptPayload as exc:
        assert str(exc).startswith(f"{KEY}: tensor 't")
    else:
        assert out.dtype == "F32" and out.shape == (35,)
        assert np.isfinite(out.to_numpy()).all()
