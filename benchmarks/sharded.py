"""What a sharded learner's ranks hold, send and spend (issue #15).

    python benchmarks/sharded.py [--ranks 1 2 4] [--modes memory time throughput]
                                 [--layers 12] [--embd 256] [--vocab 50257] [--rounds 6]
                                 [--cadence 62] [--steps 256] [--tokens fixed|counted]
                                 [--closer embedded|process] [--malloc caching|default]
                                 [--device cpu|cuda]
                                 [--results FILE] [--no-append]

For a GPT-2-shaped model (GPT-2's 12 blocks and 50,257-token vocabulary at a narrower
width, so that 4 ranks fit a 2-core CPU) sharded with FSDP2 over 1, 2 and 4 ranks (gloo on
CPU), three runs per rank count, each its own `torchrun`:
- memory: one learner (`ShardedRanks` under `RankSync`, standard DiLoCo, the default
  replicated outer step) closed by a `gradientmail sync` process. Each rank measures the
  peak of what it allocates, on any of its threads, while it publishes (its part) and
  while it applies a commit (reading its rows of the step, replaying the outer step on
  its rows of the state, loading them, the training thread's apply or rebase), against
  its shard + the largest tensor, in F32 (goal: ≤ 1.1×); and the payload bytes it
  uploads and downloads per round (goal: ≤ 1.1× shard + one tensor).
- time: the same without the allocation meter (its tracemalloc slows every Python
  allocation). Each rank times a due step's own work (on rank 0 the learner's hand-over:
  its decision, the snapshot op sent to the ranks and taken, the job posted; on the
  others the snapshot they replay; a standard DiLoCo due step then waits for its commit,
  the barrier, which is not the learner's cost) and counts its minor page faults, against
  a `clone()` of the same rows taken right after it on the same thread while the
  snapshot lives (goal: ≤ 1.5×), and, after the run, a warm `clone()` loop (each into
  the pages the last one freed) and a cold one (after `malloc_trim`).
- throughput: training steps in alternating blocks of `--cadence` steps without the
  learner and with it at the XL recipe's cadence (a round every `--cadence` steps, never
  waiting for a commit; `--tokens fixed`, the XL recipe's `tokens_per_step`, needs no
  collective for the token count), the slowest rank's total (goal: ≥ 0.99× where
  measurable).
CPU ranks run with glibc set to reuse what they free (`--malloc caching`, `CACHING_MALLOC`),
as a GPU's caching allocator does, unless `--malloc default`.
With `--device cuda` each rank has a GPU of its own, the training collectives run on NCCL
(the side group stays gloo), the peaks are the device's allocation counters and every
timer waits for the device's queued work (benchmarks/gpu_sharded_check.sh runs it).
Prints markdown tables and appends them to benchmarks/RESULTS.md (or `--results`; not
with --no-append).
Ranks run as `torchrun` processes of this file (`--rank-worker`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradientmail.learner.options import LearnerOptions

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "RESULTS.md"
sys.path.insert(0, str(ROOT / "tests" / "workers"))


# -- one rank (under torchrun) ---------------------------------------------------------


def count_payload_bytes() -> dict[str, int]:
    """Count the payload bytes this process moves through a local directory (records,
    leases and probes left out)."""
    from gradientmail.mailbox.local import LocalMailbox

    moved = {"up": 0, "down": 0}

    def payload(key: str) -> bool:
        return not key.endswith(".json") and not key.startswith(("leases/", "selftest/"))

    get, get_range = LocalMailbox.get, LocalMailbox.get_range
    create, put = LocalMailbox.create, LocalMailbox.put

    async def c_get(self: Any, key: str) -> Any:
        data = await get(self, key)
        if data is not None and payload(key):
            moved["down"] += len(data)
        return data

    async def c_get_range(self: Any, key: str, start: int, stop: int) -> Any:
        data = await get_range(self, key, start, stop)
        if data is not None and payload(key):
            moved["down"] += len(data)
        return data

    async def c_create(self: Any, key: str, data: Any) -> Any:
        if payload(key):
            moved["up"] += len(data)
        return await create(self, key, data)

    async def c_put(self: Any, key: str, data: Any) -> Any:
        if payload(key):
            moved["up"] += len(data)
        return await put(self, key, data)

    LocalMailbox.get, LocalMailbox.get_range = c_get, c_get_range  # type: ignore[method-assign]
    LocalMailbox.create, LocalMailbox.put = c_create, c_put  # type: ignore[method-assign]
    return moved


def build(args: argparse.Namespace) -> tuple[Any, Any, int]:
    """The rank's FSDP2 model (gloo process group up), its optimizer and rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=max(1, args.embd // 64),
                     vocab_size=args.vocab, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).to(device(args))
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), dist.get_rank()


