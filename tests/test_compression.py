"""Payload codecs: goldens, round trips over every dtype × format × codec, bounds."""

from __future__ import annotations

import hashlib
import os
import sys

import ml_dtypes
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradientmail.errors import (
    ConfigError,
    CorruptPayload,
    MissingExtra,
    RemoteProtocolError,
)
from gradientmail.wire.compression import (
    COMPRESSIONS,
    DEFAULT_MAX_BYTES,
    SHUFFLE_KEY,
    compression_of,
    decode,
    decode_with_metadata,
    encode,
    extension,
    shuffle,
    size_bound,
    unshuffle,
)
from gradientmail.wire.quantization import FORMATS, dequantize, quantize, roundtrip
from gradientmail.wire.serialization import ParameterSpec, Schema, pack
from gradientmail.wire.tensor_bytes import TensorBytes


def golden_tensors() -> dict[str, TensorBytes]:
    """A fixed payload from integer arithmetic only: F32, BF16, F16 and every format."""
    i = np.arange(1000, dtype=np.int64)
    x = ((i * 7919) % 2001 - 1000).astype(np.float32) * np.float32(2e-5)
    x = (x * (1 + (i % 97)).astype(np.float32)).reshape(8, 125)
    out = {
        "w": TensorBytes.from_numpy(x),
        "b": TensorBytes.from_numpy(x[0].astype(ml_dtypes.bfloat16)),
        "h": TensorBytes.from_numpy(x[1, :7].astype(np.float16)),
    }
    for fmt in FORMATS:
        out.update(quantize(f"q_{fmt}", out["w"], fmt))
    return out


GOLDEN = {
    "off": "040d68fc5da43239c4fbda81d0add53786dc5729dc983af8f159a244353b4821",
    "zstd": "abf7b402e9e08a93e535355c0e15b8803268072c4927f5666b02363b0b818e82",
    # What the zstd frame decompresses to: pins the shuffled layout apart from libzstd.
    "zstd-frame": "5b53a07ecfd80e12834bd4488b1ff1af7c839d603dae08473c1b019c2d6589f0",
    # The same frame as encoders before 2026-12-05 wrote it (zstd level 1, its own table).
    "zstd-level1": "6573e065008405c8dc90bba469fe08bb63401447477e6b5a3334f0aba07e92df",
}


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_golden_payloads(compression: str) -> None:
    blob = encode(golden_tensors(), compression, {"round": "12"})
    assert hashlib.sha256(blob).hexdigest() == GOLDEN[compression]
    if compression == "zstd":
        frame = zstandard.ZstdDecompressor().decompress(blob)
        assert hashlib.sha256(frame).hexdigest() == GOLDEN["zstd-frame"]
    assert decode_with_metadata(blob, compression) == (golden_tensors(), {"round": "12"})


