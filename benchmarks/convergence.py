"""Convergence at equal tokens: gradientmail's configurations against DDP and peers.

    python benchmarks/convergence.py [--quick | --smoke] [--arms a,b,...] [--steps S]
                                     [--results PATH] [--plot PATH]

A small GPT-2 (BPE vocabulary trained on the data) on the standard library's Python files,
fixed held-out files and seeds, the same tokens for every arm:

- `single`: one learner, batch B, M·S steps;
- `ddp`: the DDP equivalent, one learner with batch M·B for S steps (the gradient DDP
  averages over M workers of batch B);
- `diloco`: standard DiLoCo, M learners, H, outer lr 0.7 / momentum 0.9, every learner in
  every round, started together (`wait_for_learners(M)`);
- `streaming`: Streaming DiLoCo, P = 3 strided fragments, τ = 2 rounds in flight, α = 0.5,
  every learner in every round;
- `decoupled`: the library's defaults (RDA merge, quorum 1, grace window) with P = 3;
- `f4`: standard DiLoCo with F4 deltas and F4 commit updates, zstd;
- `topk` / `dtopk` (opt-in): standard DiLoCo / the Decoupled defaults with sparse deltas
  (`--sparse-dtype`, TOPK_F8 unless named) and error feedback, one arm per density of
  `--topk-density` (named by 1/density: `topk32`, `dtopk100`), with the outer step and
  feedback decay of `--sparse-outer-lr`, `--sparse-outer-momentum` and `--feedback-decay`
  (unset: the library's defaults);
- `localsgd`: Accelerate's `LocalSGD` (parameter averaging every H steps) as M processes
  on torch.distributed gloo.

Every arm is evaluated at `evals` points on the held-out blocks; the learner arms on the
*committed* model (each fragment's newest theta as of a round, read from the records, which
keep every version), the others on rank 0's model. Bytes per learner: the learners' sum of
`SnapshotPublished.bytes`; DDP's ring all-reduce 2·params·4 bytes per step; LocalSGD's
params·4 bytes per averaging. Prints a markdown table, appends it to RESULTS.md, and saves
a plot of eval loss against tokens and against bytes.

Workers are spawned processes with one torch thread each; each arm's wall time includes
process start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradientmail.learner.options import LearnerOptions

__all__ = [
    "ARMS", "PRESETS", "Arm", "Job", "Settings", "SparseSpec", "algorithm", "build_model",
    "committed_state", "evaluate", "image_link", "jobs_of", "launch", "load_into", "main",
    "parse_spec", "plot", "prepare_data", "records_of", "run_arm", "sparse_arms", "table",
    "worker_context",
]

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"


@dataclasses.dataclass(frozen=True)
class Settings:
    """One benchmark size. `steps` is each learner's optimizer steps (S)."""

    learners: int = 4
    steps: int = 500
    batch: int = 8
    block: int = 64
    vocab: int = 4096
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    lr: float = 1e-3
    schedule: str = "constant"  # or "cosine": linear warmup, then cosine decay to lr/10
    warmup: float = 0.0  # fraction of an arm's steps spent warming up
    warm_start: int = 0  # steps of one shared single-learner pretraining before every arm
    sync_every: int = 50
    fragments: int = 3
    evals: int = 5
    val_blocks: int = 256
    text_budget: int = 6_000_000
    seed: int = 0
    topk_densities: tuple[float, ...] = (1 / 32,)  # one topk / dtopk arm each
    sparse_dtype: str = "TOPK_F8"
    # The sparse arms' outer step and error-feedback decay (None: DiLoCo's defaults).
    sparse_outer_lr: float | None = None
    sparse_outer_momentum: float | None = None
    feedback_decay: float | None = None
    feedback_momentum: float | None = None
    sparse_specs: tuple[SparseSpec, ...] = ()  # --sparse-arm: one arm each, overriding the above


PRESETS: dict[str, Settings] = {
    "full": Settings(),
    "quick": Settings(steps=60, sync_every=20, evals=3, text_budget=2_000_000),
    # For CI: every arm's code path in well under a minute, numbers meaningless.
    "smoke": Settings(learners=2, steps=12, batch=4, block=32, vocab=512, n_layer=1,
                      n_embd=32, n_head=2, sync_every=6, evals=2, val_blocks=16,
                      text_budget=200_000),
}


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    label: str
    kind: str  # "alone", "learner" or "localsgd"
    sparse: SparseSpec | None = None  # a sparse arm's settings (set by `sparse_arms`)


