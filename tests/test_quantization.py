"""Transfer formats: exact values, error bounds, scale choice, goldens, numpy == torch."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradientmail.errors import ConfigError, CorruptPayload, NonFiniteError
from gradientmail.wire.quantization import (
    BLOCK,
    FORMATS,
    bytes_per_element,
    dequantize,
    quantize,
    quantized_nbytes,
    roundtrip,
    scale_name,
)
from gradientmail.wire.quantization_torch import quantize_bytes
from gradientmail.wire.tensor_bytes import TensorBytes

BACKENDS = ("numpy", "torch")


def quantize_on(path: str, name: str, tensor: TensorBytes, fmt: str) -> dict[str, TensorBytes]:
    """`quantize` on the numpy path, or the torch kernels' `quantize_bytes`."""
    return (quantize_bytes if path == "torch" else quantize)(name, tensor, fmt)


def f32(values: object) -> TensorBytes:
    return TensorBytes.from_numpy(np.asarray(values, dtype=np.float32))


def golden_input() -> TensorBytes:
    """1,000 fixed values from integer arithmetic only (no libm), shaped (8, 125)."""
    i = np.arange(1000, dtype=np.int64)
    x = ((i * 7919) % 2001 - 1000).astype(np.float32) * np.float32(2e-5)
    x = x * (1 + (i % 97)).astype(np.float32)
    return TensorBytes.from_numpy(x.reshape(8, 125))


