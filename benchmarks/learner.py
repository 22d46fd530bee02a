"""What the learner costs a training loop.

    python benchmarks/learner.py [--quick] [--device cpu|cuda] [--model tiny|124m]
                                 [--table-out PATH] [--no-append]

Measures, in one run:
- the median microseconds of `Learner.step()` when no round is due;
- `step()` when a round is due against a plain on-device clone of the same fragment
  (the floor: a due step must snapshot the fragment; goal <= 1.5x);
- steps/s of a GPT-2 training loop with the learner against the same loop without it,
  interleaved in blocks so drift on a shared machine hits both arms (goal >= 0.99x);
- peak memory the learner adds (host RSS on CPU, allocator peak on CUDA).
Prints a markdown table and appends it to benchmarks/RESULTS.md (unless --no-append).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def gpt2(size: str, device: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    if size == "124m":
        cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    else:
        cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=4096, n_positions=128,
                         bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(device)
    if size == "124m" and device == "cuda":
        model = model.to(torch.bfloat16)
    return model


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_loop(model: torch.nn.Module, steps: int, batch: int, block: int, device: str,
               learner: Learner | None) -> float:
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (steps, batch, block), generator=g)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        ids = data[i].to(device, non_blocking=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if learner is not None:
            learner.step(batch * block)
    if device == "cuda":
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - t0)


def _quartiles(xs: list[float]) -> str:
    q1, _, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{q1:.3f}-{q3:.3f}"


def _paired(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """Throughput of the `num` blocks over the `den` blocks (each a list of steps/s of
    equal-length blocks, paired by index): the ratio of total times, and its 95%
    bootstrap interval over the pairs (2,000 resamples, fixed seed)."""
    t_num, t_den = [1 / x for x in num], [1 / x for x in den]
    ratio = sum(t_den) / sum(t_num)
    rng = random.Random(0)
    n = len(num)
    boots = []
    for _ in range(2000):
        idx = [rng.randrange(n) for _ in range(n)]
        boots.append(sum(t_den[i] for i in idx) / sum(t_num[i] for i in idx))
    boots.sort()
    return ratio, boots[49], boots[1949]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="tiny", choices=["tiny", "124m"])
    ap.add_argument("--steps", type=int, default=None, help="steps per block")
    ap.add_argument("--blocks", type=int, default=None, help="interleaved blocks per arm")
    ap.add_argument("--sync-every", type=int, default=None)
    ap.add_argument("--fragments", type=int, default=4, help="P of the throughput runs")
    ap.add_argument("--table-out", default=None, help="also write the table to this file")
    ap.add_argument("--no-append", action="store_true", help="do not touch RESULTS.md")
    args = ap.parse_args()
    dev = args.device
    steps = args.steps or (20 if args.quick else 60)
    blocks = args.blocks or (2 if args.quick else 4)
    sync_every = args.sync_every or (20 if args.model == "tiny" else 100)
    batch, block = (4, 64) if args.model == "tiny" else (8, 1024)
    if dev == "cpu":
        torch.set_num_threads(1)  # leave the second core to the mailman, as a user would

    tmp = tempfile.mkdtemp(prefix="gm-bench-learner-")
    model = gpt2(args.model, dev)
    rss0 = rss_mib()
    alg = DiLoCo(sync_every=10**6, fragments=4, in_flight=1)  # nothing due on its own
    learner = Learner(
        TorchAdapter(model),
        alg,
        os.path.join(tmp, "idle"),
        "bench",
        on_event=lambda e: None,
        options=LearnerOptions(poll_interval=0.02),
    )
    learner.start()
    idle = []
    for _ in range(200 if args.quick else 2000):
        t = time.perf_counter()
        learner.step(1)
        idle.append(time.perf_counter() - t)
    learner.close()

    # Due steps: a schedule with a round due every step (gap 1), τ=2. Each step() call is
    # classified by what it did; a call that published and applied nothing is "a due step".
    # The floor is a plain clone of the same fragment on the same device.
    params = dict(model.named_parameters())
    due_alg = DiLoCo(sync_every=4, fragments=4, in_flight=2)
    learner = Learner(
        TorchAdapter(model),
        due_alg,
        os.path.join(tmp, "due"),
        "bench-due",
        on_event=lambda e: None,
        options=LearnerOptions(poll_interval=0.02),
    )
    learner.start()
    due, clone = [], []
    for _ in range(60 if args.quick else 200):
        before = learner._state_now().last_published
        r = before + 1
        frag = [params[n] for n in learner.plan[r % len(learner.plan)]]
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        _copies = [p.detach().clone() for p in frag]
        if dev == "cuda":
            torch.cuda.synchronize()
        t_clone = time.perf_counter() - t
        del _copies
        t = time.perf_counter()
        applied = learner.step(1)
        if dev == "cuda":
            torch.cuda.synchronize()
        t_step = time.perf_counter() - t
        if learner._state_now().last_published == r and not applied:
            due.append(t_step)
            clone.append(t_clone)
        time.sleep(0.01)
    learner.close()
    if not due:
        raise SystemExit("no step published without applying; rerun")
    # Training throughput, interleaved blocks: without, with, without, with, ... twice:
    # with the closer embedded in the learner (the default), and with the learner's
    # closing left to `gradientmail sync` in another process (sync=False), as a run on
    # big models would do it on a CPU box.
    run_alg = DiLoCo(sync_every=sync_every, fragments=args.fragments,
                     in_flight=min(2, args.fragments))
    train_loop(model, 3, batch, block, dev, None)  # warm-up
    # The resolution of this machine: the same pairing with no learner in either block,
    # alternating which block is the numerator, as the arms below alternate their order.
    same, same_num, same_den = [], [], []
    for b in range(blocks):
        first = train_loop(model, steps, batch, block, dev, None)
        second = train_loop(model, steps, batch, block, dev, None)
        num, den = (first, second) if b % 2 == 0 else (second, first)
        same.append(num / den)
        same_num.append(num)
        same_den.append(den)
    arms: dict[str, tuple[list[float], list[float], int, int]] = {}
    added_mib = 0.0
    for closer in ("embedded", "process"):
        box = os.path.join(tmp, f"run-{closer}")
        with_l = Learner(
            TorchAdapter(model),
            run_alg,
            box,
            f"bench-{closer}",
            on_event=lambda e: None,
            options=LearnerOptions(poll_interval=0.5, sync=closer == "embedded"),
        )
        with_l.start()
        proc = None
        if closer == "process":
            proc = subprocess.Popen(
                [sys.executable, "-m", "gradientmail.app.cli", "sync", box, "--poll-interval",
                 "0.2", "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rss1 = rss_mib()
        plain, gm = [], []
        peak_plain = peak_gm = 0
        for b in range(blocks):
            # Alternate which arm goes first, so a machine slowing down or speeding up
            # within a pair favours neither; each pair gives one ratio.
            for arm in (("plain", "gm") if b % 2 == 0 else ("gm", "plain")):
                if dev == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                if arm == "plain":
                    plain.append(train_loop(model, steps, batch, block, dev, None))
                else:
                    gm.append(train_loop(model, steps, batch, block, dev, with_l))
                if dev == "cuda":
                    peak = torch.cuda.max_memory_allocated()
                    if arm == "plain":
                        peak_plain = max(peak_plain, peak)
                    else:
                        peak_gm = max(peak_gm, peak)
        arms[closer] = (plain, gm, with_l.rounds_seen + 1, with_l._handed)
        with_l.close()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
        # CUDA: the peak of a training block with the learner over one without it
        # (anchors, snapshots and loaded commits live on the device). CPU: RSS growth.
        if closer == "embedded":
            added_mib = (peak_gm - peak_plain) / 2**20 if dev == "cuda" else rss1 - rss0

    med_idle = statistics.median(idle) * 1e6
    med_due = statistics.median(due) * 1e6
    med_clone = statistics.median(clone) * 1e6
    # Each arm: the ratio of total times over its paired blocks (what a run would see),
    # with a bootstrap interval over the pairs; the median and quartiles of the per-pair
    # ratios show the spread of one pair.
    same_r, same_lo, same_hi = _paired(same_num, same_den)
    throughput_rows = [
        f"| without / without: the noise of this pairing ({len(same)} paired blocks; 95% "
        f"interval {same_lo:.3f}-{same_hi:.3f}; per pair median {statistics.median(same):.3f}, "
        f"quartiles {_quartiles(same)}) | {same_r:.3f}x | |"
    ]
    for closer, (plain, gm, rounds, published) in arms.items():
        sp_plain, sp_gm = statistics.median(plain), statistics.median(gm)
        ratios = [g / p for g, p in zip(gm, plain, strict=True)]
        r, lo, hi = _paired(gm, plain)
        where = "in the learner" if closer == "embedded" else "in another process"
        throughput_rows += [
            f"| steps/s without learner / with it, closer {where} ({published} published, "
            f"{rounds} committed) | {sp_plain:.2f} / {sp_gm:.2f} | |",
            f"| with / without, closer {where} ({len(ratios)} paired blocks; 95% interval "
            f"{lo:.3f}-{hi:.3f}; per pair median {statistics.median(ratios):.3f}, quartiles "
            f"{_quartiles(ratios)}) | {r:.3f}x | >= 0.99x |",
        ]
    frag_mb = sum(
        params[n].numel() * params[n].element_size() for names in learner.plan for n in names
    ) / 1e6 / len(learner.plan)
    table = "\n".join([
        "| measure | value | goal |",
        "|---|---|---|",
        f"| step(), no round due (median) | {med_idle:.1f} µs | |",
        f"| step(), round due (median) | {med_due:.0f} µs | |",
        f"| plain clone of the same fragment (mean {frag_mb:.1f} MB) | {med_clone:.0f} µs | |",
        f"| due step / clone | {med_due / med_clone:.2f}x | <= 1.5x |",
        *throughput_rows,
        f"| peak memory added | {added_mib:.0f} MiB | |",
    ])
    header = (
        f"\n## learner overhead — {datetime.date.today()}\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, device {dev}"
        f"{' (' + torch.cuda.get_device_name() + ')' if dev == 'cuda' else ''}; "
        f"model GPT-2 {args.model}, batch {batch}x{block}, {blocks} interleaved blocks of "
        f"{steps} steps, DiLoCo H={sync_every}, P={args.fragments}, "
        f"τ={min(2, args.fragments)} (a round every {sync_every // args.fragments} steps), "
        f"local-directory mailbox.\n"
        f"Command: `python benchmarks/learner.py {' '.join(sys.argv[1:])}`\n\n"
    )
    print(header + table)
    if not args.no_append:
        with RESULTS.open("a") as f:
            f.write(header + table + "\n")
    if args.table_out:
        Path(args.table_out).write_text(header + table + "\n")


if __name__ == "__main__":
    main()
