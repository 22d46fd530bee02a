"""Shared pieces of the fault matrix: a numpy toy model, a mailbox that SIGKILLs its own
process, worker processes, and the integrity check every chaos test ends with.

- `ToyAdapter` implements the Adapter contract over numpy arrays (no torch: a worker
  process starts in well under a second, so the matrix fits in CI). `train_step` pulls
  each tensor toward a per-learner target; `bad_delta=n` spoils the n-th delta with NaN
  and Inf.
- `KillSwitch` wraps a mailbox and SIGKILLs the process on the Nth call matching a
  `FaultPlan` rule, before the call or after it (`--kill create:payloads/*:3:after`).
- `spawn_learner` / `spawn_closer` start `learner_worker.py` / `closer_worker.py`; each
  writes a JSON result (events, per-step durations, parameter digests) when it exits.
- `verify_run` checks what the matrix promises: records gap-free and in order, each
  fragment's versions consecutive, every referenced payload present with its SHA-256;
  `check_ends_on_commits` checks a learner's final parameters against the commits.
- `conclude` checks that no commit a party wrote or applied is missing from the records,
  and prints one line of figures per fault (`pytest -s` shows them); README.md's table is
  written from these lines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from gradientmail.algorithms.registry import algorithm_from_json
from gradientmail.errors import SchemaMismatch
from gradientmail.events import Event
from gradientmail.mailbox.base import Mailbox
from gradientmail.mailbox.local import TEMP_PREFIX
from gradientmail.mailbox.wrappers import FaultPlan
from gradientmail.run.keyspace import round_key
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import Replica, state_at
from gradientmail.wire.records import RoundRecord
from gradientmail.wire.serialization import ParameterSpec, Schema
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = [
    "CHAOS_DIR",
    "KILLED_AT",
    "SCHEMA",
    "KillSwitch",
    "LearnerResult",
    "RunFigures",
    "ToyAdapter",
    "Worker",
    "check_ends_on_commits",
    "conclude",
    "event_dict",
    "parse_kill",
    "spawn_closer",
    "spawn_learner",
    "temp_files",
    "theta_digests",
    "train_step",
    "verify_run",
    "wait_until",
]

CHAOS_DIR = Path(__file__).resolve().parent
#: What a KillSwitch prints (to the worker's log) right before it kills its process.
KILLED_AT = "chaos: SIGKILL at"
Array = npt.NDArray[np.float32]

SCHEMA = Schema((
    ParameterSpec("embed.weight", "F32", (32, 16)),
    ParameterSpec("block.0.w", "F32", (16, 16)),
    ParameterSpec("block.0.b", "F32", (16,)),
    ParameterSpec("block.1.w", "F32", (16, 16)),
    ParameterSpec("block.1.b", "F32", (16,)),
    ParameterSpec("head.w", "F32", (16, 4)),
))


# -- the toy model ------------------------------------------------------------------------


def _digest(arr: npt.NDArray[Any]) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr, np.float32).tobytes()).hexdigest()


class ToyAdapter:
    """The Adapter contract over float32 numpy arrays, one per `SCHEMA` parameter.

    `applied` logs (names, SHA-256 of each value) for every `apply`, so a test can show
    that only committed bytes ever reached the model. With `bad_delta=n`, the n-th delta
    computed holds NaN in its first tensor and Inf in its last (a device gone wrong).
    """

    def __init__(self, seed: int = 0, bad_delta: int = -1) -> None:
        rng = np.random.default_rng(seed)
        self.schema = SCHEMA
        self.params: dict[str, Array] = {
            p.name: rng.standard_normal(p.shape).astype(np.float32) for p in SCHEMA.params
        }
        self.applied: list[dict[str, str]] = []
        self.bad_delta = bad_delta
        self.deltas = 0

    def read(self, names: Sequence[str] | None = None) -> dict[str, TensorBytes]:
        chosen = SCHEMA.names if names is None else names
        return {n: TensorBytes.from_numpy(self.params[n]) for n in chosen}

    def snapshot(self, names: Sequence[str]) -> dict[str, Array]:
        return {n: self.params[n].copy() for n in names}

    def load(self, values: Mapping[str, TensorBytes]) -> dict[str, Array]:
        return {n: np.array(t.to_numpy(), dtype=np.float32) for n, t in values.items()}

    def delta(
        self, anchor: Mapping[str, Array], snapshot: Mapping[str, Array]
    ) -> dict[str, TensorBytes]:
        self.deltas += 1
        out = {n: anchor[n] - snapshot[n] for n in snapshot}
        if self.deltas == self.bad_delta:
            names = list(out)
            out[names[0]] = np.full_like(out[names[0]], np.nan)
            out[names[-1]] = np.full_like(out[names[-1]], np.inf)
        return {n: TensorBytes.from_numpy(a) for n, a in out.items()}

    def apply(self, values: Mapping[str, Any], mixing: float = 0.0) -> None:
        arrays = {
            n: v.to_numpy() if isinstance(v, TensorBytes) else np.asarray(v)
            for n, v in values.items()
        }
        bad = [f"{n!r} has shape {list(a.shape)}, the model {list(self.params[n].shape)}"
               for n, a in arrays.items() if n in self.params and a.shape != self.params[n].shape]
        bad += [f"{n!r} is not a parameter" for n in arrays if n not in self.params]
        if bad:
            raise SchemaMismatch("cannot apply: " + "; ".join(bad))
        for n, a in arrays.items():
            self.params[n][...] = mixing * self.params[n] + (1.0 - mixing) * a if mixing else a
        self.applied.append({n: _digest(a) for n, a in arrays.items()})

    def rebase(self, values: Mapping[str, Any], base: Mapping[str, Any]) -> None:
        """θ ← value + (θ − base); `applied` logs the commit's values it was built on."""
        rest = {n: self.params[n] - np.asarray(base[n], dtype=np.float32) for n in values}
        self.apply(values)
        for n, d in rest.items():
            self.params[n] += d

    def digests(self) -> dict[str, str]:
        """SHA-256 of each parameter's float32 bytes."""
        return {n: _digest(a) for n, a in self.params.items()}


