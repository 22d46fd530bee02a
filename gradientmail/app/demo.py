"""`gradientmail demo`: what Decoupled DiLoCo is for, on one machine.

The main job on the embedded default mailbox. N learner processes train a tiny GPT-2 on
the standard library's Python files (every machine has them) or on `--data`, sharing
nothing but a local directory, and one of them steps `--slow` times slower than the
others, as a learner on an older GPU or a busier machine would. They do it twice, on the
same token budget (N × S batches in all): as standard DiLoCo (a barrier every round: every
learner waits for the slow one) and as Decoupled DiLoCo (quorum 1, no barrier: the fast
learners train on, and the slow one contributes what it has when it has it). The held-out
loss of each run's committed model is sampled as it trains; the table and the plot set
them side by side against wall-clock time.

With `link` (`--link 20mbit`) the learners are sites behind slow links instead: each runs
in its own network namespace behind a veth shaped to that rate both ways, the mailbox is
an S3 bucket (moto's server in the root namespace, unshaped), and the runs are standard
DiLoCo closed by its learners, standard DiLoCo closed by `gradientmail sync` next to the
bucket, and Decoupled DiLoCo (`LINK_SYSTEMS`); the table adds the bytes that crossed each
learner's link. That needs root (or CAP_NET_ADMIN) and the `dev` extra's moto
(`gradientmail.app.demo_link`).

torch and transformers are imported inside the functions: `import gradientmail.app.demo` is
free, and the worker processes import what they need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from gradientmail.errors import ConfigError, GradientmailError

__all__ = ["LINK_SYSTEMS", "SYSTEMS", "DemoConfig", "run_demo"]

#: Text used for the tokenizer and training data: enough for the default run, small
#: enough that tokenizing takes seconds on a laptop.
TEXT_BUDGET = 6_000_000
#: The runs the demo compares, in the order it runs them.
SYSTEMS = ("standard", "decoupled")
#: The runs of a demo behind shaped links (`DemoConfig.link`).
LINK_SYSTEMS = ("standard", "standard-closer", "decoupled")
LABELS = {
    "standard": "standard DiLoCo (a barrier each round)",
    "decoupled": "Decoupled DiLoCo (quorum 1, 2 fragments)",
}
#: Behind links the closer's place is what tells the standard runs apart.
LINK_LABELS = {
    "standard": "standard DiLoCo, closed by a learner",
    "standard-closer": "standard DiLoCo, closer next to the bucket",
    "decoupled": LABELS["decoupled"],
}
#: What `gradientmail demo --link` changes in the defaults: every learner alike (the link is
#: what it shows), and fewer steps, for three runs in about the time of the demo's two.
LINK_DEFAULTS: dict[str, Any] = {"slow": 1.0, "steps": 128}
#: Seconds between samples of a run's committed model on the held-out blocks.
EVAL_EVERY = 5.0


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """`learners` processes; `steps` per learner of standard DiLoCo, so each run trains
    learners × steps batches in all; the last learner's steps take `slow` times as long
    (1: all alike); `systems` picks the runs (`SYSTEMS`, or `LINK_SYSTEMS` with `link`;
    empty: all of them); `link` (e.g. "20mbit", "none") puts every learner behind a link
    of that rate to an S3 bucket."""

    learners: int = 4
    steps: int = 160
    slow: float = 2.0
    mailbox: str | None = None
    data: str | None = None
    batch: int = 8
    block: int = 64
    vocab: int = 4096
    lr: float = 1e-3
    sync_every: int = 16
    seed: int = 0
    systems: tuple[str, ...] = ()
    #: Overrides of the DiLoCo fields of both runs, e.g. (("outer_lr", 1.0),).
    diloco: tuple[tuple[str, Any], ...] = ()
    link: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.learners <= 64:
            raise ConfigError(f"--learners {self.learners}: need 1 to 64 learners")
        if self.steps < 1:
            raise ConfigError(f"--steps {self.steps}: need at least 1 step")
        if not (math.isfinite(self.slow) and 1.0 <= self.slow <= 100.0):
            raise ConfigError(f"--slow {self.slow}: need a factor from 1 (none) to 100")
        offered = SYSTEMS if self.link is None else LINK_SYSTEMS
        if not self.systems:
            object.__setattr__(self, "systems", offered)  # frozen: the default, filled in
        unknown = [x for x in self.systems if x not in offered]
        if unknown:
            raise ConfigError(f"systems={list(self.systems)}: pick from {list(offered)}"
                              + ("" if self.link else " (standard-closer needs a link)"
                                 if "standard-closer" in unknown else ""))
        if self.link is not None:
            from gradientmail.app.links import parse_rate

            parse_rate(self.link)
            if self.mailbox is not None:
                raise ConfigError(
                    f"--mailbox {self.mailbox} with --link {self.link}: behind links the "
                    "mailbox is an S3 bucket the demo serves itself (moto); leave --mailbox "
                    "out")
        for system in self.systems:
            _algorithm(self, system)  # the DiLoCo overrides are checked now, not in workers

    @property
    def budget(self) -> int:
        """Optimizer steps of all learners together, in each run."""
        return self.learners * self.steps


@dataclasses.dataclass(frozen=True)
class _Job:
    """What one worker process does."""

    system: str
    name: str
    index: int
    config: DemoConfig
    workdir: str
    mailbox: str
    #: The S3 endpoint of a demo behind links (None: `mailbox` is a directory).
    endpoint: str | None = None

    @property
    def slow(self) -> bool:
        return self.index == self.config.learners - 1 and self.config.slow > 1.0


def _algorithm(cfg: DemoConfig, system: str) -> Any:
    """Standard DiLoCo (every learner in every round, weighted mean, a barrier), or the
    Decoupled defaults with two fragments (a round every H/2 steps, quorum 1, RDA)."""
    from gradientmail.algorithms.diloco import DiLoCo

    if system in ("standard", "standard-closer"):
        return DiLoCo.standard(cfg.sync_every, cfg.learners, **dict(cfg.diloco))
    fields: dict[str, Any] = {"sync_every": cfg.sync_every,
                              "fragments": min(2, cfg.sync_every)}
    fields.update(dict(cfg.diloco))
    return DiLoCo(**fields)


def _model(vocab: int, block: int) -> Any:
    from gradientmail.app.textdata import tiny_gpt2

    return tiny_gpt2(vocab, n_layer=2, n_embd=128, n_head=4, n_positions=block, seed=0)


def _worker(job: _Job, progress: Any, spent: Any) -> None:
    """A learner in a process of `multiprocessing`; reports each step on `progress` (a
    queue); `spent` is the run's shared budget counter (`train`)."""
    train(job, progress.put, lambda: _take_step(spent, job.config.budget))


