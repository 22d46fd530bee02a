"""Mailbox throughput: put/get/create/list ops/s and MB/s on a local directory and on S3.

S3 here is moto's server on 127.0.0.1 (a Python process, so far slower than real S3 per
request; the numbers show our client's overhead and the shape, not S3's speed). Run:

    python benchmarks/mailbox.py            # 1 KiB x 1000 and 16 MiB x 8
    python benchmarks/mailbox.py --quick    # 1 KiB x 100 and 1 MiB x 4, a few seconds

Prints a markdown table and appends it to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gradientmail.mailbox import LocalMailbox, Mailbox, S3Mailbox

KiB, MiB = 1024, 1024 * 1024
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
Row = tuple[str, str, str, int, int, float, float | None]


async def _timed(n: int, concurrency: int, op: Callable[[int], Awaitable[object]]) -> float:
    """Run op(0..n-1) with at most `concurrency` in flight; return the seconds taken."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            await op(i)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - start


def _puts(mailbox: Mailbox, prefix: str, data: bytes) -> Callable[[int], Awaitable[None]]:
    return lambda i: mailbox.put(f"{prefix}{i:06d}", data)


def _gets(mailbox: Mailbox, prefix: str) -> Callable[[int], Awaitable[bytes | None]]:
    return lambda i: mailbox.get(f"{prefix}{i:06d}")


async def measure(
    store: str, mailbox: Mailbox, small_n: int, large: int, large_n: int
) -> list[Row]:
    rows: list[Row] = []
    small = os.urandom(KiB)
    big = os.urandom(large)

    def row(op: str, size: int, conc: int, n: int, seconds: float, mb: bool = True) -> None:
        label = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB" if size else ""
        rate = n / seconds
        rows.append((store, op, label, conc, n, rate, rate * size / 1e6 if mb else None))

    for conc in (1, 16):
        t = await _timed(small_n, conc, _puts(mailbox, f"small/{conc}/", small))
        row("put", KiB, conc, small_n, t)
        t = await _timed(small_n, conc, _gets(mailbox, f"small/{conc}/"))
        row("get", KiB, conc, small_n, t)
    t = await _timed(small_n, 16, lambda i: mailbox.create(f"claims/{i:06d}", small))
    row("create (new)", KiB, 16, small_n, t)
    t = await _timed(small_n, 16, lambda i: mailbox.create(f"claims/{i:06d}", small))
    row("create (exists)", KiB, 16, small_n, t)
    lists = 10
    t = await _timed(lists, 1, lambda i: mailbox.list("small/1/"))
    row(f"list {small_n} keys", 0, 1, lists, t, mb=False)
    t = await _timed(
        lists, 1, lambda i: mailbox.list("small/1/", start_after=f"small/1/{small_n - 2:06d}")
    )
    row("list after cursor", 0, 1, lists, t, mb=False)
    t = await _timed(large_n, 1, lambda i: mailbox.put(f"large/{i}", big))
    row("put", large, 1, large_n, t)
    t = await _timed(large_n, 1, lambda i: mailbox.get(f"large/{i}"))
    row("get", large, 1, large_n, t)
    return rows


def polling_requests() -> list[Row] | None:
    """Requests per learner-hour made by the protocol's polling (benchmarks/polling.py).

    One learner's loop on a `CountingMailbox(MemoryMailbox())` with a `FakeClock` for one
    simulated hour: rounds_after every 1 s poll, a publishers LIST at the pattern's period,
    a beat and a lease LIST every 60 s, a publish every 30 s, and the theta of every
    commit (one every 30 s). Rows: requests per learner-hour by kind and their S3 price.
    """
    import concurrent.futures

    from benchmarks.polling import per_learner_hour

    # The simulation runs its own event loop; this is called from inside one.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        results = pool.submit(per_learner_hour).result()
    rows: list[Row] = []
    for pattern, c in results:
        op = (
            f"poll, {pattern.name}: LIST {c.list}, GET {c.get}, PUT {c.put}, "
            f"DELETE {c.delete} per learner-hour = ${c.cost_usd():.4f}"
        )
        rows.append(("memory (simulated)", op, "", 1, c.requests, c.requests / 3600.0, None))
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| store | op | object | concurrency | ops | ops/s | MB/s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for store, op, size, conc, n, rate, mbs in rows:
        mb = f"{mbs:.1f}" if mbs is not None else "—"
        ops = f"{rate:,.1f}" if rate < 10 else f"{rate:,.0f}"
        lines.append(f"| {store} | {op} | {size or '—'} | {conc} | {n} | {ops} | {mb} |")
    return "\n".join(lines)


async def _run_s3(small_n: int, large: int, large_n: int) -> list[Row]:
    import boto3
    from moto.server import ThreadedMotoServer

    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        mailbox = S3Mailbox("bench", "run", endpoint_url=endpoint)
        try:
            return await measure("S3 (moto)", mailbox, small_n, large, large_n)
        finally:
            await mailbox.close()
    finally:
        server.stop()


async def main_async(args: argparse.Namespace) -> list[Row]:
    small_n, large, large_n = (100, MiB, 4) if args.quick else (1000, 16 * MiB, 8)
    rows: list[Row] = []
    if "local" in args.stores:
        with tempfile.TemporaryDirectory(prefix="gm-bench-") as tmp:
            rows += await measure("local", LocalMailbox(tmp), small_n, large, large_n)
    if "s3" in args.stores:
        rows += await _run_s3(small_n, large, large_n)
    polled = polling_requests()
    if polled is not None:
        rows += polled
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--stores", default="local,s3", help="comma-separated: local,s3")
    parser.add_argument("--no-append", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args()
    args.stores = set(args.stores.split(","))
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    rows = asyncio.run(main_async(args))
    text = table(rows)
    print(text)
    if not args.no_append:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python benchmarks/mailbox.py " + " ".join(sys.argv[1:])
        header = (
            f"\n## Mailbox throughput ({stamp})\n\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. Command: `{command.strip()}`. "
            "S3 is moto's server on 127.0.0.1 (per-request cost is moto's, not S3's); local is "
            "a directory with fsync on.\n\n"
        )
        with open(RESULTS, "a") as f:
            f.write(header + text + "\n")


if __name__ == "__main__":
    main()
