"""Cross-site rehearsal: learners behind shaped links to an S3 server, beside DDP and torchft.

    sudo python benchmarks/cross_site.py [--quick | --smoke] [--learners M] [--steps S]
        [--link 20mbit[,none,...]] [--rates R0,R1,...] [--systems a,b,...] [--target LOSS]
        [--ddp-steps N] [--ddp-seconds T] [--json PATH] [--plot PATH] [--results PATH]

Needs root or CAP_NET_ADMIN (network namespaces, veth pairs, `tc ... tbf`): where any of
them is refused it says so in one line and exits 0 having measured nothing. Needs moto's
server (`pip install 'gradientmail[dev]'`); the `torchft` system needs torchft 0.2.0
(`pip install 'gradientmail[peers]'`) and is skipped with a note without it.

Every learner r runs in its own network namespace, joined to the root namespace by a veth
pair whose two ends are shaped with a token bucket (`tbf`) at the link's rate, so that
both directions of the link are limited (`--link`: 20mbit, 100mbit, 1gbit or none, a
comma list runs each in turn; `--rates` gives each learner its own rate, a slow site).
moto's S3 server listens in the root namespace, the bucket every gradientmail learner
reaches through its link. IP forwarding is on and every namespace routes through the root
namespace, so a byte between two learners (DDP, torchft) crosses two shaped links, as
between sites. Names and subnets carry this process's pid; everything is removed at the
end (also on SIGINT / SIGTERM).

Systems (`--systems`), on the same links, model, data, seeds and token budget (the model,
data and schedule of benchmarks/vs_torchft.py: GPT-2 2×128, BPE vocabulary 4096 over the
standard library, batch 16×128, AdamW 1e-3, H = 20, S = 400 steps, outer Nesterov 0.7 /
0.9; `--quick` the one-layer smoke model of benchmarks/convergence.py for 60 steps):

- `ddp`: M processes, gloo allreduce (mean) of the gradients every step;
- `torchft`: torchft 0.2.0 `local_sgd.DiLoCo`, lighthouse in the root namespace, a replica
  group per namespace whose Manager and TCPStore advertise the namespace's address;
- `standard`: `DiLoCo.standard(H, M)`, embedded closers;
- `standard-closer`: the same with `gradientmail sync` in the root namespace, next to the
  bucket (unshaped); the learners' own closers stand by as its backups (the default);
- `decoupled`: `DiLoCo(sync_every=H, fragments=2)`, the library's defaults;
- `decoupled-f4`: the same with F4 deltas, F4 commits and zstd;
- `standard-closer-sign1`: `standard-closer` with SIGN1 deltas, the learners' momentum 0.8,
  the closer's plain SGD step and zstd; by default only behind links of 20 Mbit/s or
  less, where these payloads reached the loss they reach sooner than F32 deltas (named
  in `--systems`, it runs on any link);
- `standard-closer-pipelined`: `standard-closer-zstd` as a pipelined barrier,
  `DiLoCo.standard(H, M, fragments=P, stagger=False)`: the P fragments' rounds of a sync
  go out at the same step, one after another, so one fragment's upload overlaps the
  merge and download of the one before; by default only behind links of 100 Mbit/s or
  less (named in `--systems`, on any link);
- opt-in: `decoupled-mean` (the weighted mean in every round), `standard-closer-zstd`
  (`standard-closer` with zstd payloads), `standard-pipelined` (the pipelined barrier
  with embedded closers only).

Measured per system and link:

- wall: launch to the slowest learner's exit (process start and joining included);
- held-out loss against wall-clock: learner 0 saves its model after every H-th step (for
  standard DiLoCo, DDP and torchft the synced model; for Decoupled its own model, the
  commits it has merged) and they are evaluated after the run; the last point is what a
  user keeps: gradientmail's newest committed model (the last learner to close, as in
  vs_torchft.py), torchft's and DDP's final model;
- time to the target: the first point at or below `--target` (default: the worst of the
  systems' best losses, a loss every system reaches);
- bytes through each learner's link: the root-side veth's rx + tx counters before and
  after (every byte: payloads, HTTP, gloo, heartbeats, retransmissions);
- barrier per round: Σ (step call − AdamW step) / rounds, as vs_torchft.py measures it
  (gradientmail's close() included), against the transfer floor, one fragment up and one
  down at the link's rate (payload bytes × 8 / rate × 2); and the barrier of the last
  learner to arrive (the least of the learners' per sync, median over the syncs): the
  others' also holds their wait for its steps. Bytes per round through a link against a
  ring allreduce's 2(M−1)/M × the fragment's bytes each way.

Prints a markdown table and a reading, writes a PNG of held-out loss against wall-clock
(with matplotlib), `--json` the rows, and appends to RESULTS.md unless `--quick`/`--smoke`
(or `--results ''`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import convergence as conv  # benchmarks/ is not a package
import vs_torchft as vt

from gradientmail.app.links import (
    CREDENTIALS,
    Links,
    parse_rate,
    refusal,
    s3_server,
    standalone_closer,
)

__all__ = ["PRESETS", "SYSTEMS", "Links", "main", "parse_rate", "run_system"]

HERE = Path(__file__).resolve().parent
SYSTEMS = ("ddp", "torchft", "standard", "standard-closer", "decoupled", "decoupled-f4",
           "decoupled-mean", "standard-closer-zstd", "standard-closer-sign1",
           "standard-closer-pipelined", "standard-pipelined")
#: Systems run only when named (`--systems`): what they measure is a question, not a row of
#: the default comparison.
OPT_IN = frozenset({"decoupled-mean", "standard-closer-zstd", "standard-pipelined"})
#: Systems the default comparison runs only behind links of at most so many bits/s: the
#: settings for slow links, which lose where the link is not the bottleneck (1-bit deltas
#: on time to loss; a pipelined barrier's second round on a fast link).
ON_SLOW_LINKS = {"standard-closer-sign1": 20e6, "standard-closer-pipelined": 100e6}
LABELS = {
    "ddp": "DDP-equivalent (gloo allreduce of gradients every step)",
    "torchft": "torchft 0.2.0 DiLoCo (lighthouse + Manager per site)",
    "standard": "gradientmail standard DiLoCo (embedded closers)",
    "standard-closer": "gradientmail standard DiLoCo (closer next to the bucket)",
    "decoupled": "gradientmail Decoupled defaults (P=2)",
    "decoupled-f4": "gradientmail Decoupled, F4 deltas + commits, zstd",
    "decoupled-mean": "gradientmail Decoupled defaults with merge=WeightedMean()",
    "standard-closer-zstd": "gradientmail standard DiLoCo, closer next to the bucket, zstd",
    "standard-closer-sign1": "gradientmail standard DiLoCo, closer next to the bucket, SIGN1 "
                             "deltas with the learners' momentum 0.8, zstd",
    "standard-pipelined": "gradientmail standard DiLoCo, embedded closers, zstd, pipelined",
    "standard-closer-pipelined": "gradientmail standard DiLoCo, closer next to the bucket, "
                                 "zstd, pipelined (P fragments, stagger=False)",
}
#: Systems whose payloads are compressed (zstd): their floor counts the fragment's F32
#: bytes, which compression beats.
COMPRESSED = ("-f4", "-zstd", "-sign1", "-pipelined")
PRESETS: dict[str, conv.Settings] = {
    "full": vt.BASE,
    # The one-layer model of convergence.py's smoke preset: seconds of training a system,
    # so that the test suite can afford a rehearsal; the numbers mean nothing.
    "quick": dataclasses.replace(conv.PRESETS["smoke"], steps=60, sync_every=20, fragments=2),
    "smoke": dataclasses.replace(conv.PRESETS["smoke"], steps=24, sync_every=6, fragments=2),
}
BUCKET = "gm-cross-site"


# -- workers (one process per learner, in its namespace) ----------------------------------


def _snapshot(spec: dict[str, Any], model: Any, step: int) -> None:
    import torch

    wd = Path(spec["workdir"])
    torch.save(model.state_dict(), wd / f"{spec['name']}-snap-{step}.pt")
    with (wd / f"{spec['name']}-snaps.txt").open("a") as f:
        f.write(f"{step} {time.time():.6f}\n")


def worker(spec_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    s = conv.Settings(**spec["settings"])
    rank, wd = int(spec["rank"]), Path(spec["workdir"])
    data = torch.load(wd / "train.pt")
    rows = data[rank :: s.learners]
    model = conv.build_model(s, int(torch.load(wd / "vocab.pt")))
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.1)
    g = torch.Generator().manual_seed(s.seed + 1 + rank)

    def batches() -> Iterator[Any]:
        for _ in range(s.steps):
            yield rows[torch.randint(0, rows.shape[0], (s.batch,), generator=g)]

    system = spec["system"]
    if system == "ddp":
        _ddp_worker(spec, s, model, opt, batches())
    elif system == "torchft":
        _torchft_worker(spec, s, model, opt, batches())
    else:
        _gradientmail_worker(spec, s, model, opt, batches())


def _log_path(spec: dict[str, Any], suffix: str) -> Path:
    # vs_torchft.Job.path's naming, so that vs_torchft.summarize reads these logs.
    return Path(spec["workdir"]) / f"{spec['name']}-{spec['rank']}.{suffix}"


def _ddp_worker(spec: dict[str, Any], s: conv.Settings, model: Any, opt: Any,
                batches: Iterator[Any]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=spec["master"], MASTER_PORT=str(spec["port"]),
                      GLOO_SOCKET_IFNAME=spec["ifname"])
    rank, m = int(spec["rank"]), s.learners
    dist.init_process_group("gloo", rank=rank, world_size=m, timeout=timedelta(seconds=300))
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)
    flat = torch.zeros(n + 1)  # + 1: rank 0's "stop" vote travels with the gradients
    cap_steps, cap_seconds = int(spec["max_steps"]), float(spec["max_seconds"])
    log = vt._StepLog(_log_path(spec, "log"))
    t_loop = time.perf_counter()
    steps = 0
    for i, ids in enumerate(batches):
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        t1 = time.perf_counter()
        offset = 0
        for p in params:
            flat[offset:offset + p.numel()] = p.grad.reshape(-1)
            offset += p.numel()
        late = rank == 0 and (i + 1 >= cap_steps or time.perf_counter() - t_loop > cap_seconds)
        flat[n] = 1.0 if late else 0.0
        dist.all_reduce(flat)
        flat /= m
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        steps = i + 1
        log.write(t1 - t0, t3 - t1, t3 - t2)
        if rank == 0 and (steps % s.sync_every == 0 or steps == s.steps):
            _snapshot(spec, model, steps)
        if flat[n] > 0:
            break
    loop = time.perf_counter() - t_loop
    log.close()
    if rank == 0 and steps % s.sync_every and steps != s.steps:
        _snapshot(spec, model, steps)
    _log_path(spec, "json").write_text(json.dumps(
        {"loop_seconds": loop, "close_seconds": 0.0, "steps": steps, "params": n}))
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown at exit can hang on a peer already gone


def _torchft_worker(spec: dict[str, Any], s: conv.Settings, model: Any, opt: Any,
                    batches: Iterator[Any]) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not re-exported
    from torchft import Manager, ProcessGroupGloo

    os.environ["GLOO_SOCKET_IFNAME"] = spec["ifname"]
    addr, rank = spec["addr"], int(spec["rank"])
    state_dict, load_state_dict = vt.torchft_state(model, opt)
    # The replica group's store and manager advertise the namespace's address: the peer
    # and the lighthouse reach them through the links.
    store = TCPStore(addr, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=1, use_async_quorum=False,
        timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=30), rank=0, world_size=1,
        store_addr=addr, store_port=store.port, lighthouse_addr=spec["lighthouse"],
        replica_id=f"replica-{rank}", hostname=addr, init_sync=False)
    loop, participants = vt.torchft_train(
        manager, model, opt, batches, s.sync_every, _log_path(spec, "log"),
        on_sync=(lambda step: _snapshot(spec, model, step)) if rank == 0 else None)
    _log_path(spec, "json").write_text(json.dumps(
        {"loop_seconds": loop, "close_seconds": 0.0, "participants": participants}))
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)  # as vs_torchft.py: the teardown at exit can hang on a peer


def _algorithm(system: str, s: conv.Settings) -> Any:
    from gradientmail.algorithms.diloco import DiLoCo

    if system in ("standard", "standard-closer", "standard-closer-zstd"):
        return DiLoCo.standard(s.sync_every, s.learners)
    if system in ("standard-closer-pipelined", "standard-pipelined"):
        return DiLoCo.standard(s.sync_every, s.learners, fragments=s.fragments, stagger=False)
    if system == "standard-closer-sign1":
        # The 1-bit setting of benchmarks/RESULTS.md's sparse section: each learner keeps
        # the Nesterov momentum of its own deltas; the closer steps by plain SGD.
        return DiLoCo.standard(s.sync_every, s.learners, delta_dtype="SIGN1",
                               feedback_momentum=0.8, outer_momentum=0.0)
    if system == "decoupled":
        return DiLoCo(sync_every=s.sync_every, fragments=s.fragments)
    if system == "decoupled-mean":
        from gradientmail.algorithms.merge import WeightedMean

        return DiLoCo(sync_every=s.sync_every, fragments=s.fragments, merge=WeightedMean())
    if system == "decoupled-f4":
        return DiLoCo(sync_every=s.sync_every, fragments=s.fragments, delta_dtype="F4",
                      commit_dtype="F4")
    raise ValueError(f"no gradientmail configuration {system!r}")


def _gradientmail_worker(spec: dict[str, Any], s: conv.Settings, model: Any, opt: Any,
                         batches: Iterator[Any]) -> None:


    from gradientmail.adapters import TorchAdapter
    from gradientmail.events import Event, RoundRecorded
    from gradientmail.learner.options import LearnerOptions
    from gradientmail.learner.runtime import Learner
    from gradientmail.mailbox import S3Mailbox
    from gradientmail.mailbox.wrappers import CountingMailbox

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    system, rank = spec["system"], int(spec["rank"])
    closers: dict[int, str] = {}
    events = _log_path(spec, "events").open("a")

    def on_event(e: Event) -> None:
        if isinstance(e, RoundRecorded):
            closers[e.round] = e.closer
        fields = {f.name: getattr(e, f.name) for f in dataclasses.fields(e)}
        events.write(json.dumps({"t": time.time(), "event": type(e).__name__, **fields},
                                default=str) + "\n")
        events.flush()

    box = CountingMailbox(S3Mailbox(BUCKET, prefix=spec["name"], endpoint_url=spec["endpoint"]))
    # The learners keep their embedded closers (the library's default) in every system:
    # beside a live standalone closer they stand by as its backups.
    options = LearnerOptions(poll_interval=spec["poll"],
                             compression="zstd" if system.endswith(COMPRESSED) else "off")
    learner = Learner(TorchAdapter(model), _algorithm(system, s), box, f"learner-{rank}",
                      on_event=on_event, options=options)
    learner.start()

    def snapshot(step: int) -> None:
        if rank == 0 and step % s.sync_every == 0:
            _snapshot(spec, model, step)

    vt.gradientmail_train(learner, box, model, opt, batches, s.learners,
                          _log_path(spec, "log"), _log_path(spec, "pt"),
                          _log_path(spec, "json"), closers, on_step=snapshot)
    events.close()


# -- the main process ---------------------------------------------------------------------


@contextlib.contextmanager
def _s3_server() -> Iterator[int]:
    """moto's S3 server on every address of the root namespace (each learner reaches it at
    its link's root-side address); yields its port."""
    os.environ.update(CREDENTIALS)
    with s3_server(BUCKET) as port:
        yield port