ARMS: tuple[Arm, ...] = (
    Arm("single", "single learner (batch B, M·S steps)", "alone"),
    Arm("ddp", "DDP-equivalent (batch M·B, S steps)", "alone"),
    Arm("diloco", "standard DiLoCo (P=1, quorum M, barrier, mean)", "learner"),
    Arm("streaming", "Streaming DiLoCo (P=3 strided, τ=2, α=0.5)", "learner"),
    Arm("decoupled", "Decoupled defaults (P=3, RDA, quorum 1, grace)", "learner"),
    Arm("f4", "standard DiLoCo, F4 deltas + F4 commits, zstd", "learner"),
    Arm("topk", "standard DiLoCo, sparse deltas", "learner"),
    Arm("dtopk", "Decoupled defaults, sparse deltas", "learner"),
    Arm("localsgd", "Accelerate LocalSGD (gloo, average every H)", "localsgd"),
)


@dataclasses.dataclass(frozen=True)
class Job:
    arm: Arm
    rank: int
    settings: Settings
    workdir: str
    port: int = 0


SPARSE = ("topk", "dtopk")  # the templates `sparse_arms` expands, one arm per spec


@dataclasses.dataclass(frozen=True)
class SparseSpec:
    """One sparse arm's settings (None: DiLoCo's default)."""

    dtype: str = "TOPK_F8"
    density: float = 1 / 32
    outer_lr: float | None = None
    outer_momentum: float | None = None
    decay: float | None = None
    momentum: float | None = None

    def describe(self) -> str:
        inv = 1 / self.density
        tag = f"{inv:.0f}" if abs(inv - round(inv)) < 1e-6 else f"{inv:.3g}"
        out = f"{self.dtype} density 1/{tag}"
        if self.outer_lr is not None or self.outer_momentum is not None:
            lr = 0.7 if self.outer_lr is None else self.outer_lr
            m = 0.9 if self.outer_momentum is None else self.outer_momentum
            out += f", outer lr {lr:g} / momentum {m:g}"
        if self.decay is not None:
            out += f", EF decay {self.decay:g}"
        if self.momentum is not None:
            out += f", learner momentum {self.momentum:g}"
        return out

    def settings(self) -> dict[str, Any]:
        """The DiLoCo fields of this spec."""
        out: dict[str, Any] = {"delta_dtype": self.dtype, "delta_density": self.density,
                               "feedback_decay": self.decay, "feedback_momentum": self.momentum}
        if self.outer_lr is not None:
            out["outer_lr"] = self.outer_lr
        if self.outer_momentum is not None:
            out["outer_momentum"] = self.outer_momentum
        return out


def parse_spec(text: str) -> SparseSpec:
    """`--sparse-arm DTYPE@DENSITY[,lr=X][,m=Y][,decay=Z][,lm=W]` (lm: feedback_momentum)."""
    head, *opts = text.split(",")
    dtype, _, density = head.partition("@")
    keys = {"lr": "outer_lr", "m": "outer_momentum", "decay": "decay", "lm": "momentum"}
    kw: dict[str, Any] = {"dtype": dtype.strip(), "density": _densities(density or "1/32")[0]}
    for opt in opts:
        k, _, v = opt.partition("=")
        if k.strip() not in keys:
            raise argparse.ArgumentTypeError(f"--sparse-arm {text!r}: unknown {k!r}; use "
                                             f"{', '.join(keys)}")
        kw[keys[k.strip()]] = float(v)
    return SparseSpec(**kw)


def sparse_arms(template: Arm, s: Settings) -> list[Arm]:
    """The arms of a sparse template: one per `s.sparse_specs` (named template1, 2, ...)
    or, without specs, one per density of `s.topk_densities` with the run-wide sparse
    settings (named by 1/density: `topk32`)."""
    specs = s.sparse_specs or tuple(
        SparseSpec(s.sparse_dtype, d, s.sparse_outer_lr, s.sparse_outer_momentum,
                   s.feedback_decay, s.feedback_momentum) for d in s.topk_densities)
    out = []
    for i, spec in enumerate(specs, 1):
        inv = 1 / spec.density
        tag = f"{inv:.0f}" if abs(inv - round(inv)) < 1e-6 else f"{inv:.3g}"
        label = f"{template.label.removesuffix(', sparse deltas')}, {spec.describe()}"
        name = f"{template.name}{i if s.sparse_specs else tag}"
        out.append(dataclasses.replace(template, name=name, label=label, sparse=spec))
    return out


