"""Bytes on the wire per learner per round, against an allreduce of the same pseudo-gradient.

    python benchmarks/bytes.py [--smoke] [--learners 2,4,8] [--rounds R] [--results PATH]

M learner threads (standard DiLoCo, H = 4, quorum M: every round merges every learner)
train a model of one F32 fragment of B = 4 MiB (a 1024×1024 linear layer) through a
memory mailbox, each through its own `CountingMailbox`, for R rounds; counting starts once
every learner has joined (Θ⁰ is not counted) and ends before they close. Arms:

- published (`checkpoint_every=1`): every commit uploads theta and the fp32 outer state,
  and every round's closer downloads them first (the closer role rotates);
- replicated (`checkpoint_every=20`, the default): a commit carries the merged step, every
  learner applies it; theta and the outer state go up every 20 versions.

Columns, in units of B per learner per round: up and down of the learner that closed the
round (its share over the rounds it closed) and of the others, and the mean over all
learners, against a ring allreduce's 2(M−1)/M·B each way (torchft's DiLoCo allreduces
the F32 pseudo-gradient; at M = 2 that is B up and B down). Counts are exact: no timing.
Prints a markdown table; appends it to RESULTS.md unless `--smoke`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Any

from gradientmail.learner.options import LearnerOptions

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
H = 4
WIDTH = 1024  # a 1024×1024 F32 weight: B = 4 MiB (the bias adds 4 KiB)


def _round_of(key: str) -> int | None:
    """The round a key belongs to (one fragment: version v is round v − 1), else None."""
    import re

    m = re.match(r"(?:payloads|snapshots|claims/round)/(\d{10})/", key) or re.match(
        r"rounds/(\d{10})\.json$", key)
    if m:
        return int(m.group(1))
    m = re.match(r"(?:theta|outer|steps|updates)/0/(\d{10})-", key)
    return int(m.group(1)) - 1 if m else None


def run_arm(learners: int, rounds: int, checkpoint_every: int,
            width: int = WIDTH) -> dict[str, Any]:
    """Per-learner counts of one arm: bytes up/down and rounds closed, after the join."""
    import torch

    from gradientmail.adapters import TorchAdapter
    from gradientmail.algorithms.diloco import DiLoCo
    from gradientmail.learner.runtime import Learner
    from gradientmail.mailbox import MemoryMailbox
    from gradientmail.mailbox.wrappers import CountingMailbox
    from gradientmail.run.protocol import Exchange

    torch.set_num_threads(1)
    name = f"bytes-{learners}-{checkpoint_every}-{os.getpid()}"
    MemoryMailbox.forget(name)
    alg = DiLoCo.standard(H, learners, flush_on_close=False, checkpoint_every=checkpoint_every)
    class KeyCounts(CountingMailbox):
        """Counts, and logs each payload's direction, key and size."""

        def __init__(self, inner: Any) -> None:
            super().__init__(inner)
            self.log: list[tuple[str, str, int]] = []
            self.on = False

        async def get(self, key: str) -> bytes | None:
            data = await super().get(key)
            if data is not None and self.on:
                self.log.append(("down", key, len(data)))
            return data

        async def put(self, key: str, data: bytes) -> None:
            if self.on:
                self.log.append(("up", key, len(data)))
            await super().put(key, data)

        async def create(self, key: str, data: bytes) -> bool:
            if self.on:
                self.log.append(("up", key, len(data)))
            return await super().create(key, data)

    boxes = [KeyCounts(MemoryMailbox(name)) for _ in range(learners)]
    models = []
    for _ in range(learners):
        torch.manual_seed(0)  # every learner starts from the same Θ⁰
        models.append(torch.nn.Linear(width, width))
    ids = [f"learner-{w}" for w in range(learners)]
    crowd = [Learner(
        TorchAdapter(m),
        alg,
        boxes[w],
        ids[w],
        on_event=lambda e: None,
        options=LearnerOptions(poll_interval=0.005, lease_every=5.0, lease_timeout=60.0),
    )
             for w, m in enumerate(models)]
    joined = threading.Barrier(learners)
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            crowd[w].start()
            crowd[w].wait_for_learners(learners, timeout=120)
            joined.wait(timeout=120)
            if w == 0:
                for box in boxes:
                    box.reset()
                    box.on = True
            joined.wait(timeout=120)
            gen = torch.Generator().manual_seed(w)
            # One step more than R rounds: it waits at the barrier for round R−1's commit.
            for _ in range(rounds * H + 1):
                with torch.no_grad():
                    for p in models[w].parameters():
                        p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
                crowd[w].step(1)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(learners)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = [box.snapshot() for box in boxes]
    logs = [list(box.log) for box in boxes]
    for learner in crowd:
        learner.close()
    if errors:
        raise errors[0]
    import asyncio

    records = asyncio.run(Exchange(MemoryMailbox(name)).rounds_after(-1))[:rounds]
    MemoryMailbox.forget(name)
    closed = {x: sum(r.closer == x for r in records) for x in ids}
    closers = [r.closer for r in records]
    return {"counts": counts, "logs": logs, "closers": closers, "closed": closed, "ids": ids,
            "rounds": len(records), "model_bytes": 4 * (width * width + width)}


