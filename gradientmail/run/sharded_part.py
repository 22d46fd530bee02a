"""A part of a contribution written in place (docs/design/sharded.md §3): the rank's rows of the
delta go straight into the payload's own buffer, one tensor at a time.

`Exchange.put_part` encodes tensors that already exist, so a rank would hold its whole
delta and then the blob made of it: twice its shard. An uncompressed part's bytes are
known in advance but for the data (`pack_header` over the shapes), so `PartBlob` lays
the blob out, hands each tensor's slot to whoever computes it, and `put_part_blob`
uploads it as `Exchange.put_part` would: the same key, the same bytes, the same rules
(`put_init_blob`: as `Exchange.put_init_part`, for a creator's part of Θ⁰).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gradientmail.errors import AlreadyContributed, ConfigError
from gradientmail.run.keyspace import init_part_key, part_key
from gradientmail.run.protocol import Exchange
from gradientmail.wire.compression import extension
from gradientmail.wire.record_json import check_learner_id
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.serialization import ParameterSpec, pack_header
from gradientmail.wire.sharded_blocks import BLOCKS_KEY, blocks_entry, blocks_placeholder
from gradientmail.wire.sharded_parts import part_metadata
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["PartBlob", "put_init_blob", "put_part_blob"]


class PartBlob:
    """The blob of an uncompressed part holding `specs` (rows `rows[name]` of each
    tensor), its header written; `slot(name)` is the writable view of a tensor's data.
    Once every slot is written, `data` is byte for byte what `pack` makes — with `blocks`,
    what `encode(..., blocks=blocks)` makes: the header reserves the block digests'
    room (its length depends on the shapes alone) and `data` fills them in."""

    def __init__(self, specs: Sequence[ParameterSpec],
                 rows: Mapping[str, tuple[int, int]], *, blocks: int | None = None) -> None:
        self._specs = {s.name: s for s in specs}
        self._meta = part_metadata(rows)
        self.blocks = blocks
        if blocks is not None:
            self._meta[BLOCKS_KEY] = blocks_placeholder([s.nbytes for s in specs], blocks)
        header, order = pack_header(self._specs, self._meta)
        self._head = len(header)
        self._buf = bytearray(len(header) + sum(s.nbytes for s in specs))
        self._buf[: len(header)] = header
        self._slots: dict[str, tuple[int, int]] = {}
        pos = len(header)
        for name in order:
            self._slots[name] = (pos, pos + self._specs[name].nbytes)
            pos += self._specs[name].nbytes

    def slot(self, name: str) -> memoryview:
        a, b = self._slots[name]
        return memoryview(self._buf)[a:b]

    @property
    def data(self) -> memoryview:
        if self.blocks is not None:  # the digests of the slots as they are now
            view = memoryview(self._buf)
            tensors = {n: TensorBytes(self._specs[n].dtype, self._specs[n].shape,
                                      view[a:b].toreadonly())
                       for n, (a, b) in self._slots.items()}
            meta = {**self._meta, BLOCKS_KEY: blocks_entry(tensors, self.blocks)}
            header, _ = pack_header(self._specs, meta)
            assert len(header) == self._head  # base64 of as many digests, no escapes
            self._buf[: self._head] = header
            del view, tensors
        return memoryview(self._buf).toreadonly()


async def put_part_blob(ex: Exchange, round_: int, learner: str, k: int, n: int,
                        blob: PartBlob) -> PayloadRef:
    """`Exchange.put_part` for a part written in place (an uncompressed exchange only)."""
    if ex.store.compression != "off":
        raise ConfigError(f"a part written in place is uncompressed; this exchange's codec "
                          f"is {ex.store.compression!r} (use Exchange.put_part)")
    key = part_key(round_, check_learner_id(learner), k, n) + extension("off")
    data = blob.data
    # Create-if-absent; an own part no record references yet (a failed attempt) is
    # replaced; once the record exists the learner has contributed.
    if not await ex.mailbox.create(ex.prefix + key, data):  # type: ignore[arg-type]
        if await ex.contribution(round_, learner) is not None:
            raise AlreadyContributed(
                f"learner {learner!r} has already contributed to round {round_}; part "
                f"{key!r} belongs to its record")
        await ex.mailbox.put(ex.prefix + key, data)  # type: ignore[arg-type]
    return PayloadRef.of(key, data)  # type: ignore[arg-type]


async def put_init_blob(ex: Exchange, fragment: int, k: int, n: int, blob: PartBlob, *,
                        attempt: int) -> PayloadRef:
    """`Exchange.put_init_part` for a part written in place, uncompressed whatever the
    exchange's codec (the key's extension says so): overwritten, as the whole Θ⁰
    payload is."""
    key = init_part_key(attempt, fragment, k, n) + extension("off")
    data = blob.data
    await ex.mailbox.put(ex.prefix + key, data)  # type: ignore[arg-type]
    # A blob with block digests is pinned by its header too (ranks read Θ⁰ by ranges).
    return PayloadRef.of(key, data, header=blob.blocks is not None)  # type: ignore[arg-type]
