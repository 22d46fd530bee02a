"""Decoupled DiLoCo's defaults against standard DiLoCo, healthy and with a slow learner.

    python benchmarks/decoupled.py [--learners 2,4,8] [--scenarios healthy,slow]
                                   [--steps S] [--smoke] [--results PATH] [--plot PATH]

M learner processes train the small GPT-2 of benchmarks/convergence.py (2 layers × 128,
batch 8×128, H = 50, S = 300 steps each, the same data shards and seeds for every arm)
through a local-directory mailbox with the public `Learner` API, started one after
another as users start them (no `wait_for_learners` for the decoupled arm):

- `standard`: `DiLoCo.standard(H, M)` (one fragment, barrier, quorum M, weighted mean),
  started together with `wait_for_learners(M)`;
- `decoupled`: `DiLoCo(sync_every=H, fragments=2)`, the library's defaults.

Scenarios: `healthy` (every learner at full speed, S steps each: equal tokens) and
`slow` (learner 0 sleeps after each step as long as the step took: half the speed of the
others). In `slow` the standard arm's barrier makes every learner wait for the slow one,
S steps each; the decoupled learners train for a share (`--slow-budget`, 0.8) of the
standard arm's wall time, each as many steps as its speed gives it (no one waits for
the slow one: that is the point). The question there is time to a loss: the first
second after the launch at which the decoupled arm's committed model reaches the
standard arm's final held-out loss (goal: within 0.75× the standard arm's wall time).

Reported per arm: the held-out loss of the committed model at the end, participants per
round, contribution span (steps a
contribution carries / H: a fragment is synced every H steps, so 1.0 is a learner that
takes part in every round of its fragments), the wall time, and for `slow` the first
wall-clock second at which the committed model reaches the standard arm's final loss.
A commit is timed by the first `RoundRecorded` event of any worker (one machine, one
clock).
`GM_DECOUPLED_OVERRIDES='{"quorum_size": 2}'` (JSON) changes fields of the decoupled arm
from the defaults, to try other settings (`merge` and `partition` as their JSON records,
e.g. `{"merge": {"type": "weighted_mean"}}`).
Prints a markdown table, appends it to RESULTS.md and plots loss against tokens and time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradientmail.learner.options import LearnerOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))

import convergence as conv  # benchmarks/ is not a package

__all__ = ["Case", "main", "run_case", "summarize"]

RESULTS = conv.RESULTS
BASE = conv.Settings(learners=4, steps=300, batch=8, block=128, sync_every=50, fragments=2,
                     evals=6, text_budget=4_000_000)
SMOKE = dataclasses.replace(conv.PRESETS["smoke"], steps=24, sync_every=8, fragments=2)


@dataclasses.dataclass(frozen=True)
class Case:
    """One run: an arm (`standard` or `decoupled`) in a scenario with M learners."""

    arm: str
    scenario: str
    settings: conv.Settings
    workdir: str
    rank: int = 0
    #: Wall-clock seconds from the launch the learners train for (decoupled `slow`);
    #: None: S steps each.
    budget: float | None = None
    launched: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.arm}-{self.scenario}-m{self.settings.learners}"


def algorithm(case: Case) -> Any:
    from gradientmail import DiLoCo

    s = case.settings
    if case.arm == "standard":
        return DiLoCo.standard(s.sync_every, s.learners)
    from gradientmail.algorithms.merge import merge_from_json
    from gradientmail.algorithms.partition import partition_from_json

    extra = json.loads(os.environ.get("GM_DECOUPLED_OVERRIDES", "{}"))
    # merge and partition as their JSON records: {"merge": {"type": "weighted_mean"}}
    if "merge" in extra:
        extra["merge"] = merge_from_json(extra["merge"])
    if "partition" in extra:
        extra["partition"] = partition_from_json(extra["partition"])
    return DiLoCo(sync_every=s.sync_every, fragments=s.fragments, **extra)


def _worker(case: Case) -> None:
    import torch

    from gradientmail.adapters import TorchAdapter
    from gradientmail.events import Event, RoundRecorded
    from gradientmail.learner.runtime import Learner

    torch.set_num_threads(1)
    s, wd = case.settings, Path(case.workdir)
    data = torch.load(wd / "train.pt")
    model = conv.build_model(s, int(torch.load(wd / "vocab.pt")))
    rows = data[case.rank :: s.learners]
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.1)
    commits: list[tuple[int, float]] = []

    def on_event(e: Event) -> None:
        if isinstance(e, RoundRecorded):
            commits.append((e.round, time.time()))

    learner = Learner(
        TorchAdapter(model),
        algorithm(case),
        str(wd / case.name),
        f"learner-{case.rank}",
        on_event=on_event,
        options=LearnerOptions(keep_versions=10**6),
    )
    learner.start()
    if case.arm == "standard":
        learner.wait_for_learners(s.learners, timeout=600)
    slow = case.scenario == "slow" and case.rank == 0
    g = torch.Generator().manual_seed(s.seed + 1 + case.rank)
    started = time.time()
    step = 0
    while (step < s.steps if case.budget is None
           else time.time() - case.launched < case.budget):
        step += 1
        t = time.perf_counter()
        ids = rows[torch.randint(0, rows.shape[0], (s.batch,), generator=g)]
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if slow:
            time.sleep(time.perf_counter() - t)
        learner.step(int(ids.numel()))
    learner.close()
    out = {"commits": commits, "started": started, "ended": time.time(),
           "launched": case.launched, "steps": step}
    (wd / f"{case.name}-{case.rank}.json").write_text(json.dumps(out))


def launch(case: Case, timeout: float = 3600.0) -> float:
    ctx = conv.worker_context()
    t0 = time.perf_counter()
    launched = time.time()
    procs = []
    for rank in range(case.settings.learners):
        each = dataclasses.replace(case, rank=rank, launched=launched)
        p = ctx.Process(target=_worker, args=(each,), daemon=True)
        p.start()
        procs.append(p)
    for p in procs:
        p.join(max(t0 + timeout - time.perf_counter(), 1.0))
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if bad:
        raise SystemExit(f"{case.name}: workers failed (rank, exit code): {bad}")
    return time.perf_counter() - t0


def run_case(case: Case, vocab: int, val: Any) -> dict[str, Any]:
    """Train, then read the run back: loss curve against tokens and seconds, rounds."""
    s, wd = case.settings, Path(case.workdir)
    wall = launch(case)
    outs = [json.loads((wd / f"{case.name}-{r}.json").read_text()) for r in range(s.learners)]
    t_start = outs[0]["launched"]  # commits timed from the launch, as `wall` is
    when: dict[int, float] = {}
    for o in outs:  # the first learner to read (or write) a commit times it
        for rnd, t in o["commits"]:
            when[rnd] = min(when.get(rnd, math.inf), t - t_start)
    box = wd / case.name
    records = conv.records_of(box)
    frags = max((rec.fragment for rec in records), default=0) + 1
    cum, seen = [], 0
    for rec in records:
        seen += sum(p.tokens for p in rec.participants)
        cum.append(seen // frags)
    evals = 2 * s.evals if case.scenario == "slow" else s.evals  # time to a loss: finer
    picks = sorted({round(i * (len(records) - 1) / evals) for i in range(1, evals + 1)})
    curve = []
    for i in picks:
        model = conv.load_into(conv.build_model(s, vocab), conv.committed_state(box, i))
        curve.append((cum[i], when.get(i, wall), conv.evaluate(model, val)))
    # A fragment is synced every H steps: a contribution on schedule carries H of them.
    spans = [p.steps / s.sync_every for rec in records for p in rec.participants]
    return {
        "case": case.name, "arm": case.arm, "scenario": case.scenario, "m": s.learners,
        "curve": curve, "wall": wall, "rounds": len(records),
        "participants": statistics.mean(len(r.participants) for r in records) if records else 0,
        "full": sum(len(r.participants) == s.learners for r in records) / max(len(records), 1),
        "span_mean": statistics.mean(spans) if spans else 0.0,
        "span_max": max(spans, default=0.0),
        "steps": [o["steps"] for o in outs],
    }


def summarize(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """The markdown table and the goal lines."""
    by = {(r["arm"], r["scenario"], r["m"]): r for r in rows}
    lines = [
        "| scenario | M | arm | held-out loss | vs standard | participants / round "
        "| rounds all in | span mean / max | rounds | wall s | reaches standard's loss at |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    goals = []
    for r in rows:
        std = by.get(("standard", r["scenario"], r["m"]))
        loss = r["curve"][-1][2]
        ratio = f"{loss / std['curve'][-1][2]:.3f}" if std else "—"
        reach = "—"
        if std is not None and r["arm"] == "decoupled":
            target = std["curve"][-1][2]
            hit = next((t for _, t, loss in r["curve"] if loss <= target), None)
            reach = (f"{hit:.0f} s ({hit / std['wall']:.2f}× standard's wall)" if hit
                     else "not reached")
            if r["scenario"] == "healthy":
                goals.append(f"healthy M={r['m']}: decoupled {ratio}× standard's held-out loss "
                             f"(goal ≤ 1.01×): {'met' if float(ratio) <= 1.01 else 'NOT met'}")
            if r["scenario"] == "slow":
                ok = hit is not None and hit <= 0.75 * std["wall"]
                goals.append(f"slow M={r['m']}: decoupled reaches standard's final loss "
                             f"{target:.4f} at {reach} (goal ≤ 0.75×): "
                             f"{'met' if ok else 'NOT met'}")
        lines.append(
            f"| {r['scenario']} | {r['m']} | {r['arm']} | {loss:.4f} | {ratio} | "
            f"{r['participants']:.2f} | {r['full']:.0%} | {r['span_mean']:.2f} / "
            f"{r['span_max']:.2f} | {r['rounds']} | {r['wall']:.0f} | {reach} |"
        )
    return "\n".join(lines), goals


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        xs = [c[0] for c in r["curve"]]
        ts = [c[1] for c in r["curve"]]
        ys = [c[2] for c in r["curve"]]
        label = f"{r['arm']} {r['scenario']} M={r['m']}"
        style = "-" if r["arm"] == "decoupled" else "--"
        axes[0].plot(xs, ys, style, marker="o", label=label)
        axes[1].plot(ts, ys, style, marker="o", label=label)
    axes[0].set_xlabel("tokens committed")
    axes[1].set_xlabel("wall-clock seconds")
    for ax in axes:
        ax.set_ylabel("held-out loss (committed model)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--learners", default="2,4,8", help="comma-separated M values")
    ap.add_argument("--scenarios", default="healthy,slow")
    ap.add_argument("--arms", default="standard,decoupled")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None,
                    help="model, data order and batch seed (default: the preset's)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes for CI (seconds)")
    ap.add_argument("--slow-budget", type=float, default=0.8,
                    help="slow: decoupled learners train this share of standard's wall time")
    ap.add_argument("--results", default=str(RESULTS), help="append here ('': print only)")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    base = SMOKE if args.smoke else BASE
    if args.steps is not None:
        base = dataclasses.replace(base, steps=args.steps)
    if args.seed is not None:
        base = dataclasses.replace(base, seed=args.seed)
    ms = [int(m) for m in args.learners.split(",")]
    scenarios = args.scenarios.split(",")
    arms = args.arms.split(",")
    for name, got, allowed in (("scenarios", scenarios, {"healthy", "slow"}),
                               ("arms", arms, {"standard", "decoupled"})):
        if set(got) - allowed:
            raise SystemExit(f"--{name}: unknown {sorted(set(got) - allowed)}; "
                             f"choose from {sorted(allowed)}")

    import torch

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="gm-decoupled-"))
    rows = []
    vocab = val = None
    for m in ms:
        s = dataclasses.replace(base, learners=m)
        if vocab is None:
            vocab, n_train = conv.prepare_data(s, workdir)
            val = torch.load(workdir / "val.pt")
            print(f"data: {n_train:,} training tokens; workdir {workdir}", flush=True)
        for scenario in scenarios:
            for arm in arms:
                case = Case(arm, scenario, s, str(workdir))
                std = next((r for r in rows if (r["arm"], r["scenario"], r["m"])
                            == ("standard", scenario, m)), None)
                if scenario == "slow" and arm == "decoupled":
                    if std is None:
                        raise SystemExit("--scenarios slow needs the standard arm first: the "
                                         "decoupled learners train for a share of its time")
                    case = dataclasses.replace(case, budget=args.slow_budget * std["wall"])
                rows.append(run_case(case, vocab, val))
                r = rows[-1]
                print(f"{case.name}: steps {r['steps']}, loss {r['curve'][-1][2]:.4f}, "
                      f"participants "
                      f"{r['participants']:.2f}, all in {r['full']:.0%}, span "
                      f"{r['span_mean']:.2f}/{r['span_max']:.2f}, {r['wall']:.0f}s", flush=True)
    body, goals = summarize(rows)
    png = Path(args.plot) if args.plot else conv.HERE / (
        "decoupled-smoke.png" if args.smoke else "decoupled.png")
    have_plot = plot(rows, png)
    s = base
    command = sys.argv[1:] if argv is None else argv
    header = (
        f"\n## decoupled defaults vs standard DiLoCo — {datetime.date.today()}\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared), one torch thread "
        f"per learner process. GPT-2 {s.n_layer}×{s.n_embd}, batch {s.batch}×{s.block}, "
        f"S = {s.steps} steps per learner, H = {s.sync_every}, decoupled P = {s.fragments}; "
        f"local-directory mailbox, default poll interval and leases. "
        f"{time.perf_counter() - t0:.0f}s in all.\n"
        f"Command: `{' '.join(['python', 'benchmarks/decoupled.py', *command])}`\n\n"
    )
    text = header + body + "\n\n" + "\n".join(f"- {g}" for g in goals)
    if have_plot:
        link = conv.image_link(png, Path(args.results or RESULTS))
        text += f"\n\n![held-out loss against tokens and wall-clock time]({link})"
    print(text)
    if args.results:  # --results '': print only
        with open(args.results, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
