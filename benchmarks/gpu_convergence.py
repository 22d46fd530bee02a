"""DiLoCo against DDP at equal tokens on one GPU: held-out loss against tokens (issue 30).

    python benchmarks/gpu_convergence.py [--dry] [--device cuda|cpu] [--out DIR]
        [--tokens N] [--time-limit S] [--arms ddp,diloco-m1,diloco-m4]
        [--n-layer 8] [--n-embd 640] [--n-head 10] [--block 256] [--batch 16]
        [--learners 4] [--sync-every 30] [--lr 1e-3] [--workdir DIR]

The model: a GPT-2 (transformers' `GPT2LMHeadModel`, tied embeddings, no dropout) of 8
blocks × 640 wide, 10 heads, context 256, on bytes (a 256-symbol vocabulary: no tokenizer
package, nothing downloaded): 39.6M parameters, the size of Scaling Laws for DiLoCo's
smallest model (35M: 6 × 512 with a 32k vocabulary, whose embedding this byte vocabulary
does not have, hence the extra depth and width). The text: the running Python's standard
library `.py` files, tests included, site-packages not, split into train and held-out by
a hash of each file's path (`gradientmail.integration.textdata.held_out`, 5%), so every machine
splits alike; documents joined by a 0 byte. The held-out loss is the mean over
`--val-blocks` fixed windows spread evenly over the held-out files (nats per byte).

The arms, all at the same tokens and the same data (every step draws the global batch of
M·B windows from one seeded generator; the M learners each take their quarter of it):
- `ddp`: the DDP equivalent, one process, batch M·B, S steps (the gradient DDP averages
  over M workers of batch B);
- `diloco-m1`: DiLoCo with one learner at batch M·B, `DiLoCo.standard(H, 1)`;
- `diloco-mM`: standard DiLoCo, M learners as M processes sharing the device, batch B
  each, `DiLoCo.standard(H, M)`: one fragment, every learner in every round (a barrier),
  the weighted mean, outer Nesterov lr 0.7 / momentum 0.9; the learners' own embedded
  closers on a local-directory mailbox (without fsync, in /dev/shm when it has 8 GB free).
Inner optimizer (every arm): AdamW lr `--lr`, betas (0.9, 0.95), weight decay 0.1, grad
clip 1.0, a linear warmup over 5% of S then cosine decay to lr/10 (the DiLoCo paper's
inner schedule, scaled to S; lr 1e-3 at a 16,384-token batch is nanoGPT's
character-level recipe, a byte model of this kind); bf16 autocast on CUDA, F32 on the
CPU. One inner lr for every arm, untuned: an lr too low for the DDP equivalent favours
DiLoCo, whose outer step extrapolates (the dry run's tiny model shows it). H = 30 is
Scaling Laws for DiLoCo's setting at 35M. A DiLoCo arm is evaluated on its *committed*
model: standard DiLoCo's step at a round's boundary returns once the commit is applied,
so rank 0's parameters then are the commit's; the others are evaluated on their one
process.

Every arm runs at once, each in its own process(es) on the one device, under one wall
clock: past `--time-limit` seconds from launch an arm ends at its next evaluation point
(the M learners together: rank 0 names the point in a stop file before it trains on, and
no learner can pass a boundary before rank 0 has published there). The comparison is
read at the largest token count that every arm evaluated; a worker still alive `--grace`
seconds after the limit is killed, and what it evaluated until then (appended to a
JSON-lines file as it went) still counts.

The GPU default budget, and why: S = 1200 steps of a 16,384-token global batch (64
windows of 256 bytes), 19.7M tokens per arm, 59M for the three arms together; 40 rounds
at H = 30; an evaluation every 4 rounds (120 steps, 2M tokens). Assumption: an H200
trains this 40M model in eager PyTorch with bf16 autocast at roughly 0.3-1M tokens/s in
all (≈ 2.6e8 FLOP per token for forward and backward; 0.3M tokens/s is ≈ 10% of the bf16
peak, what a small-width eager model with six processes time-slicing one GPU may well
fall to): the three arms then need 60-200 s, inside the 200 s limit, and a slower device
truncates the arms rather than overrunning the stage. The round syncs (each learner
publishes its 160 MB F32 delta, the closer merges four, every learner loads the step)
add to the M = 4 arm's wall time, not to its tokens: on 2 busy CPU cores here a round at
this size took ~6 s with four learners and ~1.6 s with one; on the GPU machine's 16
cores, 1-3 s is expected, 40-120 s over the 40 rounds, while the other arms use the GPU.
19.7M tokens is ~0.5 token per parameter, far short of the papers' compute-optimal ~20:
an early-training reading, in which DiLoCo's outer momentum has had few rounds.

Writes to `--out`: convergence.md (settings, the loss-against-tokens table, each arm's
throughput, the goals), convergence.csv (arm, step, tokens, held-out loss, training
seconds, rounds seen) and convergence-logs/ (each worker's output). `--dry` is a CPU-sized
run of every code path (a 2 × 64 model, 12 steps, H = 3), numbers meaningless.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradientmail.learner.options import LearnerOptions

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class Settings:
    """One run's sizes. `batch` is B, one learner's windows per step; the one-process arms
    take M·B. `tokens` is each arm's budget, rounded down to whole rounds."""

    device: str = "cuda"
    n_layer: int = 8
    n_embd: int = 640
    n_head: int = 10
    block: int = 256
    batch: int = 16
    learners: int = 4
    sync_every: int = 30
    tokens: int = 19_660_800
    eval_rounds: int = 4
    val_blocks: int = 512
    text_mb: float = 64.0
    lr: float = 1e-3
    warmup: float = 0.05
    seed: int = 0
    time_limit: float = 200.0
    grace: float = 40.0
    deadline: float = 0.0  # set at launch: time.time() + time_limit

    @property
    def global_batch(self) -> int:
        return self.learners * self.batch

    @property
    def steps(self) -> int:
        """S: the steps of every arm (whole rounds of H)."""
        per_step = self.global_batch * self.block
        return max(self.tokens // per_step // self.sync_every, 1) * self.sync_every

    @property
    def eval_every(self) -> int:
        return self.eval_rounds * self.sync_every


DRY = dict(device="cpu", n_layer=2, n_embd=64, n_head=2, block=64, batch=2, sync_every=3,
           tokens=12 * 4 * 2 * 64, eval_rounds=2, val_blocks=8, text_mb=1.0,
           time_limit=120.0, grace=60.0)


def arm_names(s: Settings) -> list[str]:
    return ["ddp", "diloco-m1", f"diloco-m{s.learners}"]


def arm_learners(arm: str) -> int:
    """Processes (= DiLoCo learners) of an arm; 1 for DDP."""
    return int(arm.split("-m")[1]) if arm.startswith("diloco-m") else 1


# -- data ---------------------------------------------------------------------------------


def corpus(split: str, limit: int) -> bytes:
    """The standard library's `.py` files of `split` (tests included, site-packages not),
    in path order, joined by a 0 byte, up to about `limit` bytes."""
    import sysconfig

    from gradientmail.integration.textdata import held_out

    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    parts, total = [], 0
    for rel, path in found:
        if held_out(rel, 0.05) != (split == "val"):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        parts.append(data.replace(b"\0", b""))
        total += len(data) + 1
        if total >= limit:
            break
    return b"\0".join(parts)


def prepare(s: Settings, workdir: Path) -> dict[str, Any]:
    """Write train.pt (uint8 byte stream) and val.pt ([val_blocks, block] uint8) to
    `workdir`; their sizes."""
    import torch

    train = corpus("train", int(s.text_mb * 1e6))
    val = corpus("val", int(min(s.text_mb, 4.0) * 1e6))
    n_val = min(s.val_blocks, len(val) // s.block)
    if n_val < 1 or len(train) < 2 * s.block:
        raise SystemExit(f"too little text: {len(train)} train bytes, {len(val)} held out")
    # Windows spread evenly over the held-out text, so they sample many files, not the
    # first few in path order.
    stride = len(val) // n_val
    val_t = torch.frombuffer(bytearray(val), dtype=torch.uint8)
    windows = torch.stack([val_t[i * stride : i * stride + s.block] for i in range(n_val)])
    torch.save(torch.frombuffer(bytearray(train), dtype=torch.uint8), workdir / "train.pt")
    torch.save(windows, workdir / "val.pt")
    return {"train_bytes": len(train), "val_bytes": len(val), "val_blocks": n_val}


# -- one worker (a subprocess of this file) -------------------------------------------


def lr_factor(s: Settings, step: int) -> float:
    """The inner schedule at `step` (0-based): linear warmup, cosine to 1/10."""
    warm = max(int(s.warmup * s.steps), 1)
    if step < warm:
        return (step + 1) / warm
    done = min((step - warm) / max(s.steps - warm, 1), 1.0)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * done))