def device(args: argparse.Namespace) -> Any:
    import torch

    if args.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def settle(args: argparse.Namespace) -> None:
    """Wait for the device's queued work (a CUDA clone returns before it copies)."""
    if args.device == "cuda":
        import torch

        torch.cuda.synchronize()


class CudaMeter:
    """`SharedMeter`'s windows on a CUDA device: the peak of the device's allocated
    memory over what it held when the window opened (every thread's allocations: the
    device's counters are global)."""

    def __init__(self) -> None:
        self.window: str | None = None
        self.peaks: dict[str, list[tuple[int, int]]] = {}
        self._base = 0

    def install(self) -> None:
        return None

    def tap(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def begin(self, window: str) -> None:
        import torch

        torch.cuda.synchronize()
        self.window, self._base = window, torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def end(self, window: str) -> None:
        import torch

        if self.window != window:
            return
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - self._base
        self.peaks.setdefault(window, []).append((peak, 0))
        self.window = None


def train_step(model: Any, opt: Any, ids: Any) -> None:
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


#: Set on a CUDA rank: a timer waits for the device's queued work first.
_ON_CUDA: list[bool] = []


def faults() -> tuple[float, int]:
    """This thread's clock and minor page faults so far (on CUDA after the device's
    queued work)."""
    import resource

    if _ON_CUDA:
        import torch

        torch.cuda.synchronize()

    return time.perf_counter(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def clone_times(a: Any, names: list[str], n: int) -> tuple[list[float], list[list[float]]]:
    """`n` timed `clone()`s of the rank's rows of `names`, warm (each into the pages the
    last one freed) and cold (after `malloc_trim`, so each faults its pages in, as a
    snapshot's buffer mostly does): [seconds], [[seconds, minor faults]]."""
    import ctypes

    trim = ctypes.CDLL("libc.so.6").malloc_trim
    warm, cold = [], []
    for _ in range(n):
        t0, _f = faults()
        kept = [a.local(n).clone() for n in names]
        warm.append(faults()[0] - t0)
        del kept
    for _ in range(n):
        trim(0)
        t0, f0 = faults()
        kept = [a.local(n).clone() for n in names]
        t1, f1 = faults()
        cold.append([t1 - t0, f1 - f0])
        del kept
    return warm, cold


def rank_worker(args: argparse.Namespace) -> None:
    """One rank of a `--mode` run: `memory` (allocation peaks and payload bytes, under the
    allocation meter), `time` (the due step, no meter: tracemalloc slows every Python
    allocation) or `throughput` (training steps with and without the learner)."""
    if args.mode == "throughput":
        throughput_worker(args)
        return
    if args.mode == "memory":
        from alloc_meter import SharedMeter
        from memory_learner import measure

        meter: Any = CudaMeter() if args.device == "cuda" else SharedMeter()
        meter.install()
        measure(meter, tap_snapshot=False)
    moved = count_payload_bytes()
    import torch
    import torch.distributed as dist

    from gradientmail.algorithms.diloco import DiLoCo
    from gradientmail.integration import RankSync, TorchRanks
    from gradientmail.integration.sharded import ShardedRanks
    from gradientmail.learner.runtime import Learner

    model, opt, rank = build(args)
    if args.device == "cuda":
        _ON_CUDA.append(True)
    alg = DiLoCo.standard(args.sync_every, 1)
    ranks = TorchRanks(device(args))
    sharded_ranks = ShardedRanks.create(model, args.mailbox, timeout=600.0, ranks=ranks)
    a = sharded_ranks.adapter
    # The due step's own work: on rank 0 the learner's hand-over (its decision, the
    # snapshot op sent to the ranks and taken, the job posted), on the others the snapshot
    # they replay. (A standard DiLoCo due step then waits for its commit: the barrier, not
    # the learner's cost.) Its minor page faults are counted: on the CPU a snapshot's
    # buffer is memory the allocator maps afresh (and the kernel zeroes) more often than
    # not, which a `clone()` loop over pages it just freed never pays.
    # Right after it, on the same thread and while the snapshot lives, a `clone()` of the
    # same rows: the plain copy at that moment, under the allocator's state of the moment.
    due: list[tuple[float, int]] = []
    own: list[float] = []  # the snapshot itself, within the due step
    beside: list[tuple[float, int]] = []
    replay, hand_over = ShardedRanks._replay, Learner._hand_over

    def clone_beside() -> None:
        t0, f0 = faults()
        kept = [a.local(n).clone() for n in a.schema.names]
        t1, f1 = faults()
        beside.append((t1 - t0, f1 - f0))
        del kept

    def timed_replay(self: ShardedRanks, kind: str, *rest: Any) -> None:
        t0, f0 = faults()
        replay(self, kind, *rest)
        t1, f1 = faults()
        if kind == "snapshot":
            own.append(t1 - t0)
        if kind == "snapshot" and self.rank != 0:
            due.append((t1 - t0, f1 - f0))
            clone_beside()

    def timed_hand_over(self: Learner, *rest: Any, **kw: Any) -> None:
        t0, f0 = faults()
        hand_over(self, *rest, **kw)
        t1, f1 = faults()
        due.append((t1 - t0, f1 - f0))
        clone_beside()

    ShardedRanks._replay = timed_replay  # type: ignore[method-assign]
    Learner._hand_over = timed_hand_over  # type: ignore[method-assign]
    sync = RankSync(ranks, model, sharded_ranks=sharded_ranks)
    sync.start(lambda: Learner(
        sharded_ranks.learner_adapter(),
        alg,
        args.mailbox,
        "sharded",
        options=LearnerOptions(sync=False, poll_interval=0.02, lease_every=5.0, lease_timeout=60.0),
    ))
    dist.barrier()
    joined = dict(moved)
    moved.update(up=0, down=0)
    ids = torch.randint(0, args.vocab, (1, 32),
                        generator=torch.Generator().manual_seed(rank)).to(device(args))
    for _ in range(args.rounds * args.sync_every):
        train_step(model, opt, ids)
        sync.step(32)
    sync.close()
    names = list(a.schema.names)
    warm, cold = clone_times(a, names, max(5, len(due)))
    report = {
        "rank": rank, "world": dist.get_world_size(), "rounds_seen": sync.rounds_seen,
        "shard_f32": a.local_nbytes(dtype="F32"),
        "largest_f32": max(4 * math.prod(p.shape) for p in a.schema.params),
        "model_f32": sum(4 * math.prod(p.shape) for p in a.schema.params),
        "moved": moved, "joined": joined, "due": due, "own": own, "beside": beside, "warm": warm,
        "cold": cold,
    }
    if args.mode == "memory":
        report["peaks"] = meter.peaks
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def throughput_worker(args: argparse.Namespace) -> None:
    """Training steps with the learner (the XL recipe's cadence: a round of one fragment
    every `--cadence` steps, never waiting for a commit, F4 deltas, BF16 commits, the
    closer embedded, the recipe's 2 s poll) and without it, in alternating blocks of
    `--cadence` steps after a warm-up, so the machine's drift falls on both alike. In a
    block without it `sync.step` is not called: the learner sees no steps, and its
    threads only poll (every 2 s) and renew the lease."""
    import torch
    import torch.distributed as dist

    from gradientmail.algorithms.diloco import DiLoCo
    from gradientmail.integration import RankSync, TorchRanks
    from gradientmail.integration.sharded import ShardedRanks
    from gradientmail.learner.runtime import Learner

    model, opt, rank = build(args)
    ids = torch.randint(0, args.vocab, (1, 32),
                        generator=torch.Generator().manual_seed(rank)).to(device(args))
    fragments = 4
    alg = DiLoCo(sync_every=args.cadence * fragments, fragments=fragments, in_flight=2,
                 overlap_steps=None, quorum_size=1, delta_dtype="F4", commit_dtype="BF16")
    ranks = TorchRanks(device(args))
    sharded_ranks = ShardedRanks.create(model, args.mailbox, timeout=600.0, ranks=ranks)
    sync = RankSync(ranks, model, sharded_ranks=sharded_ranks)
    sync.start(lambda: Learner(
        sharded_ranks.learner_adapter(),
        alg,
        args.mailbox,
        "sharded",
        options=LearnerOptions(
            sync=args.closer == "embedded",
            poll_interval=2.0,
            lease_every=30.0,
            lease_timeout=90.0,
        ),
    ))

    cpu: dict[str, list[tuple[float, float]]] = {"plain": [], "learner": []}

    def block(steps: int, synced: bool) -> float:
        settle(args)
        dist.barrier()
        t0, own0, all0 = time.perf_counter(), time.thread_time(), time.process_time()
        for _ in range(steps):
            train_step(model, opt, ids)
            if synced:
                sync.step(32, same_on_every_rank=args.tokens == "fixed")
        settle(args)
        # CPU seconds of the training thread and of the whole process (its background
        # threads too): a slower block that costs the training thread no more CPU waited.
        cpu["learner" if synced else "plain"].append(
            (time.thread_time() - own0, time.process_time() - all0))
        dist.barrier()
        return time.perf_counter() - t0

    block(args.cadence // 2, False)  # warm-up
    cpu["plain"].clear()
    plain, learner = [], []
    for _ in range(max(1, args.steps // args.cadence)):
        plain.append(block(args.cadence, False))
        learner.append(block(args.cadence, True))
    sync.close()
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world": dist.get_world_size(), "rounds_seen": sync.rounds_seen,
        "plain": plain, "learner": learner, "steps": args.cadence * len(plain), "cpu": cpu,
    }))
    dist.barrier()
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------

#: `--malloc caching`: glibc keeps what a rank frees for its next allocation of the size, as
#: CUDA's caching allocator does on a GPU (and jemalloc or tcmalloc, which PyTorch's CPU
#: tuning guide recommends): blocks up to 32 MiB (glibc's ceiling) come from the heap,
#: and the heap is never trimmed. By default glibc maps every block over its (adaptive)
#: threshold afresh and unmaps it when freed, so a snapshot's buffer costs page faults
#: that no recycling allocator pays.
CACHING_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_ranks(n: int, mode: str, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    box, out = tmp / f"{mode}{n}", tmp / f"out-{mode}{n}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    if args.malloc == "caching":
        env.update(CACHING_MALLOC)
    closer = None
    if mode != "throughput" or args.closer == "process":  # a closer process of its own
        closer = subprocess.Popen(
            [sys.executable, "-m", "gradientmail.app.cli", "sync", str(box), "--poll-interval",
             "0.02", "--closer-id", "closer", "--quiet"], cwd=ROOT, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    try:
        cmd = [exe, "--nproc_per_node", str(n), "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), __file__, "--rank-worker", str(box),
               str(out), "--mode", mode, "--layers", str(args.layers), "--embd",
               str(args.embd), "--vocab", str(args.vocab), "--rounds", str(args.rounds),
               "--sync-every", str(args.sync_every), "--cadence", str(args.cadence),
               "--steps", str(args.steps), "--device", args.device, "--closer", args.closer,
               "--tokens", args.tokens]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"{n} ranks ({mode}) failed:\n{proc.stdout.decode()[-4000:]}")
    finally:
        if closer is not None:
            closer.send_signal(signal.SIGTERM)
            try:
                closer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                closer.kill()
    return [json.loads(Path(f"{out}.rank{k}.json").read_text()) for k in range(n)]


def gpu_name() -> str:
    import torch

    return f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}"


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def memory_table(results: dict[int, list[dict[str, Any]]]) -> tuple[str, list[str]]:
    rows = ["| ranks | rank | shard MiB | largest tensor MiB | publish peak (×) | apply peak (×)"
            " | up per round (×) | down per round (×) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    worst = {"publish": 0.0, "apply": 0.0, "up": 0.0, "down": 0.0}
    for n, reports in results.items():
        for r in reports:
            bound = r["shard_f32"] + r["largest_f32"]
            pub = max(t + p for t, p in r["peaks"]["publish"])
            app = max(t + p for t, p in r["peaks"]["apply"])
            rounds = r["rounds_seen"] + 1
            up, down = r["moved"]["up"] / rounds, r["moved"]["down"] / rounds
            ratios = {"publish": pub / bound, "apply": app / bound, "up": up / bound,
                      "down": down / bound}
            for k, v in ratios.items():
                worst[k] = max(worst[k], v)
            rows.append(
                f"| {n} | {r['rank']} | {mib(r['shard_f32'])} | {mib(r['largest_f32'])} | "
                f"{mib(pub)} ({ratios['publish']:.2f}) | {mib(app)} ({ratios['apply']:.2f}) | "
                f"{mib(up)} ({ratios['up']:.2f}) | {mib(down)} ({ratios['down']:.2f}) |")
    goals = [
        f"per-rank publish peak ≤ 1.1× (shard + one tensor): worst {worst['publish']:.2f}×"
        f" ({verdict(worst['publish'] <= 1.1)})",
        f"per-rank apply peak ≤ 1.1×: worst {worst['apply']:.2f}× "
        f"({verdict(worst['apply'] <= 1.1)})",
        f"per-rank bytes per round ≤ 1.1×: worst up {worst['up']:.2f}×, down "
        f"{worst['down']:.2f}× ({verdict(max(worst['up'], worst['down']) <= 1.1)})",
    ]
    return "\n".join(rows), goals


def due_table(results: dict[int, list[dict[str, Any]]]) -> tuple[str, list[str]]:
    rows = ["| ranks | rank | due step ms (faults) | of which the snapshot ms | clone beside "
            "it ms (faults) | (×) | warm clone ms | (×) | cold clone ms (faults) | (×) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    worst_beside = worst_warm = worst_cold = 0.0
    for n, reports in results.items():
        for r in reports:
            due = statistics.median(t for t, _ in r["due"])
            due_f = statistics.median(f for _, f in r["due"])
            side = statistics.median(t for t, _ in r["beside"])
            side_f = statistics.median(f for _, f in r["beside"])
            worst_beside = max(worst_beside, due / side)
            warm = statistics.median(r["warm"])
            cold = statistics.median(t for t, _ in r["cold"])
            cold_f = statistics.median(f for _, f in r["cold"])
            worst_warm = max(worst_warm, due / warm)
            worst_cold = max(worst_cold, due / cold)
            snap = statistics.median(r["own"])
            rows.append(f"| {n} | {r['rank']} | {1e3 * due:.1f} ({due_f:.0f}) | "
                        f"{1e3 * snap:.1f} | {1e3 * side:.1f} ({side_f:.0f}) | {due / side:.2f} | "
                        f"{1e3 * warm:.1f} | {due / warm:.2f} | {1e3 * cold:.1f} "
                        f"({cold_f:.0f}) | {due / cold:.2f} |")
    goals = [
        f"due step ≤ 1.5× a clone() of the rank's shard beside it (the same moment): worst "
        f"{worst_beside:.2f}× ({verdict(worst_beside <= 1.5)})",
        f"due step ≤ 1.5× a warm clone() of the rank's shard: worst {worst_warm:.2f}× "
        f"({verdict(worst_warm <= 1.5)})",
        f"due step ≤ 1.5× a cold clone() (its pages faulted in): worst {worst_cold:.2f}× "
        f"({verdict(worst_cold <= 1.5)})",
    ]
    return "\n".join(rows), goals


def throughput_table(results: dict[int, list[dict[str, Any]]]) -> tuple[str, list[str]]:
    rows = ["| ranks | steps each | without ms/step (blocks) | with the learner ms/step "
            "(blocks) | throughput (×) | rounds | training thread CPU ms/step without, with "
            "| process CPU ms/step without, with |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    worst = math.inf
    for n, reports in results.items():
        r = max(reports, key=lambda x: sum(x["learner"]))  # the slowest rank sets the pace
        steps, per = r["steps"], r["steps"] / len(r["plain"])
        plain, learner = sum(r["plain"]), sum(r["learner"])
        ratio = plain / learner
        worst = min(worst, ratio)

        def each(blocks: list[float], per: float = per) -> str:
            return ", ".join(f"{1e3 * t / per:.0f}" for t in blocks)

        own = {k: 1e3 * sum(t for t, _ in v) / steps for k, v in r["cpu"].items()}
        whole = {k: 1e3 * sum(p for _, p in v) / steps for k, v in r["cpu"].items()}
        rows.append(f"| {n} | {steps} | {1e3 * plain / steps:.1f} ({each(r['plain'])}) | "
                    f"{1e3 * learner / steps:.1f} ({each(r['learner'])}) | {ratio:.3f} | "
                    f"{r['rounds_seen'] + 1} | {own['plain']:.1f}, {own['learner']:.1f} | "
                    f"{whole['plain']:.1f}, {whole['learner']:.1f} |")
    return "\n".join(rows), [f"throughput with the learner ≥ 0.99×: worst {worst:.3f}× "
                             f"({verdict(worst >= 0.99)})"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank-worker", nargs=2, metavar=("MAILBOX", "OUT"))
    ap.add_argument("--mode", choices=["memory", "time", "throughput"], default="memory")
    ap.add_argument("--modes", nargs="+", default=["memory", "time", "throughput"],
                    choices=["memory", "time", "throughput"])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--cadence", type=int, default=62,
                    help="throughput: steps between rounds (the XL recipe: 500 / 8 fragments)")
    ap.add_argument("--steps", type=int, default=256, help="throughput: steps per phase")
    ap.add_argument("--tokens", choices=["fixed", "counted"], default="fixed",
                    help="throughput: a fixed count per step (the XL recipe's "
                         "tokens_per_step: no collective) or each rank's count, summed over "
                         "the ranks every step (one all-reduce)")
    ap.add_argument("--closer", choices=["embedded", "process"], default="embedded",
                    help="throughput: the learner closes its rounds itself (the recipe), or "
                         "a `gradientmail sync` process does")
    ap.add_argument("--malloc", choices=["caching", "default"], default="caching",
                    help="CPU ranks: glibc set to reuse freed blocks (as CUDA's caching "
                         "allocator, jemalloc or tcmalloc) or left to its defaults")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: one GPU per rank, NCCL for the training collectives (the "
                         "side group stays gloo), device memory counters for the peaks")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the file appended to")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    if args.rank_worker:
        args.mailbox, args.out = args.rank_worker
        rank_worker(args)
        return
    started = time.time()
    tables = {"memory": memory_table, "time": due_table, "throughput": throughput_table}
    parts: list[str] = []
    model = 0
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            results = {n: run_ranks(n, mode, args, Path(tmp)) for n in args.ranks}
            model = model or results[args.ranks[0]][0].get("model_f32", 0)
            body, goals = tables[mode](results)
            parts += [f"**{mode}**", "", body, "", *[f"- {g}" for g in goals], ""]
            print("\n".join(parts[-len(goals) - 5:]), flush=True)
    cmd = "python benchmarks/sharded.py " + " ".join(sys.argv[1:])
    setups = [  # what each mode ran, said only for the modes that ran
        (("memory", "time"), f"memory and time: one learner (standard DiLoCo, replicated "
         f"outer step) closed by a `gradientmail sync` process, {args.rounds} rounds of "
         f"{args.sync_every} steps; memory under the allocation meter, time without it."),
        (("throughput",), f"throughput: blocks of {args.cadence} steps without the learner "
         f"and with it, alternating ({args.steps} steps each; with it a round every "
         f"{args.cadence} steps, 4 fragments, never waiting, F4 deltas, BF16 commits, closer "
         f"{args.closer}, 2 s poll, tokens {args.tokens})."),
    ]
    section = "\n".join([
        f"## sharded learner: per-rank memory, bytes, due step, throughput — "
        f"{datetime.date.today()}",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared), torch threads 1 "
        f"per rank, malloc {args.malloc}. GPT-2-shaped: {args.layers} blocks, width "
        f"{args.embd}, vocabulary "
        f"{args.vocab}{f' ({mib(model)} MiB F32)' if model else ''}, FSDP2 per block, "
        f"{'NCCL on ' + gpu_name() if args.device == 'cuda' else 'gloo on CPU'}. "
        + " ".join(setup for modes, setup in setups if set(modes) & set(args.modes))
        + f" {time.time() - started:.0f} s.",
        f"Command: `{cmd.strip()}`",
        "",
        "Ratios (×): memory and bytes against the rank's shard + the largest tensor (F32); "
        "the due step against a `clone()` of the rank's shard measured in the same run.",
        "",
        *parts,
    ])
    print(section)
    if not args.no_append:
        with open(args.results, "a", encoding="utf-8") as f:
            f.write("\n" + section)


if __name__ == "__main__":
    main()