def test_payloads_of_the_level_1_encoder_still_decode() -> None:
    """Encoders before 2026-12-05 compressed the same frame at plain level 1: those exact
    bytes (the golden of then) decode to the same tensors, small and threaded alike."""
    frame = zstandard.ZstdDecompressor().decompress(
        encode(golden_tensors(), "zstd", {"round": "12"}))
    old = zstandard.ZstdCompressor(level=1).compress(frame)
    assert hashlib.sha256(old).hexdigest() == GOLDEN["zstd-level1"]
    assert old != encode(golden_tensors(), "zstd", {"round": "12"})
    assert decode_with_metadata(old, "zstd") == (golden_tensors(), {"round": "12"})
    rng = np.random.default_rng(2)
    big = {"w": TensorBytes.from_numpy(
        (rng.standard_normal(2_300_000) * 0.02).astype(ml_dtypes.bfloat16))}
    frame = zstandard.ZstdDecompressor().decompress(encode(big, "zstd"))
    old = zstandard.ZstdCompressor(level=1, threads=2, write_content_size=True).compress(frame)
    assert decode(old, "zstd") == big
    with pytest.raises(CorruptPayload, match="the zstd frame is corrupt"):
        decode(old[: len(old) // 2], "zstd")


def test_shuffled_floats_compress_smaller_than_at_plain_level_1() -> None:
    # The shuffled blob's small hash table leaves the sign/exponent plane to the entropy
    # coder, which packs it tighter than level 1's short matches do.
    rng = np.random.default_rng(3)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        w = {"w": TensorBytes.from_numpy((rng.standard_normal(300_000) * 0.02).astype(dtype))}
        blob = encode(w, "zstd")
        frame = zstandard.ZstdDecompressor().decompress(blob)
        assert frame == pack({"w": shuffle(w["w"])}, {SHUFFLE_KEY: "1"})
        assert len(blob) < 0.995 * len(zstandard.ZstdCompressor(level=1).compress(frame))


def test_zstd_frame_is_pack_of_the_shuffled_tensors() -> None:
    tensors = golden_tensors()
    frame = zstandard.ZstdDecompressor().decompress(encode(tensors, "zstd", {"a": "b"}))
    shuffled = {name: shuffle(t) for name, t in tensors.items()}
    assert frame == pack(shuffled, {"a": "b", SHUFFLE_KEY: "1"})


def test_shuffle_layout() -> None:
    t = TensorBytes.from_numpy(np.array([1.0, -2.0], np.float32))  # 0000803f 000000c0
    assert shuffle(t).data == bytes.fromhex("00 00 00 00 80 00 3f c0")
    assert unshuffle(shuffle(t)) == t
    one_byte = TensorBytes("F8_E4M3", (3,), b"\x01\x02\x03")
    assert shuffle(one_byte) == one_byte
    f4 = TensorBytes("F4", (3,), b"\x21\x03")
    assert shuffle(f4) == f4


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_shuffle_over_many_blocks_is_the_byte_transpose(dtype: str) -> None:
    # Several of the (un)shuffle's steps and a short last one, on random bytes (every
    # byte value in every plane): the planes are the plain transpose of the elements.
    width = {"F32": 4, "F16": 2, "BF16": 2}[dtype]
    numel = 3 * (1 << 16) + 5
    raw = np.random.default_rng(width).integers(0, 256, numel * width, dtype=np.uint8)
    t = TensorBytes(dtype, (numel,), raw.tobytes())
    shuffled = shuffle(t)
    assert shuffled.data == np.ascontiguousarray(raw.reshape(-1, width).T).tobytes()
    assert unshuffle(shuffled) == t
    blob = encode({"w": t}, "zstd")
    assert decode(blob, "zstd") == {"w": t}


def test_zstd_compresses_smooth_floats_better_than_plain_zstd() -> None:
    rng = np.random.default_rng(0)
    w = TensorBytes.from_numpy((rng.standard_normal(200_000) * 0.02).astype(np.float32))
    plain = zstandard.ZstdCompressor(level=1).compress(pack({"w": w}))
    assert len(encode({"w": w}, "zstd")) < 0.95 * len(plain)


def test_large_payload_is_streamed_threaded_and_deterministic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Over 8 MiB the compressor runs zstd's worker threads; the frame stays deterministic,
    # whatever the number of cores the encoding machine has.
    rng = np.random.default_rng(1)
    big = {"w": TensorBytes.from_numpy((rng.standard_normal(2_300_000) * 0.02).astype(np.float32))}
    blob = encode(big, "zstd")
    assert encode(big, "zstd") == blob
    for cores in (1, 3, 16):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert encode(big, "zstd") == blob
    frame = zstandard.ZstdDecompressor().decompress(blob)
    assert frame == pack({"w": shuffle(big["w"])}, {SHUFFLE_KEY: "1"})
    assert decode(blob, "zstd") == big


# -- round trips ---------------------------------------------------------------------------


@st.composite
def _payloads(draw: st.DrawFn) -> tuple[dict[str, TensorBytes], str | None]:
    fmt = draw(st.sampled_from([None, *FORMATS]))
    out: dict[str, TensorBytes] = {}
    for i in range(draw(st.integers(0, 3))):
        shape = draw(
            st.one_of(
                st.just(()), hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=37)
            )
        )
        dtype = draw(st.sampled_from([np.float32, np.float16, ml_dtypes.bfloat16]))
        values = draw(hnp.arrays(np.float32, shape, elements=st.floats(-100, 100, width=32)))
        tensor = TensorBytes.from_numpy(np.asarray(values).astype(dtype))
        if fmt is None:
            out[f"t{i}"] = tensor
        else:
            out.update(quantize(f"t{i}", tensor, fmt))
    return out, fmt


@settings(max_examples=120, deadline=None)
@given(payload=_payloads(), compression=st.sampled_from(COMPRESSIONS))
def test_round_trip_every_dtype_format_and_codec(
    payload: tuple[dict[str, TensorBytes], str | None], compression: str
) -> None:
    tensors, fmt = payload
    blob = encode(tensors, compression)
    # The bound applies to the decompressed blob, the shuffle marker included when the
    # encoder shuffled (it does unless a sample compresses smaller unshuffled): it is exact.
    exact = len(pack(tensors))
    if compression == "zstd":
        frame = zstandard.ZstdDecompressor().decompress(blob)
        assert len(frame) in (exact, len(pack(tensors, {SHUFFLE_KEY: "1"})))
        exact = len(frame)
    back = decode(blob, compression, max_bytes=exact)
    assert back == tensors
    with pytest.raises(CorruptPayload, match=f"bound of {exact - 1}"):
        decode(blob, compression, max_bytes=exact - 1)
    if fmt is not None:
        for name in (n for n in tensors if not n.endswith(".scale")):
            assert dequantize(back, name, fmt) == dequantize(tensors, name, fmt)


@settings(max_examples=40, deadline=None)
@given(payload=_payloads())
def test_size_bound_covers_every_honest_payload(
    payload: tuple[dict[str, TensorBytes], str | None],
) -> None:
    tensors, fmt = payload
    names = [n for n in tensors if not n.endswith(".scale")]
    dtype_of = {"F8_E4M3": "F32", "F4": "F32", "BF16": "BF16"}
    schema = Schema(
        tuple(
            ParameterSpec(n, dtype_of.get(tensors[n].dtype, tensors[n].dtype), tensors[n].shape)
            for n in names
        )
    )
    assert len(pack(tensors, {"round": "123456"})) <= size_bound(schema, names, fmt)


def test_size_bound_with_long_escaped_names_and_odd_f4_shapes() -> None:
    name = "h.\x01\x02" + "é" * 200
    schema = Schema((ParameterSpec(name, "F32", (3, 5, 7)),))
    tensor = TensorBytes.from_numpy(np.ones((3, 5, 7), np.float32))
    for fmt in FORMATS:
        payload = pack(quantize(name, tensor, fmt), {SHUFFLE_KEY: "1"})
        assert len(payload) <= size_bound(schema, fmt=fmt)
    assert len(pack({name: tensor})) <= size_bound(schema)


def test_roundtrip_helper_agrees_with_codec_path() -> None:
    w = golden_tensors()["w"]
    for fmt in FORMATS:
        entries = decode(encode(quantize("w", w, fmt), "zstd"), "zstd")
        assert dequantize(entries, "w", fmt) == roundtrip(w, fmt)


# -- keys, bounds and errors ---------------------------------------------------------------


def test_extensions_name_the_codec() -> None:
    assert extension("off") == ".safetensors"
    assert extension("zstd") == ".safetensors.zst"
    assert compression_of("payloads/00000003/a.safetensors") == "off"
    assert compression_of("theta/0/00000007.safetensors.zst") == "zstd"
    with pytest.raises(RemoteProtocolError, match=r"key 'x\.bin' ends in neither"):
        compression_of("x.bin")
    with pytest.raises(ConfigError, match="compression 'gzip' is not one of off, zstd"):
        extension("gzip")
    with pytest.raises(ConfigError, match="compression 'lz4' is not one of off, zstd"):
        encode({}, "lz4")


def test_reserved_metadata_key() -> None:
    with pytest.raises(ConfigError, match=r"'gradientmail\.shuffle' is reserved for the codec"):
        encode({}, "zstd", {SHUFFLE_KEY: "1"})


def test_max_bytes_bounds_both_codecs() -> None:
    tensors = golden_tensors()
    size = len(pack(tensors))
    for compression in COMPRESSIONS:
        blob = encode(tensors, compression)
        assert decode(blob, compression, max_bytes=size + 100) == tensors
    with pytest.raises(CorruptPayload, match=rf"^k: {size} bytes exceed the bound of 100"):
        decode(encode(tensors, "off"), "off", key="k", max_bytes=100)
    with pytest.raises(CorruptPayload, match=r"^k: the zstd frame would decompress to \d+ bytes"):
        decode(encode(tensors, "zstd"), "zstd", key="k", max_bytes=100)


def test_zstd_bomb_is_refused_before_decompressing() -> None:
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(200 << 20))  # 200 MiB of zeros
    assert len(bomb) < 20_000
    with pytest.raises(CorruptPayload, match="would decompress to 209715200 bytes, past the"):
        decode(bomb, "zstd", key="bomb", max_bytes=1 << 20)
    assert DEFAULT_MAX_BYTES == 8 << 30