def train(job: _Job, report: Callable[[tuple[str, int, float, int, int]], None],
          take_step: Callable[[], bool]) -> None:
    """A learner in its own process; reports (name, step, loss, rounds seen, bytes sent)
    after each step, and step -1 when it has closed. Standard DiLoCo's learners train
    `steps` steps each; Decoupled ones take steps from the run's budget (`take_step`, a
    counter shared by the run's learners) until it is gone, so the fast learners train
    more of it."""
    import torch

    from gradientmail.adapters import TorchAdapter
    from gradientmail.events import Event, SnapshotPublished
    from gradientmail.learner.runtime import Learner, LearnerOptions

    torch.set_num_threads(1)
    cfg = job.config
    data = torch.load(os.path.join(job.workdir, "train.pt"))
    rows = data[job.index :: cfg.learners]
    model = _model(int(torch.load(os.path.join(job.workdir, "vocab.pt"))), cfg.block)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    sent = [0]

    def on_event(e: Event) -> None:
        if isinstance(e, SnapshotPublished):
            sent[0] += e.bytes

    mailbox: Any = job.mailbox
    if job.endpoint is not None:
        from gradientmail.mailbox.url import open_mailbox

        mailbox = open_mailbox(job.mailbox, endpoint_url=job.endpoint)
    learner = Learner(TorchAdapter(model), _algorithm(cfg, job.system), mailbox,
                      job.name, on_event=on_event,
                      options=LearnerOptions(poll_interval=0.2, lease_every=5.0,
                                             lease_timeout=20.0))
    learner.start()
    # Both runs start their learners together, so that neither run is timed from a
    # learner that trained alone while the others were starting.
    learner.wait_for_learners(cfg.learners)
    g = torch.Generator().manual_seed(cfg.seed + 1 + job.index)
    shared = job.system == "decoupled"
    step = 0
    while take_step() if shared else step < cfg.steps:
        t0 = time.perf_counter()
        ids = rows[torch.randint(0, rows.shape[0], (cfg.batch,), generator=g)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if job.slow:
            time.sleep((cfg.slow - 1.0) * (time.perf_counter() - t0))
        learner.step(int(ids.numel()), float(loss.detach()))
        step += 1
        report((job.name, step, float(loss.detach()), learner.rounds_seen, sent[0]))
    learner.close()
    report((job.name, -1, 0.0, -1, sent[0]))


def _take_step(spent: Any, budget: int) -> bool:
    """Take one step of the run's budget, if any is left (a shared counter)."""
    with spent.get_lock():
        if spent.value >= budget:
            return False
        spent.value += 1
        return True


def _prepare(cfg: DemoConfig, workdir: Path, out: TextIO) -> tuple[int, int, int]:
    """Tokenizer and token blocks for training and evaluation, saved for the workers."""
    import torch

    from gradientmail.app.textdata import (
        read_budget,
        read_texts,
        stdlib_corpus,
        token_blocks,
        train_tokenizer,
    )

    if cfg.data:
        from gradientmail.app.textdata import held_out

        docs = read_texts([cfg.data])
        train = [d for i, d in enumerate(docs) if not held_out(f"doc-{i}", 0.05)]
        val = [d for i, d in enumerate(docs) if held_out(f"doc-{i}", 0.05)] or docs[-1:]
        source = cfg.data
    else:
        train = read_budget(stdlib_corpus("train"), TEXT_BUDGET)
        val = read_budget(stdlib_corpus("val"), TEXT_BUDGET // 10)
        source = "the standard library's .py files"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gradientmail"
    t0 = time.perf_counter()
    tok = train_tokenizer(train, vocab_size=cfg.vocab, cache_dir=cache / "tokenizers")
    train_ids = token_blocks(tok, train, cfg.block)
    val_ids = token_blocks(tok, val, cfg.block)[:256]
    vocab = len(tok)
    torch.save(train_ids, workdir / "train.pt")
    torch.save(val_ids, workdir / "val.pt")
    torch.save(vocab, workdir / "vocab.pt")
    print(
        f"data: {source}: {train_ids.numel():,} training tokens, {val_ids.numel():,} held "
        f"out; BPE vocabulary {vocab} ({time.perf_counter() - t0:.1f}s)",
        file=out,
    )
    return vocab, int(train_ids.numel()), int(val_ids.numel())



def _evaluate(model: Any, val: Any) -> float:
    import torch

    model.eval()
    losses = []
    with torch.no_grad():
        for chunk in val.split(32):
            losses.append(float(model(input_ids=chunk, labels=chunk).loss) * chunk.shape[0])
    return float(sum(losses) / int(val.shape[0]))


def _committed_model(mailbox: str, vocab: int, block: int,
                     **options: Any) -> tuple[Any, int] | None:
    """The run's newest committed model (what `gradientmail export` writes) and how many
    rounds were committed; None before the run exists. `options`: the mailbox's."""
    from gradientmail.run.committed import read_committed

    try:
        committed = read_committed(mailbox, **options)
    except ConfigError:
        return None
    model = _model(vocab, block)
    committed.load_into(model)
    return model, committed.rounds_committed


def run_demo(
    cfg: DemoConfig, out: TextIO | None = None, as_json: bool = False
) -> dict[str, Any]:
    """Run the demo and return its summary (also printed on `out`, default stdout, as a
    table or JSON; progress goes to `out`, or to stderr with JSON)."""
    import torch

    out = sys.stdout if out is None else out
    t_start = time.perf_counter()
    log = sys.stderr if as_json else out
    if cfg.link is not None:
        from gradientmail.app.links import check_requirements

        missing = check_requirements()
        if missing is not None:
            raise ConfigError(f"--link {cfg.link} needs {missing}; or run without --link")
    workdir = Path(tempfile.mkdtemp(prefix="gradientmail-demo-"))
    root = Path(cfg.mailbox) if cfg.mailbox else workdir / "mailbox"
    if cfg.mailbox and root.exists() and any(root.iterdir()):
        raise ConfigError(
            f"--mailbox {cfg.mailbox} is not empty; the demo starts new runs: give an empty "
            "or new directory"
        )
    runs: dict[str, dict[str, Any]] = {}
    summary: dict[str, Any] = {
        "learners": cfg.learners,
        "steps": cfg.steps,
        "slow": cfg.slow,
        "mailbox": str(root),
    }
    if cfg.link is None:
        print(f"mailboxes: {root}/<run>  (watch one: gradientmail status "
              f"{root / cfg.systems[0]})", file=log)
    vocab, _, _ = _prepare(cfg, workdir, log)
    val = torch.load(workdir / "val.pt")
    with contextlib.ExitStack() as stack:
        site = None
        if cfg.link is not None:
            from gradientmail.app.demo_link import Site

            site = stack.enter_context(Site(cfg, workdir, log))
            summary.update(mailbox=site.root, link=cfg.link)
        for system in cfg.systems:
            if site is None:
                runs[system] = _run(system, cfg, workdir, str(root / system), vocab, val,
                                    log)
            else:
                runs[system] = site.run(system, vocab, val)
    if site is not None:
        summary["leftovers"] = site.leftovers
    target = runs[cfg.systems[0]]["eval_loss"]
    for r in runs.values():
        r["seconds_to_target"] = _time_to(r["curve"], target)
    summary.update(runs=runs, target_loss=target, seconds=time.perf_counter() - t_start)
    plot = _plot(runs, target, workdir, cfg.link)
    if plot:
        summary["plot"] = plot
    if as_json:
        print(json.dumps(summary, indent=2), file=out)
    else:
        print(_table(summary), file=out)
    return summary


@dataclasses.dataclass
class Workers:
    """A run's learner processes as `_run` watches them: `progress` (a queue of what
    `train` reports), `alive(i)` (whether learner i may still report), `join()` (after
    the last report) and `failure(names)`: what to say when some exited early; `shared`
    is held for as long as the run: what the processes share (a spawned process opens the
    budget counter's semaphore by name after `start()` returns, so it must outlive it)."""

    progress: Any
    alive: Callable[[int], bool]
    join: Callable[[], None]
    failure: Callable[[list[str]], str]
    shared: Any = None


def _spawn(jobs: list[_Job]) -> Workers:
    """The learners as `multiprocessing` processes of this machine's namespace."""
    ctx = mp.get_context("spawn")
    progress = ctx.Queue()
    spent = ctx.Value("q", 0)
    procs = [ctx.Process(target=_worker, args=(j, progress, spent), daemon=True)
             for j in jobs]
    for p in procs:
        p.start()

    def join() -> None:
        for p in procs:
            p.join(timeout=60)

    return Workers(progress, lambda i: procs[i].is_alive(), join,
                   lambda dead: f"demo worker(s) {dead} of the {jobs[0].system} run exited "
                   "early; see their output above", shared=spent)


def _run(system: str, cfg: DemoConfig, workdir: Path, mailbox: str, vocab: int, val: Any,
         log: TextIO, *, start: Callable[[list[_Job]], Workers] = _spawn,
         endpoint: str | None = None, label: str | None = None) -> dict[str, Any]:
    """One run of `system`: its learners (`start`ed) to the end of the budget, its
    committed model (in `mailbox`, at `endpoint` for S3) sampled on the held-out blocks
    every `EVAL_EVERY` seconds."""
    jobs = [_Job(system, f"learner-{i}", i, cfg, str(workdir), mailbox, endpoint)
            for i in range(cfg.learners)]
    label = label or LABELS[system]
    options = {} if endpoint is None else {"endpoint_url": endpoint}
    print(f"{label}: {cfg.learners} learners"
          + (f", {jobs[-1].name} {cfg.slow:g}x slower" if jobs[-1].slow else ""), file=log)
    workers = start(jobs)
    progress = workers.progress
    steps = {j.name: 0 for j in jobs}
    losses: dict[str, float] = {}
    sent: dict[str, int] = {}
    rounds = -1
    done: set[str] = set()
    curve: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    next_eval = t0 + EVAL_EVERY
    last_print = 0.0
    tty = log.isatty()
    while len(done) < len(jobs):
        try:
            name, step, loss, r, nbytes = progress.get(timeout=1.0)
        except queue.Empty:
            dead = [j.name for i, j in enumerate(jobs)
                    if not workers.alive(i) and j.name not in done]
            if dead:
                raise GradientmailError(workers.failure(dead)) from None
            continue
        sent[name] = nbytes
        if step < 0:
            done.add(name)
            continue
        steps[name], losses[name] = step, loss
        rounds = max(rounds, r)
        now = time.perf_counter()
        if now >= next_eval:
            sampled = _committed_model(mailbox, vocab, cfg.block, **options)
            if sampled is not None:
                curve.append((now - t0, _evaluate(sampled[0], val)))
            next_eval = time.perf_counter() + EVAL_EVERY
        if now - last_print > (0.5 if tty else 5.0):
            last_print = now
            mean = sum(losses.values()) / len(losses) if losses else float("nan")
            line = (f"  {system}: steps {sum(steps.values())}/{cfg.budget} "
                    f"({', '.join(str(steps[j.name]) for j in jobs)})  rounds committed "
                    f"{rounds + 1}  training loss {mean:.3f}  {now - t0:.0f}s")
            print(("\r" + line) if tty else line, end="" if tty else "\n", file=log,
                  flush=True)
    workers.join()
    seconds = time.perf_counter() - t0
    if tty:
        print(file=log)
    final = _committed_model(mailbox, vocab, cfg.block, **options)
    assert final is not None  # every learner committed rounds into it
    model, n_rounds = final
    loss_final = _evaluate(model, val)
    # The same blocks as every sample: the first run's final loss is the target, reached
    # by that run at its end.
    curve.append((seconds, loss_final))
    return {
        "label": label,
        "eval_loss": loss_final,
        "perplexity": math.exp(loss_final),
        "rounds_committed": n_rounds,
        "steps_per_learner": [steps[j.name] for j in jobs],
        "tokens_trained": sum(steps.values()) * cfg.batch * cfg.block,
        "bytes_sent_per_learner": sum(sent.values()) / cfg.learners,
        "seconds": seconds,
        "curve": curve,
    }


def _time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first sampled time at which the held-out loss was at most `target`."""
    return next((t for t, loss in curve if loss <= target), None)


def _table(s: dict[str, Any]) -> str:
    runs = s["runs"]
    link = s.get("link")
    rows = [("run", "held-out loss", "wall s", "to target", "steps per learner",
             "rounds", "MB mailed/learner")
            + (() if link is None else ("link", "MB through each link"))]
    for r in runs.values():
        reach = r["seconds_to_target"]
        rows.append((
            r["label"], f"{r['eval_loss']:.3f}", f"{r['seconds']:.0f}",
            "-" if reach is None else f"{reach:.0f}s",
            ",".join(str(n) for n in r["steps_per_learner"]), str(r["rounds_committed"]),
            f"{r['bytes_sent_per_learner'] / 1e6:.1f}",
        ) + (() if link is None else (
            link, "/".join(f"{b / 1e6:.1f}" for b in r["link_bytes_per_learner"]))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    first = next(iter(runs.values()))
    tail = [
        "",
        f"{s['learners']} learners, {s['learners'] * s['steps']} steps in all per run "
        f"({first['tokens_trained']:,} tokens)"
        + (f"; learner-{s['learners'] - 1} steps {s['slow']:g}x slower in "
           + ("both" if len(runs) == 2 else "every run") if s["slow"] > 1 else "")
        + f". Target: the first run's final held-out loss, {s['target_loss']:.3f}.",
    ]
    if link is not None:
        tail += _link_tail(s)
    elif {"standard", "decoupled"} <= set(runs):
        a, b = runs["standard"], runs["decoupled"]
        if b["seconds_to_target"] is not None:
            tail.append(
                f"Decoupled DiLoCo reached it after {b['seconds_to_target']:.0f}s, standard "
                f"DiLoCo after {a['seconds']:.0f}s: {a['seconds'] / b['seconds_to_target']:.2f}x "
                "sooner, the fast learners never waiting for the slow one.")
        else:
            tail.append("Decoupled DiLoCo did not reach it in this run (its samples: "
                        f"{', '.join(f'{v:.3f}' for _, v in b['curve'])}).")
    tail.append(f"Total {s['seconds']:.0f}s.")
    if "plot" in s:
        tail.append(f"Held-out loss against wall-clock: {s['plot']}")
    return "\n".join(lines + tail)


def _link_tail(s: dict[str, Any]) -> list[str]:
    """The lines a demo behind links adds under its table: the setting and each run's time
    to the target against the first run's."""
    runs = list(s["runs"].values())
    link = ("an unshaped link" if s["link"] == "none"
            else f"a {s['link']} link (tbf, both ways)")
    out = [f"Every learner in its own network namespace behind {link}; the bucket (moto's "
           "S3 server) and the standalone closer in the root namespace, unshaped. MB "
           "through each link: everything that crossed it (the veth's counters), learner-0 "
           "first."]
    for r in runs:
        if "closers" in r:
            out.append(f"{r['label']}: rounds closed by " + ", ".join(
                f"{who} {n}" for who, n in sorted(r["closers"].items())) + ".")
    first = runs[0]
    for r in runs[1:]:
        reach = r["seconds_to_target"]
        out.append(f"{r['label']}: " + (
            f"reached the target after {reach:.0f}s (the first run, which set it: "
            f"{first['seconds']:.0f}s; {first['seconds'] / reach:.2f}x)." if reach else
            "did not reach the target in this run (its samples: "
            f"{', '.join(f'{v:.3f}' for _, v in r['curve'])})."))
    return out


def _plot(runs: dict[str, dict[str, Any]], target: float, workdir: Path,
          link: str | None = None) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs.values():
        if r["curve"]:
            ax.plot([t for t, _ in r["curve"]], [v for _, v in r["curve"]], marker="o",
                    markersize=3, label=r["label"])
    ax.axhline(target, color="grey", linestyle=":", linewidth=1, label="target")
    ax.set_xlabel("wall-clock seconds")
    ax.set_ylabel("held-out loss of the committed model")
    ax.legend()
    ax.set_title("gradientmail demo: one learner slower than the others" if link is None
                 else f"gradientmail demo: every learner behind a {link} link")
    path = workdir / "loss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
