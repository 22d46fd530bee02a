"""What a payload may hold and how large it may be: the checks a reader applies before
and after it downloads one. Pure; `gradientmail.run.protocol`'s readers apply them."""

from __future__ import annotations

from collections.abc import Iterable

from gradientmail.errors import LocalProtocolError, SchemaMismatch
from gradientmail.wire import compression as codec
from gradientmail.wire.records import SnapshotRecord
from gradientmail.wire.serialization import Schema, validate
from gradientmail.wire.sharded_blocks import digest_room
from gradientmail.wire.sparse import SPARSE_FORMATS, densify, entry_names
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["check_delta", "delta_bound", "payload_bound"]


def check_delta(tensors: dict[str, TensorBytes], snapshot: SnapshotRecord, schema: Schema,
                names: Iterable[str]) -> dict[str, TensorBytes]:
    """`tensors`, checked to hold exactly `names` in the record's `delta_format` (plus
    `<name>.scale` entries of quantized formats); `SchemaMismatch` naming every missing,
    extra or mis-shaped tensor. A sparse delta (`wire.sparse`) comes back decoded: dense
    F32 tensors of the schema's shapes (`CorruptPayload` for entries that break the
    format), so that a round merges it as it merges any F32 delta."""
    names = list(names)
    if snapshot.delta_format in SPARSE_FORMATS:
        return _densified(tensors, schema, names, snapshot.delta_format)
    wanted = set(names)
    scales = {f"{n}.scale" for n in names}
    main = {n: t for n, t in tensors.items() if n in wanted or n not in scales}
    validate(schema, main, names, dtype=snapshot.delta_format)
    return tensors


def _densified(tensors: dict[str, TensorBytes], schema: Schema, names: list[str],
               fmt: str) -> dict[str, TensorBytes]:
    want = {e for n in names for e in entry_names(n, fmt)}
    missing, extra = sorted(want - set(tensors)), sorted(set(tensors) - want)
    if missing or extra:
        raise SchemaMismatch(
            f"sparse delta does not match schema {schema.digest()[:12]}: missing {missing}, "
            f"extra {extra}")
    return {n: densify(tensors, n, schema[n].shape, fmt) for n in names}


def delta_bound(schema: Schema, names: Iterable[str]) -> int:
    """A generous bound on a delta payload's bytes: F32 for every element, plus scales and
    safetensors headers. A payload over it is hostile, refused before it is read."""
    return sum(8 * schema[n].numel + 256 for n in names) + (1 << 20)


def payload_bound(schema: Schema, names: Iterable[str], kind: str) -> int:
    """A bound on the bytes of a commit's payload of `names`, refused above it: "theta"
    (Θ⁰ too) in the schema dtypes; "outer" (fp32 momentum and master) and "updates" as
    two F32 entries per tensor; headers with escaped names, block digests and zstd's
    worst case on incompressible data included."""
    names = list(names)
    if kind == "theta":
        raw = codec.size_bound(schema, names)
    elif kind in ("outer", "updates", "steps"):
        raw = sum(8 * schema[n].numel + 2 * (6 * len(n.encode()) + 120 + 24 * len(schema[n].shape))
                  + 2 * digest_room(4 * schema[n].numel) for n in names) + 4096
    else:
        raise LocalProtocolError(
            f"payload kind {kind!r} must be 'theta', 'outer', 'updates' or 'steps'")
    return raw + raw // 128 + 1024
