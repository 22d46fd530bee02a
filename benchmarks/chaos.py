"""Goodput under failures: a chaos monkey SIGKILLs learners of a running job.

    python benchmarks/chaos.py [--quick | --smoke] [--learners M] [--steps N] [--kill-every T]
                               [--down D] [--seed K] [--results PATH]

M learner processes (Decoupled DiLoCo defaults: RDA merge, quorum 1, grace window, never
waiting; `flush_on_close`) train the small GPT-2 of benchmarks/convergence.py on a
local-directory mailbox, each slot for N optimizer steps in all. Every T seconds a chaos
monkey SIGKILLs one learner — half the time the current closer (the newest record's
`closer`), otherwise one at random — and restarts it under the same id D seconds later; the
restarted process rejoins the run and trains the slot's remaining steps. Then the same run
again without faults.

Workers append one line per step (tokens, seconds of `Learner.step()`) to their own log
with a raw `os.write`, so a killed worker's steps are counted up to its death; and one line
per publish, failed or cancelled publish and dropped contribution to an events log.

- goodput: tokens inside commits / tokens trained. A step's tokens count toward every
  fragment, so the records hold each committed token once per fragment: goodput =
  Σ participants' tokens / (P × tokens trained). Trained-but-lost tokens are those of a
  killed learner since its last contribution that made it into a round, and contributions
  that came too late for their round.
- where the lost tokens went (`losses`), per learner incarnation and fragment: the tail
  trained after its last committed contribution (of a killed incarnation: died with it; of
  one that closed: its final flush did not make it), and the rest, trained before a
  committed contribution yet counted in none (overwritten by a commit, or dropped).
- stall: the longest `step()` of any learner (goal: at most the largest grace window the
  records predict plus one poll), and against one step: the median training time of a
  step, without `step()` (Decoupled DiLoCo's goal: no surviving step stalls beyond one).
- commits lost: records not gap-free or out of order, a fragment's versions not
  consecutive, or a payload a record references (theta, outer state, update) missing, not
  matching its size and SHA-256, or not finite. Must be 0.
- eval loss of the final committed model against the fault-free run's.

Prints a markdown table and appends it to RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradientmail.learner.options import LearnerOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))

import convergence as conv  # benchmarks/ is not a package

__all__ = ["PRESETS", "ChaosSettings", "SlotJob", "audit", "losses", "main", "report",
           "run_job"]

RESULTS = conv.RESULTS


@dataclasses.dataclass(frozen=True)
class ChaosSettings:
    model: conv.Settings
    learners: int = 4
    steps: int = 1200  # per learner slot, over all its incarnations
    sync_every: int = 30
    fragments: int = 2
    kill_every: float = 20.0
    down: float = 5.0
    poll: float = 0.1
    lease_every: float = 2.0
    lease_timeout: float = 6.0
    step_sleep: float = 0.0  # paces the smoke run, whose steps take microseconds
    seed: int = 0


PRESETS: dict[str, ChaosSettings] = {
    "full": ChaosSettings(conv.PRESETS["full"]),
    "quick": ChaosSettings(conv.PRESETS["quick"], steps=150, kill_every=8.0, down=2.0),
    "smoke": ChaosSettings(conv.PRESETS["smoke"], learners=2, steps=40, sync_every=4,
                           kill_every=1.0, down=0.3, poll=0.05, lease_every=0.5,
                           lease_timeout=1.5, step_sleep=0.04),
}


@dataclasses.dataclass(frozen=True)
class SlotJob:
    cs: ChaosSettings
    slot: int
    incarnation: int
    start_step: int
    workdir: str
    mailbox: str
    wait_for: int


def _algorithm(cs: ChaosSettings) -> Any:
    from gradientmail.algorithms.diloco import DiLoCo

    return DiLoCo(sync_every=cs.sync_every, fragments=cs.fragments, flush_on_close=True)


def _log(job: SlotJob, suffix: str) -> Path:
    return Path(job.workdir) / f"{Path(job.mailbox).name}-{job.slot}-{job.incarnation}.{suffix}"


def _slot_worker(job: SlotJob) -> None:
    """One incarnation of a learner slot: trains the slot's remaining steps, then closes."""
    import torch

    from gradientmail.adapters import TorchAdapter
    from gradientmail.learner.runtime import Learner

    torch.set_num_threads(1)
    cs, s, wd = job.cs, job.cs.model, Path(job.workdir)
    efd = os.open(_log(job, "events"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def on_event(event: Any) -> None:
        line = _event_line(event)
        if line:
            os.write(efd, line.encode())

    data = torch.load(wd / "train.pt")
    rows = data[job.slot :: cs.learners]
    model = conv.build_model(s, int(torch.load(wd / "vocab.pt")))
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.1)
    learner = Learner(
        TorchAdapter(model),
        _algorithm(cs),
        job.mailbox,
        f"learner-{job.slot}",
        on_event=on_event,
        options=LearnerOptions(
            poll_interval=cs.poll,
            lease_every=cs.lease_every,
            lease_timeout=cs.lease_timeout,
            keep_versions=10**6,
        ),
    )
    learner.start()
    if job.wait_for:
        learner.wait_for_learners(job.wait_for, timeout=300)
    g = torch.Generator().manual_seed(s.seed + 1000 * job.incarnation + job.slot)
    fd = os.open(_log(job, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for _ in range(job.start_step, cs.steps):
        t_train = time.perf_counter()
        ids = rows[torch.randint(0, rows.shape[0], (s.batch,), generator=g)]
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = time.perf_counter()
        learner.step(int(ids.numel()))
        os.write(fd, f"{ids.numel()} {time.perf_counter() - t:.6f} {t - t_train:.6f}\n"
                 .encode())
        if cs.step_sleep:
            time.sleep(cs.step_sleep)
    os.close(fd)
    _log(job, "closing").touch()
    learner.close()


def _event_line(event: Any) -> str:
    from gradientmail import events as ev

    if isinstance(event, ev.SnapshotPublished):
        return f"pub {event.round} {event.steps} {event.tokens}\n"
    if isinstance(event, ev.PublishFailed):
        return f"fail {event.round}\n"
    if isinstance(event, ev.PublishCancelled):
        return f"cancel {event.round}\n"
    if isinstance(event, ev.ContributionDropped):
        kind = (event.reason.split() or ["?"])[0].strip(":,")
        return f"drop {event.round} {event.learner} {kind}\n"
    return ""


def _incarnation_logs(workdir: Path, run: str, slot: int) -> list[tuple[int, Path]]:
    paths = workdir.glob(f"{run}-{slot}-*.log")
    return sorted((int(p.stem.rsplit("-", 1)[1]), p) for p in paths)


def losses(workdir: Path, run: str, box: Path, fragments: int) -> dict[str, Any]:
    """Where the tokens trained but not committed went, as token counts (per-fragment
    counts over P, like goodput): `killed_tail` / `closed_tail` were trained after the
    incarnation's last committed contribution of a fragment; `killed_before` /
    `closed_before` before it, yet counted in no commit; plus the events seen. A kill
    between `step()` and its log line puts one step in a commit that the log lacks, so a
    killed incarnation's figures may be off by one step's tokens."""
    from collections import Counter

    records = conv.records_of(box)
    out: dict[str, Any] = {"killed_tail": 0.0, "killed_before": 0.0, "closed_tail": 0.0,
                           "closed_before": 0.0}
    seen: Counter[str] = Counter()
    slots = sorted({int(p.name.split("-")[1]) for p in workdir.glob(f"{run}-*-*.log")})
    for slot in slots:
        incs = _incarnation_logs(workdir, run, slot)
        last = max(i for i, _ in incs)
        for inc, path in incs:
            tokens = [int(line.split()[0]) for line in path.read_text().splitlines()
                      if len(line.split()) == 3]  # a line cut short by a kill is no step
            mine: set[int] = set()
            events = path.with_suffix(".events")
            for line in (events.read_text().splitlines() if events.exists() else []):
                word, *rest = line.split()
                if word == "pub":
                    mine.add(int(rest[0]))
                elif word == "drop":
                    seen[f"dropped ({rest[2]})"] += 1
                else:
                    seen[f"{word}ed" if word == "cancel" else "failed"] += 1
            kind = "killed" if inc < last else "closed"
            for f in range(fragments):
                parts = [p for rec in records if rec.fragment == f and rec.round in mine
                         for p in rec.participants if p.learner == f"learner-{slot}"]
                committed = sum(p.tokens for p in parts)
                at = max((p.local_step for p in parts), default=0)
                tail = sum(tokens[at:])
                out[f"{kind}_tail"] += tail / fragments
                out[f"{kind}_before"] += (sum(tokens) - committed - tail) / fragments
    out["events"] = dict(sorted(seen.items()))
    return out


def _steps_logged(workdir: Path, run: str, slot: int) -> list[tuple[int, float, float]]:
    """(tokens, seconds in step(), seconds training) per step of the slot."""
    out = []
    for path in sorted(workdir.glob(f"{run}-{slot}-*.log")):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:  # a line cut short by a kill is not a step
                out.append((int(parts[0]), float(parts[1]), float(parts[2])))
    return out


def _newest_closer(box: Path) -> str | None:
    from gradientmail.mailbox import LocalMailbox
    from gradientmail.run.protocol import Exchange

    async def go() -> str | None:
        ex = Exchange(LocalMailbox(box))
        newest = await ex.newest_round()
        rec = await ex.read_round(newest) if newest >= 0 else None
        return rec.closer if rec is not None else None

    return asyncio.run(go())


def run_job(cs: ChaosSettings, workdir: Path, faults: bool) -> dict[str, Any]:
    """One run of M learner slots to completion, with the chaos monkey when `faults`."""
    run = "faults" if faults else "clean"
    box = workdir / run
    ctx = conv.worker_context()
    rng = random.Random(cs.seed)
    procs: dict[int, Any] = {}
    incarnation = dict.fromkeys(range(cs.learners), 0)
    down_until: dict[int, float] = {}
    kills: list[dict[str, Any]] = []

    def start(slot: int, wait_for: int = 0) -> None:
        done = len(_steps_logged(workdir, run, slot))
        job = SlotJob(cs, slot, incarnation[slot], done, str(workdir), str(box), wait_for)
        procs[slot] = ctx.Process(target=_slot_worker, args=(job,), daemon=True)
        procs[slot].start()

    t0 = time.monotonic()
    for slot in range(cs.learners):
        start(slot, wait_for=cs.learners)
    while not all(_steps_logged(workdir, run, i) for i in range(cs.learners)):
        time.sleep(0.05)
        dead = [i for i, p in procs.items() if not p.is_alive()]
        if dead or time.monotonic() - t0 > 600:
            raise SystemExit(f"{run}: learners {dead} died before their first step, or "
                             "the learners did not start within 600 s; see their output")
    next_kill = time.monotonic() + cs.kill_every
    while True:
        now = time.monotonic()
        for slot, t in list(down_until.items()):
            if now >= t:
                del down_until[slot]
                incarnation[slot] += 1
                start(slot)
        for slot, p in procs.items():
            if not p.is_alive() and p.exitcode not in (0, None) and slot not in down_until:
                raise SystemExit(f"{run}: learner-{slot} exited with {p.exitcode}")
        if not down_until and not any(p.is_alive() for p in procs.values()):
            break
        if faults and now >= next_kill:
            next_kill = now + cs.kill_every
            # A victim is a learner that is training: it has stepped and is not closing.
            training = [i for i, p in procs.items() if p.is_alive()
                        and (workdir / f"{run}-{i}-{incarnation[i]}.log").exists()
                        and not (workdir / f"{run}-{i}-{incarnation[i]}.closing").exists()]
            closer = _newest_closer(box)
            closer_slot = int(closer.rsplit("-", 1)[1]) if closer and "-" in closer else -1
            if training:
                aim = rng.random() < 0.5 and closer_slot in training
                victim = closer_slot if aim else rng.choice(training)
                procs[victim].kill()
                procs[victim].join()
                down_until[victim] = time.monotonic() + cs.down
                kills.append({"slot": victim, "at": now - t0, "closer": victim == closer_slot})
        time.sleep(0.05)
    wall = time.monotonic() - t0
    steps = [_steps_logged(workdir, run, i) for i in range(cs.learners)]
    trained = sum(tok for log in steps for tok, _, _ in log)
    stall = max((sec for log in steps for _, sec, _ in log), default=0.0)
    # One step: the median training time of a step (without step()).
    one_step = statistics.median([t for log in steps for _, _, t in log] or [0.0])
    figures = audit(box, cs)
    return {"run": run, "wall": wall, "kills": kills, "trained": trained, "stall": stall,
            "one_step": one_step,
            "goodput": figures["committed"] / max(trained, 1),
            "losses": losses(workdir, run, box, cs.fragments), **figures}


def audit(box: Path, cs: ChaosSettings) -> dict[str, Any]:
    """Check the run's records and payloads; its figures (`problems` lists what is lost)."""
    import numpy as np

    from gradientmail.algorithms.registry import algorithm_from_json
    from gradientmail.algorithms.rounds import grace_window
    from gradientmail.errors import GradientmailError
    from gradientmail.mailbox import LocalMailbox
    from gradientmail.run.keyspace import round_key
    from gradientmail.run.protocol import Exchange
    from gradientmail.run.replica import Replica

    async def go() -> dict[str, Any]:
        mailbox = LocalMailbox(box)
        ex = Exchange(mailbox)
        manifest = await ex.read_manifest()
        assert manifest is not None, f"no run in {box}"
        alg = algorithm_from_json(dict(manifest.algorithm))
        schedule = alg.schedule_for(len(manifest.plan))
        replica = Replica(ex, manifest, alg)  # follows every step: checks each digest
        records = await ex.rounds_after(-1)
        keys = await mailbox.list("rounds/")
        problems: list[str] = []
        if keys != [round_key(i) for i in range(len(records))]:
            problems.append(f"records not gap-free: {len(keys)} keys, {len(records)} in order")
        versions: dict[int, int] = {}
        committed, grace = 0, 0.0
        for i, rec in enumerate(records):
            committed += sum(p.tokens for p in rec.participants)
            grace = max(grace, grace_window(rec.estimates, schedule, i))
            versions[rec.fragment] = versions.get(rec.fragment, 0) + 1
            if rec.fragment != schedule.fragment_of(i) or rec.version != versions[rec.fragment]:
                problems.append(f"round {i}: fragment {rec.fragment} version {rec.version}")
            for ref in rec.payload_refs():
                try:
                    blob = await ex.store.fetch_payload(ref)
                except GradientmailError as exc:
                    problems.append(f"round {i}: {exc}")
                    continue
                if blob is None:
                    problems.append(f"round {i}: payload {ref.key} missing")
            try:
                state = await replica.at(rec.fragment, rec)
            except GradientmailError as exc:
                problems.append(f"round {i}: {exc}")
                continue
            if state is not None and not all(
                    np.isfinite(t.to_numpy()).all() for t in state.theta.values()):
                problems.append(f"round {i}: theta not finite")
        return {"rounds": len(records), "problems": problems, "grace": grace,
                "committed": committed / len(manifest.plan)}

    out = asyncio.run(go())
    return out


def _eval_final(box: Path, workdir: Path, s: conv.Settings, val: Any) -> float:
    import torch

    vocab = int(torch.load(workdir / "vocab.pt"))
    newest = len(conv.records_of(box)) - 1
    model = conv.load_into(conv.build_model(s, vocab), conv.committed_state(box, newest))
    return conv.evaluate(model, val)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="N=150, a kill every 8 s")
    size.add_argument("--smoke", action="store_true", help="tiny sizes for CI (seconds)")
    ap.add_argument("--learners", type=int, default=None, help="learner slots (M)")
    ap.add_argument("--steps", type=int, default=None, help="steps per learner slot")
    ap.add_argument("--kill-every", type=float, default=None, help="seconds between kills")
    ap.add_argument("--down", type=float, default=None, help="seconds before a restart")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default=str(RESULTS), help="markdown file to append to")
    args = ap.parse_args(argv)
    preset = "smoke" if args.smoke else "quick" if args.quick else "full"
    cs = dataclasses.replace(PRESETS[preset], seed=args.seed)
    for field, value in (("learners", args.learners), ("steps", args.steps),
                         ("kill_every", args.kill_every),
                         ("down", args.down)):
        if value is not None:
            cs = dataclasses.replace(cs, **{field: value})

    import torch

    workdir = Path(tempfile.mkdtemp(prefix="gm-chaos-"))
    vocab, _ = conv.prepare_data(cs.model, workdir)
    val = torch.load(workdir / "val.pt")
    print(f"workdir {workdir}; {cs.learners} learners x {cs.steps} steps, a kill every "
          f"{cs.kill_every:g} s, restart after {cs.down:g} s", flush=True)
    runs = []
    for faults in (True, False):
        r = run_job(cs, workdir, faults)
        r["eval"] = _eval_final(workdir / r["run"], workdir, cs.model, val)
        runs.append(r)
        print(f"{r['run']}: {len(r['kills'])} kills, goodput {r['goodput']:.3f}, "
              f"eval {r['eval']:.4f}, {r['wall']:.0f}s", flush=True)
    text = report(cs, runs, preset, sys.argv[1:] if argv is None else argv, vocab)
    print(text)
    with open(args.results, "a") as f:
        f.write(text + "\n")


def _loss_words(r: dict[str, Any]) -> str:
    lo, trained = r["losses"], max(r["trained"], 1)
    parts = [f"{lo[k] / trained:.1%} {words}" for k, words in (
        ("killed_tail", "trained by killed learners after their last committed contribution"),
        ("killed_before", "trained by killed learners before it but in no commit"),
        ("closed_tail", "trained by closing learners after their last committed contribution"),
        ("closed_before", "trained by closing learners before it but in no commit"),
    )]
    events = ", ".join(f"{n} {k}" for k, n in lo["events"].items()) or "none"
    return "; ".join(parts) + f" (publishes and contributions: {events})"


def report(cs: ChaosSettings, runs: list[dict[str, Any]], preset: str, command: list[str],
           vocab: int) -> str:
    faulty, clean = runs
    rate = 60.0 / cs.kill_every
    lines = ["| run | kills (of the closer) | rounds | tokens trained | goodput | longest "
             "step() | largest grace window | commits lost | eval loss | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lost = len(r["problems"])
        lines.append(
            f"| {'with faults' if r is faulty else 'without faults'} | {len(r['kills'])} "
            f"({sum(k['closer'] for k in r['kills'])}) | {r['rounds']} | {r['trained']:,} | "
            f"{r['goodput']:.1%} | {r['stall'] * 1e3:.0f} ms | {r['grace']:.2f} s | {lost} | "
            f"{r['eval']:.4f} | {r['wall']:.0f} |")
    limit = faulty["grace"] + cs.poll
    goals = [
        f"goodput >= 95% at {rate:.1f} kills per minute ({rate:.1f}x the goal's rate of one "
        f"per minute): {faulty['goodput']:.1%} "
        f"({'met' if faulty['goodput'] >= 0.95 else 'NOT met'}); without faults "
        f"{clean['goodput']:.1%}, so the faults cost "
        f"{1 - faulty['goodput'] / max(clean['goodput'], 1e-9):.1%} of the committed tokens",
        *(f"where the {r['run']} run's lost tokens went: {_loss_words(r)}" for r in runs),
        f"no step() stall longer than the grace window plus one poll ({limit:.2f} s): "
        f"longest {faulty['stall']:.3f} s ({'met' if faulty['stall'] <= limit else 'NOT met'})",
        f"no surviving step stalls beyond one step (the median training step, "
        f"{faulty['one_step'] * 1e3:.0f} ms): longest step() {faulty['stall'] * 1e3:.0f} ms "
        f"({'met' if faulty['stall'] <= faulty['one_step'] else 'NOT met'})",
        f"commits lost: {len(faulty['problems'])} "
        f"({'met' if not faulty['problems'] else 'NOT met: ' + '; '.join(faulty['problems'][:3])})",
        f"final eval loss with faults / without: {faulty['eval'] / clean['eval']:.4f} "
        f"(perplexity {math.exp(faulty['eval']):.2f} vs {math.exp(clean['eval']):.2f})",
    ]
    s = cs.model
    header = (
        f"\n## goodput under failures (chaos) — {datetime.date.today()}\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs), "
        f"torch threads 1 per process. {cs.learners} learner processes on a local-directory "
        f"mailbox, GPT-2 {s.n_layer}×{s.n_embd} (vocabulary {vocab}), batch {s.batch}×"
        f"{s.block}, {cs.steps} steps per learner slot; Decoupled DiLoCo defaults with "
        f"H = {cs.sync_every}, P = {cs.fragments}, flush_on_close; poll {cs.poll:g} s, "
        f"leases {cs.lease_every:g} s / {cs.lease_timeout:g} s. A SIGKILL every "
        f"{cs.kill_every:g} s (half aimed at the newest record's closer), restart after "
        f"{cs.down:g} s; then the same run without faults. Preset `{preset}`, seed "
        f"{cs.seed}.\nCommand: `{' '.join(['python', 'benchmarks/chaos.py', *command])}`\n\n"
    )
    return header + "\n".join(lines) + "\n\n" + "\n".join(f"- {g}" for g in goals)


if __name__ == "__main__":
    main()