@contextlib.contextmanager
def _lighthouse(m: int) -> Iterator[int]:
    from torchft.coordination import LighthouseServer

    # Every replica group in every round (no failures here): a quorum waits for all M.
    server = LighthouseServer(bind="0.0.0.0:0", min_replicas=m, join_timeout_ms=10_000,
                              quorum_tick_ms=100)
    try:
        yield int(server.address().rsplit(":", 1)[1])
    finally:
        server.shutdown()


def _standalone_closer(name: str, port: int, poll: float,
                       out: Path) -> contextlib.AbstractContextManager[None]:
    """`gradientmail sync` in the root namespace, on the bucket's own machine."""
    return standalone_closer(f"s3://{BUCKET}/{name}", f"http://127.0.0.1:{port}", poll, out)


def _launch(specs: list[dict[str, Any]], links: Links, workdir: Path,
            timeout: float) -> tuple[float, list[int]]:
    """Run every learner as `ip netns exec NS python this --worker SPEC`; the wall seconds
    to the last exit and the exit codes (None-free: a hung one is killed, -9)."""
    procs = []
    t0 = time.perf_counter()
    for spec in specs:
        path = workdir / f"{spec['name']}-{spec['rank']}.spec.json"
        path.write_text(json.dumps(spec))
        out = (workdir / f"{spec['name']}-{spec['rank']}.out").open("w")
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", links.ns[spec["rank"]], sys.executable, __file__,
             "--worker", str(path)], stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True))
        out.close()
    codes: list[int] = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(max(timeout - (time.perf_counter() - t0), 1.0)))
            except subprocess.TimeoutExpired:
                codes.append(-9)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return time.perf_counter() - t0, codes


