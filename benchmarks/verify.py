"""Seconds to verify a round (`gradientmail verify`) against the seconds its closer took.

One run on a memory mailbox: one F32 fragment of 31.5M parameters (3 tensors, one an
embedding, so both the RDA and the weighted-mean paths run), M = 8 contributions a round
(standard DiLoCo's barrier: every learner in, quorum M), `keep_rounds` 2. A standalone
`Syncer` closes each round (its `RoundClosed.seconds`: claim to record, i.e. fetching the
deltas, `close_round`, uploading the step, the record), then a `Verifier` following the
run re-derives that round from the store (reading the record, listing and fetching the
deltas, the same merge, fetching the step and comparing it entry by entry, the theta
digest). Both merge with numpy on the same number of threads. Goal: verifying costs at
most 1.2x the close.

Prints a markdown table and appends it to benchmarks/RESULTS.md.

    python benchmarks/verify.py             # 31.5M parameters, M = 8, 10 rounds
    python benchmarks/verify.py --quick     # 1M parameters, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Rda
from gradientmail.app.verify import Verifier
from gradientmail.events import Event, RoundClosed
from gradientmail.mailbox import MemoryMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.syncer.runtime import Syncer
from gradientmail.wire.records import Manifest
from gradientmail.wire.serialization import ParameterSpec, Schema
from gradientmail.wire.tensor_bytes import TensorBytes

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def shapes(quick: bool) -> dict[str, tuple[int, ...]]:
    if quick:
        return {"wte.embed.weight": (512, 1024), "h.0.mlp.fc": (256, 1024),
                "h.0.mlp.proj": (1024, 256)}
    # 12.6M + 9.4M + 9.4M = 31.5M parameters, 126 MB in F32 (as benchmarks/syncer.py).
    return {"wte.embed.weight": (8192, 1536), "h.0.mlp.fc": (1536, 6144),
            "h.0.mlp.proj": (6144, 1536)}


async def measure(quick: bool, m: int, rounds: int) -> list[tuple[int, float, float, int]]:
    """Per round: (round, close seconds, verify seconds, payload bytes verified)."""
    schema = Schema(tuple(ParameterSpec(n, "F32", s) for n, s in shapes(quick).items()))
    alg = DiLoCo(sync_every=100, fragments=1, in_flight=1, overlap_steps=0, quorum_size=m,
                 merge=Rda(direct_pattern="embed"), keep_rounds=2)
    name = f"verify-bench-{os.getpid()}"
    mailbox = MemoryMailbox(name)
    ex = Exchange(mailbox)
    rng = np.random.default_rng(0)

    def tensors(scale: float) -> dict[str, TensorBytes]:
        return {p.name: TensorBytes.from_numpy(
            (scale * rng.standard_normal(p.shape)).astype(np.float32)) for p in schema.params}

    plan = alg.plan(schema)
    init = await ex.put_init(0, tensors(1.0), attempt=0)
    await ex.create_manifest(Manifest(schema, plan, alg.to_json(), "bench", (init,), "off"))
    # The same M deltas every round: their values do not change the work.
    deltas = [tensors(0.01) for _ in range(m)]
    learners = [f"learner-{i}" for i in range(m)]
    closed: list[RoundClosed] = []

    def on_event(e: Event) -> None:
        if isinstance(e, RoundClosed):
            closed.append(e)

    syncer = Syncer.open(mailbox, closer_id="closer", on_event=on_event)
    manifest = await ex.read_manifest()
    assert manifest is not None
    # An auditor that follows the run: it verifies each round once its record is in.
    verifier = Verifier(ex, manifest)
    out = []
    for r in range(rounds):
        for i, learner in enumerate(learners):
            await ex.publish(r, learner, deltas[i], fragment=0, base_version=r,
                             local_step=100 * (r + 1), steps=100, tokens=1000 + i, final=False,
                             schema_digest=schema.digest(), delta_format="F32")
        assert await syncer.poll(live=frozenset(learners))
        t0 = time.perf_counter()
        verdict = await verifier.round(r)
        seconds = time.perf_counter() - t0
        if verdict.status != "verified":
            raise SystemExit(f"round {r} did not verify: {verdict}")
        out.append((r, closed[-1].seconds, seconds, verdict.bytes))
        print(f"round {r}: close {closed[-1].seconds:.3f} s, verify {seconds:.3f} s",
              file=sys.stderr, flush=True)
    MemoryMailbox.forget(name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 1M-parameter fragment")
    ap.add_argument("--contributions", type=int, default=8, help="M, contributions a round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--no-append", action="store_true", help="do not write RESULTS.md")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the file to append to")
    args = ap.parse_args()
    rows = asyncio.run(measure(args.quick, args.contributions, args.rounds))
    numel = sum(int(np.prod(s)) for s in shapes(args.quick).values())
    close = [c for _, c, _, _ in rows]
    check = [v for _, _, v, _ in rows]
    mb = [b / 1e6 for _, _, _, b in rows]
    lines = ["| round | close s | verify s | verify / close | MB verified | verify MB/s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for (r, c, v, _), size in zip(rows, mb, strict=True):
        lines.append(f"| {r} | {c:.3f} | {v:.3f} | {v / c:.2f}x | {size:.0f} | "
                     f"{size / v:.0f} |")
    ratio = sum(check) / sum(close)
    lines.append(f"| all | {sum(close):.3f} | {sum(check):.3f} | {ratio:.2f}x | "
                 f"{sum(mb):.0f} | {sum(mb) / sum(check):.0f} |")
    table = "\n".join(lines)
    verdict = "met" if ratio <= 1.2 else "NOT met"
    summary = (f"- verify / close over {len(rows)} rounds: {ratio:.2f}x (goal <= 1.2x: "
               f"{verdict}); median per round {statistics.median(check):.3f} s vs "
               f"{statistics.median(close):.3f} s")
    print(table)
    print(summary)
    if not args.no_append:
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python benchmarks/verify.py" + (" --quick" if args.quick else "")
        text = (
            f"\n## verify: re-deriving a round vs closing it ({when})\n\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}. "
            f"Command: `{command}`. One F32 fragment of {numel / 1e6:.1f}M parameters in 3 "
            f"tensors (RDA, the embedding by weighted mean), {args.contributions} "
            "contributions a round, a memory mailbox, keep_rounds 2. Close: the standalone "
            "syncer's claim to record (`RoundClosed.seconds`: fetch the deltas, "
            "close_round, upload the step, commit). Verify: a `Verifier` following the "
            "run, on that round (read the record, list and fetch the deltas with their "
            "digests, the same merge, fetch the step and compare it entry by entry, the "
            "theta digest); both numpy on the default threads.\n\n"
            f"{table}\n\n{summary}\n"
        )
        with open(args.results, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
