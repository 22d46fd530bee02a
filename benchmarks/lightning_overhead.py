"""Training speed of a tiny GPT-2 under Lightning with DiLoCoCallback against without it.

Both modes run in the same process, interleaved (A B B A A B …, so drift hits both
alike) after one discarded warm-up segment of each: each segment is a fresh
`Trainer.fit` of the recipe's tiny GPT-2 (2 layers, 128 wide, vocab 4096, blocks of 128,
batch 16) on random tokens, with a CSV logger at the Trainer's default cadence (every 50
steps, which the callback follows). Steps/s is timed from
the end of a warm-up step to the last step, so joining the run and closing are left out;
the callback's segments join a fresh run in a local directory and close their own rounds
(`sync=True`), so the merge and the uploads compete for the same cores as training.
"hook" is the time spent inside the callback's `on_train_batch_end` per step, and its
share of the step time: the callback's own cost, which machine noise does not blur the
way it blurs the ratio of two rates on a shared machine.

    python benchmarks/lightning_overhead.py            # 5 pairs of 300 steps, H = 100
    python benchmarks/lightning_overhead.py --quick    # 2 pairs of 40 steps, H = 20

Prints a markdown table and appends it to benchmarks/RESULTS.md (unless --no-append).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail_lightning import DiLoCoCallback
from gradientmail_lightning.gpt2 import GPT2Module

__all__ = ["main", "segment"]

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
VOCAB, BLOCK, BATCH = 4096, 128, 16


class StepClock(Callback):
    """perf_counter at the end of every batch (placed after every other callback)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *a: Any) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())


class TimedDiLoCo(DiLoCoCallback):
    """DiLoCoCallback that adds up the seconds spent in its per-batch hook."""

    hook_seconds = 0.0
    hook_calls = 0

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        super().on_train_batch_end(*args, **kwargs)
        self.hook_seconds += time.perf_counter() - t0
        self.hook_calls += 1


def loader(steps: int, seed: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, VOCAB, (steps * BATCH, BLOCK), generator=g)
    data = [{"input_ids": b} for b in blocks]
    return DataLoader(data, batch_size=BATCH, shuffle=False)  # type: ignore[arg-type]


def segment(
    with_callback: bool, steps: int, sync_every: int, accelerator: str, box: Path
) -> tuple[float, float]:
    """(steps/s after the first step, callback µs per step) of one fit."""
    model = GPT2Module(
        vocab_size=VOCAB,
        block_size=BLOCK,
        n_layer=2,
        n_embd=128,
        n_head=4,
        warmup_steps=10,
        seed=0,
    )
    clock = StepClock()
    callbacks: list[Callback] = []
    diloco = None
    if with_callback:
        diloco = TimedDiLoCo(
            str(box),
            DiLoCo(sync_every=sync_every, fragments=2, in_flight=2),
            "bench",
            poll_interval=0.5,
            lease_every=10.0,
            lease_timeout=30.0,
            on_event=lambda e: None,
        )
        callbacks.append(diloco)
    callbacks.append(clock)
    trainer = Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        logger=CSVLogger(box.with_name(box.name + "-logs")),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader(steps, seed=1))
    t = clock.times
    rate = (len(t) - 1) / (t[-1] - t[0])
    hook = 1e6 * diloco.hook_seconds / max(diloco.hook_calls, 1) if diloco else 0.0
    return rate, hook


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 pairs of 40 steps, H = 20")
    ap.add_argument("--pairs", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--accelerator", default="cpu", help="cpu or gpu")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--no-append", action="store_true", help="do not touch RESULTS.md")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the file to append to")
    args = ap.parse_args()
    pairs = args.pairs or (2 if args.quick else 5)
    steps = args.steps or (40 if args.quick else 300)
    sync_every = 20 if args.quick else 100
    for name in ("lightning", "lightning.pytorch", "gradientmail"):
        logging.getLogger(name).setLevel(logging.WARNING)

    without: list[float] = []
    with_cb: list[float] = []
    hooks: list[float] = []
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for on in (False, True):  # warm-up: first-fit costs (kernels, caches) land here
            segment(on, min(steps, 20), sync_every, args.accelerator, Path(tmp) / f"w{on}")
        for i in range(pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            for on in order:
                rate, hook = segment(on, steps, sync_every, args.accelerator, Path(tmp) / f"r{i}")
                (with_cb if on else without).append(rate)
                if on:
                    hooks.append(hook)
                print(f"pair {i}: {'with' if on else 'without'} {rate:.2f} steps/s", flush=True)

    ratios = [w / o for w, o in zip(with_cb, without, strict=True)]
    device = args.accelerator
    if device == "gpu" and torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    lines = [
        "| mode | segments × steps | steps/s (median) | ratio to without "
        "| hook µs/step | hook share of a step |",
        "|---|---|---:|---:|---:|---:|",
        f"| without callback | {pairs} × {steps} | {statistics.median(without):.2f} | 1.000 "
        "| — | — |",
        f"| DiLoCoCallback (H={sync_every}, P=2, sync=True) | {pairs} × {steps} | "
        f"{statistics.median(with_cb):.2f} | {statistics.median(ratios):.3f} | "
        f"{statistics.median(hooks):.0f} | "
        f"{statistics.median(hooks) * statistics.median(with_cb) / 1e4:.3f}% |",
    ]
    table = "\n".join(lines)
    print(table)
    if not args.no_append:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        cmd = "python benchmarks/lightning_overhead.py " + " ".join(sys.argv[1:])
        head = (
            f"\n## Lightning callback overhead ({now})\n\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, device {device}. "
            f"torch threads {torch.get_num_threads()}. "
            f"Command: `{cmd.strip()}`. Tiny GPT-2 (2×128, vocab {VOCAB}, block {BLOCK}, "
            f"batch {BATCH}), interleaved segments; per-pair ratios: "
            + ", ".join(f"{r:.3f}" for r in ratios)
            + ".\n\n"
        )
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(head + table + "\n")


if __name__ == "__main__":
    main()