def _curve(name: str, workdir: Path, s: conv.Settings, vocab: int, val: Any,
           t0: float) -> list[tuple[float, int, float]]:
    """(seconds since launch, step, held-out loss) of learner 0's snapshots."""
    import torch

    path = workdir / f"{name}-snaps.txt"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        step, t = line.split()
        model = conv.build_model(s, vocab)
        model.load_state_dict(torch.load(workdir / f"{name}-snap-{step}.pt"))
        out.append((float(t) - t0, int(step), conv.evaluate(model, val)))
        (workdir / f"{name}-snap-{step}.pt").unlink()
    return out


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def closer_events(path: Path) -> list[dict[str, Any]]:
    """RoundClaimed / RoundClosed of a standalone closer, from its logged lines (`gradientmail
    sync` logs events with the logging module's local-time stamps)."""
    out: list[dict[str, Any]] = []
    pattern = re.compile(r"^(\S+ \S+) gradientmail INFO (RoundClaimed|RoundClosed)\((.*)\)$")
    for line in path.read_text().splitlines() if path.exists() else []:
        m = pattern.match(line)
        if not m:
            continue
        t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        e: dict[str, Any] = {"t": t, "event": m.group(2)}
        for key, value in re.findall(r"(\w+)=('[^']*'|[-\d.e]+)", m.group(3)):
            e[key] = value.strip("'") if value.startswith("'") else float(value)
        e["round"] = int(e["round"])
        out.append(e)
    return out


