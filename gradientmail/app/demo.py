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
bucket, and Decoupled DiLoCo beside that closer (`LINK_SYSTEMS`); the table adds the
bytes that crossed each learner's link. That needs root (or CAP_NET_ADMIN) and the `dev`
extra's moto (`gradientmail.app.demo_link`).

The settings (`DemoConfig`) and the training of one run are in `gradientmail.app.demo_runs`.
torch and transformers are imported inside the functions: `import gradientmail.app.demo` is
free, and the worker processes import what they need.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from gradientmail.app.demo_runs import DemoConfig, _run
from gradientmail.errors import ConfigError

__all__ = ["run_demo"]

#: Text used for the tokenizer and training data: enough for the default run, small
#: enough that tokenizing takes seconds on a laptop.
TEXT_BUDGET = 6_000_000


def _prepare(cfg: DemoConfig, workdir: Path, out: TextIO) -> tuple[int, int, int]:
    """Tokenizer and token blocks for training and evaluation, saved for the workers."""
    import torch

    from gradientmail.integration.textdata import (
        read_budget,
        read_texts,
        stdlib_corpus,
        token_blocks,
        train_tokenizer,
    )

    if cfg.data:
        from gradientmail.integration.textdata import held_out

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
