"""Liveness in seconds: how long a SIGKILLed learner holds its peer in standard DiLoCo.

    python benchmarks/liveness.py [--smoke] [--steps S] [--kill-at K] [--runs N]
                                  [--results PATH]

Two learner processes train the small GPT-2 of benchmarks/convergence.py (2 layers × 128,
batch 8×128, H = 50, S = 300 steps each) with `DiLoCo.standard(H, 2)` (one fragment, a
barrier, quorum 2) through a local-directory mailbox, with the library's defaults (poll
1 s, leases every 60 s, timeout 120 s), started together with `wait_for_learners(2)`. When
the victim (`learner-1`) has logged K steps (mid-round), the parent SIGKILLs it: its lease
stays behind, nobody releases it. The survivor trains its S steps alone.

Run i kills at step K + i·H (the round after the kill is preferred-closed by the victim
in one run and by the survivor in the next: live learners take turns by round).

Each worker appends one line per `step()` with a raw `os.write`: the wall-clock time it
returned (one machine, one clock) and its seconds; and one line per commit it read,
contribution it published and roll call it saw. Reported per run:

- the survivor's longest stall: the longest gap between two consecutive `step()` returns,
  before the kill (a healthy barrier) and after it (goal: ≤ 10 s; without the roll call it
  was the lease timeout, ~110 s);
- kill → first commit without the victim: seconds from the SIGKILL to the first record
  whose participants lack the victim (includes the survivor's training to its barrier);
- contribution → that commit: from the survivor's contribution to that round to its
  record: what the barrier waited for the dead learner;
- the roll calls the run made and the learners judged gone.

Prints a markdown table; appends it to RESULTS.md unless `--smoke`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradientmail.learner.options import LearnerOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))

import convergence as conv  # benchmarks/ is not a package

__all__ = ["Job", "main", "measure", "run_once"]

RESULTS = conv.RESULTS
BASE = conv.Settings(learners=2, steps=300, batch=8, block=128, sync_every=50, fragments=1,
                     text_budget=2_000_000)
SMOKE = dataclasses.replace(conv.PRESETS["smoke"], steps=24, sync_every=6, fragments=1)
GOAL = 10.0  # seconds a SIGKILLed learner may hold its peer
VICTIM, SURVIVOR = 1, 0


@dataclasses.dataclass(frozen=True)
class Job:
    settings: conv.Settings
    rank: int
    workdir: str
    box: str

    def log(self, suffix: str) -> Path:
        return Path(self.workdir) / f"{Path(self.box).name}-{self.rank}.{suffix}"


def _worker(job: Job) -> None:
    import torch

    from gradientmail import events as ev
    from gradientmail.adapters import TorchAdapter
    from gradientmail.algorithms.diloco import DiLoCo
    from gradientmail.learner.runtime import Learner

    torch.set_num_threads(1)
    s, wd = job.settings, Path(job.workdir)
    efd = os.open(job.log("events"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def on_event(e: ev.Event) -> None:
        line = ""
        if isinstance(e, ev.RoundRecorded):
            line = f"rec {e.round} {time.time():.6f} {','.join(e.participants) or '-'}\n"
        elif isinstance(e, ev.SnapshotPublished):
            line = f"pub {e.round} {time.time():.6f}\n"
        elif isinstance(e, ev.RollCalled):
            line = f"call {e.round} {time.time():.6f} {e.called}\n"
        elif isinstance(e, ev.LearnersGone):
            line = f"gone {e.round} {time.time():.6f} {','.join(e.learners)}\n"
        if line:
            os.write(efd, line.encode())

    data = torch.load(wd / "train.pt")
    rows = data[job.rank :: s.learners]
    model = conv.build_model(s, int(torch.load(wd / "vocab.pt")))
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.1)
    learner = Learner(
        TorchAdapter(model),
        DiLoCo.standard(s.sync_every, s.learners),
        job.box,
        f"learner-{job.rank}",
        on_event=on_event,
        options=LearnerOptions(keep_versions=10**6),
    )  # the library's defaults otherwise
    learner.start()
    learner.wait_for_learners(s.learners, timeout=600)
    g = torch.Generator().manual_seed(s.seed + 1 + job.rank)
    fd = os.open(job.log("log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for _ in range(s.steps):
        ids = rows[torch.randint(0, rows.shape[0], (s.batch,), generator=g)]
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = time.perf_counter()
        learner.step(int(ids.numel()))
        os.write(fd, f"{time.time():.6f} {time.perf_counter() - t:.6f}\n".encode())
    os.close(fd)
    learner.close()


def _lines(path: Path) -> list[list[str]]:
    return [ln.split() for ln in path.read_text().splitlines()] if path.exists() else []


def run_once(s: conv.Settings, workdir: Path, run: str, kill_at: int,
             timeout: float = 3600.0) -> dict[str, Any]:
    """Both learners to the end, the victim SIGKILLed at its step `kill_at`."""
    box = workdir / run
    ctx = conv.worker_context()
    jobs = [Job(s, rank, str(workdir), str(box)) for rank in range(2)]
    procs = [ctx.Process(target=_worker, args=(j,), daemon=True) for j in jobs]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    victim, survivor = procs[VICTIM], procs[SURVIVOR]
    log = jobs[VICTIM].log("log")
    t_kill = conv.kill_at_step(victim, lambda: len(_lines(log)), kill_at, t0 + timeout, run)
    victim.join()
    survivor.join(max(timeout - (time.monotonic() - t0), 1.0))
    if survivor.exitcode != 0:
        if survivor.is_alive():
            survivor.kill()
        raise SystemExit(f"{run}: the survivor failed (exit code {survivor.exitcode})")
    return measure(jobs[SURVIVOR], jobs[VICTIM], t_kill)


def measure(survivor: Job, victim: Job, t_kill: float) -> dict[str, Any]:
    """The figures of one run from the survivor's logs."""
    returns = [float(parts[0]) for parts in _lines(survivor.log("log")) if len(parts) == 2]
    gaps = [(b - a, b) for a, b in itertools.pairwise(returns)]
    before = max((g for g, end in gaps if end <= t_kill), default=0.0)
    after = max((g for g, end in gaps if end > t_kill), default=0.0)
    events = _lines(survivor.log("events"))
    victim_id = f"learner-{victim.rank}"
    without = next(((int(e[1]), float(e[2])) for e in events if e[0] == "rec"
                    and float(e[2]) > t_kill and victim_id not in e[3].split(",")), None)
    published = {int(e[1]): float(e[2]) for e in events if e[0] == "pub"}
    gone = sorted({x for e in events if e[0] == "gone" for x in e[3].split(",")})
    calls = sum(e[0] == "call" for e in events)
    out: dict[str, Any] = {"stall_before": before, "stall_after": after, "calls": calls,
                           "gone": gone, "round": None, "kill_to_commit": None,
                           "wait": None, "preferred": None}
    if without is not None:
        r, t = without
        out["round"] = r
        out["kill_to_commit"] = t - t_kill
        out["wait"] = t - published[r] if r in published else None
        # Live learners take turns by round, in id order: learner-(r mod 2).
        out["preferred"] = "victim" if r % 2 == victim.rank else "survivor"
    return out


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f} s"


