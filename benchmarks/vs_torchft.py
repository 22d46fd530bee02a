"""Side by side with torchft 0.2.0: the same DiLoCo run through gradientmail and torchft.

    python benchmarks/vs_torchft.py [--quick | --smoke] [--arms a,b,...] [--steps S]
                                    [--poll SECONDS] [--heartbeat-ms MS] [--results PATH]

Needs torchft (`pip install 'gradientmail[peers]'`) and, for the S3 arm, moto's server
(`pip install 'gradientmail[dev]'`). Everything runs on one machine over loopback.

Both systems train the small GPT-2 of benchmarks/convergence.py (2 layers × 128, BPE
vocabulary 4096 over the standard library's .py files) with the same data split, seeds and
schedule: 2 learners, each its own process with one torch thread and its own half of the
training blocks, batch 16×128, AdamW lr 1e-3 wd 0.1, clip 1.0, H = 20, S = 400 steps
(`--quick` 120, `--smoke` a tiny model for 24), outer Nesterov SGD lr 0.7 momentum 0.9;
every learner starts from the same seeded weights and waits for the other before step 1.

Arms (`--arms`, default all but `standard-p2` and `decoupled-mean`, which measure what
fragments and the merge cost at two learners):

- gradientmail, learners with the library's defaults (poll 1 s, leases 60 s / 120 s,
  `--poll` to change) and their embedded closers, started with `wait_for_learners(2)`:
  `standard` = `DiLoCo.standard(20, 2)` on a local directory; `standard-s3` the same on
  moto's S3 server in this process; `decoupled` = `DiLoCo(sync_every=20, fragments=2)`
  (quorum 1, RDA for rounds of 3 or more deltas, τ = 2, never waits); `standard-p2` =
  `DiLoCo.standard(20, 2, fragments=2)` (Streaming DiLoCo behind a barrier: a fragment
  synced every H/2 steps);
  `decoupled-mean` = the decoupled defaults with `merge=WeightedMean()`;
  `f4` = standard with F4 deltas and F4 commit updates, payloads compressed with zstd;
- torchft: `torchft` = `torchft.local_sgd.DiLoCo` over one fragment (the whole model),
  sync_every 20, the same outer SGD; a `Manager` per learner (a replica group of one
  process, its own TCPStore) with `ProcessGroupGloo(timeout=10 s)`, `use_async_quorum=False`,
  `init_sync=False` (the replicas start from identical seeded weights), manager timeout
  10 s, quorum timeout 60 s, connect timeout 10 s; one lighthouse (`LighthouseServer`, the
  library's in-process form of `torchft_lighthouse`) with `min_replicas=1` so that a
  survivor goes on alone, `join_timeout_ms=10000`, `quorum_tick_ms=100` and the default
  `heartbeat_timeout_ms=5000` (`--heartbeat-ms`): a dead replica leaves the quorum once
  its heartbeats stop for that long;
- `-kill` arms (`standard-kill`, `decoupled-kill`, `torchft-kill`): the same run, and the
  parent SIGKILLs learner 1 once it has logged S/2 + H/2 steps (mid-round, half way);
  learner 0 trains its S steps alone after that.

Measured (each worker appends one line per step with a raw `os.write`):

- held-out loss of the global model at the end: gradientmail, the newest committed theta of
  every fragment: the model of the last learner to close, which `close()` resets to the
  newest commits after waiting for its rounds and reading every record (for the standard
  arms both learners end on the same bytes); torchft, learner 0's model after its last
  sync (its parameters are the synced global ones: `fragment_update_alpha` = 0);
- sync overhead per round: the step call is `optimizer.step()` plus, for gradientmail,
  `Learner.step()` (torchft syncs inside `optimizer.step()`, in its post-hook); the plain
  step is the AdamW update itself, timed by a pre-hook registered after torchft's and a
  post-hook registered before it. Overhead = Σ over steps (step call − plain step), plus
  gradientmail's `Learner.close()` (where the last round's barrier waits; torchft's last
  sync is inside its last `optimizer.step()`), divided by the rounds, S/H (one outer step
  of every parameter; the decoupled arm commits P = 2 records per round). Mean per learner
  (survivor only in a kill arm); median and p90 over the rounds of both learners, a round
  being the steps [kH − H/2, kH + H/2). Not in it: CPU the communication threads take from
  training (the wall time shows that);
- bytes up and down per learner per round: gradientmail, its mailbox wrapped in
  `CountingMailbox` (payload bytes of put/create up, of get down: contributions, commits,
  records, leases, the embedded closer's work included; HTTP headers not), from after
  joining (Θ⁰ is not counted) to the end of `close()`, over rounds committed / P; for the
  standard arms split by the rounds a learner closed and those it did not (a round's bytes
  are those counted in its H steps). torchft: the pseudo-gradient allreduce, Σ numel × 4
  bytes (fp32) per sync that had 2 participants: a 2-rank allreduce (ring, or gloo's
  halving-doubling) sends and receives that much per rank; quorum, commit RPCs and
  heartbeats are not counted;
- survivor's longest stall after the kill: its longest step call that ended after the
  SIGKILL;
- wall s: from starting the processes to the last one's exit (process start, joining,
  closing included).

Prints a markdown table with a reading; appends both to RESULTS.md unless `--smoke`.
"""

