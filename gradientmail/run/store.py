"""`RunStore`: a run's sealed records and verified payloads on a Mailbox.

What `gradientmail.run.protocol.Exchange` keeps the run's protocol in (`Exchange.store`),
and what readers of payloads use directly: every key
under the run's prefix, every record through the run's `Seal` and created once, every
payload encoded with the writer's codec, checked against its ref's size and SHA-256 when
read, and bounded before it is downloaded. Payloads that sharded learners read by ranges
(`RANGED_AREAS`) carry block digests when uncompressed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TypeVar

from gradientmail.errors import ConfigError, CorruptPayload
from gradientmail.mailbox.base import Mailbox
from gradientmail.wire import compression as codec
from gradientmail.wire.auth import HmacSeal, PlainSeal, Seal
from gradientmail.wire.record_json import CODECS
from gradientmail.wire.records import Record
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.sharded_blocks import BLOCK_BYTES
from gradientmail.wire.sharded_parts import Part, rows_in
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["RANGED_AREAS", "RunStore"]

_R = TypeVar("_R", bound=Record)

#: Payloads a sharded learner's ranks read by ranges (docs/design/sharded.md §2): Θ⁰, a commit's
#: theta and outer state, a replicated commit's step. Written with block digests
#: (`gradientmail.wire.sharded_blocks`) when uncompressed. Not contributions or their parts (the
#: closer reads them whole and checks their SHA-256) nor updates (read whole).
RANGED_AREAS = ("init/", "theta/", "outer/", "steps/")


class RunStore:
    """The run's records and payloads on `mailbox`, under `prefix`.

    `compression` is the codec of the payloads this process writes ("off" or "zstd");
    readers take the codec from each key's extension. Records pass through `seal` (or an
    `HmacSeal` of `run_key`; plain JSON without either). No I/O happens in the constructor.
    """

    def __init__(
        self,
        mailbox: Mailbox,
        *,
        compression: str = "off",
        prefix: str = "",
        seal: Seal | None = None,
        run_key: str | bytes | None = None,
    ) -> None:
        if seal is not None and run_key is not None:
            raise ConfigError("give an Exchange a seal or a run_key, not both")
        if compression not in CODECS:
            raise ConfigError(f"compression={compression!r} must be one of {CODECS}")
        if prefix and (prefix.startswith("/") or not prefix.endswith("/")):
            raise ConfigError(f"prefix={prefix!r} must be empty or end with '/', no leading '/'")
        self.mailbox = mailbox
        self.compression = compression
        self.prefix = prefix
        self.seal: Seal = seal if seal is not None else (
            PlainSeal() if run_key is None else HmacSeal(run_key))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mailbox!r}, prefix={self.prefix!r})"

    @property
    def where(self) -> str:
        """The run's place, for messages: the mailbox URL and the prefix, if any."""
        return self.mailbox.url + (f" (prefix {self.prefix!r})" if self.prefix else "")

    async def keys(self, prefix: str) -> list[str]:
        """The keys under the run's `prefix`/`prefix`, relative to the run's prefix."""
        return [k[len(self.prefix):] for k in await self.mailbox.list(self.prefix + prefix)]

    async def write_record(self, key: str, record: Record) -> bool:
        """Every record is created once (create-if-absent): records never change."""
        return await self.mailbox.create(self.prefix + key, self.seal.seal(key, record.encode()))

    async def read_record(self, key: str, cls: type[_R]) -> _R | None:
        """The record at `key`, opened and decoded as `cls`; None when absent."""
        data = await self.mailbox.get(self.prefix + key)
        return None if data is None else cls.decode(self.seal.open(key, data), key)

    async def put_payload(self, key: str, tensors: Mapping[str, TensorBytes],
                          *, create: bool = False,
                          metadata: Mapping[str, str] | None = None) -> PayloadRef | None:
        """Encode `tensors` (and `metadata`) with this store's codec and store them at
        `key` + extension. A payload that sharded learners read by ranges (`RANGED_AREAS`)
        is written, uncompressed, with block digests and its ref pins its header.

        With `create`, store only if absent and return None when the key exists.
        """
        key += codec.extension(self.compression)
        ranged = self.compression == "off" and key.startswith(RANGED_AREAS)
        blob = codec.encode(tensors, self.compression, metadata,
                            blocks=BLOCK_BYTES if ranged else None)
        if create:
            if not await self.mailbox.create(self.prefix + key, blob):
                return None
        else:
            await self.mailbox.put(self.prefix + key, blob)
        return PayloadRef.of(key, blob, header=ranged)

    async def fetch_payload(self, ref: PayloadRef, max_bytes: int | None = None) -> bytes | None:
        """The payload's bytes, checked against the ref's size and SHA-256; None if swept.

        Raises `CorruptPayload` naming the key when the size exceeds `max_bytes` or when
        the stored bytes differ from the ref.
        """
        if max_bytes is not None and ref.size > max_bytes:
            raise CorruptPayload(
                f"payload {ref.key!r} is declared {ref.size} bytes, over the bound of "
                f"{max_bytes} bytes for what it should hold; refusing to download it"
            )
        blob = await self.mailbox.get(self.prefix + ref.key)
        if blob is None:
            return None
        if len(blob) != ref.size:
            raise CorruptPayload(
                f"payload {ref.key!r} is {len(blob)} bytes but its record says {ref.size}; "
                "it was truncated or replaced after the record was written"
            )
        digest = hashlib.sha256(blob).hexdigest()
        if digest != ref.sha256:
            raise CorruptPayload(
                f"payload {ref.key!r} has SHA-256 {digest[:16]}..., its record says "
                f"{ref.sha256[:16]}...; it was corrupted or replaced after the record was written"
            )
        return blob

    async def fetch_tensors(
        self, ref: PayloadRef, max_bytes: int | None = None
    ) -> dict[str, TensorBytes] | None:
        """Fetch, verify and decode a payload (codec from the key's extension); None if swept."""
        blob = await self.fetch_payload(ref, max_bytes)
        if blob is None:
            return None
        return codec.decode(blob, codec.compression_of(ref.key), key=ref.key,
                            max_bytes=max_bytes)

    async def fetch_parts(self, refs: Sequence[PayloadRef], bound: int) -> list[Part] | None:
        """The parts `refs` name, each checked and decoded with the rows it holds; None
        when one is gone (swept)."""
        parts: list[Part] = []
        for ref in refs:
            blob = await self.fetch_payload(ref, bound)
            if blob is None:
                return None
            entries, meta = codec.decode_with_metadata(
                blob, codec.compression_of(ref.key), key=ref.key, max_bytes=bound)
            parts.append((ref.key, entries, rows_in(meta, ref.key)))
        return parts
