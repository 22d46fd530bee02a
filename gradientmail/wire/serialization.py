"""Tensors on the wire: `Schema`, `ParameterSpec`, `TensorBytes`, and safetensors payloads.

A model is described by its `Schema` (the ordered `ParameterSpec(name, dtype, shape)` of
its parameters); a tensor travels as `TensorBytes` (raw little-endian bytes plus dtype and
shape). A payload is a safetensors blob (`pack`), read back by `unpack`, which checks every
byte of the header before slicing the data, so a truncated, corrupted or hostile payload
raises `CorruptPayload` naming the key and the tensor, never another exception and never
an allocation larger than the blob itself.

`pack` lays the blob out exactly as the `safetensors` library does (tensors ordered by
dtype, widest first, then by name; compact JSON; the header padded with spaces to a
multiple of 8) -- the tests check byte equality with `safetensors.serialize` -- with one
difference: metadata keys are sorted. The library keeps metadata in a hash map and writes
it in a different order in every process, and payloads must be byte-stable (they are
addressed by SHA-256 and pinned by golden tests). Writing the header ourselves also lets
the zstd codec stream a payload without building it in memory (`pack_header`).

Dtypes: the storage dtypes "F32", "F16", "BF16" (what a schema may hold) and the transfer
dtypes "F8_E4M3", "F8_E8M0" (MX block scales) and "F4" (E2M1, two codes per byte, element
2i in the low nibble). An "F4" `TensorBytes` keeps its logical shape and holds
ceil(numel / 2) bytes. The safetensors format can only express an F4 tensor whose
element count is even (and its Python binding only one whose last dimension is), so
`pack` writes any other F4 tensor flat, padded to an even length with a zero code, and
records its logical shape in the metadata entry ``gradientmail.f4shape.<name>`` (a JSON
list); `unpack` restores it. Metadata keys starting with ``gradientmail.f4shape.`` are
reserved.
"""

from __future__ import annotations

import hashlib
import json
import reprlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gradientmail.errors import (
    ConfigError,
    CorruptPayload,
    RemoteProtocolError,
    SchemaMismatch,
)
from gradientmail.wire.tensor_bytes import (
    _BITS,
    DTYPES,
    STORAGE_DTYPES,
    TensorBytes,
    _check_shape,
    _numel,
    nbytes_of,
)

__all__ = [
    "MAX_HEADER_BYTES",
    "MAX_TENSORS",
    "ParameterSpec",
    "Schema",
    "Span",
    "frozen_view",
    "pack",
    "pack_header",
    "read_header",
    "read_index",
    "unpack",
    "unpack_with_metadata",
    "validate",
    "write_order",
]

#: Default bounds for `unpack`: safetensors itself refuses headers over 100 MB.
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_TENSORS = 1_000_000

_F4_SHAPE_PREFIX = "gradientmail.f4shape."
@dataclass(frozen=True)
class ParameterSpec:
    """One parameter of a model: its name, storage dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name == "__metadata__":
            raise ConfigError(f"parameter name {self.name!r} must be a non-empty string")
        if self.dtype not in STORAGE_DTYPES:
            raise ConfigError(
                f"parameter {self.name!r}: dtype {self.dtype!r} is not a storage dtype; "
                f"use one of {', '.join(STORAGE_DTYPES)}"
            )
        _check_shape(self.shape, f"parameter {self.name!r}")

    @property
    def numel(self) -> int:
        """Number of elements."""
        return _numel(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the parameter in its storage dtype."""
        return nbytes_of(self.dtype, self.shape)