from __future__ import annotations

import argparse
import asyncio
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gradientmail.learner.options import LearnerOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))

import convergence as conv  # benchmarks/ is not a package

__all__ = [
    "ARMS",
    "OPT_IN_ARMS",
    "PRESETS",
    "Arm",
    "Job",
    "gradientmail_train",
    "main",
    "run_arm",
    "summarize",
    "table",
    "torchft_state",
    "torchft_train",
]

RESULTS = conv.RESULTS
BASE = conv.Settings(learners=2, steps=400, batch=16, block=128, sync_every=20, fragments=2,
                     text_budget=2_000_000)
PRESETS: dict[str, conv.Settings] = {
    "full": BASE,
    "quick": dataclasses.replace(BASE, steps=120),
    # Every code path in seconds of training; the numbers mean nothing.
    "smoke": dataclasses.replace(conv.PRESETS["smoke"], steps=24, sync_every=6, fragments=2),
}
VICTIM, SURVIVOR = 1, 0
BUCKET = "gm-vs-torchft"
PEERS_HINT = "pip install 'gradientmail[peers]'"


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    system: str  # "gradientmail" or "torchft"
    config: str  # "standard", "standard-p2", "decoupled", "decoupled-mean" or "f4"
    store: str  # "local directory", "S3 (moto)" or "gloo allreduce"
    kill: bool = False


#: Arms run only when named: what fragments and the merge cost at two learners.
OPT_IN_ARMS = frozenset({"standard-p2", "decoupled-mean"})
ARMS: tuple[Arm, ...] = (
    Arm("torchft", "torchft", "standard", "gloo allreduce"),
    Arm("standard", "gradientmail", "standard", "local directory"),
    Arm("standard-s3", "gradientmail", "standard", "S3 (moto)"),
    Arm("decoupled", "gradientmail", "decoupled", "local directory"),
    Arm("standard-p2", "gradientmail", "standard-p2", "local directory"),
    Arm("decoupled-mean", "gradientmail", "decoupled-mean", "local directory"),
    Arm("f4", "gradientmail", "f4", "local directory"),
    Arm("torchft-kill", "torchft", "standard", "gloo allreduce", kill=True),
    Arm("standard-kill", "gradientmail", "standard", "local directory", kill=True),
    Arm("decoupled-kill", "gradientmail", "decoupled", "local directory", kill=True),
)
LABELS = {
    ("torchft", "standard"): "DiLoCo (1 fragment, Manager + gloo)",
    ("gradientmail", "standard"): "standard DiLoCo (`DiLoCo.standard(H, 2)`)",
    ("gradientmail", "decoupled"): "decoupled defaults (P=2, quorum 1, RDA from 3 deltas)",
    ("gradientmail", "standard-p2"): "standard DiLoCo over P=2 fragments (streaming, barrier)",
    ("gradientmail", "decoupled-mean"): "decoupled defaults, merge=WeightedMean()",
    ("gradientmail", "f4"): "standard DiLoCo, F4 deltas + F4 commits, zstd",
}


@dataclasses.dataclass(frozen=True)
class Job:
    arm: Arm
    rank: int
    settings: conv.Settings
    workdir: str
    poll: float
    endpoint: str = ""  # S3 endpoint (the moto server), gradientmail's S3 arm
    lighthouse: str = ""  # torchft's lighthouse address

    def path(self, suffix: str) -> Path:
        return Path(self.workdir) / f"{self.arm.name}-{self.rank}.{suffix}"


# -- workers (processes from a fork server) -----------------------------------------------


