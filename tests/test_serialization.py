"""Schema, TensorBytes, validate, and the safetensors payload format (pack/unpack)."""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.errors import (
    ConfigError,
    CorruptPayload,
    RemoteProtocolError,
    SchemaMismatch,
)
from gradientmail.wire.serialization import (
    ParameterSpec,
    Schema,
    pack,
    pack_header,
    read_index,
    unpack,
    unpack_with_metadata,
    validate,
)
from gradientmail.wire.tensor_bytes import DTYPES, STORAGE_DTYPES, TensorBytes, nbytes_of

# -- TensorBytes ---------------------------------------------------------------------------


def test_tensorbytes_checks_length_against_dtype_and_shape() -> None:
    with pytest.raises(ConfigError, match=r"F32\[2, 3\] needs 24 bytes but holds 23"):
        TensorBytes("F32", (2, 3), bytes(23))
    with pytest.raises(ConfigError, match=r"F4\[3\] needs 2 bytes but holds 1"):
        TensorBytes("F4", (3,), bytes(1))
    with pytest.raises(ConfigError, match=r"dtype 'F64' is not one of F32, F16, BF16"):
        TensorBytes("F64", (1,), bytes(8))
    with pytest.raises(ConfigError, match=r"must be bytes, not bytearray"):
        TensorBytes("F32", (1,), bytearray(4))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"shape \[2\] must be a tuple of non-negative ints"):
        TensorBytes("F32", [2], bytes(8))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"non-negative ints"):
        TensorBytes("F32", (-1,), b"")
    assert TensorBytes("F4", (3,), bytes(2)).nbytes == 2
    assert TensorBytes("F32", (), bytes(4)).numel == 1
    assert TensorBytes("F16", (0, 7), b"").numel == 0


def test_nbytes_of_every_dtype() -> None:
    assert [nbytes_of(d, (5,)) for d in DTYPES] == [20, 10, 10, 5, 5, 3, 10, 5, 20]


@pytest.mark.parametrize(
    ("dtype", "np_dtype"),
    [
        ("F32", np.float32),
        ("F16", np.float16),
        ("BF16", ml_dtypes.bfloat16),
        ("F8_E4M3", ml_dtypes.float8_e4m3fn),
        ("F8_E8M0", ml_dtypes.float8_e8m0fnu),
        ("F4", ml_dtypes.float4_e2m1fn),
        ("U16", np.uint16),
        ("U8", np.uint8),
        ("U32", np.uint32),
    ],
)
def test_numpy_round_trip(dtype: str, np_dtype: Any) -> None:
    values = np.array([[0.5, 1.0, 2.0], [4.0, 0.5, 1.0]], dtype=np.float32).astype(np_dtype)
    tensor = TensorBytes.from_numpy(values)
    assert tensor.dtype == dtype
    assert tensor.shape == (2, 3)
    back = tensor.to_numpy()
    assert back.dtype == np.dtype(np_dtype)
    assert np.array_equal(back.astype(np.float32), values.astype(np.float32))


def test_f4_packs_two_codes_per_byte_low_nibble_first() -> None:
    codes = np.array([1.0, 6.0, -0.5], dtype=ml_dtypes.float4_e2m1fn)  # codes 2, 7, 9
    tensor = TensorBytes.from_numpy(codes)
    assert tensor.data == bytes([0x72, 0x09])


def test_from_numpy_refuses_other_dtypes() -> None:
    with pytest.raises(ConfigError, match=r"cannot wrap a numpy array of dtype float64"):
        TensorBytes.from_numpy(np.zeros(3))


def test_from_numpy_big_endian_is_stored_little_endian() -> None:
    arr = np.array([1.0, 2.0], dtype=">f4")
    assert TensorBytes.from_numpy(arr).data == np.array([1.0, 2.0], "<f4").tobytes()


# -- Schema --------------------------------------------------------------------------------

SCHEMA = Schema(
    (
        ParameterSpec("wte.weight", "F32", (8, 4)),
        ParameterSpec("h.0.ln.bias", "BF16", (4,)),
        ParameterSpec("scalar", "F16", ()),
    )
)