def train_step(adapter: ToyAdapter, worker: int, step: int, lr: float = 0.1) -> None:
    """One deterministic inner step: every tensor moves toward this worker's target, plus
    a little noise drawn from (worker, step)."""
    for i, p in enumerate(adapter.params.values()):
        target = np.random.default_rng([worker, i]).standard_normal(p.shape).astype(np.float32)
        noise = np.random.default_rng([worker, step, i]).standard_normal(p.shape)
        p += (lr * (target - p) + 0.01 * noise).astype(np.float32)


# -- a mailbox that kills its own process ------------------------------------------------


def parse_kill(spec: str) -> tuple[str, str, int, bool]:
    """`OP:PATTERN:NTH[:after]` -> (op, pattern, nth, after)."""
    parts = spec.split(":")
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "after"):
        raise ValueError(f"kill spec {spec!r} must be OP:PATTERN:NTH or OP:PATTERN:NTH:after")
    return parts[0], parts[1], int(parts[2]), len(parts) == 4


class KillSwitch(Mailbox):
    """Passes calls to `inner`; SIGKILLs this process on the call a rule fires on (before
    the call, or once it returned with `after`). Rules count calls only while `armed`."""

    def __init__(self, inner: Mailbox, kills: Sequence[str], *, armed: bool = True) -> None:
        self.inner = inner
        self.url = inner.url
        self.armed = armed
        self.plan = FaultPlan()
        for spec in kills:
            op, pattern, nth, after = parse_kill(spec)
            self.plan.fail(op, pattern, nth=nth, after=after)

    def _firing(self, op: str, key: str) -> tuple[bool, bool]:
        if not self.armed:
            return False, False
        rules = self.plan.firing(op, key)
        return any(not r.after for r in rules), any(r.after for r in rules)

    @staticmethod
    def _die(op: str, key: str) -> None:
        print(f"{KILLED_AT} {op} {key}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    async def get(self, key: str) -> bytes | None:
        before, after = self._firing("get", key)
        if before:
            self._die("get", key)
        data = await self.inner.get(key)
        if after:
            self._die("get", key)
        return data

    async def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        # A range, not the base class's full read; "get" kill rules match it (FaultPlan).
        before, after = self._firing("get_range", key)
        if before:
            self._die("get_range", key)
        data = await self.inner.get_range(key, start, stop)
        if after:
            self._die("get_range", key)
        return data

    async def put(self, key: str, data: bytes) -> None:
        before, after = self._firing("put", key)
        if before:
            self._die("put", key)
        await self.inner.put(key, data)
        if after:
            self._die("put", key)

    async def create(self, key: str, data: bytes) -> bool:
        before, after = self._firing("create", key)
        if before:
            self._die("create", key)
        created = await self.inner.create(key, data)
        if after:
            self._die("create", key)
        return created

    async def list(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        before, after = self._firing("list", prefix)
        if before:
            self._die("list", prefix)
        keys = await self.inner.list(prefix, start_after)
        if after:
            self._die("list", prefix)
        return keys

    async def delete(self, key: str) -> None:
        before, after = self._firing("delete", key)
        if before:
            self._die("delete", key)
        await self.inner.delete(key)
        if after:
            self._die("delete", key)

    async def close(self) -> None:
        await self.inner.close()


def event_dict(event: Event) -> dict[str, Any]:
    """An event as JSON: its type, its plain fields, and when it happened (monotonic, so
    comparable across the processes of one machine)."""
    out: dict[str, Any] = {"type": type(event).__name__, "t": time.monotonic()}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        if isinstance(value, tuple):
            value = list(value)
        if value is None or isinstance(value, int | float | str | list):
            out[f.name] = value
    return out


# -- worker processes ----------------------------------------------------------------------


@dataclasses.dataclass
class Worker:
    """A worker process, its result file and its log."""

    name: str
    proc: subprocess.Popen[bytes]
    out: Path
    log: Path

    @property
    def ready(self) -> Path:
        return Path(str(self.out) + ".ready")

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    def finish(self, timeout: float) -> dict[str, Any]:
        """Wait for a clean exit (a hang past `timeout` fails the test); the result."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} hung past {timeout} s:\n{self.log_tail()}") from None
        assert self.proc.returncode == 0, f"{self.name} failed:\n{self.log_tail()}"
        result: dict[str, Any] = json.loads(self.out.read_text())
        return result

    def killed(self, timeout: float) -> None:
        """Wait for the process to die of SIGKILL (its own KillSwitch's)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"{self.name} was not killed within {timeout} s:\n{self.log_tail()}"
            ) from None
        assert self.proc.returncode == -signal.SIGKILL, (
            f"{self.name} exited with {self.proc.returncode}, not SIGKILL:\n{self.log_tail()}"
        )

    def killed_at(self) -> tuple[str, str]:
        """The (op, key) its KillSwitch killed it at, from its log."""
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith(KILLED_AT):
                op, key = line[len(KILLED_AT):].split()
                return op, key
        raise AssertionError(f"{self.name} logged no kill:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _spawn(script: str, name: str, out: Path, argv: Sequence[str]) -> Worker:
    log = Path(str(out) + ".log")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, str(CHAOS_DIR / script), *argv, "--out", str(out)],
            env=env, stdout=f, stderr=subprocess.STDOUT,
        )
    return Worker(name, proc, out, log)


def spawn_learner(box: Path, learner: str, out: Path, *options: str) -> Worker:
    """Start `learner_worker.py` on the LocalMailbox `box`; see its docstring for options."""
    return _spawn("learner_worker.py", learner, out, [str(box), learner, *options])


def spawn_closer(box: Path, closer: str, out: Path, *options: str) -> Worker:
    """Start `closer_worker.py` on the LocalMailbox `box`."""
    return _spawn("closer_worker.py", closer, out, [str(box), closer, *options])


def wait_until(cond: Callable[[], bool], timeout: float, what: str,
               workers: Sequence[Worker] = ()) -> None:
    """Poll `cond` until true; fail naming `what` after `timeout` s or when a worker dies."""
    deadline = time.monotonic() + timeout
    while not cond():
        for w in workers:
            if w.proc.poll() is not None:
                raise AssertionError(f"{w.name} exited ({w.proc.returncode}) while waiting "
                                     f"for {what}:\n{w.log_tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def temp_files(root: Path) -> list[Path]:
    """LocalMailbox temporary files left under `root` (a partial object would be one)."""
    return sorted(p for p in root.rglob(TEMP_PREFIX + "*"))


# -- the integrity check --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunFigures:
    """The records `verify_run` checked."""

    records: tuple[RoundRecord, ...]

    @property
    def rounds(self) -> int:
        return len(self.records)

    def participants(self, learner: str) -> list[int]:
        """The rounds `learner` took part in."""
        return [r.round for r in self.records if any(p.learner == learner
                                                     for p in r.participants)]

    def dropped(self, learner: str) -> list[tuple[int, str]]:
        return [(r.round, d.reason) for r in self.records for d in r.dropped
                if d.learner == learner]

    def lost(self, events: Iterable[Mapping[str, Any]]) -> tuple[int, list[str]]:
        """Commits some party wrote (RoundClosed) or applied (FragmentAligned), and those
        of them the records do not hold: (how many were seen, the lost ones)."""
        seen, lost = 0, []
        for e in events:
            if e["type"] not in ("RoundClosed", "FragmentAligned"):
                continue
            seen += 1
            r = int(e["round"])
            rec = self.records[r] if r < len(self.records) else None
            closer = e.get("closer", rec.closer if rec is not None else None)
            if rec is None or (rec.fragment, rec.version, rec.closer) != (
                    e["fragment"], e["version"], closer):
                lost.append(f"{e['type']} of round {r} (fragment {e['fragment']} version "
                            f"{e['version']})")
        return seen, lost


def verify_run(mailbox: Mailbox, prefix: str = "") -> RunFigures:
    """Check the run in `mailbox`; return its figures.

    Records 0..n−1 exist and no other (gap-free), each in its schedule's fragment with that
    fragment's next version; every payload a record references is present, its size and
    SHA-256 equal to the reference (requires the writers to keep every version), and every
    committed theta finite.
    """

    async def go() -> RunFigures:
        ex = Exchange(mailbox, prefix=prefix)
        manifest = await ex.read_manifest()
        assert manifest is not None, f"no run in {mailbox.url}"
        alg = algorithm_from_json(dict(manifest.algorithm))
        schedule = alg.schedule_for(len(manifest.plan))
        replica = Replica(ex, manifest, alg)
        keys = [k[len(prefix):] for k in await mailbox.list(prefix + "rounds/")]
        records = await ex.rounds_after(-1)
        assert keys == [round_key(i) for i in range(len(records))], (
            f"records are not gap-free: {keys[:5]}...{keys[-5:]} vs {len(records)} in order")
        versions: dict[int, int] = {}
        for i, rec in enumerate(records):
            assert rec.round == i
            assert rec.fragment == schedule.fragment_of(i), (i, rec.fragment)
            versions[rec.fragment] = versions.get(rec.fragment, 0) + 1
            assert rec.version == versions[rec.fragment], (i, rec.version)
            for ref in rec.payload_refs():
                blob = await ex.store.fetch_payload(ref)  # raises CorruptPayload on a mismatch
                assert blob is not None, f"round {i}: payload {ref.key} is missing"
            state = await replica.at(rec.fragment, rec)  # checks a step's theta digest
            assert state is not None
            theta = state.theta
            for name in manifest.plan[rec.fragment]:
                arr = theta[name].to_numpy()
                assert np.isfinite(arr).all(), f"round {i}: {name} is not finite"
        return RunFigures(tuple(records))

    return asyncio.run(go())


def theta_digests(mailbox: Mailbox, upto: int) -> dict[str, str]:
    """SHA-256 of every parameter as committed by round `upto` (Θ⁰ where never)."""

    async def go() -> dict[str, str]:
        ex = Exchange(mailbox)
        manifest = await ex.read_manifest()
        assert manifest is not None
        latest = await ex.latest_commit_per_fragment(len(manifest.plan), upto)
        out: dict[str, str] = {}
        for p, names in enumerate(manifest.plan):
            tensors = (await state_at(ex, p, latest.get(p), manifest)).theta
            out.update((n, hashlib.sha256(tensors[n].data).hexdigest()) for n in names)
        return out

    return asyncio.run(go())


@dataclasses.dataclass(frozen=True)
class LearnerResult:
    """A learner worker's result file."""

    learner: str
    rounds_seen: int
    local_step: int
    params: dict[str, str]
    events: list[dict[str, Any]]
    step_max: float
    step_max_at: int
    stalls: list[list[float]]

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> LearnerResult:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]


def check_ends_on_commits(mailbox: Mailbox, result: LearnerResult) -> None:
    """The learner's final parameters are the commits as of the last round it saw."""
    want = theta_digests(mailbox, result.rounds_seen)
    assert result.params == want, f"{result.learner} did not end on the commits"


def conclude(fault: str, figures: RunFigures, events: Iterable[Mapping[str, Any]],
             stall: float | None, **extra: Any) -> None:
    """Check that no commit a party wrote or applied is missing from the records, then
    print the figures of this fault (README.md's table is written from these lines)."""
    seen, lost = figures.lost(events)
    assert lost == [], f"commits lost: {lost}"
    stall_text = "-" if stall is None or not math.isfinite(stall) else f"{stall:.3f} s"
    rest = "".join(f" | {k}={v}" for k, v in extra.items())
    print(f"\nCHAOS | {fault} | rounds={figures.rounds} | commits seen by parties={seen} "
          f"| lost={len(lost)} | longest step stall={stall_text}{rest}")