def _worker(job: Job) -> None:
    import torch

    torch.set_num_threads(1)
    s, wd = job.settings, Path(job.workdir)
    data = torch.load(wd / "train.pt")
    rows = data[job.rank :: s.learners]
    model = conv.build_model(s, int(torch.load(wd / "vocab.pt")))
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.1)
    g = torch.Generator().manual_seed(s.seed + 1 + job.rank)

    def batches() -> Iterator[Any]:
        for _ in range(s.steps):
            yield rows[torch.randint(0, rows.shape[0], (s.batch,), generator=g)]

    if job.arm.system == "torchft":
        _torchft_worker(job, model, opt, batches())
    else:
        _gradientmail_worker(job, model, opt, batches())


class _StepLog:
    """One line per step, written with a raw `os.write` so that a SIGKILL loses at most
    the line being written: training seconds, step-call seconds, plain-step seconds, the
    wall-clock time the call returned, cumulative bytes up and down."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, train: float, call: float, plain: float, up: int = 0,
              down: int = 0) -> None:
        os.write(self.fd, f"{train:.6f} {call:.6f} {plain:.6f} {time.time():.6f} {up} {down}\n"
                 .encode())

    def close(self) -> None:
        os.close(self.fd)


def _algorithm(config: str, s: conv.Settings) -> Any:
    from gradientmail.algorithms.diloco import DiLoCo
    from gradientmail.algorithms.merge import WeightedMean

    if config == "standard":
        return DiLoCo.standard(s.sync_every, s.learners)
    if config == "f4":
        return DiLoCo.standard(s.sync_every, s.learners, delta_dtype="F4", commit_dtype="F4")
    if config == "decoupled":
        return DiLoCo(sync_every=s.sync_every, fragments=s.fragments)
    if config == "decoupled-mean":
        return DiLoCo(sync_every=s.sync_every, fragments=s.fragments, merge=WeightedMean())
    if config == "standard-p2":
        return DiLoCo.standard(s.sync_every, s.learners, fragments=s.fragments)
    raise ValueError(f"no gradientmail configuration {config!r}")


def _mailbox(job: Job) -> Any:
    from gradientmail.mailbox import LocalMailbox, S3Mailbox

    if job.endpoint:
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                          AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
        return S3Mailbox(BUCKET, prefix=job.arm.name, endpoint_url=job.endpoint)
    return LocalMailbox(Path(job.workdir) / job.arm.name)


def _gradientmail_worker(job: Job, model: Any, opt: Any, batches: Iterator[Any]) -> None:
    from gradientmail.adapters import TorchAdapter
    from gradientmail.events import Event, RoundRecorded, log_events
    from gradientmail.learner.runtime import Learner
    from gradientmail.mailbox.wrappers import CountingMailbox

    closers: dict[int, str] = {}

    def on_event(e: Event) -> None:
        if isinstance(e, RoundRecorded):
            closers[e.round] = e.closer
        log_events(e)

    box = CountingMailbox(_mailbox(job))
    learner = Learner(
        TorchAdapter(model),
        _algorithm(job.arm.config, job.settings),
        box,
        f"learner-{job.rank}",
        on_event=on_event,
        options=LearnerOptions(
            poll_interval=job.poll,
            compression="zstd" if job.arm.config == "f4" else "off",
        ),
    )
    learner.start()
    gradientmail_train(learner, box, model, opt, batches, job.settings.learners,
                       job.path("log"), job.path("pt"), job.path("json"), closers)


def gradientmail_train(learner: Any, box: Any, model: Any, opt: Any, batches: Iterator[Any],
                       learners: int, log_path: Path, pt_path: Path, json_path: Path,
                       closers: dict[int, str],
                       on_step: Callable[[int], None] | None = None) -> None:
    """Train a started `learner` (its mailbox counted by `box`, a `CountingMailbox`) on
    `batches` once `learners` are live: a `_StepLog` line per step at `log_path`,
    `on_step(step)` after each; then close it and save the model it ends on (`pt_path`)
    and the loop's and closing's seconds, bytes and `closers` (`json_path`)."""
    import torch

    learner.wait_for_learners(learners, timeout=600)
    box.reset()  # joining (Θ⁰ up for the creator, down for the other) is not counted
    log = _StepLog(log_path)
    t_loop = time.perf_counter()
    for i, ids in enumerate(batches):
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        learner.step(int(ids.numel()))
        t3 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        c = box.snapshot()
        log.write(t1 - t0, t3 - t1, t2 - t1, c.bytes_up, c.bytes_down)
        if on_step is not None:
            on_step(i + 1)
    loop = time.perf_counter() - t_loop
    t = time.perf_counter()
    learner.close()
    closing = time.perf_counter() - t
    c = box.snapshot()
    log.close()
    # close() reset the model to the newest commit of every fragment it knows of; the last
    # learner to close knows of them all (it waited for its rounds, then read every record).
    torch.save(model.state_dict(), pt_path)
    result = {"loop_seconds": loop, "close_seconds": closing, "closed_at": time.time(),
              "bytes_up": c.bytes_up, "bytes_down": c.bytes_down,
              "closers": {str(r): who for r, who in sorted(closers.items())}}
    json_path.write_text(json.dumps(result))
    asyncio.run(box.close())


def torchft_state(model: Any, opt: Any) -> tuple[Callable[[], dict[str, Any]],
                                                  Callable[[dict[str, Any]], None]]:
    """The `state_dict` / `load_state_dict` pair a torchft `Manager` recovers a replica
    with: the model and its inner optimizer."""

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": opt.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["inner"])

    return state_dict, load_state_dict


def torchft_train(manager: Any, model: Any, opt: Any, batches: Iterator[Any], sync_every: int,
                  log_path: Path, on_sync: Callable[[int], None] | None = None,
                  ) -> tuple[float, list[int]]:
    """Train on `batches` under torchft's DiLoCo (the outer step Nesterov SGD 0.7 / 0.9),
    a `_StepLog` line per step at `log_path`, `on_sync(step)` after each sync; the loop's
    seconds and each sync's participants."""
    import torch
    from torchft.local_sgd import DiLoCo

    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    marks: dict[str, float] = {}

    def adam_starts(*_: Any) -> None:
        marks["start"] = time.perf_counter()

    def adam_ends(*_: Any) -> None:
        marks["end"] = time.perf_counter()

    # Registered before DiLoCo's hooks, this post-hook runs before its sync; the pre-hook,
    # registered after them, runs after its state-dict lock: between them is AdamW alone.
    hooks = [opt.register_step_post_hook(adam_ends)]
    participants: list[int] = []
    log = _StepLog(log_path)
    t_loop = time.perf_counter()
    with DiLoCo(manager, [model], opt, outer, sync_every=sync_every, pin_memory=False):
        hooks.append(opt.register_step_pre_hook(adam_starts))
        for i, ids in enumerate(batches):
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if (i + 1) % sync_every == 0:
                participants.append(manager.num_participants())
                if on_sync is not None:
                    on_sync(i + 1)
            log.write(t1 - t0, t2 - t1, marks["end"] - marks["start"])
    loop = time.perf_counter() - t_loop
    for h in hooks:
        h.remove()
    log.close()
    return loop, participants


