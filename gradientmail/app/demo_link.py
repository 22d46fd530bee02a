"""`gradientmail demo --link RATE`: the demo's learners as sites behind shaped links.

`Site` holds what the runs share: a network namespace per learner joined to the root
namespace by a veth shaped to the rate both ways (`gradientmail.app.links.Links`), and
moto's S3 server in the root namespace on learner 0's root-side address, which every
namespace reaches through its own link and the root namespace (the demo's sampling of the
committed model, the standalone closer) reaches without crossing any. Each learner is a
process started with `ip netns exec NS python -m gradientmail.app.demo_worker SPEC.json`
(multiprocessing cannot start one in another namespace): it reports its steps as JSON
lines on its stdout, its output goes to a log in the demo's workdir, and Decoupled's
shared step budget is a counter in a file under an exclusive lock.

Leaving the `Site` (at the end, on an error, on SIGINT, SIGTERM or SIGHUP) kills what is
left of the learners, stops the server and removes the namespaces and links.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import fcntl
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import IO, Any, TextIO

from gradientmail.app.demo_runs import (
    CLOSED_NEXT_TO_THE_BUCKET,
    LINK_LABELS,
    DemoConfig,
    Workers,
    _Job,
    _run,
)
from gradientmail.app.links import CREDENTIALS, Links, parse_rate, s3_server, standalone_closer

__all__ = ["BUCKET", "Site", "job_from_spec", "job_spec", "take_from_file"]

#: The bucket of a demo behind links; each run is a prefix in it.
BUCKET = "gradientmail-demo"
#: Seconds a learner may take to exit after its last report before it is killed.
JOIN_TIMEOUT = 60.0


def job_spec(job: _Job, budget: Path) -> dict[str, Any]:
    """What `demo_worker` needs to run `job`, as JSON-ready data; `budget`: the run's step
    counter (`take_from_file`)."""
    return {"job": dataclasses.asdict(job), "budget": str(budget)}


def job_from_spec(spec: dict[str, Any]) -> tuple[_Job, Path]:
    """The job and budget counter of a `job_spec`."""
    fields = dict(spec["job"])
    cfg = dict(fields.pop("config"))
    cfg["systems"] = tuple(cfg["systems"])
    cfg["diloco"] = tuple((str(k), v) for k, v in cfg["diloco"])
    return _Job(config=DemoConfig(**cfg), **fields), Path(spec["budget"])


def take_from_file(path: Path, budget: int) -> bool:
    """Take one step of a run's budget from the counter in `path` (8 bytes, little-endian,
    under an exclusive lock: learners in other namespaces share the file system, not
    memory), if any is left."""
    with path.open("r+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        spent = int.from_bytes(f.read(8), "little")
        if spent >= budget:
            return False
        f.seek(0)
        f.write((spent + 1).to_bytes(8, "little"))
        return True


def _pump(stream: IO[str], into: queue.Queue[Any]) -> None:
    """A learner's reports, line by line, until it exits (or the pipe is closed under it
    when the demo stops early)."""
    with contextlib.suppress(ValueError, OSError):
        for line in stream:
            with contextlib.suppress(ValueError):
                into.put(tuple(json.loads(line)))


def _tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)"


class Site:
    """The links and the bucket of a demo behind links, for `with`: `run(system, ...)`
    trains one run through them and returns `_run`'s row with the bytes through each
    learner's link; `root` is the bucket's URL, `leftovers` (after leaving) what could
    not be removed."""

    def __init__(self, cfg: DemoConfig, workdir: Path, log: TextIO) -> None:
        assert cfg.link is not None
        self.cfg, self.workdir, self.log = cfg, workdir, log
        self.rate = parse_rate(cfg.link)
        self.links = Links(cfg.learners)
        self.root = f"s3://{BUCKET}"
        self.endpoint = ""
        self.leftovers: list[str] = []
        self._stack = contextlib.ExitStack()
        self._procs: list[subprocess.Popen[str]] = []
        self._main = threading.current_thread() is threading.main_thread()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Site:
        try:
            self._enter()
        except BaseException:
            self._exit()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit()

    def _enter(self) -> None:
        if self._main:
            # A SIGTERM or a closed terminal unwinds like ^C, through every finally.
            for signum in _STOPS[1:]:
                self._previous[signum] = signal.signal(signum, _interrupt)
        saved = {k: os.environ.get(k) for k in CREDENTIALS}
        self._stack.callback(_restore_environ, saved)
        os.environ.update(CREDENTIALS)  # boto3 here, and every process started from here
        self._stack.callback(self._remove_links)
        self.links.open(forward=False)  # learners talk to the bucket only, not each other
        self.links.shape([self.rate] * self.cfg.learners)
        host = self.links.host(0)
        port = self._stack.enter_context(s3_server(BUCKET, host=host))
        self.endpoint = f"http://{host}:{port}"
        print(f"links: {self.cfg.learners} network namespaces ({', '.join(self.links.ns)}), "
              f"each behind a {self.cfg.link} link; bucket {self.root} at {self.endpoint} "
              f"(watch a run: gradientmail status {self.root}/standard --endpoint-url "
              f"{self.endpoint})", file=self.log, flush=True)

    def _exit(self) -> None:
        """Kill, stop and remove everything, then restore the signal handlers; a ^C or
        SIGTERM meanwhile waits for the end of it (as KeyboardInterrupt)."""
        caught: list[int] = []
        if self._main:
            self._previous.setdefault(signal.SIGINT, signal.getsignal(signal.SIGINT))
            for signum in _STOPS:
                signal.signal(signum, lambda n, _f: caught.append(n))
        try:
            self._kill()
        finally:
            try:
                self._stack.close()
            finally:
                for number, previous in self._previous.items():
                    signal.signal(number, previous)
                self._previous.clear()
        if caught:
            raise KeyboardInterrupt(f"signal {caught[0]}")

    def _remove_links(self) -> None:
        self.links.close()
        self.leftovers = self.links.leftovers()
        if self.leftovers:
            print(f"could not remove {self.leftovers}: `ip netns del NAME` / `ip link del "
                  "NAME` as root", file=self.log, flush=True)

    def _kill(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self._procs.clear()

    def run(self, system: str, vocab: int, val: Any) -> dict[str, Any]:
        """One run of `system` behind the links; `_run`'s row plus `link_bytes_per_learner`
        and `link_up_down` (what the root side received from / sent to each learner)."""
        with contextlib.ExitStack() as stack:
            if system in CLOSED_NEXT_TO_THE_BUCKET:
                stack.enter_context(standalone_closer(
                    f"{self.root}/{system}", self.endpoint, 0.2,
                    self.workdir / f"{system}-closer.log"))
            before = self.links.split_counters()
            try:
                row = _run(system, self.cfg, self.workdir, f"{self.root}/{system}", vocab,
                           val, self.log, start=self._start, endpoint=self.endpoint,
                           label=LINK_LABELS[system])
            finally:
                self._kill()  # the learners before their closer, on any way out
            after = self.links.split_counters()
        up_down = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
        row["link_up_down"] = up_down
        row["link_bytes_per_learner"] = [u + d for u, d in up_down]
        row["closers"] = _closers(f"{self.root}/{system}", self.endpoint)
        return row

    def _start(self, jobs: list[_Job]) -> Workers:
        """Each job's learner in its namespace; their reports on one queue."""
        system = jobs[0].system
        budget = self.workdir / f"{system}.budget"
        budget.write_bytes(bytes(8))
        reports: queue.Queue[Any] = queue.Queue()
        logs = [self.workdir / f"{system}-{job.name}.log" for job in jobs]
        procs, pumps = [], []
        for i, job in enumerate(jobs):
            spec = self.workdir / f"{system}-{job.name}.json"
            spec.write_text(json.dumps(job_spec(job, budget)))
            with logs[i].open("w") as err:
                proc = subprocess.Popen(
                    ["ip", "netns", "exec", self.links.ns[i], sys.executable, "-m",
                     "gradientmail.app.demo_worker", str(spec)],
                    stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
            self._procs.append(proc)
            assert proc.stdout is not None
            pump = threading.Thread(target=_pump, args=(proc.stdout, reports), daemon=True)
            pump.start()
            procs.append(proc)
            pumps.append(pump)

        def join() -> None:
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(JOIN_TIMEOUT)

        def failure(dead: list[str]) -> str:
            tails = "\n".join(f"--- {job.name} (exit {procs[i].poll()}, {logs[i]}):\n"
                              f"{_tail(logs[i])}" for i, job in enumerate(jobs)
                              if job.name in dead)
            return f"demo worker(s) {dead} of the {system} run exited early:\n{tails}"

        # A learner is done reporting once its pipe is closed (it exited): every line it
        # wrote is on the queue by then.
        return Workers(reports, lambda i: pumps[i].is_alive(), join, failure)


def _closers(url: str, endpoint: str) -> dict[str, int]:
    """How many of the run's committed rounds each closer closed (read from the bucket
    before it goes away with the demo)."""
    from gradientmail.app.history import read_history
    from gradientmail.mailbox.url import open_mailbox
    from gradientmail.run.protocol import Exchange

    async def read() -> dict[str, int]:
        box = open_mailbox(url, read_only=True, endpoint_url=endpoint)
        try:
            records = await read_history(Exchange(box))
        finally:
            await box.close()
        return dict(collections.Counter(rec.closer for rec in records))

    return asyncio.run(read())


_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, _frame: types.FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _restore_environ(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
