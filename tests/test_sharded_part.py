"""A part written in place (`PartBlob`, `ShardedAdapter.delta_into`) is byte for byte the
part `Exchange.put_part` encodes from `ShardedAdapter.delta`, under the same key; and it
replaces an own part no record references, as `put_part` does."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch

from gradientmail.adapters.sharded import ShardedAdapter
from gradientmail.errors import AlreadyContributed, ConfigError
from gradientmail.mailbox import MemoryMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.sharded_part import PartBlob, put_part_blob

RANKS = 3


class Mixed(torch.nn.Module):
    """Rows that split unevenly over 3 ranks, a BF16 layer, a 0-d parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(7, 4)
        self.fc = torch.nn.Linear(4, 3).to(torch.bfloat16)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))


def part(rank: int) -> tuple[PartBlob, dict[str, Any], dict[str, tuple[int, int]]]:
    """Rank `rank`'s part written in place, the delta `delta` returns, and its rows."""
    model = Mixed()
    adapter = ShardedAdapter(model, group_size=RANKS, group_rank=rank)
    names = list(adapter.schema.names)
    snapshot = adapter.snapshot(names)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3)
    anchor = adapter.snapshot(names)
    delta = adapter.delta(anchor, snapshot)
    rows = adapter.mailed(names)
    assert rows == {n: (r.start, r.stop) for n, r in delta.items()}
    specs = [dataclasses.replace(p, dtype="F32") for p in adapter.part_schema(list(rows)).params]
    blob = PartBlob(specs, rows)
    adapter.delta_into(anchor, snapshot, {n: blob.slot(n) for n in rows})
    return blob, {n: r.tensor for n, r in delta.items()}, rows


def test_a_part_written_in_place_is_the_part_put_part_writes() -> None:
    async def main() -> None:
        for name in ("blob", "blob-ref"):
            MemoryMailbox.forget(name)
        ex, want_ex = Exchange(MemoryMailbox("blob")), Exchange(MemoryMailbox("blob-ref"))
        refs = []
        for k in range(RANKS):
            blob, delta, rows = part(k)
            ref = await put_part_blob(ex, 4, "node", k, RANKS, blob)
            want = await want_ex.put_part(4, "node", k, RANKS, delta, rows)
            assert ref == want, k
            assert await ex.mailbox.get(ref.key) == await want_ex.mailbox.get(want.key)
            # A retry of an attempt no record references replaces it.
            assert await put_part_blob(ex, 4, "node", k, RANKS, blob) == ref
            refs.append(ref)
        draft = ex.draft(4, "node", fragment=0, base_version=0, local_step=1, steps=1,
                         tokens=1, final=False, schema_digest="0" * 64, delta_format="F32")
        await ex.publish_parts(draft, refs)
        with pytest.raises(AlreadyContributed):
            await put_part_blob(ex, 4, "node", 0, RANKS, part(0)[0])
        with pytest.raises(ConfigError, match="uncompressed"):
            await put_part_blob(Exchange(MemoryMailbox("blob"), compression="zstd"), 5,
                                "node", 0, RANKS, part(0)[0])

    asyncio.run(main())