def _torchft_worker(job: Job, model: Any, opt: Any, batches: Iterator[Any]) -> None:
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not re-exported
    from torchft import Manager, ProcessGroupGloo

    s = job.settings
    state_dict, load_state_dict = torchft_state(model, opt)
    # A replica group of one process keeps its own TCPStore, as torchrun would host it.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=1, use_async_quorum=False,
        timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10), rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=job.lighthouse,
        replica_id=f"replica-{job.rank}", hostname="127.0.0.1", init_sync=False)
    # Every replica heartbeats before anyone trains: a quorum asked for while the other is
    # not yet known would go ahead alone (min_replicas=1), like gradientmail's
    # wait_for_learners.
    job.path("ready").touch()
    deadline = time.monotonic() + 600
    while not all(dataclasses.replace(job, rank=r).path("ready").exists()
                  for r in range(s.learners)):
        if time.monotonic() > deadline:
            raise SystemExit(f"replica-{job.rank}: the other replicas did not start in 600 s")
        time.sleep(0.05)
    time.sleep(0.5)  # a few heartbeats (every 100 ms)
    loop, participants = torchft_train(manager, model, opt, batches, s.sync_every,
                                       job.path("log"))
    if job.rank == SURVIVOR:
        torch.save(model.state_dict(), job.path("pt"))
    job.path("json").write_text(json.dumps({"loop_seconds": loop, "close_seconds": 0.0,
                                            "participants": participants}))
    manager.shutdown(wait=False)
    # The result is on disk; tearing gloo and the manager's threads down at interpreter exit
    # can hang on a dead peer, so leave without it (as convergence.py's LocalSGD does).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the main process ---------------------------------------------------------------------


