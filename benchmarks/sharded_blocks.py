"""What block digests cost a sharded learner's ranged reads (docs/design/sharded.md §2, issue #15).

    python benchmarks/sharded_blocks.py [--layers 4] [--embd 1600] [--dtype BF16] [--ranks 2 4 8 16]
                                [--blocks 16 32 64 256] [--no-append]

A GPT-2-shaped fragment (`--layers` transformer blocks of width `--embd`, 1600 as GPT-2
XL's, in Hugging Face's Conv1D layout: c_attn (d, 3d), c_proj (d, d), c_fc (d, 4d), the
MLP's c_proj (4d, d), their biases and the two layer norms, 12 tensors a block) is written
as the closer writes a commit's theta: uncompressed, without block digests and with
digests of each block size (`--blocks`, KiB). For each rank count every rank reads its
rows of every tensor (`chunk_rows`: `torch.chunk`'s split, as FSDP2 shards dim 0) through
a memory mailbox that counts the bytes of each ranged GET, twice: tensor by tensor, as
`ShardedReplica` reads a commit (`fetch_header`, then `fetch_span_rows` per tensor), and all
at once with `fetch_rows` (touching ranges fetched as one). Reported: the header and its
growth (every rank reads the header whole), and per rank (mean and worst over the ranks)
the data bytes fetched beyond its rows, and header growth + extra as a share of its rows.
The numbers are exact byte counts, the same on every machine; only the seconds vary.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import time
from pathlib import Path
from typing import Any

import numpy as np

from gradientmail.mailbox import MemoryMailbox
from gradientmail.wire.compression import encode
from gradientmail.wire.sharded_ranges import (
    HEADER_PROBE,
    fetch_header,
    fetch_rows,
    fetch_span_rows,
    header_length,
)
from gradientmail.wire.tensor_bytes import TensorBytes, nbytes_of

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
KEY = "theta/0/0000000001-000000.safetensors"


def chunk_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """`gradientmail.adapters.sharded.chunk_rows` (torch.chunk's split), without torch."""
    size = -(-rows // parts) if rows else 0
    start = min(index * size, rows)
    return start, min(start + size, rows)


def gpt2_blocks(layers: int, d: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        h = f"transformer.h.{i}."
        shapes.update({
            h + "ln_1.weight": (d,), h + "ln_1.bias": (d,),
            h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
            h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
            h + "ln_2.weight": (d,), h + "ln_2.bias": (d,),
            h + "mlp.c_fc.weight": (d, 4 * d), h + "mlp.c_fc.bias": (4 * d,),
            h + "mlp.c_proj.weight": (4 * d, d), h + "mlp.c_proj.bias": (d,),
        })
    return shapes


class Counting(MemoryMailbox):
    """A memory mailbox that sums the bytes its ranged GETs return."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.bytes = 0

    async def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        got = await super().get_range(key, start, stop)
        self.bytes += 0 if got is None else len(got)
        return got


async def rank_reads(box: Counting, size: int, rows: dict[str, tuple[int, int]]
                     ) -> tuple[int, int]:
    """Data bytes one rank fetches for `rows`: tensor by tensor, then all at once."""
    index = await fetch_header(box, KEY, size)
    assert index is not None
    box.bytes = 0
    for name, (a, b) in rows.items():
        assert await fetch_span_rows(box, KEY, index.spans[name], a, b,
                                     blocks=index.blocks) is not None
    each = box.bytes
    head = header_length(await box.get_range(KEY, 0, 8) or b"")
    box.bytes = 0
    assert await fetch_rows(box, KEY, size, rows) is not None
    # fetch_rows reads the header too: its probe, and the rest when the header is larger.
    return each, box.bytes - max(min(size, HEADER_PROBE), head)


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    shapes = gpt2_blocks(args.layers, args.embd)
    rng = np.random.default_rng(0)
    tensors = {n: TensorBytes(args.dtype, s, rng.bytes(nbytes_of(args.dtype, s)))
               for n, s in shapes.items()}
    data = sum(t.nbytes for t in tensors.values())
    plain_head = header_length(encode(tensors, "off")[:8])
    rows_out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for kib in [None, *args.blocks]:
        blob = encode(tensors, "off", blocks=None if kib is None else kib * 1024)
        head = header_length(blob[:8])
        box = Counting(f"blocks-bench-{kib}")
        asyncio.run(box.put(KEY, blob))
        for n in args.ranks:
            per_rank = []
            for k in range(n):
                rows = {name: chunk_rows(s[0], n, k) for name, s in shapes.items()}
                mine = sum(nbytes_of(args.dtype, (b - a, *shapes[name][1:]))
                           for name, (a, b) in rows.items())
                each, merged = asyncio.run(rank_reads(box, len(blob), rows))
                per_rank.append((mine, each - mine, merged - mine))
            rows_out.append({
                "block": kib, "ranks": n, "header": head, "growth": head - plain_head,
                "rows": sum(p[0] for p in per_rank) / n,
                "each_mean": sum(p[1] for p in per_rank) / n,
                "each_max": max(p[1] for p in per_rank),
                "merged_mean": sum(p[2] for p in per_rank) / n,
                "share_max": max((head - plain_head + p[1]) / p[0] for p in per_rank),
            })
        del blob, box
    about = {"params": data // nbytes_of(args.dtype, (1,)), "data": data,
             "plain_header": plain_head, "tensors": len(shapes),
             "seconds": time.perf_counter() - t0}
    return rows_out, about


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| block | ranks | header bytes (growth) | rank's rows MiB | extra, tensor by "
        "tensor: mean (worst) | extra, fetch_rows: mean | growth + extra, worst rank |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        block = "none" if r["block"] is None else f"{r['block']} KiB"
        lines.append(
            f"| {block} | {r['ranks']} | {r['header']:,} (+{r['growth']:,}) | "
            f"{r['rows'] / 2**20:.2f} | {r['each_mean'] / 1024:,.0f} KiB "
            f"({r['each_max'] / 1024:,.0f} KiB) | {r['merged_mean'] / 1024:,.0f} KiB | "
            f"{100 * r['share_max']:.2f}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=1600)
    parser.add_argument("--dtype", default="BF16", choices=("F32", "BF16"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64, 256],
                        help="block sizes, KiB")
    parser.add_argument("--no-append", action="store_true", help="do not touch RESULTS.md")
    args = parser.parse_args()
    rows, about = measure(args)
    command = "python benchmarks/sharded_blocks.py" + "".join(
        f" --{k} " + (" ".join(map(str, v)) if isinstance(v, list) else str(v))
        for k, v in vars(args).items()
        if k != "no_append" and v != parser.get_default(k))
    section = (
        f"## block digests: header growth and range overhead — "
        f"{datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d')}\n\n"
        f"GPT-2-shaped fragment: {args.layers} blocks of width {args.embd}, {about['tensors']} "
        f"tensors, {about['params']:,} parameters in {args.dtype} ({about['data'] / 2**20:.1f} "
        f"MiB of data; header {about['plain_header']:,} bytes without digests). Each rank "
        "reads its rows (torch.chunk's split) of every tensor; extra = data bytes fetched "
        "beyond them. Exact byte counts; "
        f"{about['seconds']:.0f} s.\nCommand: `{command}`\n\n{table(rows)}\n"
    )
    print(section)
    if not args.no_append:
        with open(RESULTS, "a", encoding="utf-8") as f:
            f.write("\n" + section)


if __name__ == "__main__":
    main()