def test_schema_accessors() -> None:
    assert SCHEMA.names == ("wte.weight", "h.0.ln.bias", "scalar")
    assert SCHEMA["h.0.ln.bias"] == ParameterSpec("h.0.ln.bias", "BF16", (4,))
    assert SCHEMA.nbytes("wte.weight") == 128
    assert SCHEMA.nbytes("scalar") == 2
    assert SCHEMA.total_nbytes == 128 + 8 + 2
    assert "scalar" in SCHEMA and "nope" not in SCHEMA
    assert len(SCHEMA) == 3
    with pytest.raises(KeyError, match="'nope' is not in the schema"):
        SCHEMA["nope"]


def test_schema_canonical_json_and_digest_are_pinned() -> None:
    text = SCHEMA.to_json()
    assert text == (
        '{"params":[{"dtype":"F32","name":"wte.weight","shape":[8,4]},'
        '{"dtype":"BF16","name":"h.0.ln.bias","shape":[4]},'
        '{"dtype":"F16","name":"scalar","shape":[]}]}'
    )
    assert SCHEMA.digest() == hashlib.sha256(text.encode()).hexdigest()
    assert SCHEMA.digest() == "f6efa0b923e2350e4515591c8acaa860cbddd7fe7171b1a637d59567c61a0912"


def test_schema_json_round_trip_and_order_matters() -> None:
    assert Schema.from_json(SCHEMA.to_json()) == SCHEMA
    assert Schema.from_json(SCHEMA.to_json().encode()) == SCHEMA
    assert Schema.from_dict(SCHEMA.to_dict()) == SCHEMA
    swapped = Schema((SCHEMA.params[1], SCHEMA.params[0], SCHEMA.params[2]))
    assert swapped.digest() != SCHEMA.digest()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "schema record is not valid JSON"),
        ("[]", "exactly the key 'params'"),
        ('{"params": [], "extra": 1}', "exactly the key 'params'"),
        ('{"params": [{"name": "a", "dtype": "F32"}]}', r"params\[0\] must be an object"),
        ('{"params": [{"name": "a", "dtype": "F32", "shape": 3}]}', r"params\[0\]"),
        (
            '{"params": [{"name": "a", "dtype": "F64", "shape": [1]}]}',
            r"params\[0\]: parameter 'a': dtype 'F64' is not a storage dtype",
        ),
        (
            '{"params": [{"name": "a", "dtype": "F32", "shape": [-1]}]}',
            "non-negative ints",
        ),
        (
            '{"params": [{"name": "a", "dtype": "F32", "shape": [true]}]}',
            "non-negative ints",
        ),
        (
            '{"params": [{"name": "a", "dtype": "F32", "shape": [1]},'
            ' {"name": "a", "dtype": "F32", "shape": [1]}]}',
            r"schema names \['a'\] more than once",
        ),
        ("[" * 100_000, "not valid JSON"),
    ],
)
def test_schema_from_json_is_strict(text: str, message: str) -> None:
    with pytest.raises(RemoteProtocolError, match=message):
        Schema.from_json(text)


def test_parameter_spec_rules() -> None:
    with pytest.raises(ConfigError, match="dtype 'F8_E4M3' is not a storage dtype"):
        ParameterSpec("a", "F8_E4M3", (1,))
    with pytest.raises(ConfigError, match="must be a non-empty string"):
        ParameterSpec("", "F32", (1,))
    with pytest.raises(ConfigError, match="more than once"):
        Schema((ParameterSpec("a", "F32", ()), ParameterSpec("a", "F16", ())))


def test_schema_from_tensors() -> None:
    tensors = {"a": TensorBytes("F32", (2,), bytes(8)), "b": TensorBytes("BF16", (), bytes(2))}
    assert Schema.from_tensors(tensors) == Schema(
        (ParameterSpec("a", "F32", (2,)), ParameterSpec("b", "BF16", ()))
    )


# -- validate ------------------------------------------------------------------------------


def _zeros(spec: ParameterSpec, dtype: str | None = None) -> TensorBytes:
    dtype = dtype or spec.dtype
    return TensorBytes(dtype, spec.shape, bytes(nbytes_of(dtype, spec.shape)))


