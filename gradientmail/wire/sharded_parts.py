"""A contribution made of parts: each part holds some rows of each tensor, the parts
together hold every row exactly once.

A learner whose ranks each mail their own rows (docs/design/sharded.md §3) uploads one payload
per rank. Each part is an ordinary payload whose tensors keep their full names, shaped as
the rows it holds, with the metadata entry `gradientmail.rows`: the canonical JSON
`{"name": [start, stop], ...}`. Quantized formats quantize each part on its own (its own
F8 scale, F4 blocks counted from its first element), so a reader decodes each part's
rows with that part's scales (`quantization.Quantized`) before putting rows side by side.

Sparse formats (`wire.sparse`: TOPK_F8, TOPK_Q2, SIGN1) sparsify each part on its own:
its chunks of `CHUNK` elements are counted from the part's first element, so a reader
densifies each part's entries at the part's shape (the rows it holds), with the bounds
and checks of `sparse.densify`, and merges the dense rows as F32 rows.

Pure functions: `part_metadata` for the writer; `rows_in`, `pieces_of` and `assemble` for
the reader, which check that the parts tile every tensor exactly once, each in the
record's format. `pieces_of` hands the merge each tensor's rows where they lie
(`RowPieces`, read window by window); `assemble` builds full tensors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from gradientmail.errors import CorruptPayload, SchemaMismatch
from gradientmail.wire.quantization import Quantized, dequantizing
from gradientmail.wire.serialization import ParameterSpec, Schema, validate
from gradientmail.wire.sharded_pieces import DeltaTensor, Piece, RowPieces
from gradientmail.wire.sparse import SPARSE_FORMATS, densify, entry_names
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["ROWS_KEY", "Part", "assemble", "part_metadata", "pieces_of", "rows_in"]

#: The metadata entry naming the rows of each tensor a part holds.
ROWS_KEY = "gradientmail.rows"

#: Formats whose parts join byte for byte; the others are read part by part (`Quantized`).
_RAW = ("F32", "F16", "BF16")

#: One part as read: its key (for messages), its entries, and the rows of each tensor.
Part = tuple[str, Mapping[str, TensorBytes], Mapping[str, tuple[int, int]]]


def part_metadata(rows: Mapping[str, tuple[int, int]]) -> dict[str, str]:
    """The metadata a part carries for `rows` (name -> [start, stop) of the full tensor)."""
    body = {name: [int(a), int(b)] for name, (a, b) in sorted(rows.items())}
    return {ROWS_KEY: json.dumps(body, sort_keys=True, separators=(",", ":"))}


def rows_in(metadata: Mapping[str, str], key: str) -> dict[str, tuple[int, int]]:
    """The rows a part's metadata says it holds; `CorruptPayload` naming `key` when the
    entry is missing or not an object of `[start, stop]` pairs with 0 <= start <= stop."""
    text = metadata.get(ROWS_KEY)
    if text is None:
        raise CorruptPayload(f"{key}: a part must carry the metadata entry {ROWS_KEY!r}")
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise CorruptPayload(f"{key}: metadata {ROWS_KEY!r} is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise CorruptPayload(f"{key}: metadata {ROWS_KEY!r} must map names to [start, stop]")
    out = {}
    for name, pair in body.items():
        ok = isinstance(pair, list) and len(pair) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in pair)
        if not ok or not 0 <= pair[0] <= pair[1]:
            raise CorruptPayload(f"{key}: metadata {ROWS_KEY!r}: tensor {name!r} has rows "
                                 f"{pair!r:.60}; need [start, stop] with 0 <= start <= stop")
        out[name] = (pair[0], pair[1])
    return out


def assemble(parts: Sequence[Part], schema: Schema, names: Sequence[str],
             fmt: str | None) -> dict[str, TensorBytes]:
    """`pieces_of`, each tensor joined into one buffer."""
    return {name: t.joined() if isinstance(t, RowPieces) else t
            for name, t in pieces_of(parts, schema, names, fmt).items()}


def pieces_of(parts: Sequence[Part], schema: Schema, names: Sequence[str],
              fmt: str | None) -> dict[str, DeltaTensor]:
    """The full delta of `names` from `parts`, never joined: each part checked to hold
    its rows of its tensors in `fmt` (plus `<name>.scale` entries of quantized formats)
    and nothing else, the rows of all parts checked to tile every tensor exactly once.
    F32, F16 and BF16 rows stay as they are; quantized ones stay quantized, each part a
    `Quantized` read as F32 with its own scales (`dequantizing`: checked as `dequantize`
    checks them, with the same errors, but never decoded whole). A tensor held by one
    raw part is that part's tensor; one held by several, or by a quantized part, is a
    `RowPieces` (F32 for quantized parts) of their rows, which the merge reads where
    they lie, a window at a time. `SchemaMismatch` naming the part and the tensor otherwise
    ("parts do not tile ..."). A sparse `fmt` (`sparse.SPARSE_FORMATS`): each part must
    hold exactly its tensors' entries, and each tensor's rows are densified at the part's
    shape (`sparse.densify`: `CorruptPayload` naming the part and the rule) into F32 rows.
    `fmt` None: each tensor in the schema's own dtype (a model's parameters read by rows,
    rank by rank)."""
    wanted = set(names)
    pieces: dict[str, list[tuple[int, int, Piece]]] = {n: [] for n in names}
    for key, entries, rows in parts:
        stray = sorted(set(rows) - wanted)
        if stray:
            raise SchemaMismatch(f"part {key!r} holds rows of {stray}, not in the fragment")
        specs = []
        for name, (a, b) in rows.items():
            full = schema[name].shape
            if b > (full[0] if full else 1):
                raise SchemaMismatch(f"part {key!r}: rows [{a}, {b}) of {name!r} run past "
                                     f"its shape {list(full)}")
            specs.append(ParameterSpec(name, schema[name].dtype,
                                       (b - a, *full[1:]) if full else ()))
        if fmt in SPARSE_FORMATS:
            for spec, dense in zip(specs, _densified(key, entries, specs, fmt), strict=True):
                a, b = rows[spec.name]
                pieces[spec.name].append((a, b, dense))
            continue
        scales = {f"{n}.scale" for n in rows}
        main = {n: t for n, t in entries.items() if n not in scales}
        try:
            validate(Schema(tuple(specs)), main, list(rows), dtype=fmt)
        except SchemaMismatch as exc:
            raise SchemaMismatch(f"part {key!r}: {exc}") from exc
        for name, (a, b) in rows.items():
            raw = fmt is None or fmt in _RAW
            value = entries[name] if raw else dequantizing(entries, name, str(fmt), key=key)
            pieces[name].append((a, b, value))
    out: dict[str, DeltaTensor] = {}
    for name in names:
        out[name] = _tiled(name, schema[name], sorted(pieces[name], key=lambda p: p[:2]),
                           fmt)
    return out


def _densified(key: str, entries: Mapping[str, TensorBytes], specs: Sequence[ParameterSpec],
               fmt: str) -> list[TensorBytes]:
    """Part `key`'s rows of each tensor of `specs` (shaped as the part holds them),
    densified from its sparse `fmt` entries, once the part is checked to hold exactly
    those tensors' entries."""
    want = {e for spec in specs for e in entry_names(spec.name, fmt)}
    missing, extra = sorted(want - set(entries)), sorted(set(entries) - want)
    if missing or extra:
        raise SchemaMismatch(f"part {key!r}: its {fmt} entries do not match its rows: "
                             f"missing {missing}, extra {extra}")
    return [densify(entries, spec.name, spec.shape, fmt, key=key) for spec in specs]