GOLDEN = {
    "BF16": {"w": "b0e95c5994013d492775400b9d1ef247ce28dcf445f7ffdb768bc42c50306d0e"},
    "F8_E4M3": {
        "w": "ea2063dbdb822b71780af48d9e34033eb2a2df846fe639c5116eee622904ec57",
        "w.scale": "4082763076bdaee3a85e52eb5893169d45d057397616251e0e699e6403238e66",
    },
    "F4": {
        "w": "1557a79d98de3097a1b45b15c193f8ebe12a47383f131c8f30b3e70608d2dad9",
        "w.scale": "61df4510cd563397b640509073931f0a8aa7de172e1c525aa9d43f68422bd9d1",
    },
}
ENTRY_LAYOUT = {
    "BF16": {"w": ("BF16", (8, 125))},
    "F8_E4M3": {"w": ("F8_E4M3", (8, 125)), "w.scale": ("F32", ())},
    "F4": {"w": ("F4", (8, 125)), "w.scale": ("F8_E8M0", (32,))},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_golden_entries(fmt: str, backend: str) -> None:
    source = golden_input()
    assert hashlib.sha256(source.data).hexdigest() == (
        "4fe971f1280cd5497768493bcc5db72400439139b6856e4e02d6e0686fb0f9e5"
    )
    entries = quantize_on(backend, "w", source, fmt)
    assert {k: (v.dtype, v.shape) for k, v in entries.items()} == ENTRY_LAYOUT[fmt]
    assert {k: hashlib.sha256(v.data).hexdigest() for k, v in entries.items()} == GOLDEN[fmt]


@pytest.mark.parametrize("backend", BACKENDS)
def test_f8_literal_codes(backend: str) -> None:
    # 1.0 = 2^0 (biased exponent 7), 0.3 -> 1.25 * 2^-2, 1e-3 -> the smallest subnormal 2^-9.
    entries = quantize_on(backend, "a", f32([0.0, 1.0, -448.0, 0.3, 1e-3]), "F8_E4M3")
    assert entries["a"].data == bytes([0x00, 0x38, 0xFE, 0x2A, 0x01])
    assert entries["a.scale"] == TensorBytes("F32", (), np.float32(1.0).tobytes())
    # 1000 needs 2^2 (448 * 2 < 1000 <= 448 * 4); 250 rounds up to 256 = 2^8.
    entries = quantize_on(backend, "a", f32([1000.0]), "F8_E4M3")
    assert entries["a"].data == bytes([0x78])
    assert entries["a.scale"].data == np.float32(4.0).tobytes()
    assert roundtrip(f32([1000.0]), "F8_E4M3").to_numpy().tolist() == [1024.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_f4_literal_codes_ties_to_even_and_short_last_block(backend: str) -> None:
    first = np.zeros(BLOCK, np.float32)
    first[:10] = [0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -6]
    x = np.concatenate([first, np.array([0.1, -0.2, 100], np.float32)])  # 35 elements
    entries = quantize_on(backend, "a", f32(x), "F4")
    # codes 0 0 | 2 2 | 4 4 | 6 6 | 7 F, low nibble first; ties go to the even code.
    assert entries["a"].data == bytes.fromhex("00224466f7") + bytes(11) + bytes.fromhex("8005")
    # block 0: absmax 6 -> 2^0 (E8M0 127); block 1: 100 needs 2^5 (6*16 < 100 <= 6*32).
    assert entries["a.scale"] == TensorBytes("F8_E8M0", (2,), bytes([127, 132]))
    back = dequantize(entries, "a", "F4").to_numpy()
    assert back[:10].tolist() == [0, 0, 1, 1, 2, 2, 4, 4, 6, -6]
    assert back[32:].tolist() == [0.0, -0.0, 96.0]
    assert math.copysign(1.0, back[33]) == -1.0


def test_bf16_rounds_to_nearest_even() -> None:
    one_ulp = 2.0**-7
    x = [1 + one_ulp / 2, 1 + 1.5 * one_ulp, 1 + one_ulp / 2 + 2**-20]
    entries = quantize("b", f32(x), "BF16")
    assert entries["b"].to_numpy().astype(np.float32).tolist() == [
        1.0,
        1 + 2 * one_ulp,
        1 + one_ulp,
    ]


def test_scales_of_zero_and_empty_tensors_are_one() -> None:
    for shape in [(0,), (3, 0), (40,)]:
        zeros = TensorBytes("F32", shape, bytes(4 * math.prod(shape)))
        f8 = quantize("z", zeros, "F8_E4M3")
        assert f8["z.scale"].to_numpy().tolist() == 1.0
        f4 = quantize("z", zeros, "F4")
        assert set(f4["z.scale"].data) <= {127}
        assert roundtrip(zeros, "F4") == zeros
        assert roundtrip(zeros, "F8_E4M3") == zeros


# -- properties ----------------------------------------------------------------------------

_shapes = st.one_of(
    st.just(()),
    hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=40),
)


@st.composite
def _tensors(draw: st.DrawFn) -> TensorBytes:
    shape = draw(_shapes)
    dtype = draw(st.sampled_from([np.float32, np.float16, ml_dtypes.bfloat16]))
    elements = st.floats(-1e4, 1e4, width=32, allow_subnormal=True)
    arr = draw(hnp.arrays(np.float32, shape, elements=elements))
    magnitude = draw(st.sampled_from([1.0, 2.0**-60, 2.0**-140, 2.0**60]))
    arr = np.asarray(arr * np.float32(magnitude), dtype=np.float32)
    if dtype is not np.float32:
        with np.errstate(over="ignore"):
            arr = np.where(np.isfinite(arr.astype(dtype)), arr, 0).astype(dtype)
    return TensorBytes.from_numpy(arr)


def _values(t: TensorBytes) -> npt.NDArray[np.float64]:
    return t.to_numpy().astype(np.float64).reshape(-1)


@settings(max_examples=60, deadline=None)
@given(tensor=_tensors(), fmt=st.sampled_from(FORMATS))
def test_numpy_and_torch_give_identical_bytes(tensor: TensorBytes, fmt: str) -> None:
    assert quantize("t", tensor, fmt) == quantize_bytes("t", tensor, fmt)


@settings(max_examples=60, deadline=None)
@given(tensor=_tensors(), fmt=st.sampled_from(FORMATS))
def test_dequantized_values_are_representable_and_round_trip_exactly(
    tensor: TensorBytes, fmt: str
) -> None:
    once = roundtrip(tensor, fmt)
    assert once.dtype == "F32" and once.shape == tensor.shape
    assert roundtrip(once, fmt) == once  # what the format represents comes back bit for bit
    assert np.isfinite(once.to_numpy()).all()


def _exponent(v: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    with np.errstate(divide="ignore"):
        return np.floor(np.log2(np.abs(v)))


@settings(max_examples=60, deadline=None)
@given(tensor=_tensors())
def test_bf16_error_bound(tensor: TensorBytes) -> None:
    x = _values(tensor)
    err = np.abs(_values(roundtrip(tensor, "BF16")) - x)
    # Half an ulp of 8 significant bits: 2^-8 relative (2^-134 absolute among subnormals).
    assert (err <= np.maximum(np.abs(x) * 2.0**-8, 2.0**-134)).all()


@settings(max_examples=60, deadline=None)
@given(tensor=_tensors())
def test_f8_error_bound_and_scale_choice(tensor: TensorBytes) -> None:
    x = _values(tensor)
    entries = quantize("t", tensor, "F8_E4M3")
    scale = float(entries["t.scale"].to_numpy())
    k = math.frexp(scale)[1] - 1
    assert scale == 2.0**k
    amax = float(np.abs(x).max()) if x.size else 0.0
    assert amax <= 448 * scale
    assert amax == 0 or k == -126 or amax > 224 * scale  # the smallest k that fits
    y = x / scale
    # Half an ulp of E4M3 (3 mantissa bits; subnormal below 2^-6) in the scale's binade.
    bound = scale * 2.0 ** (np.maximum(_exponent(y), -6) - 4)
    err = np.abs(_values(dequantize(entries, "t", "F8_E4M3")) - x)
    assert (err[y != 0] <= bound[y != 0]).all()
    assert (err[y == 0] == 0).all()


@settings(max_examples=60, deadline=None)
@given(tensor=_tensors())
def test_f4_error_bound_per_block_and_scale_choice(tensor: TensorBytes) -> None:
    x = _values(tensor)
    entries = quantize("t", tensor, "F4")
    k = entries["t.scale"].to_numpy().view(np.uint8).astype(np.int64) - 127
    assert k.shape == (-(-x.size // BLOCK),)
    scale = np.repeat(2.0**k, BLOCK)[: x.size]
    blocks = np.pad(np.abs(x), (0, -x.size % BLOCK)).reshape(-1, BLOCK)
    amax = blocks.max(axis=1) if x.size else np.zeros(0)
    assert (amax <= 6 * 2.0**k).all()
    assert ((amax == 0) | (k == -127) | (amax > 3 * 2.0**k)).all()
    assert (k[amax == 0] == 0).all()
    y = x / scale
    # E2M1 steps are 1/2 on [0, 2), 1 on [2, 4), 2 on [4, 6]: half a step is
    # 2^(max(floor(log2 |y|), 0) - 2), times the block's scale.
    bound = scale * 2.0 ** (np.maximum(_exponent(y), 0) - 2)
    err = np.abs(_values(dequantize(entries, "t", "F4")) - x)
    assert (err <= np.where(y == 0, 0, bound)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_f8_rounding_matches_ml_dtypes_on_every_bf16_pattern_and_tie(backend: str) -> None:
    # Every bf16 bit pattern in range, plus the float32 values just beside it and halfway
    # to the next: covers every rounding boundary and tie of E4M3.
    base = np.arange(1 << 16, dtype=np.uint32) << 16
    candidates = np.concatenate([base, base + 1, base - 1, base + 0x8000]).view(np.float32)
    values = candidates[np.isfinite(candidates) & (np.abs(candidates) <= 448)]
    values = np.concatenate([[np.float32(448.0)], values])  # pins the scale at 2^0
    entries = quantize_on(backend, "v", f32(values), "F8_E4M3")
    assert entries["v.scale"].to_numpy().tolist() == 1.0
    expected = values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).tobytes()
    assert entries["v"].data == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_f4_rounding_matches_ml_dtypes_on_every_bf16_pattern_and_tie(backend: str) -> None:
    base = np.arange(1 << 16, dtype=np.uint32) << 16
    candidates = np.concatenate([base, base + 1, base - 1, base + 0x8000]).view(np.float32)
    values = candidates[np.isfinite(candidates) & (np.abs(candidates) <= 6)]
    values = values[: values.size - values.size % (BLOCK - 1)].reshape(-1, BLOCK - 1)
    # A 6 at the head of every block pins each block's scale at 2^0.
    blocks = np.concatenate([np.full((values.shape[0], 1), 6, np.float32), values], axis=1)
    entries = quantize_on(backend, "v", f32(blocks), "F4")
    assert set(entries["v.scale"].data) == {127}
    codes = blocks.reshape(-1).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    expected = (codes[0::2] | (codes[1::2] << 4)).tobytes()
    assert entries["v"].data == expected


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_half_precision_inputs(dtype: Any, fmt: str) -> None:
    x = np.array([0.5, -1.5, 3.0, 0.0], dtype=np.float32)
    half = TensorBytes.from_numpy(x.astype(dtype))
    assert roundtrip(half, fmt) == f32(x)  # representable in every format (F4: scale 2^-1)


def test_bf16_input_to_bf16_is_unchanged() -> None:
    t = TensorBytes.from_numpy(np.array([1.5, -3.0], ml_dtypes.bfloat16))
    assert quantize("b", t, "BF16") == {"b": t}


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_names_the_tensor(fmt: str, backend: str, bad: float) -> None:
    x = np.zeros(70, np.float32)
    x[5] = bad
    x[60] = bad
    with pytest.raises(NonFiniteError) as info:
        quantize_on(backend, "h.3.mlp.weight", f32(x), fmt)
    assert str(info.value).startswith(
        "tensor 'h.3.mlp.weight' holds 2 NaN or infinite values (first at flat index 5); "
        f"cannot quantize to {fmt}"
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_rounding_past_float32_max_is_refused(fmt: str) -> None:
    with pytest.raises(NonFiniteError, match=f"'big'.*overflow to infinity when rounded to {fmt}"):
        quantize("big", f32([3.4e38, 1.0]), fmt)


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="transfer format 'F8' is not one of BF16, F8_E4M3, F4"):
        quantize("a", f32([1.0]), "F8")
    with pytest.raises(ConfigError, match="can only quantize F32, F16, BF16 TensorBytes, not F4"):
        quantize("a", TensorBytes("F4", (2,), b"\x00"), "F4")


def _f8(scale: float | bytes) -> dict[str, TensorBytes]:
    data = scale if isinstance(scale, bytes) else np.float32(scale).tobytes()
    return {"w": TensorBytes("F8_E4M3", (2,), b"\x38\x40"), "w.scale": TensorBytes("F32", (), data)}


@pytest.mark.parametrize(
    "scale",
    [
        math.nan,
        math.inf,
        0.0,
        -2.0,
        3.0,
        1.5,
        2.0**-127,
        2.0**-149,
        np.uint32(0x7FC00001).tobytes(),
    ],
)
def test_bad_f8_scale_is_corrupt(scale: float | bytes) -> None:
    with pytest.raises(CorruptPayload, match=r"^p/1\.safetensors: tensor 'w': F8_E4M3 scale"):
        dequantize(_f8(scale), "w", "F8_E4M3", key="p/1.safetensors")


def test_good_f8_scales_at_the_edges() -> None:
    low = dequantize(_f8(2.0**-126), "w", "F8_E4M3").to_numpy()
    assert low.tolist() == [2.0**-126, 2.0**-125]
    with pytest.raises(CorruptPayload, match="decode to NaN or past float32's range"):
        dequantize(_f8(2.0**127), "w", "F8_E4M3")  # 2 * 2^127 overflows


def test_f8_nan_codes_are_corrupt() -> None:
    entries = {"w": TensorBytes("F8_E4M3", (1,), b"\x7f"), "w.scale": _f8(1.0)["w.scale"]}
    with pytest.raises(CorruptPayload, match="tensor 'w': F8_E4M3 codes decode to NaN"):
        dequantize(entries, "w", "F8_E4M3")


def test_bad_f4_scales_are_corrupt() -> None:
    codes = TensorBytes("F4", (40,), bytes(20))
    nan = {"w": codes, "w.scale": TensorBytes("F8_E8M0", (2,), b"\x7f\xff")}
    with pytest.raises(CorruptPayload, match=r"tensor 'w': F4 scale block 1 is NaN \(E8M0 0xFF\)"):
        dequantize(nan, "w", "F4")
    short = {"w": codes, "w.scale": TensorBytes("F8_E8M0", (1,), b"\x7f")}
    with pytest.raises(CorruptPayload, match=r"40 elements need \[2\] \(one per block of 32\)"):
        dequantize(short, "w", "F4")
    f32_scale = {"w": codes, "w.scale": f32([1.0, 1.0])}
    with pytest.raises(CorruptPayload, match=r"tensor 'w\.scale' is F32; expected F8_E8M0"):
        dequantize(f32_scale, "w", "F4")
    huge = {"w": TensorBytes("F4", (1,), b"\x07"), "w.scale": TensorBytes("F8_E8M0", (1,), b"\xfe")}
    with pytest.raises(CorruptPayload, match="past float32's range"):
        dequantize(huge, "w", "F4")  # 6 * 2^127


def test_missing_or_mistyped_entries_are_corrupt() -> None:
    with pytest.raises(CorruptPayload, match=r"^k: tensor 'w\.scale' is missing from the payload"):
        dequantize({"w": TensorBytes("F8_E4M3", (1,), b"\x00")}, "w", "F8_E4M3", key="k")
    with pytest.raises(CorruptPayload, match="tensor 'w' is missing"):
        dequantize({}, "w", "BF16")
    with pytest.raises(CorruptPayload, match="tensor 'w' is F32; expected BF16"):
        dequantize({"w": f32([1.0])}, "w", "BF16")
    with pytest.raises(CorruptPayload, match=r"F8_E4M3 scale has shape \[1\]; need \[\]"):
        dequantize(
            {"w": TensorBytes("F8_E4M3", (1,), b"\x00"), "w.scale": f32([1.0])}, "w", "F8_E4M3"
        )
    nan_bf16 = TensorBytes.from_numpy(np.array([np.nan], ml_dtypes.bfloat16))
    with pytest.raises(CorruptPayload, match="BF16 values hold NaN or infinity"):
        dequantize({"w": nan_bf16}, "w", "BF16")


# -- sizes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("numel", [0, 1, 31, 32, 33, 1000])
def test_quantized_nbytes_is_exact(fmt: str, numel: int) -> None:
    entries = quantize("t", f32(np.ones(numel)), fmt)
    assert quantized_nbytes(fmt, numel) == sum(e.nbytes for e in entries.values())


def test_bytes_per_element_and_scale_name() -> None:
    assert [bytes_per_element(f) for f in FORMATS] == [2.0, 1.0, 0.53125]
    assert scale_name("h.0.attn.c_attn.weight") == "h.0.attn.c_attn.weight.scale"