def test_missing_zstandard_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(MissingExtra, match=r"pip install 'gradientmail\[zstd\]'") as info:
        encode(golden_tensors(), "zstd")
    assert info.value.extra == "zstd"
    with pytest.raises(MissingExtra, match="zstd"):
        decode(b"", "zstd")
    assert decode(encode(golden_tensors(), "off"), "off") == golden_tensors()


def test_a_payload_of_few_distinct_values_is_packed_unshuffled() -> None:
    """A merged step of 1-bit deltas (signs times one magnitude per chunk, summed over
    learners) compresses to a third of its shuffled size unshuffled: the encoder packs it
    so, without the marker, and the decoder reads it back."""
    rng = np.random.default_rng(0)
    n, chunk = 300_000, 4096
    step = np.zeros(n, np.float32)
    for _ in range(4):
        mags = np.abs(rng.standard_normal(-(-n // chunk)) * 1e-3).astype(np.float32)
        step += np.sign(rng.standard_normal(n)).astype(np.float32) * np.repeat(mags, chunk)[:n]
    tensors = {"w": TensorBytes.from_numpy(step)}
    blob = encode(tensors, "zstd")
    assert zstandard.ZstdDecompressor().decompress(blob) == pack(tensors)
    shuffled = zstandard.ZstdCompressor(level=1).compress(
        pack({"w": shuffle(tensors["w"])}, {SHUFFLE_KEY: "1"}))
    assert len(blob) < 0.5 * len(shuffled)
    assert decode(blob, "zstd") == tensors
    # Trained-looking floats still shuffle.
    floats = {"w": TensorBytes.from_numpy((rng.standard_normal(n) * 0.02).astype(np.float32))}
    frame = zstandard.ZstdDecompressor().decompress(encode(floats, "zstd"))
    assert frame == pack({"w": shuffle(floats["w"])}, {SHUFFLE_KEY: "1"})