def table(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    lines = [
        "| run | killed at step | first round without it | its preferred closer "
        "| survivor's longest stall before / after the kill | kill → commit without it "
        "| survivor's contribution → that commit | roll calls | judged gone |",
        "|---|---:|---:|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['kill_at']} | {r['round'] if r['round'] is not None else '—'} "
            f"| {r['preferred'] or '—'} | {_s(r['stall_before'])} / {_s(r['stall_after'])} "
            f"| {_s(r['kill_to_commit'])} | {_s(r['wait'])} | {r['calls']} "
            f"| {', '.join(r['gone']) or '—'} |"
        )
    worst = max(r["stall_after"] for r in rows)
    goals = [f"a SIGKILLed learner holds its peer at most {GOAL:.0f} s with default settings: "
             f"longest stall after the kill {worst:.1f} s "
             f"({'met' if worst <= GOAL else 'NOT met'})"]
    return "\n".join(lines), goals


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (seconds; no append)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per learner")
    ap.add_argument("--kill-at", type=int, default=None,
                    help="the victim's step to kill it at (default: 2.5 rounds in)")
    ap.add_argument("--runs", type=int, default=2, help="runs, each killing a round later")
    ap.add_argument("--results", default=str(RESULTS), help="markdown file to append to")
    args = ap.parse_args(argv)
    s = SMOKE if args.smoke else BASE
    if args.steps is not None:
        s = dataclasses.replace(s, steps=args.steps)
    h = s.sync_every
    kill_at = args.kill_at if args.kill_at is not None else 2 * h + h // 2
    if kill_at + (args.runs - 1) * h >= s.steps:
        raise SystemExit(f"--kill-at {kill_at} with --runs {args.runs} kills past the "
                         f"{s.steps} steps; give more --steps or fewer --runs")

    import torch

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="gm-liveness-"))
    _, n_train = conv.prepare_data(s, workdir)
    print(f"data: {n_train:,} training tokens; workdir {workdir}", flush=True)
    rows = []
    for i in range(args.runs):
        at = kill_at + i * h
        row = {"run": f"run-{i}", "kill_at": at, **run_once(s, workdir, f"run-{i}", at)}
        rows.append(row)
        print(f"run-{i}: killed at step {at}; stall {row['stall_after']:.1f} s; "
              f"kill → commit without it {_s(row['kill_to_commit'])}", flush=True)
    body, goals = table(rows)
    command = sys.argv[1:] if argv is None else argv
    header = (
        f"\n## liveness: a SIGKILLed learner in standard DiLoCo — {datetime.date.today()}\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared), one torch thread "
        f"per learner process. 2 learners, `DiLoCo.standard(H={h}, 2)`, GPT-2 "
        f"{s.n_layer}×{s.n_embd}, batch {s.batch}×{s.block}, S = {s.steps} steps each; "
        f"local-directory mailbox; default poll (1 s) and leases (60 s / 120 s); the "
        f"victim SIGKILLed mid-round. {time.perf_counter() - t0:.0f}s in all.\n"
        f"Command: `{' '.join(['python', 'benchmarks/liveness.py', *command])}`\n\n"
    )
    text = header + body + "\n\n" + "\n".join(f"- {g}" for g in goals)
    print(text)
    if not args.smoke:
        with Path(args.results).open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