def grid_at_or_after(s: Settings, step: int) -> int:
    """The first evaluation step at or after `step` (S at most)."""
    return min(-(-step // s.eval_every) * s.eval_every, s.steps)


def evaluate(model: Any, val: Any, autocast: Any) -> float:
    import torch

    model.eval()
    total = torch.zeros((), device=val.device)
    with torch.no_grad(), autocast():
        for chunk in val.split(64):
            ids = chunk.long()
            total += model(input_ids=ids, labels=ids).loss.float() * chunk.shape[0]
    model.train()
    return float(total) / int(val.shape[0])


def worker(arm: str, rank: int, workdir: Path) -> None:
    """Train one process of `arm` and append its evaluations to {arm}-{rank}.jsonl."""
    import contextlib

    import torch

    from gradientmail.integration.textdata import tiny_gpt2

    s = Settings(**json.loads((workdir / "settings.json").read_text()))
    dev = torch.device(s.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(1)
    m = arm_learners(arm)
    batch = s.batch if m > 1 else s.global_batch
    train = torch.load(workdir / "train.pt").to(dev)
    val = torch.load(workdir / "val.pt").to(dev)
    model = tiny_gpt2(VOCAB, n_layer=s.n_layer, n_embd=s.n_embd, n_head=s.n_head,
                      n_positions=s.block, seed=s.seed).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=dev.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(s, i))

    def autocast() -> Any:
        if dev.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sync_device() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    published: list[int] = []
    learner = None
    if arm.startswith("diloco"):
        from gradientmail.adapters import TorchAdapter
        from gradientmail.algorithms.diloco import DiLoCo
        from gradientmail.events import Event, SnapshotPublished
        from gradientmail.learner.runtime import Learner
        from gradientmail.mailbox import LocalMailbox

        def on_event(e: Event) -> None:
            if isinstance(e, SnapshotPublished):
                published.append(e.bytes)

        learner = Learner(
            TorchAdapter(model),
            DiLoCo.standard(s.sync_every, m),
            LocalMailbox(workdir / arm, fsync=False),
            f"learner-{rank}",
            on_event=on_event,
            options=LearnerOptions(poll_interval=0.05, lease_every=5.0, lease_timeout=30.0),
        )
        learner.start()
        learner.wait_for_learners(m, timeout=300)
    log = (workdir / f"{arm}-{rank}.jsonl").open("a")
    evaluating = rank == 0
    stop_file = workdir / f"{arm}.stop"
    tokens_per_step = s.global_batch * s.block  # every arm's, all its processes together
    offsets_g = torch.Generator().manual_seed(s.seed + 1)  # the same windows in every arm
    span = torch.arange(s.block, device=dev)
    train_s = sync_s = 0.0

    def point(step: int, ended: str = "") -> None:
        if not evaluating:
            return
        loss = evaluate(model, val, autocast)
        rec = {"arm": arm, "step": step, "tokens": step * tokens_per_step, "loss": loss,
               "train_s": round(train_s, 3), "sync_s": round(sync_s, 3),
               "rounds_seen": learner.rounds_seen if learner is not None else -1}
        if ended:
            rec["ended"] = ended
        log.write(json.dumps(rec) + "\n")
        log.flush()
        print(json.dumps(rec), flush=True)

    point(0)
    stop_at = s.steps
    ended = "budget"
    step = 0
    while step < stop_at:
        sync_device()
        t0 = time.perf_counter()
        for _ in range(s.sync_every):  # one round of H steps
            offsets = torch.randint(0, int(train.numel()) - s.block, (s.global_batch,),
                                    generator=offsets_g)
            if m > 1:
                offsets = offsets[rank * batch : (rank + 1) * batch]
            ids = train[offsets.to(dev, non_blocking=True)[:, None] + span].long()
            with autocast():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if learner is not None:
                if step % s.sync_every == 0:  # the round's boundary: publish, wait, apply
                    sync_device()
                    t1 = time.perf_counter()
                    learner.step(int(ids.numel()))
                    sync_s += time.perf_counter() - t1
                else:
                    learner.step(int(ids.numel()))
        sync_device()
        train_s += time.perf_counter() - t0
        # Past the limit an arm ends at its next evaluation (so that every arm's last
        # point is on the common grid); the learners of an arm together, at the first
        # one past the next boundary, which rank 0 names before it trains on (no learner
        # can pass a boundary before rank 0 has published there).
        if stop_at == s.steps and step < s.steps and time.time() > s.deadline:
            if m == 1:
                stop_at, ended = grid_at_or_after(s, step), "time limit"
            elif rank == 0 and not stop_file.exists():
                tmp = stop_file.with_suffix(".tmp")
                tmp.write_text(str(grid_at_or_after(s, step + s.sync_every)))
                tmp.replace(stop_file)
        if m > 1 and stop_at == s.steps and stop_file.exists():
            named = int(stop_file.read_text())
            if named < s.steps:
                stop_at, ended = max(named, step), "time limit"
        if step == stop_at:
            point(step, ended)
        elif step % s.eval_every == 0:
            point(step)
    if learner is not None:
        learner.close()
    done = {"arm": arm, "rank": rank, "done": True, "steps": step, "planned": s.steps,
            "ended": ended, "train_s": round(train_s, 3), "sync_s": round(sync_s, 3),
            "published_bytes": sum(published), "rounds": len(published)}
    log.write(json.dumps(done) + "\n")
    log.close()
    print(json.dumps(done), flush=True)


# -- the main process -------------------------------------------------------------------


def launch(s: Settings, arms: list[str], workdir: Path, logs: Path) -> dict[str, Any]:
    """Start every arm's processes at once and wait for them (killing any still alive
    `grace` seconds past the limit); each process's exit code."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if s.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    # glibc keeps what a worker frees for its next allocation of the size (as
    # benchmarks/sharded.py's CPU ranks do): a round's host buffers (snapshots, payloads,
    # the outer step) then reuse pages instead of faulting fresh ones in, which is costly
    # where the kernel is emulated (gVisor, as on the lent GPU machine).
    env.update(MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(1 << 40))
    procs = {}
    for arm in arms:
        for rank in range(arm_learners(arm)):
            out = (logs / f"{arm}-{rank}.log").open("w")
            procs[(arm, rank)] = subprocess.Popen(
                [sys.executable, __file__, "--worker", arm, str(rank), str(workdir)],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            out.close()
    hard = s.deadline + s.grace
    while any(p.poll() is None for p in procs.values()) and time.time() < hard:
        time.sleep(0.5)
    codes = {}
    for (arm, rank), p in procs.items():
        if p.poll() is None:
            p.kill()
            p.wait()
            codes[f"{arm}-{rank}"] = "killed"
        else:
            codes[f"{arm}-{rank}"] = p.returncode
    return codes


def read_points(workdir: Path, arms: list[str]) -> tuple[dict[str, list[dict[str, Any]]],
                                                         dict[str, list[dict[str, Any]]]]:
    """Each arm's evaluations (rank 0's) and every process's closing record."""
    points: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    done: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    for arm in arms:
        for rank in range(arm_learners(arm)):
            path = workdir / f"{arm}-{rank}.jsonl"
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                (done if rec.get("done") else points)[arm].append(rec)
    return points, done


def tables(s: Settings, arms: list[str], points: dict[str, list[dict[str, Any]]],
           done: dict[str, list[dict[str, Any]]], codes: dict[str, Any]) -> tuple[str, str]:
    """(the markdown body, the CSV)."""
    csv = ["arm,step,tokens,heldout_loss,train_s,sync_s,rounds_seen"]
    by_arm = {a: {p["tokens"]: p for p in points[a]} for a in arms}
    for a in arms:
        for p in points[a]:
            csv.append(f"{a},{p['step']},{p['tokens']},{p['loss']:.6f},{p['train_s']},"
                       f"{p['sync_s']},{p['rounds_seen']}")
    all_tokens = sorted({t for a in arms for t in by_arm[a]})
    ref = "ddp"
    others = [a for a in arms if a != ref]
    head = "| tokens | " + " | ".join(arms) + " | " + " | ".join(
        f"{a} / ddp" for a in others) + " |"
    rows = [head, "|" + "---:|" * (1 + len(arms) + len(others))]
    for t in all_tokens:
        cells = [f"{by_arm[a][t]['loss']:.4f}" if t in by_arm[a] else "–" for a in arms]
        ratios = []
        for a in others:
            if t in by_arm[a] and t in by_arm.get(ref, {}):
                ratios.append(f"{by_arm[a][t]['loss'] / by_arm[ref][t]['loss']:.4f}")
            else:
                ratios.append("–")
        rows.append(f"| {t:,} | " + " | ".join(cells + ratios) + " |")
    common = [t for t in all_tokens if all(t in by_arm[a] for a in arms)]
    goals = []
    last = common[-1] if common else 0
    if last and ref in arms:
        d = by_arm[ref][last]["loss"]
        planned = s.steps * s.global_batch * s.block
        where = f"at {last:,} tokens" + (
            "" if last == planned else f" ({last / planned:.0%} of the planned {planned:,}: "
            "the arms ran out of time)")
        for a in others:
            r = by_arm[a][last]["loss"] / d
            bound = 1.0 if a == "diloco-m1" else 1.02
            goals.append(f"{a} held-out loss ≤ {bound:.2f}× DDP-equivalent's {where}: "
                         f"{r:.4f}× ({'met' if r <= bound else 'NOT met'})")
    else:
        goals.append("no token count past 0 that every arm evaluated: no comparison (see "
                     "the logs)")
    runs = ["| arm | processes | steps / planned | tokens | training s | tokens/s | of which "
            "round syncs s (rank 0) | rounds published (rank 0) | MB sent per round per learner"
            " | ended | exit |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for a in arms:
        d0 = next((d for d in done[a] if d["rank"] == 0), None)
        exits = ",".join(str(codes.get(f"{a}-{r}", "?")) for r in range(arm_learners(a)))
        if d0 is None:
            last_p = points[a][-1] if points[a] else None
            steps = last_p["step"] if last_p else 0
            runs.append(f"| {a} | {arm_learners(a)} | {steps} / {s.steps} (no closing "
                        f"record) | {steps * s.global_batch * s.block:,} | – | – | – | – | – "
                        f"| – | {exits} |")
            continue
        toks = d0["steps"] * s.global_batch * s.block
        # A learner that closes a round merges its own delta from memory, unsent: the mean
        # over the arm's learners is what one sends.
        per_round = (sum(d["published_bytes"] for d in done[a])
                     / max(sum(d["rounds"] for d in done[a]), 1) / 1e6)
        runs.append(
            f"| {a} | {arm_learners(a)} | {d0['steps']} / {d0['planned']} | {toks:,} | "
            f"{d0['train_s']:.1f} | {toks / max(d0['train_s'], 1e-9):,.0f} | "
            f"{d0['sync_s']:.1f} | {d0['rounds']} | "
            f"{per_round:.1f} | {d0['ended']} | {exits} |")
    body = "\n".join(rows) + "\n\n" + "\n".join(runs) + "\n\n" + "\n".join(
        f"- {g}" for g in goals)
    return body, "\n".join(csv) + "\n"


def memory_folder(need: int = 8 << 30) -> str | None:
    """/dev/shm when it is writable and has `need` bytes free (a container's default
    /dev/shm is 64 MB), else None (the system's temporary folder)."""
    shm = "/dev/shm"
    try:
        st = os.statvfs(shm)
    except OSError:
        return None
    return shm if os.access(shm, os.W_OK) and st.f_bavail * st.f_frsize >= need else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=3, metavar=("ARM", "RANK", "WORKDIR"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--dry", action="store_true",
                    help="CPU-sized run of every code path (also GM_GPU_DRY=1)")
    ap.add_argument("--out", default="gpu-convergence", help="folder for the tables and logs")
    ap.add_argument("--workdir", default=None,
                    help="data and mailboxes (default: a new folder in /dev/shm, else tmp)")
    ap.add_argument("--arms", default=None, help="comma-separated subset of ddp, diloco-m1, "
                    "diloco-mM (default all three)")
    for f in dataclasses.fields(Settings):
        if f.name != "deadline":
            ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                            default=None)
    args = ap.parse_args(argv)
    if args.worker:
        arm, rank, wd = args.worker
        worker(arm, int(rank), Path(wd))
        return
    dry = args.dry or os.environ.get("GM_GPU_DRY") == "1"
    s = Settings(**DRY) if dry else Settings()
    for f in dataclasses.fields(Settings):
        value = getattr(args, f.name, None)
        if value is not None:
            s = dataclasses.replace(s, **{f.name: value})
    arms = args.arms.split(",") if args.arms else arm_names(s)
    if unknown := [a for a in arms if a not in arm_names(s)]:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {arm_names(s)} (M is "
                         "--learners)")
    if s.n_embd % s.n_head:
        raise SystemExit(f"--n-embd {s.n_embd} is not divisible by --n-head {s.n_head}")
    out = Path(args.out)
    logs = out / "convergence-logs"
    logs.mkdir(parents=True, exist_ok=True)
    base = args.workdir or memory_folder()
    workdir = Path(tempfile.mkdtemp(prefix="gm-gpu-convergence-", dir=base))
    t0 = time.time()
    try:
        import torch

        from gradientmail.integration.textdata import tiny_gpt2

        sizes = prepare(s, workdir)
        n_params = sum(p.numel() for p in tiny_gpt2(
            VOCAB, n_layer=s.n_layer, n_embd=s.n_embd, n_head=s.n_head,
            n_positions=s.block).parameters())
        s = dataclasses.replace(s, deadline=time.time() + s.time_limit)
        (workdir / "settings.json").write_text(json.dumps(dataclasses.asdict(s)))
        planned = s.steps * s.global_batch * s.block
        print(f"model {n_params:,} parameters; {sizes['train_bytes']:,} train bytes, "
              f"{sizes['val_blocks']} held-out windows; S = {s.steps} steps, "
              f"{planned:,} tokens per arm ({planned / sizes['train_bytes']:.2f} epochs); "
              f"arms {arms}; limit {s.time_limit:.0f} s; workdir {workdir}", flush=True)
        codes = launch(s, arms, workdir, logs)
        points, done = read_points(workdir, arms)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    body, csv = tables(s, arms, points, done, codes)
    device = s.device
    if device == "cuda" and torch.cuda.is_available():
        device += f" ({torch.cuda.get_device_name()})"
    m = s.learners
    header = (
        f"## DiLoCo against DDP at equal tokens on one device — {datetime.date.today()}\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, device {device}, torch "
        f"{torch.__version__}{', bf16 autocast' if s.device == 'cuda' else ', F32'}"
        f"{'; DRY RUN (--dry): sizes for the plumbing, numbers meaningless' if dry else ''}. "
        f"GPT-2 {s.n_layer} × {s.n_embd}, {s.n_head} heads, context {s.block}, byte "
        f"vocabulary: {n_params:,} parameters. Text: the standard library's .py files, "
        f"{sizes['train_bytes']:,} training bytes; held out: {sizes['val_blocks']} windows "
        f"of {s.block} bytes from the held-out files. M = {m}, B = {s.batch} × {s.block} "
        f"per learner (DDP-equivalent and M = 1: {s.global_batch} × {s.block}), "
        f"S = {s.steps} steps, {planned:,} tokens per arm "
        f"({planned / sizes['train_bytes']:.2f} epochs); AdamW lr {s.lr:g}, betas "
        f"(0.9, 0.95), wd 0.1, clip 1.0, warmup {s.warmup:g} of S then cosine to lr/10; "
        f"H = {s.sync_every}, outer Nesterov lr 0.7, momentum 0.9 (`DiLoCo.standard`). "
        f"Every arm at once on the device; limit {s.time_limit:.0f} s, "
        f"{time.time() - t0:.0f} s in all. Loss: held-out nats per byte.\n"
        f"Command: `python benchmarks/gpu_convergence.py "
        f"{' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
    )
    text = header + body + "\n"
    (out / "convergence.md").write_text(text)
    (out / "convergence.csv").write_text(csv)
    print(text)
    bad = {k: v for k, v in codes.items() if v != 0}
    if bad:
        raise SystemExit(f"workers that failed or were killed: {bad}; see {logs}")


if __name__ == "__main__":
    main()
