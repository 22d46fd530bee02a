"""What a sharded learner's ranks hold, send and spend (issue #15).

    python benchmarks/sharded.py [--ranks 1 2 4] [--layers 12] [--embd 256]
                                 [--vocab 50257] [--rounds 4] [--no-append]

For a GPT-2-shaped model (GPT-2's 12 blocks and 50,257-token vocabulary at a narrower
width, so that 4 ranks fit a 2-core CPU) sharded with FSDP2 over 1, 2 and 4 ranks (gloo on
CPU), one learner (`PartedRanks` under `RankSync`, standard DiLoCo, the default
replicated outer step) trains a few rounds closed by a `gradientmail sync` process.
Each rank measures, in the same run:
- the peak of what it allocates, on any of its threads, while it publishes (its part)
  and while it applies a commit (reading its rows of the step, replaying the outer step
  on its rows of the state, loading them, the training thread's apply or rebase), against
  its shard + the largest tensor, in F32 (goal: ≤ 1.1×);
- the payload bytes it uploads and downloads per round (goal: ≤ 1.1× shard + one tensor);
- the median time of a due step's own work (on rank 0 the learner's hand-over: its
  decision, the snapshot broadcast to the ranks and taken, the job posted; on the other
  ranks the snapshot they replay; a standard DiLoCo due step then waits for its commit,
  the barrier, which is not the learner's cost) against a plain `clone()` of the rank's
  shard (goal: ≤ 1.5×).
Prints a markdown table and appends it to benchmarks/RESULTS.md (unless --no-append).
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


def rank_worker(args: argparse.Namespace) -> None:
    from alloc_meter import SharedMeter
    from memory_learner import measure

    meter = SharedMeter()
    meter.install()
    measure(meter, tap_snapshot=False)  # the due step is timed: no Python dispatch in it
    moved = count_payload_bytes()
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    from gradientmail.algorithms.diloco import DiLoCo
    from gradientmail.integration import RankSync, TorchRanks
    from gradientmail.integration.parted import PartedRanks
    from gradientmail.learner.runtime import Learner

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=max(1, args.embd // 64),
                     vocab_size=args.vocab, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    alg = DiLoCo.standard(args.sync_every, 1)
    parted = PartedRanks.create(model, args.mailbox, timeout=600.0)
    # The due step's own work: on rank 0 the learner's hand-over (its decision, the
    # snapshot broadcast to the ranks and taken, the job posted), on the others the
    # snapshot they replay. (A standard DiLoCo due step then waits for its commit: the
    # barrier, not the learner's cost.)
    due: list[float] = []
    replay, hand_over = PartedRanks._replay, Learner._hand_over

    def timed_replay(self: PartedRanks, kind: str, *rest: Any) -> None:
        t0 = time.perf_counter()
        replay(self, kind, *rest)
        if kind == "snapshot" and self.rank != 0:
            due.append(time.perf_counter() - t0)

    def timed_hand_over(self: Learner, *rest: Any, **kw: Any) -> None:
        t0 = time.perf_counter()
        hand_over(self, *rest, **kw)
        due.append(time.perf_counter() - t0)

    PartedRanks._replay = timed_replay  # type: ignore[method-assign]
    Learner._hand_over = timed_hand_over  # type: ignore[method-assign]
    sync = RankSync(TorchRanks("cpu"), model, parted=parted)
    sync.start(lambda: Learner(parted.learner_adapter(), alg, args.mailbox, "sharded",
                               sync=False, poll_interval=0.02, lease_every=5.0,
                               lease_timeout=60.0))
    dist.barrier()
    joined = dict(moved)
    moved.update(up=0, down=0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, args.vocab, (1, 32), generator=torch.Generator().manual_seed(rank))
    for _ in range(args.rounds * args.sync_every):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sync.step(32)
    sync.close()
    a = parted.adapter
    names = list(a.schema.names)
    clones = []
    for _ in range(max(5, len(due))):
        t0 = time.perf_counter()
        kept = [a.local(n).clone() for n in names]
        clones.append(time.perf_counter() - t0)
        del kept
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world": dist.get_world_size(), "rounds_seen": sync.rounds_seen,
        "shard_f32": a.local_nbytes(dtype="F32"),
        "largest_f32": max(4 * math.prod(p.shape) for p in a.schema.params),
        "model_f32": sum(4 * math.prod(p.shape) for p in a.schema.params),
        "peaks": meter.peaks, "moved": moved, "joined": joined,
        "due": due, "clone": clones,
    }))
    dist.barrier()
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_ranks(n: int, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    box, out = tmp / f"run{n}", tmp / f"out{n}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    closer = subprocess.Popen(
        [sys.executable, "-m", "gradientmail.app.cli", "sync", str(box), "--poll-interval",
         "0.02", "--closer-id", "closer", "--quiet"], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    try:
        cmd = [exe, "--nproc_per_node", str(n), "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), __file__, "--rank-worker", str(box),
               str(out), "--layers", str(args.layers), "--embd", str(args.embd),
               "--vocab", str(args.vocab), "--rounds", str(args.rounds),
               "--sync-every", str(args.sync_every)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"{n} ranks failed:\n{proc.stdout.decode()[-4000:]}")
    finally:
        closer.send_signal(signal.SIGTERM)
        try:
            closer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            closer.kill()
    return [json.loads(Path(f"{out}.rank{k}.json").read_text()) for k in range(n)]


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(results: dict[int, list[dict[str, Any]]]) -> tuple[str, list[str]]:
    rows = ["| ranks | rank | shard MiB | largest tensor MiB | publish peak (×) | apply peak (×)"
            " | up per round (×) | down per round (×) | due step ms | clone ms (×) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    worst = {"publish": 0.0, "apply": 0.0, "up": 0.0, "down": 0.0, "due": 0.0}
    for n, reports in results.items():
        for r in reports:
            bound = r["shard_f32"] + r["largest_f32"]
            pub = max(t + p for t, p in r["peaks"]["publish"])
            app = max(t + p for t, p in r["peaks"]["apply"])
            rounds = r["rounds_seen"] + 1
            up, down = r["moved"]["up"] / rounds, r["moved"]["down"] / rounds
            due = statistics.median(r["due"]) if r["due"] else math.nan
            clone = statistics.median(r["clone"])
            ratios = {"publish": pub / bound, "apply": app / bound, "up": up / bound,
                      "down": down / bound, "due": due / clone}
            for k, v in ratios.items():
                worst[k] = max(worst[k], v)
            rows.append(
                f"| {n} | {r['rank']} | {mib(r['shard_f32'])} | {mib(r['largest_f32'])} | "
                f"{mib(pub)} ({ratios['publish']:.2f}) | {mib(app)} ({ratios['apply']:.2f}) | "
                f"{mib(up)} ({ratios['up']:.2f}) | {mib(down)} ({ratios['down']:.2f}) | "
                f"{1e3 * due:.1f} | {1e3 * clone:.1f} ({ratios['due']:.2f}) |")
    goals = [
        f"per-rank publish peak ≤ 1.1× (shard + one tensor): worst {worst['publish']:.2f}×"
        f" ({'met' if worst['publish'] <= 1.1 else 'NOT met'})",
        f"per-rank apply peak ≤ 1.1×: worst {worst['apply']:.2f}×"
        f" ({'met' if worst['apply'] <= 1.1 else 'NOT met'})",
        f"per-rank bytes per round ≤ 1.1×: worst up {worst['up']:.2f}×, down "
        f"{worst['down']:.2f}× ({'met' if max(worst['up'], worst['down']) <= 1.1 else 'NOT met'})",
        f"due step ≤ 1.5× a clone() of the rank's shard: worst {worst['due']:.2f}×"
        f" ({'met' if worst['due'] <= 1.5 else 'NOT met'})",
    ]
    return "\n".join(rows), goals


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank-worker", nargs=2, metavar=("MAILBOX", "OUT"))
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    if args.rank_worker:
        args.mailbox, args.out = args.rank_worker
        rank_worker(args)
        return
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        results = {n: run_ranks(n, args, Path(tmp)) for n in args.ranks}
    body, goals = table(results)
    model = results[args.ranks[0]][0]["model_f32"]
    cmd = "python benchmarks/sharded.py " + " ".join(sys.argv[1:])
    section = "\n".join([
        f"## sharded learner: per-rank memory, bytes, due step — {datetime.date.today()}",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared), torch threads 1 "
        f"per rank. GPT-2-shaped: {args.layers} blocks, width {args.embd}, vocabulary "
        f"{args.vocab} ({mib(model)} MiB F32), FSDP2 per block, gloo on CPU; one learner "
        f"(standard DiLoCo, replicated outer step) closed by a `gradientmail sync` process, "
        f"{args.rounds} rounds of {args.sync_every} steps; {time.time() - started:.0f} s.",
        f"Command: `{cmd.strip()}`",
        "",
        "Ratios (×) are against the rank's shard + the largest tensor (F32), and for the "
        "due step against a `clone()` of the rank's shard, measured in the same run.",
        "",
        body,
        "",
        *[f"- {g}" for g in goals],
        "",
    ])
    print(section)
    if not args.no_append:
        with open(RESULTS, "a", encoding="utf-8") as f:
            f.write("\n" + section)


if __name__ == "__main__":
    main()