def barrier_breakdown(events: dict[int, list[dict[str, Any]]]) -> dict[str, float] | None:
    """Where a barrier round's time went, from the learners' events (standard DiLoCo,
    P = 1): medians over the rounds of (a) the last non-held delta's upload
    (SnapshotPublished.seconds), (b) from that upload's end to the closer's claim, (c) the
    closer's claim to its commit (download of the deltas, merge, upload of step/theta:
    RoundClosed.seconds), (d) the commit to the other learner's FragmentAligned (its poll
    and download of the step), and the payload bytes of each."""
    import statistics

    by_round: dict[int, dict[str, Any]] = {}
    for rank, evs in events.items():
        for e in evs:
            r = e.get("round")
            if r is None:
                continue
            d = by_round.setdefault(r, {"pub": [], "aligned": {}})
            if e["event"] == "SnapshotPublished":
                d["pub"].append(e)
            elif e["event"] == "RoundClaimed":
                d["claim"] = e
            elif e["event"] == "RoundClosed":
                d["closed"] = e
            elif e["event"] == "FragmentAligned":
                d["aligned"][rank] = e
    cols: dict[str, list[float]] = {k: [] for k in (
        "upload_s", "to_claim_s", "close_s", "other_aligned_s", "delta_bytes", "commit_bytes",
        "step_down_bytes", "boundary_to_aligned_s")}
    for d in by_round.values():
        if "closed" not in d or "claim" not in d:
            continue
        closer = d["closed"]["closer"]
        sent = [e for e in d["pub"] if not e.get("held") and e["learner"] != closer]
        others = [a for r, a in d["aligned"].items() if f"learner-{r}" != closer]
        if not sent or not others:
            continue
        last = max(sent, key=lambda e: e["t"])
        closed_t = d["closed"]["t"]
        cols["upload_s"].append(last["seconds"])
        cols["to_claim_s"].append(d["claim"]["t"] - last["t"])
        cols["close_s"].append(d["closed"]["seconds"])
        cols["other_aligned_s"].append(max(a["t"] for a in others) - closed_t)
        cols["delta_bytes"].append(last["bytes"])
        cols["commit_bytes"].append(d["closed"]["bytes"])
        cols["step_down_bytes"].append(max(a["bytes"] for a in others))
        cols["boundary_to_aligned_s"].append(
            max(a["t"] for a in others) - (last["t"] - last["seconds"]))
    if not cols["upload_s"]:
        return None
    out = {k: statistics.median(v) for k, v in cols.items()}
    out["rounds"] = float(len(cols["upload_s"]))
    return out


def last_arrivers_barrier(logs: list[list[tuple[Any, ...]]], h: int) -> float | None:
    """The barrier of the learner that waited for no one's steps: per window of H steps
    around a sync (`vs_torchft.round_window`; the first and the closing one left out),
    the least time any learner's step calls spent beyond their optimizer steps; the median
    over the windows. What a sync costs when learners are equal: the others' barrier also
    holds their wait for the last one's steps (here, learners sharing 2 cores)."""
    import statistics

    windows: list[list[float]] = []
    for steps in logs:
        n = len(steps) // h
        if n < 3:
            return None
        w = [0.0] * (n + 1)
        for i, (_, call, plain, *_) in enumerate(steps):
            w[vt.round_window(i, h, n)] += call - plain
        windows.append(w[2:n])
    least = [min(w[k] for w in windows) for k in range(min(len(w) for w in windows))]
    return statistics.median(least) if least else None