def _tiled(name: str, spec: ParameterSpec, pieces: list[tuple[int, int, Piece]],
           fmt: str | None) -> DeltaTensor:
    rows = spec.shape[0] if spec.shape else 1
    # Empty pieces (a rank past the last chunk holds none of its rows) tile nothing.
    held = [p for p in pieces if p[1] > p[0]]
    at = 0
    for a, b, _ in held:
        if a != at:
            what = "overlap" if a < at else "a gap"
            raise SchemaMismatch(f"parts do not tile {name!r}: {what} at row {min(a, at)} "
                                 f"(rows {[[p[0], p[1]] for p in held]} of {rows})")
        at = b
    if at != rows:
        raise SchemaMismatch(f"parts do not tile {name!r}: rows {at}..{rows} are in no part "
                             f"(rows {[[p[0], p[1]] for p in held]})")
    dtype = spec.dtype if fmt is None else fmt if fmt in _RAW else "F32"
    if not held:  # a tensor of no rows
        return TensorBytes(dtype, spec.shape, b"")
    first = held[0][2]
    if len(held) == 1 and isinstance(first, TensorBytes):
        return TensorBytes(first.dtype, spec.shape, first.buffer)
    if not spec.shape:  # a quantized scalar: one element, decoded
        assert isinstance(first, Quantized)
        return TensorBytes("F32", (), first.read(0, 1).tobytes())
    return RowPieces(dtype, spec.shape, tuple((a, t) for a, _, t in held))