def algorithm(arm: str | Arm, s: Settings) -> Any:
    """The DiLoCo configuration of a learner arm."""
    from gradientmail.algorithms.diloco import DiLoCo
    from gradientmail.algorithms.merge import WeightedMean
    from gradientmail.algorithms.partition import Strided

    standard: dict[str, Any] = {"sync_every": s.sync_every, "fragments": 1, "in_flight": 1,
                                "overlap_steps": 0, "merge": WeightedMean(),
                                "quorum_size": s.learners}
    if isinstance(arm, Arm) and arm.sparse is not None:
        sparse = arm.sparse.settings()
        if arm.name.startswith("dtopk"):
            return DiLoCo(sync_every=s.sync_every, fragments=s.fragments, **sparse)
        return DiLoCo(**standard, **sparse)
    arm = arm.name if isinstance(arm, Arm) else arm
    if arm == "diloco":
        return DiLoCo(**standard)
    if arm == "f4":
        return DiLoCo(**standard, delta_dtype="F4", commit_dtype="F4")
    if arm == "streaming":
        # Streaming DiLoCo overlaps a fragment's sync with training, then takes the merged
        # fragment: a learner may train one round's gap past its unmerged publish.
        return DiLoCo(sync_every=s.sync_every, fragments=s.fragments, in_flight=2, mixing=0.5,
                      overlap_steps=s.sync_every // s.fragments, partition=Strided(),
                      merge=WeightedMean(), quorum_size=s.learners)
    if arm == "decoupled":
        return DiLoCo(sync_every=s.sync_every, fragments=s.fragments)
    raise ValueError(f"arm {arm!r} has no DiLoCo configuration")


def build_model(s: Settings, vocab: int) -> Any:
    from gradientmail.integration.textdata import tiny_gpt2

    return tiny_gpt2(vocab, n_layer=s.n_layer, n_embd=s.n_embd, n_head=s.n_head,
                     n_positions=s.block, seed=s.seed)