def sync_breakdown(events: dict[int, list[dict[str, Any]]],
                   per_sync: int) -> dict[str, float] | None:
    """A pipelined barrier's sync (`stagger=False`, `per_sync` rounds a sync), from the
    learners' events: medians over the syncs of the last learner's start of its first
    upload to the last learner aligned with the sync's last round (`boundary_to_aligned_s`,
    as `barrier_breakdown`'s), and of that learner's uploads' seconds end to end."""
    import statistics

    # (sync, rank) -> [first upload's start, last upload's end]
    uploads: dict[tuple[int, int], list[float]] = {}
    aligned: dict[int, list[float]] = {}
    for rank, evs in events.items():
        for e in evs:
            r = e.get("round")
            if r is None or rank < 0:
                continue
            k, last = divmod(int(r), per_sync)
            if e["event"] == "SnapshotPublished" and not e.get("held"):
                span = uploads.setdefault((k, rank), [math.inf, -math.inf])
                span[0], span[1] = min(span[0], e["t"] - e["seconds"]), max(span[1], e["t"])
            elif e["event"] == "FragmentAligned" and last == per_sync - 1:
                aligned.setdefault(k, []).append(e["t"])
    spans, ups = [], []
    for k in sorted({k for k, _ in uploads}):
        mine = {rank: span for (kk, rank), span in uploads.items() if kk == k}
        if len(aligned.get(k, ())) < len(mine):
            continue
        first, end = max(mine.values())  # the learner that started last
        spans.append(max(aligned[k]) - first)
        ups.append(end - first)
    if not spans:
        return None
    return {"boundary_to_aligned_s": statistics.median(spans),
            "upload_s": statistics.median(ups), "rounds": float(len(spans))}


@dataclasses.dataclass
class Run:
    """What one system on one link needs from the main process."""

    system: str
    link: str
    rates: list[float | None]
    s: conv.Settings
    workdir: Path
    vocab: int
    val: Any
    links: Links
    s3_port: int
    poll: float
    ddp_steps: int
    ddp_seconds: float
    timeout: float


def run_system(run: Run) -> dict[str, Any]:
    """Train one system on the current links; its row (curve, bytes, barrier...)."""
    import torch

    s, m, system = run.s, run.s.learners, run.system
    name = re.sub(r"[^a-z0-9-]", "", f"{system}-{run.link}".lower())
    base = {"name": name, "system": system, "settings": dataclasses.asdict(s),
            "workdir": str(run.workdir), "poll": run.poll}
    specs = []
    for r in range(m):
        spec = dict(base, rank=r, addr=run.links.addr(r), ifname=run.links.ns_dev[r],
                    endpoint=f"http://{run.links.host(r)}:{run.s3_port}")
        if system == "ddp":
            spec.update(master=run.links.addr(0), port=29500 + os.getpid() % 1000,
                        max_steps=run.ddp_steps or s.steps,
                        max_seconds=run.ddp_seconds or math.inf)
        specs.append(spec)
    before = run.links.split_counters()
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        if system == "torchft":
            port = stack.enter_context(_lighthouse(m))
            for r, spec in enumerate(specs):
                spec["lighthouse"] = f"http://{run.links.host(r)}:{port}"
        if system.startswith("standard-closer"):
            stack.enter_context(_standalone_closer(name, run.s3_port, run.poll,
                                                   run.workdir / f"{name}-closer.out"))
        wall, codes = _launch(specs, run.links, run.workdir, run.timeout)
    after = run.links.split_counters()
    up_down = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    row: dict[str, Any] = {"system": system, "link": run.link, "wall": wall,
                           "link_bytes": [u + d for u, d in up_down], "link_up_down": up_down,
                           "codes": codes}
    if any(codes):
        tails = []
        for r in range(m):
            out = run.workdir / f"{name}-{r}.out"
            tails.append(f"--- learner {r} (exit {codes[r]}):\n"
                         + (out.read_text()[-1500:] if out.exists() else ""))
        row["error"] = "\n".join(tails)
        print(f"{system} @ {run.link}: FAILED, exit codes {codes}\n{row['error']}", flush=True)
        return row
    curve = _curve(name, run.workdir, s, run.vocab, run.val, t0)
    results = [json.loads((run.workdir / f"{name}-{r}.json").read_text()) for r in range(m)]
    if system not in ("ddp", "torchft"):
        last = max(range(m), key=lambda r: float(results[r]["closed_at"]))
        model = conv.build_model(s, run.vocab)
        model.load_state_dict(torch.load(run.workdir / f"{name}-{last}.pt"))
        curve.append((float(results[last]["closed_at"]) - t0, s.steps,
                      conv.evaluate(model, run.val)))
    row["curve"] = curve
    row["loss"] = curve[-1][2] if curve else math.nan
    n_params = sum(p.numel() for p in conv.build_model(s, run.vocab).parameters())
    row["params"] = n_params
    h = s.sync_every
    if system == "ddp":
        steps = min(int(r["steps"]) for r in results)
        row["steps"] = steps
        logs = [vt._steps(run.workdir / f"{name}-{r}.log") for r in range(m)]
        # The allreduce and AdamW of a step beyond AdamW alone, per H steps.
        row["barrier"] = sum(sum(c - p for _, c, p, *_ in lg) for lg in logs) / m / (steps / h)
        row["payload"] = [2 * (m - 1) / m * (n_params + 1) * 4 * 2 * steps] * m
        row["rounds"] = steps / h
    else:
        row["steps"] = s.steps
        kind = "torchft" if system == "torchft" else "gradientmail"
        config = "decoupled" if system.startswith("decoupled") else "standard"
        arm = vt.Arm(name, kind, config, "S3 (moto)" if kind == "gradientmail" else "gloo")
        jobs = [vt.Job(arm, r, s, str(run.workdir), run.poll) for r in range(m)]
        summary = vt.summarize(arm, s, jobs, wall, None, row["loss"], n_params * 4)
        row["barrier"] = summary["overhead"]
        row["barrier_median"] = summary["overhead_median"]
        row["rounds"] = s.steps / h
        if kind == "gradientmail":
            row["payload"] = [r["bytes_up"] + r["bytes_down"] for r in results]
            row["records"] = summary["records"]
            events = {r: _events(run.workdir / f"{name}-{r}.events") for r in range(m)}
            fragment_bytes = [e["bytes"] for evs in events.values() for e in evs
                              if e["event"] == "SnapshotPublished" and not e.get("held")]
            if fragment_bytes and not system.endswith(COMPRESSED):
                # The floor moves a fragment's F32 bytes: compressed payloads beat it.
                row["fragment_bytes"] = max(fragment_bytes)
            if config == "standard":
                if system.startswith("standard-closer"):
                    events[-1] = closer_events(run.workdir / f"{name}-closer.out")
                if system.endswith("-pipelined"):
                    row["sync"] = sync_breakdown(events, s.fragments)
                else:
                    row["breakdown"] = barrier_breakdown(events)
            recorded = {e["round"]: e["participants"] for evs in events.values() for e in evs
                        if e["event"] == "RoundRecorded"}
            row["short_rounds"] = sorted(r for r, who in recorded.items() if len(who) < m)
        else:
            synced = sum(1 for n in results[0]["participants"] if n >= 2)
            # A ring allreduce of the fp32 model per sync, each way.
            row["payload"] = [2 * 2 * (m - 1) / m * n_params * 4 * synced] * m
    row["barrier_last"] = last_arrivers_barrier(
        [vt._steps(run.workdir / f"{name}-{r}.log") for r in range(m)], h)
    row.setdefault("fragment_bytes", n_params * 4)
    slowest = min((x for x in run.rates if x is not None), default=None)
    if slowest is not None:
        row["floor"] = row["fragment_bytes"] * 8 / slowest * 2
    # Per H steps every fragment syncs once: P of them for Decoupled.
    per_round = s.fragments if system.startswith("decoupled") else 1
    row["ring_bytes"] = 2 * (m - 1) / m * row["fragment_bytes"] * 2 * per_round
    return row