@dataclass(frozen=True)
class Schema:
    """The ordered parameters of a model; equal schemas have equal `digest()`."""

    params: tuple[ParameterSpec, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.params, tuple) or not all(
            isinstance(p, ParameterSpec) for p in self.params
        ):
            raise ConfigError("Schema.params must be a tuple of ParameterSpec")
        names = [p.name for p in self.params]
        dups = (
            sorted({n for n in names if names.count(n) > 1}) if len(set(names)) < len(names) else []
        )
        if dups:
            raise ConfigError(f"schema names {dups} more than once; names must be unique")
        object.__setattr__(self, "_index", {p.name: p for p in self.params})

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, TensorBytes]) -> Schema:
        """The schema of `tensors`, in their iteration order."""
        return cls(tuple(ParameterSpec(n, t.dtype, t.shape) for n, t in tensors.items()))

    @property
    def names(self) -> tuple[str, ...]:
        """Parameter names in schema order."""
        return tuple(p.name for p in self.params)

    def __getitem__(self, name: str) -> ParameterSpec:
        index: dict[str, ParameterSpec] = self._index  # type: ignore[attr-defined]
        try:
            return index[name]
        except KeyError:
            raise KeyError(f"parameter {name!r} is not in the schema") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.params)

    def nbytes(self, name: str) -> int:
        """Bytes of parameter `name` in its storage dtype."""
        return self[name].nbytes

    @property
    def total_nbytes(self) -> int:
        """Bytes of every parameter in its storage dtype."""
        return sum(p.nbytes for p in self.params)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"params": [{"name", "dtype", "shape"}, ...]}``."""
        return {
            "params": [
                {"name": p.name, "dtype": p.dtype, "shape": list(p.shape)} for p in self.params
            ]
        }

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no whitespace, parameters in schema order."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """SHA-256 hex digest of `to_json()`."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    @classmethod
    def from_dict(cls, obj: object) -> Schema:
        """Inverse of `to_dict`; `RemoteProtocolError` for anything of another shape."""
        if (
            not isinstance(obj, dict)
            or set(obj) != {"params"}
            or not isinstance(obj["params"], list)
        ):
            raise RemoteProtocolError(
                f"schema record must be an object with exactly the key 'params' (a list); "
                f"got {_brief(obj)}"
            )
        params = []
        for i, entry in enumerate(obj["params"]):
            if (
                not isinstance(entry, dict)
                or set(entry) != {"name", "dtype", "shape"}
                or not isinstance(entry["shape"], list)
            ):
                raise RemoteProtocolError(
                    f"schema params[{i}] must be an object with exactly 'name', 'dtype' and "
                    f"'shape' (a list); got {_brief(entry)}"
                )
            try:
                params.append(ParameterSpec(entry["name"], entry["dtype"], tuple(entry["shape"])))
            except ConfigError as exc:
                raise RemoteProtocolError(f"schema params[{i}]: {exc}") from None
        try:
            return cls(tuple(params))
        except ConfigError as exc:
            raise RemoteProtocolError(f"schema record: {exc}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> Schema:
        """Parse `to_json()` output strictly; `RemoteProtocolError` on anything else."""
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise RemoteProtocolError(f"schema record is not valid JSON: {exc}") from None
        return cls.from_dict(obj)


def _brief(obj: object) -> str:
    """A short repr of a possibly huge (hostile) value."""
    return reprlib.repr(obj)


def validate(
    schema: Schema,
    tensors: Mapping[str, TensorBytes],
    names: Iterable[str] | None = None,
    *,
    dtype: str | None = None,
) -> None:
    """Check that `tensors` holds exactly `names` (default: the whole schema), each shaped
    as the schema says and of `dtype` (default: the schema's own dtype of each parameter).

    Raises `SchemaMismatch` naming every missing, extra, mis-shaped or wrong-dtype tensor.
    """
    expected = list(schema.names if names is None else names)
    unknown = [n for n in expected if n not in schema]
    if unknown:
        raise ConfigError(f"validate: names {unknown} are not in the schema")
    want = set(expected)
    problems = []
    missing = [n for n in expected if n not in tensors]
    extra = sorted(n for n in tensors if n not in want)
    if missing:
        problems.append(f"missing {missing}")
    if extra:
        problems.append(f"extra {extra}")
    for name in expected:
        tensor = tensors.get(name)
        if tensor is None:
            continue
        spec = schema[name]
        want_dtype = spec.dtype if dtype is None else dtype
        if tuple(tensor.shape) != spec.shape:
            problems.append(
                f"{name!r} has shape {list(tensor.shape)}, the schema says {list(spec.shape)}"
            )
        if tensor.dtype != want_dtype:
            problems.append(f"{name!r} has dtype {tensor.dtype}, expected {want_dtype}")
    if problems:
        raise SchemaMismatch(
            f"tensors do not match schema {schema.digest()[:12]}: " + "; ".join(problems)
        )


# The library writes tensors by dtype, widest first (its Dtype enum, descending), then name.
_WRITE_RANK = {"F32": 0, "U32": 1, "BF16": 2, "F16": 3, "U16": 4, "F8_E8M0": 5, "F8_E4M3": 6,
               "U8": 7, "F4": 8}


def write_order(tensors: Mapping[str, TensorBytes | ParameterSpec]) -> list[str]:
    """The order in which `pack` writes the data of `tensors` (dtype widest first, then
    name): what a writer needs to know of the data section before the header exists."""
    return sorted(tensors, key=lambda n: (_WRITE_RANK[tensors[n].dtype], n))


def pack_header(
    tensors: Mapping[str, TensorBytes | ParameterSpec],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[str]]:
    """The header `pack` writes for `tensors` (8-byte length, JSON, padding), and the
    order in which their data follows it. A `ParameterSpec` stands for a tensor of its
    dtype and shape (a blob whose data is written in place afterwards)."""
    meta: dict[str, str] = {}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ConfigError(f"payload metadata must map str to str; got {k!r}: {v!r}")
        if k.startswith(_F4_SHAPE_PREFIX):
            raise ConfigError(f"payload metadata key {k!r} uses the reserved prefix")
        meta[k] = v
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ConfigError(f"tensor name {name!r} is empty, not a string or reserved")
        if not isinstance(tensor, TensorBytes | ParameterSpec):
            raise ConfigError(f"tensor {name!r} must be TensorBytes, not {type(tensor).__name__}")
    order = write_order(tensors)
    entries: dict[str, Any] = {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        shape = list(tensor.shape)
        if tensor.dtype == "F4" and not (shape and shape[-1] % 2 == 0):
            meta[_F4_SHAPE_PREFIX + name] = json.dumps(shape, separators=(",", ":"))
            shape = [2 * tensor.nbytes]
        entries[name] = {
            "dtype": tensor.dtype,
            "shape": shape,
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    head: dict[str, Any] = {"__metadata__": dict(sorted(meta.items()))} if meta else {}
    head.update(entries)
    text = json.dumps(head, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def pack(tensors: Mapping[str, TensorBytes], metadata: Mapping[str, str] | None = None) -> bytes:
    """Write `tensors` (and string `metadata`) as one safetensors blob.

    The bytes depend only on the input, never on its order or the process: equal inputs
    give equal blobs, so golden payloads and SHA-256 references stay stable.
    """
    header, order = pack_header(tensors, metadata)
    return b"".join([header, *(tensors[n].buffer for n in order)])


@dataclass(frozen=True)
class Span:
    """Where one tensor's data lies in a blob: ``blob[start:end]`` (absolute offsets)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def unpack(
    blob: bytes | memoryview,
    *,
    key: str = "payload",
    max_tensors: int = MAX_TENSORS,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> dict[str, TensorBytes]:
    """Read a safetensors blob; `CorruptPayload` naming `key` and the tensor on bad input.

    The tensors are read-only views into `blob` (no copy; a writable `blob` is copied
    once first), so they keep the whole blob alive.
    """
    return unpack_with_metadata(
        blob, key=key, max_tensors=max_tensors, max_header_bytes=max_header_bytes
    )[0]


def unpack_with_metadata(
    blob: bytes | memoryview,
    *,
    key: str = "payload",
    max_tensors: int = MAX_TENSORS,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> tuple[dict[str, TensorBytes], dict[str, str]]:
    """Like `unpack`, also returning the blob's metadata (without reserved entries)."""
    spans, meta = read_index(
        blob, key=key, max_tensors=max_tensors, max_header_bytes=max_header_bytes
    )
    view = frozen_view(blob)
    out: dict[str, TensorBytes] = {}
    for span in spans:
        out[span.name] = TensorBytes(span.dtype, span.shape, view[span.start : span.end])
    return out, meta


def frozen_view(blob: bytes | bytearray | memoryview) -> memoryview:
    """A read-only byte view of `blob` that nobody can write: `bytes` and read-only views
    are viewed in place, anything writable is copied once (its owner could change it)."""
    if isinstance(blob, memoryview) and blob.readonly:
        return blob.cast("B") if blob.format != "B" or blob.ndim != 1 else blob
    return memoryview(blob if isinstance(blob, bytes) else bytes(blob))


def read_index(
    blob: bytes | memoryview,
    *,
    key: str = "payload",
    max_tensors: int = MAX_TENSORS,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> tuple[list[Span], dict[str, str]]:
    """Check a blob's header and return where each tensor lies, and the metadata: the
    whole blob's `read_header`."""
    return read_header(blob, len(blob), key=key, max_tensors=max_tensors,
                       max_header_bytes=max_header_bytes)


def read_header(
    head: bytes | memoryview,
    size: int,
    *,
    key: str = "payload",
    max_tensors: int = MAX_TENSORS,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> tuple[list[Span], dict[str, str]]:
    """Where each tensor of a blob of `size` bytes lies, and its metadata, from the
    blob's first bytes `head` (at least its whole header; the data is not needed, so a
    ranged reader checks a payload exactly as a whole-blob reader does).

    Checked before any data is touched: the header length is bounded by `size` and
    `max_header_bytes`; the header is a JSON object without duplicate keys; every entry
    has exactly a known dtype, a shape of non-negative ints and data offsets; the offsets
    tile the data section from 0 to its end, contiguous and non-overlapping; each span
    holds exactly shape × dtype bytes. Spans come in data order, with offsets from the
    blob's start. `ConfigError` when `head` is shorter than the header it declares.
    """
    view = memoryview(head)
    if size < 8 or len(view) < 8:
        raise CorruptPayload(
            f"{key}: {min(size, len(view))} bytes is shorter than the 8-byte safetensors "
            "header length"
        )
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > size - 8 or header_len > max_header_bytes:
        raise CorruptPayload(
            f"{key}: header claims {header_len} bytes but the blob has {size - 8} after "
            f"the length (limit {max_header_bytes}); the payload is truncated or corrupt"
        )
    data_start = 8 + header_len
    if len(view) < data_start:
        raise ConfigError(
            f"{key}: read_header got {len(view)} bytes; the header needs {data_start}"
        )
    header = _parse_header(bytes(view[8:data_start]), key)
    data_len = size - data_start
    raw_meta = header.pop("__metadata__", None)
    if raw_meta is None:
        raw_meta = {}
    if not isinstance(raw_meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw_meta.items()
    ):
        raise CorruptPayload(f"{key}: __metadata__ must map strings to strings")
    if len(header) > max_tensors:
        raise CorruptPayload(f"{key}: {len(header)} tensors exceed the limit of {max_tensors}")
    entries = sorted((*_check_entry(name, entry, key), name) for name, entry in header.items())
    cursor = 0
    for start, end, _, _, name in entries:
        if start != cursor:
            rule = "overlaps the previous tensor" if start < cursor else "leaves a gap"
            raise CorruptPayload(
                f"{key}: tensor {name!r} starts at data offset {start}, expected {cursor}; it "
                f"{rule}. Tensors must be contiguous and non-overlapping"
            )
        cursor = end
    if cursor != data_len:
        raise CorruptPayload(
            f"{key}: the header describes {cursor} data bytes but the blob holds {data_len}; "
            "the payload is truncated or has trailing bytes"
        )
    spans = []
    for start, end, dtype, shape, name in entries:
        f4_shape = raw_meta.get(_F4_SHAPE_PREFIX + name)
        if f4_shape is not None:
            shape = _f4_logical_shape(f4_shape, dtype, shape, name, key)
        spans.append(Span(name, dtype, shape, data_start + start, data_start + end))
    stray = [
        k[len(_F4_SHAPE_PREFIX) :]
        for k in raw_meta
        if k.startswith(_F4_SHAPE_PREFIX) and k[len(_F4_SHAPE_PREFIX) :] not in header
    ]
    if stray:
        raise CorruptPayload(f"{key}: F4 shape metadata names tensors {stray} that are absent")
    meta = {k: v for k, v in raw_meta.items() if not k.startswith(_F4_SHAPE_PREFIX)}
    return spans, meta


def _parse_header(raw: bytes, key: str) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for k, v in pairs:
            if k in result:
                raise CorruptPayload(f"{key}: the header names {k!r} twice")
            result[k] = v
        return result

    try:
        text = raw.decode("utf-8")
        header = json.loads(text, object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptPayload(f"{key}: the safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptPayload(f"{key}: the safetensors header must be a JSON object")
    return header


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_entry(name: str, entry: object, key: str) -> tuple[int, int, str, tuple[int, ...]]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CorruptPayload(
            f"{key}: tensor {name!r} must have exactly dtype, shape and data_offsets; "
            f"got {_brief(entry)}"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _BITS:
        raise CorruptPayload(
            f"{key}: tensor {name!r} has dtype {_brief(dtype)}; allowed: {', '.join(DTYPES)}"
        )
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise CorruptPayload(
            f"{key}: tensor {name!r} has shape {_brief(shape)}; need a list of non-negative ints"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise CorruptPayload(
            f"{key}: tensor {name!r} has data_offsets {_brief(offsets)}; need [begin, end] "
            "with 0 <= begin <= end"
        )
    start, end = offsets
    numel = _numel_upto(shape, 8 * (end - start))
    bits = None if numel is None else numel * _BITS[dtype]
    if bits is None or bits % 8 or bits // 8 != end - start:
        raise CorruptPayload(
            f"{key}: tensor {name!r} is {dtype}{_brief(shape)} but spans {end - start} bytes"
        )
    return start, end, dtype, tuple(shape)


def _numel_upto(shape: list[int], limit: int) -> int | None:
    """The product of `shape`, or None once it exceeds `limit` (a hostile shape of many
    huge dimensions would otherwise cost quadratic time in big-integer products)."""
    if 0 in shape:
        return 0
    numel = 1
    for d in shape:
        numel *= d
        if numel > limit:
            return None
    return numel


def _f4_logical_shape(
    text: str, dtype: str, stored: tuple[int, ...], name: str, key: str
) -> tuple[int, ...]:
    try:
        shape = json.loads(text)
    except (ValueError, RecursionError):
        shape = None
    if (
        dtype != "F4"
        or not isinstance(shape, list)
        or not all(_is_int(d) for d in shape)
        or len(stored) != 1
        or (numel := _numel_upto(shape, stored[0])) is None
        or stored[0] != numel + numel % 2
    ):
        raise CorruptPayload(
            f"{key}: tensor {name!r}: F4 shape metadata {_brief(text)} does not match the "
            f"stored {dtype}{list(stored)}"
        )
    return tuple(shape)