def prepare_data(s: Settings, workdir: Path) -> tuple[int, int]:
    """Train the tokenizer and save train/val token blocks and the vocabulary size for the
    workers; returns (vocabulary, training tokens)."""
    import torch

    from gradientmail.integration.textdata import (
        read_budget,
        stdlib_corpus,
        token_blocks,
        train_tokenizer,
    )

    train = read_budget(stdlib_corpus("train"), s.text_budget)
    val = read_budget(stdlib_corpus("val"), max(s.text_budget // 10, 50_000))
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gradientmail"
    tok = train_tokenizer(train, vocab_size=s.vocab, cache_dir=cache / "tokenizers")
    train_ids = token_blocks(tok, train, s.block)
    val_ids = token_blocks(tok, val, s.block)[: s.val_blocks]
    torch.save(train_ids, workdir / "train.pt")
    torch.save(val_ids, workdir / "val.pt")
    torch.save(len(tok), workdir / "vocab.pt")
    return len(tok), int(train_ids.numel())


# -- workers (spawned processes) ----------------------------------------------------------


def lr_schedule(opt: Any, s: Settings, steps: int) -> Any:
    """The inner learning-rate schedule over an arm's own `steps`: constant, or a linear
    warmup over `warmup`·steps followed by a cosine decay to lr/10 (the DiLoCo paper's
    inner schedule)."""
    import torch

    warm = int(s.warmup * steps)

    def factor(i: int) -> float:
        if i < warm:
            return (i + 1) / warm
        if s.schedule == "constant":
            return 1.0
        done = (i - warm) / max(steps - warm, 1)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(done, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _worker(job: Job) -> None:
    import torch

    torch.set_num_threads(1)
    s, arm, wd = job.settings, job.arm, Path(job.workdir)
    data = torch.load(wd / "train.pt")
    model = build_model(s, int(torch.load(wd / "vocab.pt")))
    if (wd / "warm.pt").exists():
        model.load_state_dict(torch.load(wd / "warm.pt"))
    if arm.kind == "localsgd":
        _localsgd_worker(job, model, data)
        return
    rows = data[job.rank :: s.learners] if arm.kind == "learner" else data
    batch = s.batch * (s.learners if arm.name == "ddp" else 1)
    steps = s.steps * (s.learners if arm.name == "single" else 1)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.1)
    sched = lr_schedule(opt, s, steps)
    published: list[tuple[int, int]] = []
    learner = None
    if arm.kind == "learner":
        from gradientmail.adapters import TorchAdapter
        from gradientmail.events import Event, SnapshotPublished
        from gradientmail.learner.runtime import Learner

        def on_event(e: Event) -> None:
            if isinstance(e, SnapshotPublished):
                published.append((e.round, e.bytes))

        learner = Learner(
            TorchAdapter(model),
            algorithm(arm, s),
            str(wd / arm.name),
            f"learner-{job.rank}",
            on_event=on_event,
            options=LearnerOptions(
                poll_interval=0.2,
                lease_every=5.0,
                lease_timeout=20.0,
                keep_versions=10**6,
                compression="zstd" if arm.name == "f4" else "off",
            ),
        )
        learner.start()
        learner.wait_for_learners(s.learners, timeout=600)
    g = torch.Generator().manual_seed(s.seed + 1 + job.rank)
    every = max(steps // s.evals, 1)
    t0 = time.perf_counter()
    for step in range(steps):
        ids = rows[torch.randint(0, rows.shape[0], (batch,), generator=g)]
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if learner is not None:
            learner.step(int(ids.numel()))
        elif (step + 1) % every == 0 or step + 1 == steps:
            torch.save(model.state_dict(), wd / f"{arm.name}-{step + 1}.pt")
    if learner is not None:
        learner.close()
    result = {"published": published, "seconds": time.perf_counter() - t0,
              "tokens": steps * batch * s.block}
    (wd / f"{arm.name}-{job.rank}.json").write_text(json.dumps(result))


def pretrain(s: Settings, workdir: Path, vocab: int) -> None:
    """The shared starting point of every arm with `warm_start` > 0 (the DiLoCo paper
    starts its runs from a pretrained checkpoint): one learner, batch B, constant lr,
    saved as warm.pt for the workers."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the workers; two spinning threads lose on a busy box
    data = torch.load(workdir / "train.pt")
    model = build_model(s, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.1)
    g = torch.Generator().manual_seed(s.seed + 1000)
    for _ in range(s.warm_start):
        ids = data[torch.randint(0, data.shape[0], (s.batch,), generator=g)]
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.save(model.state_dict(), workdir / "warm.pt")
    torch.set_num_threads(threads)


def _localsgd_worker(job: Job, model: Any, data: Any) -> None:
    import torch

    s, wd = job.settings, Path(job.workdir)
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port),
                      RANK=str(job.rank), WORLD_SIZE=str(s.learners),
                      LOCAL_RANK=str(job.rank), LOCAL_WORLD_SIZE=str(s.learners))
    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    acc = Accelerator(cpu=True)
    rows = data[job.rank :: s.learners]
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.1)
    wrapped, opt = acc.prepare(model, opt)
    sched = lr_schedule(opt, s, s.steps)
    g = torch.Generator().manual_seed(s.seed + 1 + job.rank)
    every = max(s.steps // s.evals, 1)
    t0 = time.perf_counter()
    with LocalSGD(accelerator=acc, model=wrapped, local_sgd_steps=s.sync_every,
                  enabled=True) as local_sgd:
        for step in range(s.steps):
            ids = rows[torch.randint(0, rows.shape[0], (s.batch,), generator=g)]
            acc.backward(wrapped(input_ids=ids, labels=ids).loss)
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            local_sgd.step()
            if job.rank == 0 and ((step + 1) % every == 0 or step + 1 == s.steps):
                torch.save(acc.unwrap_model(wrapped).state_dict(),
                           wd / f"localsgd-{step + 1}.pt")
    acc.wait_for_everyone()
    result = {"published": [], "seconds": time.perf_counter() - t0,
              "tokens": s.steps * s.batch * s.block}
    (wd / f"localsgd-{job.rank}.json").write_text(json.dumps(result))
    # Every rank passed the barrier above and its result is on disk. Tearing gloo down at
    # interpreter exit now and then hung a rank on a loaded 2-core machine (the process
    # never exited and the smoke test timed out), so leave without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the main process ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: Imported once by the fork server, so a worker starts in a fraction of a second instead
#: of importing torch and transformers again (seconds of CPU each on a small machine).
PRELOAD = ["torch", "transformers.models.gpt2.modeling_gpt2", "gradientmail.learner.runtime",
           "gradientmail.adapters.torch", "accelerate"]


def kill_at_step(victim: Any, logged: Any, at: int, deadline: float, label: str) -> float:
    """SIGKILL the process `victim` once `logged()` (its steps logged so far) reaches
    `at`; the wall-clock time of the kill. `SystemExit` naming `label` when the victim
    ends first, or `time.monotonic()` passes `deadline`."""
    while logged() < at:
        if not victim.is_alive() or time.monotonic() > deadline:
            raise SystemExit(f"{label}: the victim ended before its step {at} "
                             f"(exit code {victim.exitcode}); see its output")
        time.sleep(0.005)
    t_kill = time.time()
    victim.kill()
    return t_kill


def worker_context() -> Any:
    """A forkserver context with the heavy imports preloaded: the server is a clean
    single-threaded process, so forking it is safe (unlike forking this one, whose torch
    and tokenizers thread pools have started)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def launch(jobs: list[Job], timeout: float = 3600.0) -> float:
    """Run `jobs` as spawned processes; their wall seconds. Raises if one fails."""
    ctx = worker_context()
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_worker, args=(j,), daemon=True) for j in jobs]
    for p in procs:
        p.start()
    deadline = t0 + timeout
    for p in procs:
        p.join(max(deadline - time.perf_counter(), 1.0))
    bad = [(j.arm.name, j.rank, p.exitcode) for j, p in zip(jobs, procs, strict=True)
           if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if bad:
        raise SystemExit(f"workers failed (arm, rank, exit code): {bad}; see their output")
    return time.perf_counter() - t0


def evaluate(model: Any, val: Any) -> float:
    import torch

    model.eval()
    total = 0.0
    with torch.no_grad():
        for chunk in val.split(32):
            total += float(model(input_ids=chunk, labels=chunk).loss) * chunk.shape[0]
    return total / int(val.shape[0])


def committed_state(box: Path, upto: int) -> dict[str, Any]:
    """The committed parameters as of round `upto`: each fragment's newest theta then."""
    from gradientmail.adapters.torch import to_torch
    from gradientmail.mailbox import LocalMailbox
    from gradientmail.run.protocol import Exchange
    from gradientmail.run.replica import state_at

    async def go() -> dict[str, Any]:
        ex = Exchange(LocalMailbox(box))
        manifest = await ex.read_manifest()
        assert manifest is not None, f"no run in {box}"
        latest = await ex.latest_commit_per_fragment(len(manifest.plan), upto)
        out: dict[str, Any] = {}
        for p, names in enumerate(manifest.plan):
            tensors = (await state_at(ex, p, latest.get(p), manifest)).theta
            out.update({n: to_torch(tensors[n]) for n in names})
        return out

    return asyncio.run(go())


def records_of(box: Path) -> list[Any]:
    from gradientmail.mailbox import LocalMailbox
    from gradientmail.run.protocol import Exchange

    return asyncio.run(Exchange(LocalMailbox(box)).rounds_after(-1))


def load_into(model: Any, state: dict[str, Any]) -> Any:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name])
    return model