def test_validate_accepts_matching_tensors_and_subsets() -> None:
    validate(SCHEMA, {p.name: _zeros(p) for p in SCHEMA.params})
    validate(SCHEMA, {"scalar": _zeros(SCHEMA["scalar"])}, ["scalar"])
    validate(SCHEMA, {p.name: _zeros(p, "F32") for p in SCHEMA.params}, dtype="F32")


def test_validate_names_every_problem() -> None:
    tensors = {
        "wte.weight": TensorBytes("F32", (4, 8), bytes(128)),
        "h.0.ln.bias": TensorBytes("F32", (4,), bytes(16)),
        "stray": TensorBytes("F32", (), bytes(4)),
    }
    with pytest.raises(SchemaMismatch) as info:
        validate(SCHEMA, tensors)
    message = str(info.value)
    assert f"tensors do not match schema {SCHEMA.digest()[:12]}" in message
    assert "missing ['scalar']" in message
    assert "extra ['stray']" in message
    assert "'wte.weight' has shape [4, 8], the schema says [8, 4]" in message
    assert "'h.0.ln.bias' has dtype F32, expected BF16" in message


def test_validate_rejects_names_outside_the_schema() -> None:
    with pytest.raises(ConfigError, match=r"names \['ghost'\] are not in the schema"):
        validate(SCHEMA, {}, ["ghost"])


# -- pack / unpack -------------------------------------------------------------------------


def _tiny() -> dict[str, TensorBytes]:
    return {
        "w": TensorBytes.from_numpy(np.array([[1.0, -2.0]], np.float32)),
        "b": TensorBytes.from_numpy(np.array([0.5], ml_dtypes.bfloat16)),
    }


def test_pack_golden_bytes() -> None:
    header = (
        b'{"__metadata__":{"round":"7"},'
        b'"w":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]},'
        b'"b":{"dtype":"BF16","shape":[1],"data_offsets":[8,10]}}'
    )
    header += b" " * (-len(header) % 8)
    expected = (
        struct.pack("<Q", len(header))
        + header
        + bytes.fromhex("0000803f000000c0")  # 1.0, -2.0 as little-endian F32
        + bytes.fromhex("003f")  # 0.5 as BF16
    )
    assert pack(_tiny(), {"round": "7"}) == expected


def test_pack_is_independent_of_insertion_order_and_sorts_metadata() -> None:
    tensors = _tiny()
    meta = {k: "v" for k in "hgfedcba"}
    reordered = dict(reversed(list(tensors.items())))
    blob = pack(tensors, meta)
    assert blob == pack(reordered, dict(reversed(list(meta.items()))))
    header = json.loads(blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]])
    assert list(header["__metadata__"]) == sorted(meta)


def test_pack_refuses_bad_input() -> None:
    with pytest.raises(ConfigError, match="reserved prefix"):
        pack(_tiny(), {"gradientmail.f4shape.w": "[1]"})
    with pytest.raises(ConfigError, match="must map str to str"):
        pack(_tiny(), {"a": 1})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="reserved"):
        pack({"__metadata__": TensorBytes("F32", (), bytes(4))})
    with pytest.raises(ConfigError, match="must be TensorBytes, not ndarray"):
        pack({"a": np.zeros(2)})  # type: ignore[dict-item]


_LIBRARY_DTYPE = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
    "U16": "uint16",
    "U8": "uint8",
    "U32": "uint32",
}


def _library_pack(tensors: dict[str, TensorBytes], meta: dict[str, str] | None) -> bytes:
    """What safetensors itself writes for `tensors` (F4 only with an even last dim)."""
    keep = []
    specs = {}
    for name, t in tensors.items():
        buf = np.frombuffer(t.data, np.uint8) if t.data else np.zeros(1, np.uint8)
        keep.append(buf)
        shape = list(t.shape)
        if t.dtype == "F4":
            shape[-1] //= 2  # the binding takes F4's storage shape
        specs[name] = safetensors.TensorSpec(
            dtype=_LIBRARY_DTYPE[t.dtype], shape=shape, data_ptr=buf.ctypes.data, data_len=t.nbytes
        )
    return bytes(safetensors.serialize(specs, metadata=meta))