def time_to(curve: list[Any], target: float) -> float | None:
    """The first point's seconds at which the held-out loss is at or below `target`."""
    return next((t for t, _, loss in curve if loss <= target), None)


def _mb(n: float | None) -> str:
    return "—" if n is None else f"{n / 1e6:.2f} MB"


def table(rows: list[dict[str, Any]], target: float) -> str:
    lines = [f"| system | link | wall s | final held-out loss | time to {target:.4f} s | "
             "barrier per round (median; the last to arrive's) | floor (1 fragment up + "
             "down) | MB through each "
             "link | MB per round per link (ring allreduce) |",
             "|---|---|---:|---:|---:|---|---:|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['link']} | failed (exit codes {r['codes']}) "
                         "| | | | | | |")
            continue
        tt = time_to(r["curve"], target)
        capped = (f" ({r['steps']} of {r['settings_steps']} steps)"
                  if r["steps"] < r["settings_steps"] else "")
        med = f" ({r['barrier_median']:.2f})" if "barrier_median" in r else ""
        if r.get("barrier_last") is not None:
            med += f"; the last to arrive {r['barrier_last']:.2f}"
        floor = f"{r['floor']:.2f} s" if "floor" in r else "—"
        per_link = " / ".join(f"{b / 1e6:.1f}" for b in r["link_bytes"])
        per_round = " / ".join(f"{b / r['rounds'] / 1e6:.2f}" for b in r["link_bytes"])
        lines.append(
            f"| {LABELS[r['system']]}{capped} | {r['link']} | {r['wall']:.0f} | "
            f"{r['loss']:.4f} | {'—' if tt is None else f'{tt:.0f}'} | "
            f"{r['barrier']:.2f} s{med} | {floor} | {per_link} | {per_round} "
            f"({r['ring_bytes'] / 1e6:.2f}) |")
    return "\n".join(lines)


def _estimate(row: dict[str, Any], rows: list[dict[str, Any]], target: float) -> float | None:
    """A capped row's time to the target where it stopped short of it: the step at which
    the same system reached the target on another link × this row's seconds per step."""
    if row["steps"] >= row["settings_steps"] or not row["curve"]:
        return None
    steps = [next((st for _, st, loss in r["curve"] if loss <= target), None) for r in rows
             if r["system"] == row["system"] and r is not row and "error" not in r]
    step = min((x for x in steps if x is not None), default=None)
    t_last, s_last, _ = row["curve"][-1]
    return None if step is None else step * t_last / s_last


def reading(rows: list[dict[str, Any]], target: float) -> list[str]:
    out = []
    for link in dict.fromkeys(r["link"] for r in rows):
        ok = [r for r in rows if r["link"] == link and "error" not in r]
        times = {r["system"]: time_to(r["curve"], target) for r in ok}
        reached = {k: v for k, v in times.items() if v is not None}
        if not reached:
            continue
        best = min(reached, key=lambda k: reached[k])
        parts = [f"{k} {v:.0f} s ({v / reached[best]:.2f}x)" for k, v in
                 sorted(reached.items(), key=lambda kv: kv[1])]
        missed = []
        for r in ok:
            if times[r["system"]] is None:
                est = _estimate(r, rows, target)
                t_last, s_last, loss = r["curve"][-1] if r["curve"] else (0, 0, math.nan)
                missed.append(f"{r['system']} (stopped at step {s_last} after {t_last:.0f} s, "
                              f"loss {loss:.4f}" + (
                                  f"; at its pace it would reach the target at ~{est:.0f} s, "
                                  f"{est / reached[best]:.2f}x" if est else "") + ")")
        out.append(f"{link}: time to {target:.4f}: " + ", ".join(parts)
                   + (f"; not reached: {', '.join(missed)}" if missed else ""))
    for r in rows:
        if r.get("short_rounds") and not r["system"].startswith("decoupled"):
            out.append(f"{r['system']} @ {r['link']}: {len(r['short_rounds'])} of "
                       f"{r['records']} rounds were committed with fewer than all "
                       f"{len(r['link_bytes'])} learners (rounds "
                       f"{', '.join(map(str, r['short_rounds']))})")
    return out