def jobs_of(arm: Arm, s: Settings, workdir: Path) -> list[Job]:
    ranks = 1 if arm.kind == "alone" else s.learners
    port = _free_port() if arm.kind == "localsgd" else 0
    return [Job(arm, r, s, str(workdir), port) for r in range(ranks)]


def run_arm(arm: Arm, s: Settings, workdir: Path, vocab: int, val: Any,
            n_params: int, wall: float) -> dict[str, Any]:
    """Evaluate a trained arm; its curve (tokens, bytes per learner, eval loss)."""
    import torch

    ranks = 1 if arm.kind == "alone" else s.learners
    results = [json.loads((workdir / f"{arm.name}-{r}.json").read_text()) for r in range(ranks)]
    total_tokens = sum(r["tokens"] for r in results)
    curve: list[tuple[int, float, float]] = []  # (tokens, bytes per learner, eval loss)
    syncs = 0
    if arm.kind == "learner":
        box = workdir / arm.name
        records = records_of(box)
        syncs = len(records)
        # A step's tokens count toward every fragment, so each token trained appears in
        # one record per fragment: tokens committed = the records' tokens / P.
        frags = max((rec.fragment for rec in records), default=0) + 1
        cum, seen = [], 0
        for rec in records:
            seen += sum(p.tokens for p in rec.participants)
            cum.append(seen // frags)
        picks = []
        for k in range(1, s.evals + 1):
            target = total_tokens * k / s.evals * 1.001
            done = [i for i, c in enumerate(cum) if c <= target]
            if done and done[-1] not in picks:
                picks.append(done[-1])
        if records and len(records) - 1 not in picks:
            picks.append(len(records) - 1)
        sent = [(rnd, b) for r in results for rnd, b in r["published"]]
        for i in picks:
            model = load_into(build_model(s, vocab), committed_state(box, i))
            nbytes = sum(b for rnd, b in sent if rnd <= i) / s.learners
            curve.append((cum[i], nbytes, evaluate(model, val)))
    else:
        steps = s.steps * (s.learners if arm.name == "single" else 1)
        batch = s.batch * (s.learners if arm.name == "ddp" else 1)
        every = max(steps // s.evals, 1)
        points = sorted({*range(every, steps + 1, every), steps})
        for step in points:
            model = build_model(s, vocab)
            model.load_state_dict(torch.load(workdir / f"{arm.name}-{step}.pt"))
            tokens = step * batch * s.block * (s.learners if arm.kind == "localsgd" else 1)
            if arm.name == "ddp":
                nbytes = 2.0 * n_params * 4 * step
            elif arm.kind == "localsgd":
                nbytes = float(n_params * 4 * (step // s.sync_every))
            else:
                nbytes = 0.0
            curve.append((tokens, nbytes, evaluate(model, val)))
        syncs = s.steps if arm.name == "ddp" else (
            s.steps // s.sync_every if arm.kind == "localsgd" else 0)
    return {"arm": arm.name, "label": arm.label, "curve": curve, "wall": wall,
            "tokens": total_tokens, "syncs": syncs}


def table(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """The markdown table and the goal lines."""
    by = {r["arm"]: r for r in rows}
    ddp = by.get("ddp")
    lines = ["| arm | eval loss | perplexity | ratio to DDP-eq | bytes sent per learner | "
             "fewer bytes than DDP-eq | syncs | tokens | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        loss, nbytes = r["curve"][-1][2], r["curve"][-1][1]
        ratio = f"{loss / ddp['curve'][-1][2]:.3f}" if ddp else "–"
        fewer = (f"{ddp['curve'][-1][1] / nbytes:.0f}x" if ddp and nbytes > 0 else "–")
        lines.append(f"| {r['label']} | {loss:.4f} | {math.exp(loss):.2f} | {ratio} | "
                     f"{_mb(nbytes)} | {fewer} | {r['syncs']} | {r['tokens']:,} | "
                     f"{r['wall']:.0f} |")
    goals = []
    if ddp and "diloco" in by:
        d = by["diloco"]["curve"][-1]
        ratio, fewer = d[2] / ddp["curve"][-1][2], ddp["curve"][-1][1] / max(d[1], 1.0)
        ok = ratio <= 1.0 and fewer >= 100
        goals.append(f"DiLoCo <= 1.00x DDP-equivalent loss at >= 100x fewer bytes: "
                     f"{ratio:.3f}x at {fewer:.1f}x fewer ({'met' if ok else 'NOT met'})")
    compared = [("f4", "diloco", "F4", 7)] + [
        (r["arm"], "decoupled" if r["arm"].startswith("dtopk") else "diloco", r["arm"], 30)
        for r in rows if r["arm"].startswith(SPARSE)]
    for arm, base, label, least in compared:
        if base in by and arm in by:
            d, c = by[base]["curve"][-1], by[arm]["curve"][-1]
            rel, fewer = c[2] / d[2] - 1.0, d[1] / max(c[1], 1.0)
            ok = rel <= 0.005 and fewer >= least
            of = "F32" if base == "diloco" else "the Decoupled F32"
            goals.append(f"{label} within +0.5% of {of} loss at >= {least}x fewer "
                         f"bytes: {rel:+.2%} at {fewer:.1f}x fewer "
                         f"({'met' if ok else 'NOT met'})")
    return "\n".join(lines), goals


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Eval loss against tokens and against bytes per learner; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    color = {r["arm"]: f"C{i % 10}" for i, r in enumerate(rows)}  # the same in both panels
    for r in rows:
        toks = [c[0] for c in r["curve"]]
        losses = [c[2] for c in r["curve"]]
        a.plot(toks, losses, marker="o", label=r["arm"], color=color[r["arm"]])
        pts = [(c[1], c[2]) for c in r["curve"] if c[1] > 0]
        if pts:
            b.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=r["arm"],
                   color=color[r["arm"]])
    a.set_xlabel("tokens trained (all learners; learner arms: tokens in commits)")
    a.set_ylabel("held-out eval loss")
    a.legend()
    b.set_xscale("log")
    b.set_xlabel("bytes sent per learner (log)")
    b.set_ylabel("held-out eval loss")
    b.legend()
    fig.suptitle("gradientmail convergence at equal tokens")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def image_link(png: Path, results: Path) -> str:
    """How the markdown file `results` links to `png`: relative when it can."""
    try:
        return png.resolve().relative_to(results.resolve().parent).as_posix()
    except ValueError:
        return str(png)


def _densities(text: str) -> tuple[float, ...]:
    """`--topk-density`: a comma list of fractions (1/32) or decimals (0.01)."""
    out = []
    for part in text.split(","):
        num, _, den = part.strip().partition("/")
        try:
            out.append(float(num) / float(den) if den else float(num))
        except (ValueError, ZeroDivisionError):
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a density; write 1/32 or 0.03125") from None
    return tuple(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="S=60, H=20 (minutes)")
    size.add_argument("--smoke", action="store_true", help="tiny sizes for CI (seconds)")
    # The sparse arms (issue #29) are opt-in: name them in --arms.
    ap.add_argument("--arms", default=",".join(a.name for a in ARMS if a.name not in SPARSE))
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per learner")
    ap.add_argument("--n-layer", type=int, default=None, help="GPT-2 layers (default 2)")
    ap.add_argument("--n-embd", type=int, default=None, help="GPT-2 width (default 128)")
    ap.add_argument("--lr", type=float, default=None, help="inner AdamW lr (default 1e-3)")
    ap.add_argument("--schedule", choices=("constant", "cosine"), default=None,
                    help="inner lr schedule (default constant)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="fraction of each arm's steps warming up (default 0)")
    ap.add_argument("--warm-start", type=int, default=None,
                    help="steps of a shared single-learner pretraining before the arms")
    ap.add_argument("--sync-every", type=int, default=None,
                    help="H, for every arm (default 50; quick 20)")
    ap.add_argument("--topk-density", type=_densities, default=None,
                    help="the sparse arms' delta_density, a comma list (1/32,1/100,0.005): "
                    "one arm each (default 1/32)")
    ap.add_argument("--sparse-dtype", default=None, help="the sparse arms' delta_dtype "
                    "(default TOPK_F8)")
    ap.add_argument("--sparse-outer-lr", type=float, default=None,
                    help="the sparse arms' outer_lr (default DiLoCo's 0.7)")
    ap.add_argument("--sparse-outer-momentum", type=float, default=None,
                    help="the sparse arms' outer_momentum (default DiLoCo's 0.9)")
    ap.add_argument("--feedback-decay", type=float, default=None,
                    help="the sparse arms' feedback_decay (default None: no decay)")
    ap.add_argument("--sparse-arm", type=parse_spec, action="append", default=None,
                    help="one sparse arm per use (in place of --topk-density and the sparse "
                    "flags): DTYPE@DENSITY[,lr=X][,m=Y][,decay=Z][,lm=W], e.g. "
                    "SIGN1@1,lr=0.7,m=0,lm=0.9")
    ap.add_argument("--feedback-momentum", type=float, default=None,
                    help="the sparse arms' feedback_momentum (default None: off; needs "
                    "--sparse-outer-momentum 0)")
    ap.add_argument("--results", default=str(RESULTS), help="markdown file to append to")
    ap.add_argument("--plot", default=None, help="PNG path (default benchmarks/convergence"
                    "[-quick].png)")
    args = ap.parse_args(argv)
    preset = "smoke" if args.smoke else "quick" if args.quick else "full"
    s = PRESETS[preset]
    for flag, field in (("steps", "steps"), ("n_layer", "n_layer"), ("n_embd", "n_embd"),
                        ("lr", "lr"), ("schedule", "schedule"), ("warmup", "warmup"),
                        ("warm_start", "warm_start"), ("sync_every", "sync_every"),
                        ("topk_density", "topk_densities"), ("sparse_dtype", "sparse_dtype"),
                        ("sparse_outer_lr", "sparse_outer_lr"),
                        ("sparse_outer_momentum", "sparse_outer_momentum"),
                        ("feedback_decay", "feedback_decay"),
                        ("feedback_momentum", "feedback_momentum")):
        if getattr(args, flag) is not None:
            s = dataclasses.replace(s, **{field: getattr(args, flag)})
    if args.sparse_arm:
        s = dataclasses.replace(s, sparse_specs=tuple(args.sparse_arm))
    sized = (s.n_layer, s.n_embd) != (PRESETS[preset].n_layer, PRESETS[preset].n_embd)
    names = args.arms.split(",")
    arms = [b for a in ARMS if a.name in names
            for b in (sparse_arms(a, s) if a.name in SPARSE else [a])]
    unknown = set(names) - {a.name for a in ARMS}
    if unknown:
        raise SystemExit(f"--arms: unknown {sorted(unknown)}; choose from "
                         f"{[a.name for a in ARMS]}")
    if s.steps % s.sync_every or s.steps % s.evals:
        raise SystemExit(f"--steps {s.steps} must be a multiple of H={s.sync_every} and of "
                         f"evals={s.evals}, so every arm ends on a sync")
    stem = "convergence" + ("" if preset == "full" else f"-{preset}") + (
        f"-{s.n_layer}x{s.n_embd}" if sized else "")
    png = Path(args.plot) if args.plot else HERE / f"{stem}.png"

    import torch

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="gm-convergence-"))
    vocab, n_train = prepare_data(s, workdir)
    val = torch.load(workdir / "val.pt")
    if s.warm_start:
        pretrain(s, workdir, vocab)
        warm = load_into(build_model(s, vocab), torch.load(workdir / "warm.pt"))
        print(f"warm start: {s.warm_start} steps, eval loss {evaluate(warm, val):.4f}",
              flush=True)
    n_params = sum(p.numel() for p in build_model(s, vocab).parameters())
    print(f"data: {n_train:,} training tokens, {val.numel():,} held out, vocabulary {vocab}; "
          f"model {n_params:,} parameters; workdir {workdir}", flush=True)
    rows = []
    # The one-process arms run side by side (each takes one core); the others one by one.
    groups = [[a for a in arms if a.kind == "alone"]] + [[a] for a in arms if a.kind != "alone"]
    for group in filter(None, groups):
        wall = launch([j for a in group for j in jobs_of(a, s, workdir)])
        for arm in group:
            if arm.kind == "alone":  # their own training time: they shared the launch
                wall = json.loads((workdir / f"{arm.name}-0.json").read_text())["seconds"]
            rows.append(run_arm(arm, s, workdir, vocab, val, n_params, wall))
            last = rows[-1]["curve"][-1]
            print(f"{arm.name}: eval loss {last[2]:.4f}, {_mb(last[1])} per learner, "
                  f"{wall:.0f}s", flush=True)
    body, goals = table(rows)
    have_plot = plot(rows, png)
    tokens = s.learners * s.steps * s.batch * s.block
    command = sys.argv[1:] if argv is None else argv
    link = image_link(png, Path(args.results))
    warm_note = (f"every arm starts from one shared pretraining of {s.warm_start} steps "
                 f"(batch B, not counted below); " if s.warm_start else "")
    header = (
        f"\n## convergence at equal tokens — {datetime.date.today()}\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs), "
        f"torch threads 1 per process. GPT-2 {s.n_layer} layers × {s.n_embd} wide, "
        f"{s.n_head} heads, {n_params:,} parameters, BPE vocabulary {vocab} trained on the "
        f"standard library's .py files ({n_train:,} training tokens; held out: "
        f"{val.shape[0]} blocks of {s.block} from the held-out files). M = {s.learners}, "
        f"S = {s.steps} steps per learner, batch B = {s.batch}×{s.block}, AdamW lr {s.lr} "
        f"({s.schedule}{f', warmup {s.warmup:g}' if s.warmup else ''}) wd 0.1, clip 1.0; "
        f"H = {s.sync_every}, P = {s.fragments}; "
        f"{warm_note}"
        f"{tokens:,} tokens per "
        f"arm. DDP-equivalent bytes: 2 × params × 4 bytes per step (ring all-reduce of fp32 "
        f"gradients); LocalSGD: params × 4 bytes per averaging. Wall s: from launch to "
        f"exit for the M-process arms (process start, joining and closing included), the "
        f"training loop for the one-process arms (run side by side). Preset `{preset}`, "
        f"{time.perf_counter() - t0:.0f}s in all.\n"
        f"Command: `{' '.join(['python', 'benchmarks/convergence.py', *command])}`\n\n"
    )
    text = header + body + "\n\n" + "\n".join(f"- {g}" for g in goals)
    if have_plot:
        text += f"\n\n![eval loss against tokens and bytes]({link})"
    print(text)
    with open(args.results, "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
