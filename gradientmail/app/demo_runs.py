"""The demo's settings and one of its runs: the learner processes that spend a shared step
budget, and the committed model sampled on the held-out blocks as they train.

`gradientmail.app.demo` prepares the data and runs the demo; `gradientmail.app.demo_link`
starts the same learners inside network namespaces (`_run`'s `start`); the worker
processes enter through `train`. torch is imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from gradientmail.errors import ConfigError, GradientmailError

__all__ = ["EVAL_EVERY", "LABELS", "LINK_DEFAULTS", "LINK_LABELS", "LINK_SYSTEMS", "SYSTEMS",
           "DemoConfig", "Workers", "train"]

#: The runs the demo compares, in the order it runs them.
SYSTEMS = ("standard", "decoupled")
#: The runs of a demo behind shaped links (`DemoConfig.link`).
LINK_SYSTEMS = ("standard", "standard-closer", "decoupled")
LABELS = {
    "standard": "standard DiLoCo (a barrier each round)",
    "decoupled": "Decoupled DiLoCo (quorum 1, 2 fragments)",
}
#: Behind links the closer's place is what tells the standard runs apart; Decoupled runs
#: as the README advises between sites, beside a standalone closer (closed by a learner,
#: each round's closer pulls the other deltas through its own link: at 20 Mbit/s the
#: rounds fall behind learners that step as fast as the demo's).
LINK_LABELS = {
    "standard": "standard DiLoCo, closed by a learner",
    "standard-closer": "standard DiLoCo, closer next to the bucket",
    "decoupled": "Decoupled DiLoCo, closer next to the bucket",
}
#: The runs behind links that a `gradientmail sync` next to the bucket closes.
CLOSED_NEXT_TO_THE_BUCKET = frozenset({"standard-closer", "decoupled"})
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
    from gradientmail.integration.textdata import tiny_gpt2

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
    from gradientmail.learner.options import LearnerOptions
    from gradientmail.learner.runtime import Learner

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