#: Imported once by the fork server, so that a worker starts in a fraction of a second.
PRELOAD = ["torch", "transformers.models.gpt2.modeling_gpt2", "gradientmail.learner.runtime",
           "gradientmail.adapters.torch"]


def _context(torchft: bool) -> Any:
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD + (["torchft"] if torchft else []))
    return ctx


@contextmanager
def _lighthouse(heartbeat_ms: int) -> Iterator[str]:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=10_000,
                              quorum_tick_ms=100, heartbeat_timeout_ms=heartbeat_ms)
    try:
        # address() names the host by its hostname; it is bound to loopback only.
        yield f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    finally:
        server.shutdown()


@contextmanager
def _moto() -> Iterator[str]:
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        server.stop()


def _steps(path: Path) -> list[tuple[float, float, float, float, int, int]]:
    """The step lines of a log; a line cut short by a SIGKILL is no step."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        p = line.split()
        if len(p) == 6:
            out.append((float(p[0]), float(p[1]), float(p[2]), float(p[3]), int(p[4]),
                        int(p[5])))
    return out


def kill_step(s: conv.Settings) -> int:
    """The victim's default step to be SIGKILLed at: half way, mid-round."""
    return s.steps // 2 + s.sync_every // 2


def launch(jobs: list[Job], kill_at: int | None,
           timeout: float = 3600.0) -> tuple[float, float | None]:
    """Run the learners to the end, SIGKILLing the victim once it has logged `kill_at`
    steps (None: no kill); the wall seconds and the time of the kill."""
    ctx = _context(any(j.arm.system == "torchft" for j in jobs))
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_worker, args=(j,), daemon=True) for j in jobs]
    for p in procs:
        p.start()
    t_kill = None
    kill = kill_at is not None
    if kill_at is not None:
        log = jobs[VICTIM].path("log")
        t_kill = conv.kill_at_step(procs[VICTIM], lambda: len(_steps(log)), kill_at,
                                   time.monotonic() + timeout, jobs[0].arm.name)
    for p in procs:
        p.join(max(timeout - (time.perf_counter() - t0), 1.0))
    wall = time.perf_counter() - t0
    bad = [(j.rank, p.exitcode) for j, p in zip(jobs, procs, strict=True)
           if p.exitcode != 0 and not (kill and j.rank == VICTIM)]
    for p in procs:
        if p.is_alive():
            p.kill()
    if bad:
        raise SystemExit(f"{jobs[0].arm.name}: workers failed (rank, exit code): {bad}; "
                         "see their output")
    return wall, t_kill


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def round_window(step: int, h: int, rounds: int) -> int:
    """The round (1..`rounds`) whose window holds the 0-based `step`: round k is steps
    [kH − H/2, kH + H/2); the steps before H/2 count in round 1, and those after the
    last window (and the close) in round `rounds`."""
    return min(max(1, (step + h // 2) // h), rounds)


def summarize(arm: Arm, s: conv.Settings, jobs: list[Job], wall: float,
              t_kill: float | None, loss: float, allreduce_bytes: int) -> dict[str, Any]:
    """One table row from the workers' logs and results."""
    h = s.sync_every
    rounds = s.steps // h
    finished = [j for j in jobs if j.path("json").exists()]
    results = {j.rank: json.loads(j.path("json").read_text()) for j in finished}
    closers: dict[int, str] = {}  # round → its closer, the records as the learners read them
    for result in results.values():
        closers.update({int(r): who for r, who in result.get("closers", {}).items()})
    per_learner: dict[int, dict[str, Any]] = {}
    window_overheads: list[float] = []
    for j in finished:
        steps = _steps(j.path("log"))
        result = results[j.rank]
        windows = [0.0] * (rounds + 1)
        ups = [0] * (rounds + 1)
        downs = [0] * (rounds + 1)
        last_up = last_down = 0
        for i, (_, call, plain, _, up, down) in enumerate(steps):
            k = round_window(i, h, rounds)
            windows[k] += call - plain
            ups[k] += up - last_up
            downs[k] += down - last_down
            last_up, last_down = up, down
        windows[rounds] += result["close_seconds"]
        if arm.system == "gradientmail":
            ups[rounds] += result["bytes_up"] - last_up
            downs[rounds] += result["bytes_down"] - last_down
        window_overheads += windows[1:]
        row: dict[str, Any] = {"overhead": sum(windows) / rounds}
        if arm.system == "gradientmail":
            fragmented = arm.config in ("decoupled", "decoupled-mean", "standard-p2")
            committed = len(closers) / (s.fragments if fragmented else 1)
            row["up"] = result["bytes_up"] / committed
            row["down"] = result["bytes_down"] / committed
            if not fragmented and len(closers) >= rounds:
                me = f"learner-{j.rank}"
                closed = [k for k in range(1, rounds + 1) if closers[k - 1] == me]
                other = [k for k in range(1, rounds + 1) if closers[k - 1] != me]
                for name, ks in (("closer", closed), ("other", other)):
                    if ks:
                        row[name] = sum(ups[k] + downs[k] for k in ks) / len(ks)
        else:
            synced = sum(1 for n in result["participants"] if n >= 2)
            row["up"] = row["down"] = allreduce_bytes * synced / rounds
        if t_kill is not None:
            row["stall"] = max((call for _, call, _, end, _, _ in steps if end > t_kill),
                               default=0.0)
        per_learner[j.rank] = row
    return {
        "arm": arm, "loss": loss, "wall": wall, "learners": per_learner,
        "overhead": statistics.fmean(r["overhead"] for r in per_learner.values()),
        "overhead_median": statistics.median(window_overheads),
        "overhead_p90": _quantile(window_overheads, 0.9),
        "stall": per_learner[SURVIVOR].get("stall") if t_kill is not None else None,
        "close": results[SURVIVOR]["close_seconds"],
        "records": len(closers) if arm.system == "gradientmail" else None,
    }


def run_arm(arm: Arm, s: conv.Settings, workdir: Path, vocab: int, val: Any, poll: float,
            heartbeat_ms: int, endpoint: str, kill_at: int) -> dict[str, Any]:
    import torch

    def jobs(lighthouse: str = "") -> list[Job]:
        return [Job(arm, r, s, str(workdir), poll,
                    endpoint if arm.store.startswith("S3") else "", lighthouse)
                for r in range(s.learners)]

    model = conv.build_model(s, vocab)
    allreduce_bytes = sum(p.numel() * 4 for p in model.parameters())
    if arm.system == "torchft":
        with _lighthouse(heartbeat_ms) as address:
            js = jobs(address)
            wall, t_kill = launch(js, kill_at if arm.kill else None)
        final = js[SURVIVOR]
    else:
        js = jobs()
        wall, t_kill = launch(js, kill_at if arm.kill else None)
        final = max((j for j in js if j.path("json").exists()),
                    key=lambda j: float(json.loads(j.path("json").read_text())["closed_at"]))
    model.load_state_dict(torch.load(final.path("pt")))
    loss = conv.evaluate(model, val)
    return summarize(arm, s, js, wall, t_kill, loss, allreduce_bytes)


def _mb(n: float | None) -> str:
    if n is None:
        return "—"
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _sec(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f} s"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| system | arm | store | held-out loss | sync overhead per round: mean / median / "
        "p90 | bytes up / down per learner per round (learner-0; learner-1) | as closer / "
        "not (learner-0; learner-1) | survivor's longest stall after the kill | records | "
        "wall s |",
        "|---|---|---|---:|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        arm: Arm = r["arm"]
        ls = r["learners"]
        updown = "; ".join(f"{_mb(ls[k]['up'])} / {_mb(ls[k]['down'])}" for k in sorted(ls))
        roles = "; ".join(f"{_mb(ls[k].get('closer'))} / {_mb(ls[k].get('other'))}"
                          for k in sorted(ls)) if arm.system == "gradientmail" else "—"
        label = LABELS[(arm.system, arm.config)] + (" + SIGKILL" if arm.kill else "")
        lines.append(
            f"| {arm.system} | {label} | {arm.store} | {r['loss']:.4f} | "
            f"{_sec(r['overhead'])} / {_sec(r['overhead_median'])} / {_sec(r['overhead_p90'])} "
            f"| {updown} | {roles} | {_sec(r['stall'])} | "
            f"{r['records'] if r['records'] is not None else '—'} | {r['wall']:.0f} |")
    return "\n".join(lines)


def reading(rows: list[dict[str, Any]]) -> list[str]:
    """The ratios against torchft and the goals."""
    by = {r["arm"].name: r for r in rows}
    out: list[str] = []
    tft = by.get("torchft")
    if tft is None:
        return out

    def total(r: dict[str, Any], k: int) -> float:
        return float(r["learners"][k]["up"] + r["learners"][k]["down"])

    tft_bytes = statistics.fmean(total(tft, k) for k in tft["learners"])
    std = by.get("standard")
    if std is not None:
        ratio = std["overhead"] / tft["overhead"] if tft["overhead"] > 0 else math.inf
        out.append(f"sync overhead per round, standard DiLoCo on the local directory vs "
                   f"torchft: {std['overhead']:.2f} s vs {tft['overhead']:.2f} s = {ratio:.2f}x "
                   f"(goal <= 1.0x: {'met' if ratio <= 1.0 else 'NOT met'})")
        each = [total(std, k) / tft_bytes for k in sorted(std["learners"])]
        mean = statistics.fmean(each)
        out.append(f"bytes up + down per learner per round at F32 (standard, closing "
                   f"included) vs torchft's {_mb(tft_bytes)}: mean {mean:.3f}x, per learner "
                   f"{' / '.join(f'{x:.3f}x' for x in each)} (goal mean <= 1.25x: "
                   f"{'met' if mean <= 1.25 else 'NOT met'})")
        roles = [(k, std["learners"][k].get("other")) for k in sorted(std["learners"])]
        other = [f"learner-{k} {v / tft_bytes:.3f}x" for k, v in roles if v is not None]
        if other:
            worst = max(v / tft_bytes for _, v in roles if v is not None)
            out.append(f"bytes of a learner in the rounds it did not close vs torchft: "
                       f"{', '.join(other)} (goal <= 1.0x: "
                       f"{'met' if worst <= 1.0 else 'NOT met'})")
        out.append(f"held-out loss, standard DiLoCo / torchft: "
                   f"{std['loss'] / tft['loss']:.3f}x ({std['loss']:.4f} vs {tft['loss']:.4f})")
    for name in ("standard-s3", "decoupled", "decoupled-mean", "standard-p2", "f4"):
        r = by.get(name)
        if r is not None:
            mean = statistics.fmean(total(r, k) for k in r["learners"]) / tft_bytes
            out.append(f"{name}: loss {r['loss'] / tft['loss']:.3f}x torchft's, sync overhead "
                       f"{r['overhead']:.2f} s per round, bytes {mean:.2f}x")
    kills = [(n, by[n]["stall"]) for n in ("torchft-kill", "standard-kill", "decoupled-kill")
             if n in by]
    if kills:
        out.append("survivor's longest step call after the SIGKILL: " + ", ".join(
            f"{n} {_sec(x)} (its close() {_sec(by[n]['close'])})" for n, x in kills)
            + ". torchft's lighthouse counts the heartbeat timeout from the victim's last "
            "heartbeat, so the training between the kill and the survivor's next sync comes "
            "off its stall; gradientmail's closer calls the roll only once the survivor's "
            "round waits short of its quorum, and judges the call after its answer deadline")
    return out


def _require(arms: list[Arm]) -> None:
    import importlib

    def missing(module: str) -> bool:
        try:
            importlib.import_module(module)
        except ImportError:
            return True
        return False

    if any(a.system == "torchft" for a in arms) and missing("torchft"):
        raise SystemExit(f"torchft is not installed, and the torchft arms need it: "
                         f"{PEERS_HINT} (torchft==0.2.0); or choose gradientmail arms only "
                         "with --arms")
    if any(a.store.startswith("S3") for a in arms) and (missing("moto.server")
                                                       or missing("boto3")):
        raise SystemExit("the S3 arm runs moto's server on 127.0.0.1: pip install "
                         "'gradientmail[dev]' (moto[server], boto3); or leave standard-s3 out "
                         "of --arms")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="S=120 (minutes)")
    size.add_argument("--smoke", action="store_true", help="tiny sizes (seconds; no append)")
    ap.add_argument("--arms", default=",".join(a.name for a in ARMS
                                               if a.name not in OPT_IN_ARMS))
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per learner")
    ap.add_argument("--kill-at", type=int, default=None,
                    help="the victim's step to SIGKILL it at (default S/2 + H/2, mid-round)")
    ap.add_argument("--poll", type=float, default=1.0,
                    help="gradientmail's poll interval in seconds (default: the library's 1.0)")
    ap.add_argument("--heartbeat-ms", type=int, default=5000,
                    help="torchft lighthouse heartbeat timeout (default: its 5000)")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the initial weights and the batches (default: the preset's 0)")
    ap.add_argument("--results", default=str(RESULTS), help="markdown file to append to")
    args = ap.parse_args(argv)
    preset = "smoke" if args.smoke else "quick" if args.quick else "full"
    s = PRESETS[preset]
    if args.steps is not None:
        s = dataclasses.replace(s, steps=args.steps)
    if args.seed is not None:
        s = dataclasses.replace(s, seed=args.seed)
    names = args.arms.split(",")
    unknown = set(names) - {a.name for a in ARMS}
    if unknown:
        raise SystemExit(f"--arms: unknown {sorted(unknown)}; choose from "
                         f"{[a.name for a in ARMS]}")
    arms = [a for a in ARMS if a.name in names]
    if s.steps % s.sync_every or s.sync_every % s.fragments:
        raise SystemExit(f"--steps {s.steps} must be a multiple of H={s.sync_every} (and H of "
                         f"P={s.fragments}), so that both systems end on a sync")
    # torchft's Rust servers log every quorum at INFO to stderr (read once, at import);
    # warnings still show.
    os.environ.setdefault("RUST_LOG", "warn")
    kill_at = args.kill_at if args.kill_at is not None else kill_step(s)
    if not 0 < kill_at < s.steps:
        raise SystemExit(f"--kill-at {kill_at} must be within the {s.steps} steps")
    _require(arms)

    import torch

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="gm-vs-torchft-"))
    vocab, n_train = conv.prepare_data(s, workdir)
    val = torch.load(workdir / "val.pt")
    n_params = sum(p.numel() for p in conv.build_model(s, vocab).parameters())
    print(f"data: {n_train:,} training tokens, {val.numel():,} held out, vocabulary {vocab}; "
          f"model {n_params:,} parameters; workdir {workdir}", flush=True)
    rows = []
    with _moto() if any(a.store.startswith("S3") for a in arms) else _nothing() as endpoint:
        for arm in arms:
            rows.append(run_arm(arm, s, workdir, vocab, val, args.poll, args.heartbeat_ms,
                                endpoint, kill_at))
            r = rows[-1]
            print(f"{arm.name}: loss {r['loss']:.4f}, sync overhead {r['overhead']:.3f} s per "
                  f"round, stall {_sec(r['stall'])}, {r['wall']:.0f} s", flush=True)
    versions = f"torch {torch.__version__}, torchft {_version('torchft')}"
    command = sys.argv[1:] if argv is None else argv
    header = (
        f"\n## side by side with torchft — {datetime.date.today()}\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs), "
        f"one torch thread per learner process; {versions}. GPT-2 {s.n_layer}×{s.n_embd}, "
        f"{n_params:,} parameters, BPE vocabulary {vocab} over the standard library; "
        f"{s.learners} learners, each its half of the data, batch {s.batch}×{s.block}, "
        f"AdamW lr {s.lr} wd 0.1, clip 1.0, H = {s.sync_every}, S = {s.steps} steps each, "
        f"outer Nesterov lr 0.7 momentum 0.9; same seeds for both systems. gradientmail: "
        f"library defaults{'' if args.poll == 1.0 else f' except the poll, {args.poll:g} s'} "
        f"(poll 1 s, leases 60 s / 120 s), embedded closers. "
        f"torchft 0.2.0: `local_sgd.DiLoCo` over the whole model, a Manager per learner "
        f"(replica group of 1), ProcessGroupGloo timeout 10 s, manager timeout 10 s, "
        f"lighthouse min_replicas 1, join timeout 10 s, heartbeat timeout "
        f"{args.heartbeat_ms} ms. Kill arms: learner 1 SIGKILLed at its step "
        f"{kill_at}. Sync overhead: seconds of `optimizer.step()` (+ `Learner.step()`, "
        f"+ `close()`) beyond the AdamW update, per round of H steps. Bytes: gradientmail "
        f"counted by `CountingMailbox` after joining (records and leases included); torchft "
        f"= params × 4 bytes each way per 2-replica allreduce. Preset `{preset}`, "
        f"{time.perf_counter() - t0:.0f}s in all.\n"
        f"Command: `{' '.join(['python', 'benchmarks/vs_torchft.py', *command])}`\n\n"
    )
    text = header + table(rows) + "\n\n" + "\n".join(f"- {x}" for x in reading(rows))
    print(text)
    if not args.smoke:
        with Path(args.results).open("a") as f:
            f.write(text + "\n")


@contextmanager
def _nothing() -> Iterator[str]:
    yield ""


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