def plot(rows: list[dict[str, Any]], path: Path, target: float) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(6.5 * len(links), 4.5), squeeze=False)
    color = {name: f"C{i}" for i, name in enumerate(SYSTEMS)}
    for ax, link in zip(axes[0], links, strict=True):
        for r in rows:
            if r["link"] == link and r.get("curve"):
                ax.plot([c[0] for c in r["curve"]], [c[2] for c in r["curve"]], marker=".",
                        label=r["system"], color=color[r["system"]])
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"link {link}")
        ax.set_xlabel("wall-clock seconds since launch")
        ax.set_ylabel("held-out loss")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _breakdown_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if r.get("sync"):
            b = r["sync"]
            floor = f" ({b['boundary_to_aligned_s'] / r['floor']:.2f}x the floor)" \
                if "floor" in r else ""
            out.append(
                f"{r['system']} @ {r['link']}: a sync's barrier (medians over "
                f"{b['rounds']:.0f} syncs): the last learner's uploads end to end "
                f"{b['upload_s']:.2f} s; its first upload's start to every learner aligned "
                f"with the sync's last round {b['boundary_to_aligned_s']:.2f} s{floor}")
        b = r.get("breakdown")
        if not b:
            continue
        out.append(
            f"{r['system']} @ {r['link']}: a round's barrier (medians over {b['rounds']:.0f} "
            f"rounds): the other learner's delta upload {b['upload_s']:.2f} s "
            f"({_mb(b['delta_bytes'])}), then {b['to_claim_s']:.2f} s until the closer "
            f"claims, the closer's claim to commit {b['close_s']:.2f} s (download of the "
            f"delta, merge, upload of {_mb(b['commit_bytes'])}), the commit to the other "
            f"learner aligned {b['other_aligned_s']:.2f} s ({_mb(b['step_down_bytes'])} "
            f"down); the other learner's publish start to aligned "
            f"{b['boundary_to_aligned_s']:.2f} s")
    return out