def summarize(arm: dict[str, Any]) -> dict[str, float]:
    """Bytes per learner per round in units of B: the mean over all learners (every
    request counted), and per round, the closer's and the others' bytes (requests
    attributed to a round by their keys: its contributions, claims, record, step, theta
    and outer state; leases and roll calls are left out of that split)."""
    b, rounds, m = arm["model_bytes"], arm["rounds"], len(arm["ids"])
    total = sum(c.bytes_up + c.bytes_down for c in arm["counts"]) / b
    split = {("closer", "up"): 0.0, ("closer", "down"): 0.0, ("other", "up"): 0.0,
             ("other", "down"): 0.0}
    for learner, log in zip(arm["ids"], arm["logs"], strict=True):
        for direction, key, n in log:
            r = _round_of(key)
            if r is None or r >= rounds:
                continue
            role = "closer" if arm["closers"][r] == learner else "other"
            split[(role, direction)] += n / b
    others = rounds * (m - 1)
    ring = 2 * 2 * (m - 1) / m  # a ring allreduce: 2(M−1)/M·B up and as much down
    out = {"closer_up": split[("closer", "up")] / rounds,
           "closer_down": split[("closer", "down")] / rounds,
           "other_up": split[("other", "up")] / others,
           "other_down": split[("other", "down")] / others,
           "mean": total / (m * rounds), "ring": ring}
    out["ratio"] = out["mean"] / ring
    out["other_ratio"] = (out["other_up"] + out["other_down"]) / ring
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a small model, 2 learners, 6 rounds")
    ap.add_argument("--learners", default="2,4,8")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args(argv)
    sizes = [2] if args.smoke else [int(x) for x in args.learners.split(",")]
    rounds = 6 if args.smoke else args.rounds
    width = 64 if args.smoke else WIDTH
    rows = []
    for m in sizes:
        for label, k in (("published", 1), ("replicated", 20)):
            s = summarize(run_arm(m, rounds, k, width))
            rows.append((m, label, s))
            print(f"M={m} {label}: mean {s['mean']:.3f} B = {s['ratio']:.3f}x allreduce",
                  flush=True)
    lines = [
        "| M | outer state | closer up | closer down | other up | other down | mean up+down "
        "| ring allreduce up+down | mean / allreduce | other / allreduce |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, label, s in rows:
        lines.append(
            f"| {m} | {label} | {s['closer_up']:.3f} | {s['closer_down']:.3f} | "
            f"{s['other_up']:.3f} | {s['other_down']:.3f} | {s['mean']:.3f} | "
            f"{s['ring']:.3f} | {s['ratio']:.3f}x | {s['other_ratio']:.3f}x |")
    table = "\n".join(lines)
    print(table)
    if args.smoke:
        return
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"\n## Bytes per learner per round ({stamp})\n\n"
        f"`python benchmarks/{Path(__file__).name} {' '.join(argv or sys.argv[1:])}`. "
        f"Standard DiLoCo, H = {H}, one F32 fragment of B = 4 MiB, {rounds} rounds, counted "
        "after the join; units of B per learner per round. Machine: "
        f"{platform.machine()}, {os.cpu_count()} cores (counts, not timings).\n\n{table}\n"
    )
    with Path(args.results).open("a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
