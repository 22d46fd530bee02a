"""`gradientmail demo`: several learners train a small GPT-2 through a local directory.

The main job on the embedded default mailbox. N learner processes (and one learner alone,
the baseline) train a tiny GPT-2 on the standard library's Python files (every machine
has them) or on `--data`; the learners share nothing but a directory. At the end the
committed model and the baseline are evaluated on held-out files.

torch and transformers are imported inside the functions: `import gradientmail.app.demo` is
free, and the worker processes import what they need.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from gradientmail.errors import ConfigError, GradientmailError

__all__ = ["DemoConfig", "run_demo"]

#: Text used for the tokenizer and training data: enough for the default run, small
#: enough that tokenizing takes seconds on a laptop.
TEXT_BUDGET = 6_000_000


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    learners: int = 4
    steps: int = 240
    mailbox: str | None = None
    data: str | None = None
    batch: int = 8
    block: int = 64
    vocab: int = 4096
    lr: float = 1e-3
    sync_every: int = 15
    fragments: int = 1
    seed: int = 0
    #: Overrides of the DiLoCo fields, e.g. (("outer_lr", 1.0),).
    diloco: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.learners <= 64:
            raise ConfigError(f"--learners {self.learners}: need 1 to 64 learners")
        if self.steps < 1:
            raise ConfigError(f"--steps {self.steps}: need at least 1 step")
        if self.fragments > self.sync_every:
            raise ConfigError(
                f"fragments={self.fragments} exceeds sync_every={self.sync_every}"
            )
        _algorithm(self)  # the DiLoCo overrides are checked now, not in every worker


@dataclasses.dataclass(frozen=True)
class _Job:
    """What one worker process does."""

    name: str
    index: int
    config: DemoConfig
    workdir: str
    mailbox: str | None  # None: the baseline, trained alone


def _algorithm(cfg: DemoConfig) -> Any:
    """DiLoCo with every learner in every round and a barrier at each sync: on a few
    hundred steps of a tiny model this beat the decoupled defaults (quorum 1) and plain
    averaging in our runs (benchmarks/RESULTS.md, "demo configurations")."""
    from gradientmail.algorithms.diloco import DiLoCo, WeightedMean

    fields: dict[str, Any] = {
        "sync_every": cfg.sync_every,
        "fragments": cfg.fragments,
        "in_flight": 1,
        "overlap_steps": 0,
        "quorum_size": cfg.learners,
        "merge": WeightedMean(),
    }
    fields.update(dict(cfg.diloco))
    return DiLoCo(**fields)


def _model(vocab: int, block: int) -> Any:
    from gradientmail.app.textdata import tiny_gpt2

    return tiny_gpt2(vocab, n_layer=2, n_embd=128, n_head=4, n_positions=block, seed=0)


def _worker(job: _Job, progress: Any) -> None:
    """A learner (or the baseline) in its own process; reports progress on a queue."""
    import torch

    torch.set_num_threads(1)
    cfg = job.config
    data = torch.load(os.path.join(job.workdir, "train.pt"))
    rows = data[job.index :: max(cfg.learners, 1)] if job.mailbox else data
    model = _model(int(torch.load(os.path.join(job.workdir, "vocab.pt"))), cfg.block)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    learner = None
    sent = [0]
    if job.mailbox is not None:
        from gradientmail.adapters import TorchAdapter
        from gradientmail.events import Event, SnapshotPublished
        from gradientmail.learner.runtime import Learner

        def on_event(e: Event) -> None:
            if isinstance(e, SnapshotPublished):
                sent[0] += e.bytes

        learner = Learner(TorchAdapter(model), _algorithm(cfg), job.mailbox, job.name,
                          poll_interval=0.2, lease_every=5.0, lease_timeout=20.0,
                          on_event=on_event)
        learner.start()
        # Every learner is in every round: start together, or the first would train
        # alone until the others joined.
        learner.wait_for_learners(cfg.learners, timeout=300)
    g = torch.Generator().manual_seed(cfg.seed + 1 + job.index)
    for step in range(cfg.steps):
        idx = torch.randint(0, rows.shape[0], (cfg.batch,), generator=g)
        ids = rows[idx]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rounds = -1
        if learner is not None:
            learner.step(int(ids.numel()), float(loss.detach()))
            rounds = learner.rounds_seen
        progress.put((job.name, step + 1, float(loss.detach()), rounds, sent[0]))
    if learner is not None:
        learner.close()
    else:
        torch.save(model.state_dict(), os.path.join(job.workdir, "baseline.pt"))
    progress.put((job.name, -1, 0.0, -1, sent[0]))


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


def _committed_model(mailbox: str, vocab: int, block: int) -> tuple[Any, int]:
    """The run's newest committed model (what `gradientmail export` writes), and how many
    rounds were committed."""
    from gradientmail.run.committed import read_committed

    committed = read_committed(mailbox)
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
    workdir = Path(tempfile.mkdtemp(prefix="gradientmail-demo-"))
    mailbox = cfg.mailbox or str(workdir / "mailbox")
    if cfg.mailbox and Path(cfg.mailbox).exists() and any(Path(cfg.mailbox).iterdir()):
        raise ConfigError(
            f"--mailbox {cfg.mailbox} is not empty; the demo starts a new run: give an empty "
            "or new directory"
        )
    print(f"mailbox: {mailbox}  (watch it: gradientmail status {mailbox})", file=log)
    vocab, _, _ = _prepare(cfg, workdir, log)
    ctx = mp.get_context("spawn")
    progress = ctx.Queue()
    jobs = [
        _Job(f"learner-{i}", i, cfg, str(workdir), mailbox) for i in range(cfg.learners)
    ] + [_Job("alone", cfg.learners, cfg, str(workdir), None)]
    procs = [ctx.Process(target=_worker, args=(j, progress), daemon=True) for j in jobs]
    for p in procs:
        p.start()
    curves: dict[str, list[tuple[int, float]]] = {j.name: [] for j in jobs}
    sent: dict[str, int] = {}
    rounds = -1
    done: set[str] = set()
    last_print = 0.0
    tty = log.isatty()
    while len(done) < len(jobs):
        try:
            name, step, loss, r, nbytes = progress.get(timeout=1.0)
        except queue.Empty:
            dead = [j.name for j, p in zip(jobs, procs, strict=True)
                    if not p.is_alive() and j.name not in done]
            if dead:
                raise GradientmailError(
                    f"demo worker(s) {dead} exited early; see their output above"
                ) from None
            continue
        sent[name] = nbytes
        if step < 0:
            done.add(name)
            continue
        curves[name].append((step, loss))
        rounds = max(rounds, r)
        now = time.perf_counter()
        if now - last_print > (0.5 if tty else 5.0):
            last_print = now
            steps = [curves[j.name][-1][0] if curves[j.name] else 0 for j in jobs[:-1]]
            recent = [v for j in jobs[:-1] for _, v in curves[j.name][-10:]]
            mean = f"{sum(recent) / len(recent):.3f}" if recent else "-"
            alone = f"{curves['alone'][-1][1]:.3f}" if curves["alone"] else "-"
            line = (
                f"steps {min(steps)}-{max(steps)}/{cfg.steps}  rounds committed {rounds + 1}  "
                f"loss {mean}  (alone: {alone})"
            )
            print(("\r" + line) if tty else line, end="" if tty else "\n", file=log, flush=True)
    for p in procs:
        p.join(timeout=60)
    if tty:
        print(file=log)

    val = torch.load(workdir / "val.pt")
    committed, n_rounds = _committed_model(mailbox, vocab, cfg.block)
    loss_gm = _evaluate(committed, val)
    alone = _model(vocab, cfg.block)
    alone.load_state_dict(torch.load(workdir / "baseline.pt"))
    loss_alone = _evaluate(alone, val)
    tokens_each = cfg.steps * cfg.batch * cfg.block
    summary: dict[str, Any] = {
        "learners": cfg.learners,
        "steps": cfg.steps,
        "rounds_committed": n_rounds,
        "mailbox": mailbox,
        "eval_loss": {"gradientmail": loss_gm, "alone": loss_alone},
        "perplexity": {"gradientmail": math.exp(loss_gm), "alone": math.exp(loss_alone)},
        "tokens_trained": {"gradientmail": tokens_each * cfg.learners, "alone": tokens_each},
        "bytes_sent_per_learner": (
            sum(v for k, v in sent.items() if k != "alone") / cfg.learners
        ),
        "seconds": time.perf_counter() - t_start,
    }
    plot = _plot(curves, workdir)
    if plot:
        summary["plot"] = plot
    if as_json:
        print(json.dumps(summary, indent=2), file=out)
    else:
        print(_table(summary), file=out)
    return summary


def _table(s: dict[str, Any]) -> str:
    rows = [
        ("arm", "eval loss", "perplexity", "tokens trained"),
        (
            f"gradientmail, {s['learners']} learners",
            f"{s['eval_loss']['gradientmail']:.3f}",
            f"{s['perplexity']['gradientmail']:.1f}",
            f"{s['tokens_trained']['gradientmail']:,}",
        ),
        (
            "one learner alone",
            f"{s['eval_loss']['alone']:.3f}",
            f"{s['perplexity']['alone']:.1f}",
            f"{s['tokens_trained']['alone']:,}",
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    ratio = s["eval_loss"]["gradientmail"] / s["eval_loss"]["alone"]
    tail = (
        f"\n{s['steps']} steps each, {s['rounds_committed']} rounds committed, "
        f"{s['bytes_sent_per_learner'] / 1e6:.1f} MB mailed per learner, "
        f"{s['seconds']:.0f}s. Held-out loss ratio gradientmail/alone: {ratio:.3f}"
    )
    if "plot" in s:
        tail += f"\nLoss plot: {s['plot']}"
    return "\n".join(lines) + tail


def _plot(curves: dict[str, list[tuple[int, float]]], workdir: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in curves.items():
        if not pts:
            continue
        xs = [s for s, _ in pts]
        k = 10  # a running mean: per-step losses of a tiny model are noisy
        ys = [sum(v for _, v in pts[max(0, i - k + 1) : i + 1]) / min(i + 1, k)
              for i in range(len(pts))]
        ax.plot(xs, ys, label=name, linewidth=2 if name == "alone" else 1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (running mean of 10)")
    ax.legend()
    ax.set_title("gradientmail demo")
    path = workdir / "loss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