def _on_signal(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--from-json", default=None,
                    help="re-render the table, reading and plot of a saved --json run")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="M=2, the one-layer smoke model, 60 steps (no append)")
    size.add_argument("--smoke", action="store_true", help="tinier still (no append)")
    ap.add_argument("--learners", type=int, default=None, help="M (default 2)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per learner")
    ap.add_argument("--link", default=None,
                    help="rate of every link, comma list run in turn (default: 20mbit,none; "
                    "--quick/--smoke 20mbit)")
    ap.add_argument("--rates", default=None,
                    help="per-learner rates (one per learner, replaces --link)")
    ap.add_argument("--systems", default=None,
                    help=f"comma list of {','.join(SYSTEMS)} (default: all but "
                    f"{', '.join(sorted(OPT_IN))}; standard-closer-sign1 only behind links "
                    "of 20 Mbit/s or less, standard-closer-pipelined of 100 Mbit/s or less; "
                    "--quick/--smoke standard,ddp)")
    ap.add_argument("--target", type=float, default=None, help="target held-out loss")
    ap.add_argument("--ddp-steps", type=int, default=0, help="cap DDP's steps")
    ap.add_argument("--ddp-seconds", type=float, default=0.0,
                    help="cap DDP's training seconds (it stops at the step past it)")
    ap.add_argument("--poll", type=float, default=1.0,
                    help="gradientmail's poll interval (default: the library's 1 s)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per system and link")
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    ap.add_argument("--plot", default=None, help="PNG path (default benchmarks/cross_site"
                    "[-quick]-mM.png)")
    ap.add_argument("--results", default=None,
                    help="markdown file to append to (default RESULTS.md unless --quick/"
                    "--smoke; '' for none)")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    if args.from_json:
        report(json.loads(Path(args.from_json).read_text()), args.target,
               Path(args.plot) if args.plot else None, args.results or "", None)
        return
    preset = "smoke" if args.smoke else "quick" if args.quick else "full"
    s = PRESETS[preset]
    if args.learners:
        s = dataclasses.replace(s, learners=args.learners)
    if args.steps:
        s = dataclasses.replace(s, steps=args.steps)
    if s.steps % s.sync_every or s.sync_every % s.fragments:
        raise SystemExit(f"--steps {s.steps} must be a multiple of H={s.sync_every}")
    default = ",".join(x for x in SYSTEMS if x not in OPT_IN)
    names = (args.systems or ("standard,ddp" if preset != "full" else default))
    systems = [x for x in names.split(",") if x]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; choose from {list(SYSTEMS)}")
    if args.rates:
        per = [parse_rate(x) for x in args.rates.split(",")]
        if len(per) != s.learners:
            raise SystemExit(f"--rates has {len(per)} rates for {s.learners} learners")
        settings_links = [(args.rates, per)]
    else:
        link_names = (args.link or ("20mbit" if preset != "full" else "20mbit,none")).split(",")
        settings_links = [(x, [parse_rate(x)] * s.learners) for x in link_names]
    results = (args.results if args.results is not None
               else "" if preset != "full" else str(conv.RESULTS))
    why = refusal()
    if why is not None:
        print(f"cross_site: network namespaces, veth pairs or tbf are refused here ({why}); "
              "it needs root or CAP_NET_ADMIN — nothing measured", flush=True)
        return
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at INFO
    notes = []
    if "torchft" in systems:
        try:
            import torchft  # noqa: F401
        except ImportError:
            systems.remove("torchft")
            notes.append(f"torchft skipped: not installed ({vt.PEERS_HINT})")
            print(notes[-1], flush=True)

    import torch

    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, _on_signal)
    t_all = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="gm-cross-site-"))
    vocab, n_train = conv.prepare_data(s, workdir)
    val = torch.load(workdir / "val.pt")
    n_params = sum(p.numel() for p in conv.build_model(s, vocab).parameters())
    print(f"data: {n_train:,} training tokens, vocabulary {vocab}; model {n_params:,} "
          f"parameters; M = {s.learners}; workdir {workdir}", flush=True)
    links = Links(s.learners)
    rows: list[dict[str, Any]] = []
    data: dict[str, Any] = {
        "settings": dataclasses.asdict(s), "preset": preset, "vocab": vocab,
        "params": n_params, "poll": args.poll, "seconds": 0.0,
        "command": sys.argv[1:] if argv is None else argv, "date": str(datetime.date.today()),
        "versions": f"torch {torch.__version__}, torchft {vt._version('torchft')}",
        "notes": notes, "tag": links.tag, "leftovers": [], "rows": rows}
    try:
        links.open()
        with _s3_server() as port:
            for link, rates in settings_links:
                links.shape(rates)
                for system in systems:
                    slow = ON_SLOW_LINKS.get(system)
                    if (slow is not None and not args.systems
                            and not all(r is not None and r <= slow for r in rates)):
                        continue
                    row = run_system(Run(system, link, rates, s, workdir, vocab, val, links,
                                         port, args.poll, args.ddp_steps, args.ddp_seconds,
                                         args.timeout))
                    row["settings_steps"] = s.steps
                    rows.append(row)
                    data["seconds"] = time.perf_counter() - t_all
                    if args.json:  # what is measured survives a run cut short
                        Path(args.json).write_text(json.dumps(data, default=str))
                    if "error" not in row:
                        print(f"{system} @ {link}: wall {row['wall']:.0f} s, loss "
                              f"{row['loss']:.4f}, barrier {row['barrier']:.2f} s per round, "
                              f"link MB {[round(b / 1e6, 1) for b in row['link_bytes']]}",
                              flush=True)
    finally:
        links.close()
        data["leftovers"] = leftovers = links.leftovers()
    data["seconds"] = time.perf_counter() - t_all
    report(data, args.target, Path(args.plot) if args.plot else None, results, args.json)
    if leftovers:
        print(f"cross_site: could not remove {leftovers}", flush=True)


def default_target(rows: list[dict[str, Any]]) -> float:
    """The worst of the systems' best held-out losses (a loss every system reaches), over
    the rows that trained their whole budget (a capped DDP is left out)."""
    full = [r for r in rows if "error" not in r and r["curve"]
            and r["steps"] >= r["settings_steps"]]
    return max((min(c[2] for c in r["curve"]) for r in full), default=math.nan)


def report(data: dict[str, Any], target: float | None, png: Path | None, results: str,
           json_path: str | None) -> None:
    """Print the table and reading of a run (`data`: what `main` measured, or its saved
    JSON), write the plot, the JSON and append to `results` ('' for none)."""
    rows, s = data["rows"], conv.Settings(**data["settings"])
    if target is None:
        target = default_target(rows)
    stem = ("cross_site" + ("" if data["preset"] == "full" else f"-{data['preset']}")
            + f"-m{s.learners}")
    png = png or HERE / f"{stem}.png"
    have_plot = plot(rows, png, target) if any(r.get("curve") for r in rows) else False
    header = (
        f"\n### cross-site rehearsal, M = {s.learners} — {data['date']}\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs), "
        f"one torch thread per learner; {data['versions']}. GPT-2 {s.n_layer}×{s.n_embd} "
        f"({data['params']:,} parameters, vocabulary {data['vocab']}), batch "
        f"{s.batch}×{s.block}, AdamW lr {s.lr}, H = {s.sync_every}, S = {s.steps} steps per "
        f"learner, outer Nesterov 0.7 / 0.9; each learner in its own network namespace "
        f"behind a veth shaped with tbf both ways, moto's S3 server in the root namespace; "
        f"gradientmail poll {data['poll']:g} s. Time to target: the first saved model (every "
        f"H steps) at or below it, seconds from launch (process start and joining "
        f"included). Barrier: Σ (step call − AdamW) / rounds (DDP: its allreduce per H "
        f"steps); floor: one fragment up and one down at the slowest link's rate; MB "
        f"through each link: the veth's counters (everything on the wire). Preset "
        f"`{data['preset']}`, {data['seconds']:.0f} s in all.\n"
        f"Command: `{' '.join(['python', 'benchmarks/cross_site.py', *data['command']])}`"
        f"\n\n")
    lines = reading(rows, target) + _breakdown_lines(rows) + data.get("notes", [])
    text = header + table(rows, target) + "\n\n" + "\n".join(f"- {x}" for x in lines)
    if have_plot:
        text += f"\n\n![held-out loss against wall-clock]({conv.image_link(png, conv.RESULTS)})"
    print(text, flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(dict(data, target=target), default=str,
                                              indent=1))
    if results:
        with Path(results).open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
