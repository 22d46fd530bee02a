"""Bad bytes from a peer or the store: every one is left out by name, none is applied.

tests/test_syncer.py already drops stale, other-schema-digest, other-fragment, mis-shaped,
non-finite and bit-flipped contributions and an unparseable record. Here, on a local
directory: truncated, grown and oversized payloads, a zstd bomb, garbage behind a digest
that matches it, a record whose digest lies, missing / extra / mistyped tensors, and
records that are oversized, mistyped, of another version, not an object or lying about
their learner. Then the learner side (a corrupted commit payload or record is never
applied) and a learner whose parameters go NaN/Inf mid-run (processes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_syncer import SCHEMA, Run, algorithm, delta

from chaos.harness import (
    LearnerResult,
    ToyAdapter,
    check_ends_on_commits,
    conclude,
    event_dict,
    spawn_learner,
    theta_digests,
    train_step,
    verify_run,
)
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.registry import algorithm_from_json
from gradientmail.errors import CorruptPayload
from gradientmail.events import ContributionDropped, Event, FragmentAligned, PollFailed
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import FaultPlan, FaultyMailbox, LocalMailbox, Mailbox, MemoryMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import Replica
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.tensor_bytes import TensorBytes

SNAP = "snapshots/0000000000/{}.json"
PAYLOAD = "payloads/0000000000/{}.safetensors"


def f32(shape: tuple[int, ...], value: float = 0.0) -> TensorBytes:
    return TensorBytes.from_numpy(np.full(shape, value, np.float32))


async def rewrite(mailbox: Mailbox, key: str, edit: Callable[[bytes], bytes]) -> bytes:
    blob = await mailbox.get(key)
    assert blob is not None
    await mailbox.put(key, edit(blob))
    return blob


async def publish_bad_payloads(r: Run) -> dict[str, tuple[str, str]]:
    """Contributions to round 0 whose payload is bad: learner -> (key, reason part)."""
    names = r.plan[0]
    good = delta(0, "x", names)
    out: dict[str, tuple[str, str]] = {}

    snap = await r.contribute(0, "truncated")
    n = snap.payload.size
    await rewrite(r.mailbox, snap.payload.key, lambda b: b[: n // 2])
    out["truncated"] = (snap.payload.key, f"is {n // 2} bytes but its record says {n}")

    snap = await r.contribute(0, "grown")
    await rewrite(r.mailbox, snap.payload.key, lambda b: b + b"\0" * 64)
    out["grown"] = (snap.payload.key, f"is {n + 64} bytes but its record says {n}")

    # An honest record of a payload far larger than the fragment: refused unread.
    big = {**good, "junk": f32((300_000,))}
    snap = await r.contribute(0, "oversized", tensors=big)
    out["oversized"] = (snap.payload.key, f"is declared {snap.payload.size} bytes, over the bound")

    # A few KB of zstd that would inflate to 8 MB.
    zstd = Exchange(r.mailbox, clock=r.clock, compression="zstd")
    snap = await zstd.publish(
        0, "bomb", {**good, "junk": f32((2_000_000,))}, fragment=0, base_version=0,
        local_step=4, steps=4, tokens=64, final=False, schema_digest=SCHEMA.digest(),
        delta_format="F32")
    assert snap.payload.size < 100_000
    out["bomb"] = (snap.payload.key, "the zstd frame would decompress to 8000")

    # Garbage written before the digest was taken: the digest matches, the decoder refuses.
    snap = await r.contribute(0, "garbage")
    key = SNAP.format("garbage")
    junk = bytes(range(256)) * (snap.payload.size // 256 + 1)
    await r.mailbox.put(snap.payload.key, junk)
    lied = dataclasses.replace(snap, payload=PayloadRef.of(snap.payload.key, junk))
    await r.mailbox.put(key, lied.encode())
    out["garbage"] = (snap.payload.key, "the payload is truncated or corrupt")

    # The record's digest is wrong, the payload intact.
    snap = await r.contribute(0, "wrong-digest")
    lied = dataclasses.replace(snap, payload=dataclasses.replace(snap.payload, sha256="0" * 64))
    await r.mailbox.put(SNAP.format("wrong-digest"), lied.encode())
    out["wrong-digest"] = (snap.payload.key, "its record says 0000000000000000")

    # Another schema behind the run's digest: a tensor missing, one extra, one mistyped.
    snap = await r.contribute(0, "missing", tensors={})
    out["missing"] = (snap.payload.key, "mis-shaped: ")
    snap = await r.contribute(0, "extra", tensors={**good, "w.extra": f32((2,))})
    out["extra"] = (snap.payload.key, "mis-shaped: ")
    half = {n: TensorBytes.from_numpy(t.to_numpy().astype(np.float16)) for n, t in good.items()}
    snap = await r.contribute(0, "mistyped", tensors=half)
    out["mistyped"] = (snap.payload.key, "mis-shaped: ")
    return out


async def publish_bad_records(r: Run) -> dict[str, tuple[str, str]]:
    """Contribution records of round 0 that do not parse: learner -> (key, reason part)."""
    template = json.loads((await r.contribute(0, "template")).encode())
    await r.mailbox.delete(SNAP.format("template"))
    await r.mailbox.delete(PAYLOAD.format("template"))

    def variant(learner: str, **fields: Any) -> bytes:
        obj = {**template, "learner": learner, **fields}
        obj["payload"] = {**obj["payload"], "key": PAYLOAD.format(learner)}
        return json.dumps(obj).encode()

    records = {
        "huge": (b'{"v": 1, "pad": "' + b"x" * (1 << 20) + b'"}',
                 "records are at most 1048576 bytes"),
        "wrong-type": (variant("wrong-type", steps="4"), "field 'steps' must be an integer"),
        "extra-field": (variant("extra-field", extra=1), "unexpected ['extra']"),
        "version-2": (variant("version-2", v=2), "field 'v' is 2, but this gradientmail"),
        "array": (b"[1, 2, 3]", "is a JSON list, not an object"),
        "not-utf8": (b'{"v": 1, "learner": "\xff"}', "is not valid JSON"),
        "nan": (variant("nan").replace(b'"steps": 4', b'"steps": NaN'), "non-finite number"),
        "liar": (variant("good"), "says learner 'good'"),
    }
    out = {}
    for learner, (data, reason) in records.items():
        await r.mailbox.put(SNAP.format(learner), data)
        out[learner] = (SNAP.format(learner), reason)
    return out


def test_bad_payloads_and_records_are_dropped_by_key(tmp_path: Path) -> None:
    async def main() -> tuple[Run, dict[str, tuple[str, str]], str]:
        r = Run(LocalMailbox(tmp_path / "run"), algorithm(fragments=2, quorum_size=1))
        await r.create()
        expected = await publish_bad_payloads(r)
        expected.update(await publish_bad_records(r))
        await r.contribute(0, "good")
        assert await r.syncer().poll(live=frozenset({*expected, "good"}))
        # What the good contribution alone commits.
        clean = Run(MemoryMailbox(), algorithm(fragments=2, quorum_size=1))
        await clean.create()
        await clean.contribute(0, "good")
        assert await clean.syncer().poll(live=frozenset({"good"}))
        alone = await clean.ex.read_round(0)
        assert alone is not None
        return r, expected, [ref.sha256 for ref in alone.payload_refs()]

    r, expected, alone = asyncio.run(main())
    figures = verify_run(r.mailbox)
    [rec] = figures.records
    assert [p.learner for p in rec.participants] == ["good"]
    assert [ref.sha256 for ref in rec.payload_refs()] == alone  # the run unharmed
    events = {e.learner: e for e in r.of(ContributionDropped)}
    assert sorted(events) == sorted(expected)
    reasons = {d.learner: d.reason for d in rec.dropped}
    for learner, (key, part) in expected.items():
        event = events[learner]
        assert (event.round, event.key) == (0, key), learner
        assert part in event.reason, (learner, event.reason)
        assert reasons[learner] == event.reason[:500]
    conclude(f"bad payloads and records ({len(expected)} kinds)", figures,
             [event_dict(e) for e in r.events], None,
           dropped_by_key=len(events), merged=["good"])


# -- the learner side --------------------------------------------------------------------


FAST: dict[str, Any] = {"poll_interval": 0.01, "lease_every": 0.5, "lease_timeout": 5.0,
        "keep_versions": 10**6}


class ObjectFaults(FaultyMailbox):
    """A FaultyMailbox whose get rules count only reads of objects that exist: a learner
    polls for the next record long before it is written, and a fault on a read that finds
    nothing damages nothing."""

    async def get(self, key: str) -> bytes | None:
        data = await self.inner.get(key)
        if data is None:
            return None
        for rule in self.plan.firing("get", key):
            if rule.kind == "corrupt":
                flipped = bytearray(data)
                for i in {0, len(data) // 2, len(data) - 1}:
                    flipped[i] ^= 0x5A
                data = bytes(flipped)
            elif rule.kind == "truncate":
                data = data[: rule.length]
        return data


def committed(mailbox: Mailbox) -> list[dict[str, str]]:
    """The SHA-256 of each tensor of Θ⁰ and of every committed theta, per fragment."""

    async def go() -> list[dict[str, str]]:
        ex = Exchange(mailbox)
        manifest = await ex.read_manifest()
        assert manifest is not None
        replica = Replica(ex, manifest, algorithm_from_json(dict(manifest.algorithm)))
        states = [await replica.at(p, None) for p in range(len(manifest.plan))]
        states += [await replica.at(rec.fragment, rec) for rec in await ex.rounds_after(-1)]
        out = []
        for state in states:
            assert state is not None
            out.append({n: hashlib.sha256(t.data).hexdigest() for n, t in state.theta.items()})
        return out

    return asyncio.run(go())


def train(learner: Learner, adapter: ToyAdapter, worker: int, steps: int) -> Callable[[], None]:
    def go() -> None:
        for step in range(steps):
            train_step(adapter, worker, step)
            learner.step(16)
            time.sleep(0.01)
        learner.close()

    return go


def in_threads(*targets: Callable[[], None], timeout: float = 120) -> None:
    errors: list[BaseException] = []

    def wrap(f: Callable[[], None]) -> Callable[[], None]:
        def inner() -> None:
            try:
                f()
            except BaseException as exc:  # re-raised in the test's thread
                errors.append(exc)

        return inner

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
        assert not t.is_alive(), "a learner hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize(("commit_dtype", "checkpoint_every"), [(None, 1), ("BF16", 1), (None, 20)],
                         ids=["theta", "update", "step"])
def test_a_corrupted_commit_seen_by_a_learner_is_never_applied(
    tmp_path: Path, commit_dtype: str | None, checkpoint_every: int
) -> None:
    """The reader's mailbox flips bits in (or cuts short) the commit payloads and a round
    record it reads, a few times each. It reports each, applies none, and ends on the
    same commits as the writer."""
    box = tmp_path / "run"
    plan = (FaultPlan()
            .corrupt("theta/*", nth=2, times=3)
            .truncate("theta/*", 100, nth=8, times=1)
            .corrupt("updates/*", nth=2, times=3)
            .corrupt("steps/*", nth=2, times=3)
            .truncate("steps/*", 100, nth=8, times=1)
            .corrupt("rounds/*", nth=5, times=1))
    alg = DiLoCo(sync_every=4, fragments=2, commit_dtype=commit_dtype,
                 checkpoint_every=checkpoint_every)
    seen: dict[str, list[Event]] = {"writer": [], "reader": []}
    adapters = {"writer": ToyAdapter(0), "reader": ToyAdapter(1)}
    writer = Learner(adapters["writer"], alg, LocalMailbox(box), "writer",
                     on_event=seen["writer"].append, options=LearnerOptions(**FAST))
    reader = Learner(
        adapters["reader"],
        alg,
        ObjectFaults(LocalMailbox(box), plan),
        "reader",
        on_event=seen["reader"].append,
        options=LearnerOptions(**FAST, sync=False),
    )
    writer.start()
    reader.start()  # no commit yet: the join reads Θ⁰ only
    in_threads(train(writer, adapters["writer"], 0, 80),
               train(reader, adapters["reader"], 1, 80))
    mailbox = LocalMailbox(box)
    figures = verify_run(mailbox)
    failures = [e.error for e in seen["reader"] if isinstance(e, PollFailed)]
    fired = {r.kind + " " + r.pattern: r.fired for r in plan.rules}
    wanted = {
        "corrupt theta/*": ("theta/", "SHA-256"),
        "truncate theta/*": ("theta/", "but its record says"),
        "corrupt updates/*": ("updates/", "SHA-256"),
        "corrupt steps/*": ("steps/", "SHA-256"),
        "truncate steps/*": ("steps/", "but its record says"),
        "corrupt rounds/*": ("rounds/", "is not valid JSON"),
    }
    for rule, count in fired.items():
        key, words = wanted[rule]
        reported = [f for f in failures if key in f and words in f]
        assert len(reported) == count, (rule, count, failures)
    main = ("corrupt steps/*" if checkpoint_every > 1 else
            "corrupt updates/*" if commit_dtype else "corrupt theta/*")
    assert fired[main] == 3 and fired["corrupt rounds/*"] == 1
    good = committed(mailbox)
    applied = adapters["reader"].applied
    assert applied and all(any(d.items() <= c.items() for c in good) for d in applied)
    for name in ("writer", "reader"):
        learner, adapter = (writer, reader)[name == "reader"], adapters[name]
        assert adapter.digests() == theta_digests(mailbox, learner.rounds_seen), name
    aligned = [e for e in seen["reader"] if isinstance(e, FragmentAligned)]
    kind = "step" if checkpoint_every > 1 else "update" if commit_dtype else "theta"
    conclude(f"corrupted commit {kind} payloads and a "
             "corrupted record, seen by a learner", figures,
             [event_dict(e) for e in seen["writer"] + seen["reader"]], None,
             faults_injected=sum(fired.values()), poll_failures=len(failures),
             applied=len(applied), aligned=len(aligned))


@pytest.mark.slow
def test_a_nan_and_inf_delta_is_rejected_and_the_run_unharmed(tmp_path: Path) -> None:
    """The 5th delta of learner `bad` holds NaN and Inf (a device gone wrong): its round
    leaves it out by name and merges the other; later rounds merge both again."""
    box = tmp_path / "run"
    run = ["--sync-every", "8", "--fragments", "2", "--quorum", "2", "--overlap", "8",
           "--sleep", "0.02", "--poll", "0.01"]
    steady = spawn_learner(box, "steady", tmp_path / "steady.json", "--worker", "0",
                           "--steps", "100", "--wait-for", "2", *run)
    bad = spawn_learner(box, "bad", tmp_path / "bad.json", "--worker", "1",
                        "--steps", "100", "--bad-delta", "5", *run)
    try:
        results = [LearnerResult.of(w.finish(timeout=120)) for w in (steady, bad)]
    finally:
        for w in (steady, bad):
            w.stop()
    mailbox = LocalMailbox(box)
    figures = verify_run(mailbox)  # every committed theta is finite
    for res in results:
        check_ends_on_commits(mailbox, res)
    [(r, reason)] = figures.dropped("bad")
    assert reason.startswith("non-finite values in ['"), reason
    assert r in [e["round"] for e in results[1].of_type("SnapshotPublished")]
    events = [e for res in results for e in res.of_type("ContributionDropped")]
    # Named by its payload's key: uploaded (`bad.safetensors`), or, when bad's own closer
    # closed the round and merged it from memory, the key it was drafted under (`bad`):
    # which closer closes depends on who arrives last.
    assert [(e["round"], e["learner"]) for e in events] == [(r, "bad")]
    assert events[0]["key"] in (f"payloads/{r:010d}/bad.safetensors",
                                f"payloads/{r:010d}/bad")
    assert r in figures.participants("steady")
    assert any(later > r for later in figures.participants("bad"))
    conclude("a NaN/Inf delta from one learner", figures,
             [e for res in results for e in res.events], results[0].step_max,
             dropped_round=r, reason=reason,
             bad_back_in_round=min(x for x in figures.participants("bad") if x > r))


@pytest.mark.parametrize("kind", ["theta", "steps"])
def test_a_corrupted_commit_read_at_join_is_refused_not_applied(tmp_path: Path,
                                                                 kind: str) -> None:
    """Joining reads each fragment's newest theta once (or Θ⁰ and the steps since): a
    corrupted read fails `start()` with the key named, and nothing reaches the model (a
    later start joins normally)."""
    box = tmp_path / "run"
    alg = DiLoCo(sync_every=4, fragments=2, checkpoint_every=1 if kind == "theta" else 20)
    first = ToyAdapter(0)
    writer = Learner(first, alg, LocalMailbox(box), "writer", on_event=lambda e: None,
                     options=LearnerOptions(**FAST))
    writer.start()
    for step in range(12):
        train_step(first, 0, step)
        writer.step(16)
        time.sleep(0.01)
    writer.close()
    newest = asyncio.run(Exchange(LocalMailbox(box)).newest_round())
    assert newest >= 1
    late = ToyAdapter(1)
    before = late.digests()
    faulty = FaultyMailbox(LocalMailbox(box), FaultPlan().corrupt(f"{kind}/*", times=1))
    joiner = Learner(late, alg, faulty, "late", on_event=lambda e: None,
                     options=LearnerOptions(**FAST))
    with pytest.raises(CorruptPayload, match=rf"payload '{kind}/\d/\d{{10}}-000000.safetensors' "
                                             r"has SHA-256 [0-9a-f]{16}\.\.\., its record says"):
        joiner.start()
    joiner.close()
    assert late.applied == [] and late.digests() == before
    again = Learner(late, alg, faulty, "late", on_event=lambda e: None,
                    options=LearnerOptions(**FAST))
    again.start()
    assert late.digests() == theta_digests(LocalMailbox(box), newest)
    again.close()
