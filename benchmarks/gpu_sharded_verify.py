"""The check after each launch of benchmarks/gpu_sharded_check.sh.

    python benchmarks/gpu_sharded_verify.py lightning|accelerate RUN_DIR RESULT.json RANKS
        [KEY_LOG]

Passes (exit 0, a line starting "verify <kind>: ok") when the launch ended on its run's
newest commits (every parameter, gathered whole by the worker, equal to the committed
theta), the run committed at least 3 rounds, its last contribution was one part per rank
(or was swept already), with KEY_LOG (the worker's `--key-log`) every rank wrote its own
part of every round and no rank a whole payload, and, for Accelerate, the launch ran as
FSDP with FSDP2.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import state_at


async def newest(box: Path) -> tuple[list[Any], dict[str, np.ndarray], Any]:
    ex = Exchange(LocalMailbox(box))
    recs = list(await ex.rounds_after(-1))
    latest = {r.fragment: r for r in recs}
    theta: dict[str, np.ndarray] = {}
    for rec in latest.values():
        for name, t in (await state_at(ex, rec.fragment, rec)).theta.items():
            theta[name] = np.frombuffer(t.data, dtype="<f4").reshape(t.shape)
    last = recs[-1]
    snap = await ex.contribution(last.round, last.participants[0].learner) \
        if last.participants else None
    await ex.mailbox.close()
    return recs, theta, snap


def main() -> int:
    kind, box, result, ranks = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    got = json.loads(result.read_text())
    recs, theta, snap = asyncio.run(newest(box))
    problems = []
    if len(recs) < 3:
        problems.append(f"{len(recs)} rounds committed, expected at least 3")
    for name, want in theta.items():
        mine = np.asarray(got["params"][name], dtype=np.float32).reshape(want.shape)
        if not np.array_equal(mine, want):
            problems.append(f"{name}: ended {np.abs(mine - want).max():.3g} off the commit")
    if snap is not None and (snap.payload is not None or len(snap.parts) != ranks):
        problems.append(f"last contribution: payload {snap.payload}, {len(snap.parts)} parts "
                        f"for {ranks} ranks")
    if kind == "accelerate" and (got.get("distributed_type"), got.get("fsdp2")) != ("FSDP", True):
        problems.append(f"distributed_type {got.get('distributed_type')}, fsdp2 "
                        f"{got.get('fsdp2')}: the plugin did not shard")
    if len(sys.argv) > 5:
        for rank in range(ranks):
            log = Path(f"{sys.argv[5]}.rank{rank}")
            keys = log.read_text().split() if log.exists() else []
            whole = [k for k in keys if k.startswith("payloads/")]
            parts = {int(m[1]): m[2] for k in keys
                     if (m := re.fullmatch(r"parts/(\d+)/[^/]+/(\d+-of-\d+)\.safetensors", k))}
            if whole:
                problems.append(f"rank {rank} wrote whole payloads: {whole[:3]}")
            wrong = {r: parts.get(r.round) for r in recs
                     if r.participants and parts.get(r.round) != f"{rank}-of-{ranks}"}
            if wrong:
                problems.append(f"rank {rank}: parts written per round {parts}, expected "
                                f"{rank}-of-{ranks} in every round")
    for p in problems:
        print(f"verify {kind}: FAIL {p}")
    if not problems:
        print(f"verify {kind}: ok, {len(recs)} rounds, ended on the newest commits"
              + (f", each of {ranks} rank(s) wrote its part" if len(sys.argv) > 5 else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