_names = st.text(alphabet=st.characters(exclude_categories=["Cs"]), min_size=1, max_size=12).filter(
    lambda n: n != "__metadata__" and not n.startswith("gradientmail.f4shape.")
)
_shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def _tensor_sets(draw: st.DrawFn, f4_even: bool = False) -> dict[str, TensorBytes]:
    names = draw(st.lists(_names, min_size=0, max_size=5, unique=True))
    out = {}
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(_shapes)
        if dtype == "F4" and f4_even:
            shape = (*shape, 2 * draw(st.integers(0, 3)))
        n = nbytes_of(dtype, shape)
        out[name] = TensorBytes(dtype, shape, draw(st.binary(min_size=n, max_size=n)))
    return out


@settings(max_examples=150, deadline=None)
@given(
    tensors=_tensor_sets(f4_even=True),
    meta=st.none() | st.dictionaries(_names, st.text(max_size=8), min_size=1, max_size=1),
)
def test_pack_is_byte_identical_to_the_safetensors_library(
    tensors: dict[str, TensorBytes], meta: dict[str, str] | None
) -> None:
    # With at most one metadata key the library's output is deterministic: compare bytes.
    assert pack(tensors, meta) == _library_pack(tensors, meta)


@settings(max_examples=150, deadline=None)
@given(tensors=_tensor_sets(), meta=st.dictionaries(_names, st.text(max_size=8), max_size=4))
def test_unpack_inverts_pack_and_the_library_reads_it(
    tensors: dict[str, TensorBytes], meta: dict[str, str]
) -> None:
    blob = pack(tensors, meta)
    back, back_meta = unpack_with_metadata(blob)
    assert back == tensors
    assert back_meta == meta
    read = dict(safetensors.deserialize(blob))  # type: ignore[no-untyped-call]
    assert set(read) == set(tensors)
    for name, t in tensors.items():
        assert bytes(read[name]["data"]) == t.data


def test_f4_with_odd_shapes_travels_flat_with_its_shape_in_metadata() -> None:
    odd = TensorBytes.from_numpy(np.array([[1.0, 2.0, 3.0]], ml_dtypes.float4_e2m1fn))
    scalar = TensorBytes.from_numpy(np.array(-6.0, ml_dtypes.float4_e2m1fn))
    blob = pack({"odd": odd, "s": scalar})
    header = json.loads(blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]])
    assert header["__metadata__"] == {
        "gradientmail.f4shape.odd": "[1,3]",
        "gradientmail.f4shape.s": "[]",
    }
    assert header["odd"]["shape"] == [4] and header["s"]["shape"] == [2]
    back, meta = unpack_with_metadata(blob)
    assert back == {"odd": odd, "s": scalar}
    assert meta == {}


def test_pack_header_matches_pack() -> None:
    tensors = _tiny()
    header, order = pack_header(tensors, {"k": "v"})
    assert order == ["w", "b"]  # F32 before BF16, as the library orders them
    assert pack(tensors, {"k": "v"}) == header + tensors["w"].data + tensors["b"].data


def test_read_index_spans_are_absolute() -> None:
    blob = pack(_tiny())
    spans, meta = read_index(blob)
    assert meta == {}
    assert [(s.name, s.dtype, s.shape) for s in spans] == [
        ("w", "F32", (1, 2)),
        ("b", "BF16", (1,)),
    ]
    assert blob[spans[0].start : spans[0].end] == _tiny()["w"].data
    assert spans[1].end == len(blob)


def test_empty_payload_round_trips() -> None:
    assert pack({}) == struct.pack("<Q", 8) + b"{}      "
    assert unpack(pack({})) == {}


def test_unpack_names_the_key() -> None:
    with pytest.raises(CorruptPayload, match=r"^payloads/3/a\.safetensors: 3 bytes is shorter"):
        unpack(b"abc", key="payloads/3/a.safetensors")


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
def test_storage_dtypes_are_listed(dtype: str) -> None:
    assert dtype in DTYPES
