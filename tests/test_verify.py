"""`gradientmail verify` and the `keep_rounds` retention that makes a run auditable.

Runs come from three places: real learners on threads (the oracle's standard DiLoCo, and
the decoupled defaults), rounds written and closed by hand (`test_syncer.Run`: RDA and the
weighted mean, F4 deltas and commits, a takeover, held contributions), and tampered copies
of those: a byte of a stored theta, outer state, step or contribution flipped, a record
resealed with another key, a closer that merges differently. Verification must pass on
every honest run and name the round and tensor of every dishonest one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_learner_runtime import in_threads
from test_syncer import SCHEMA, GateClock, Run, delta, fake, init_tensors
from workers.toy import inner_step, make_model

import gradientmail.syncer.runtime as syncer_module
from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Rda, WeightedMean
from gradientmail.app.cli import main
from gradientmail.app.verify import first_difference, verify_run
from gradientmail.app.verify_report import Report, format_report
from gradientmail.errors import CorruptPayload, RemoteProtocolError
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import LocalMailbox, Mailbox, MemoryMailbox
from gradientmail.mailbox.wrappers import FaultPlan, FaultyMailbox
from gradientmail.run.committed import read_committed
from gradientmail.run.keyspace import audit_floor, plan_sweep, round_key
from gradientmail.run.protocol import Exchange
from gradientmail.wire import compression as codec
from gradientmail.wire.auth import HmacSeal, key_fingerprint
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.quantization import quantize
from gradientmail.wire.records import Manifest, RoundRecord
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.serialization import pack, unpack
from gradientmail.wire.sharded_blocks import BLOCK_BYTES, BLOCKS_KEY, blocks_entry
from gradientmail.wire.sharded_ranges import fetch_rows
from gradientmail.wire.tensor_bytes import TensorBytes

KEY = "a-run-key-for-the-tests-0123456789"
OTHER_KEY = "another-key-nobody-should-use-9876543210"
LIVE = frozenset({"a", "b"})
TOKENS = {"a": 40, "b": 90}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def audited(merge: Any = None, **kw: Any) -> DiLoCo:
    """Two fragments (w and b), a closer per round, the outer step replicated with a
    checkpoint every 2 versions, and every round kept."""
    kw.setdefault("checkpoint_every", 2)
    kw.setdefault("keep_rounds", 1000)
    kw.setdefault("quorum_size", 2)
    kw.setdefault("in_flight", 1)
    return DiLoCo(4, 2, merge=merge or WeightedMean(), **kw)


async def create(r: Run, run_key: str | None = None) -> None:
    if run_key is None:
        await r.create()
        return
    r.ex = Exchange(r.mailbox, clock=r.clock, run_key=run_key)
    init = init_tensors()
    refs = [await r.ex.put_init(p, {n: init[n] for n in names}, attempt=0)
            for p, names in enumerate(r.plan)]
    assert await r.ex.create_manifest(Manifest(
        SCHEMA, r.plan, r.alg.to_json(), "creator", tuple(refs), "off",
        key_fingerprint=key_fingerprint(run_key)))


async def contribute(r: Run, rnd: int, learner: str) -> None:
    """`learner`'s contribution to round `rnd` in the run's delta format."""
    fmt = r.alg.delta_dtype or "F32"
    if fmt == "F32":
        await r.contribute(rnd, learner, tokens=TOKENS[learner])
        return
    fragment = r.schedule.fragment_of(rnd)
    entries = {}
    for name, t in delta(rnd, learner, r.plan[fragment]).items():
        entries.update(quantize(name, t, fmt))
    await r.ex.publish(rnd, learner, entries, fragment=fragment, base_version=rnd // 2,
                       local_step=4 * rnd + 4, steps=4, tokens=TOKENS[learner], final=False,
                       schema_digest=SCHEMA.digest(), delta_format=fmt)


def closed_run(mailbox: Mailbox, alg: DiLoCo, rounds: int = 8,
               run_key: str | None = None) -> Run:
    """A run of `rounds` rounds of a's and b's contributions, closed by one syncer."""

    async def go() -> Run:
        r = Run(mailbox, alg)
        await create(r, run_key)
        s = r.syncer(run_key=run_key)
        for rnd in range(rounds):
            for learner in ("a", "b"):
                await contribute(r, rnd, learner)
            assert await s.poll(live=LIVE)
        return r

    return run(go())


def verify(mailbox: Mailbox, run_key: str | None = None, start: int = 0) -> Report:
    async def go() -> Report:
        return await verify_run(Exchange(mailbox, run_key=run_key), "test-run", start=start)

    return run(go())


def statuses(report: Report) -> list[str]:
    return [v.status for v in report.rounds]


@pytest.fixture
def mailbox() -> Iterator[Mailbox]:
    name = "verify-test"
    MemoryMailbox.forget(name)
    yield MemoryMailbox(name)
    MemoryMailbox.forget(name)


# -- honest runs verify ----------------------------------------------------------------


@pytest.mark.parametrize("merge", [WeightedMean(), Rda(direct_pattern=None, min_deltas=2)],
                         ids=["weighted-mean", "rda"])
@pytest.mark.parametrize("checkpoint_every", [1, 2, 20])
def test_every_round_of_an_audited_run_verifies(mailbox: Mailbox, merge: Any,
                                                checkpoint_every: int) -> None:
    closed_run(mailbox, audited(merge, checkpoint_every=checkpoint_every))
    report = verify(mailbox)
    assert report.ok and statuses(report) == ["verified"] * 8
    assert report.first_mismatch is None
    assert all(v.bytes > 0 for v in report.rounds)


def test_a_pipelined_barriers_rounds_verify(mailbox: Mailbox) -> None:
    # stagger=False: both fragments' rounds of a sync at one step; the records say
    # nothing of it, and each round re-derives as any other.
    closed_run(mailbox, audited(in_flight=2, overlap_steps=0, stagger=False))
    report = verify(mailbox)
    assert report.ok and statuses(report) == ["verified"] * 8


def test_rounds_short_of_their_cohort_verify(mailbox: Mailbox) -> None:
    """Quorum 1: rounds 2 and 5 close with a alone after the grace window (b awaited in
    vain), and b's next rounds carry it again. Each round's cohort, a and b, comes from
    the records (the fragment's previous round, `missed`), so the verifier re-derives
    the closer's shares byte for byte."""

    async def go() -> list[RoundRecord]:
        r = Run(mailbox, audited(quorum_size=1))
        await create(r)
        s = r.syncer()
        for rnd in range(8):
            alone = rnd in (2, 5)
            for learner in ("a",) if alone else ("a", "b"):
                await contribute(r, rnd, learner)
            if alone:
                assert not await s.poll(live=LIVE)  # b may still come
                fake(r).advance(60.0)
            assert await s.poll(live=LIVE)
        return await r.records()

    recs = run(go())
    assert [len(rec.participants) for rec in recs] == [2, 2, 1, 2, 2, 1, 2, 2]
    assert recs[2].arrival is not None and recs[2].arrival.missed == ("b",)
    report = verify(mailbox)
    assert report.ok and statuses(report) == ["verified"] * 8


@pytest.mark.parametrize("checkpoint_every", [1, 2], ids=["update", "step"])
def test_f4_deltas_and_commits_verify(mailbox: Mailbox, checkpoint_every: int) -> None:
    alg = audited(Rda(direct_pattern=None, min_deltas=2), delta_dtype="F4", commit_dtype="F4",
                  checkpoint_every=checkpoint_every)
    r = closed_run(mailbox, alg)
    recs = run(r.records())
    # F4 travels both ways: as a quantized update (every commit a checkpoint) or as the
    # replicated step itself.
    if checkpoint_every == 1:
        assert all(x.update is not None and x.update.format == "F4" for x in recs)
    else:
        assert all(x.step is not None and x.step.format == "F4" for x in recs)
    report = verify(mailbox)
    assert report.ok and statuses(report) == ["verified"] * 8


def test_a_takeover_mid_round_verifies(mailbox: Mailbox) -> None:
    """Closer a hangs uploading round 3's step and is cancelled; b takes the round over
    under claim attempt 1. Every commit, the taken-over one too, re-derives."""

    async def go() -> None:
        r = Run(mailbox, audited())
        await r.create()
        for rnd in range(6):
            for learner in ("a", "b"):
                await contribute(r, rnd, learner)
        gate = GateClock()
        stuck = FaultyMailbox(mailbox, FaultPlan().delay(
            "put", "steps/1/0000000002-*", 1.0, gate))
        a, b = r.syncer("a-closer", mailbox=stuck), r.syncer("b-closer")
        for _ in range(3):
            assert await a.poll(live=LIVE)
        task = asyncio.create_task(a.poll(live=LIVE))
        await gate.waiting.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not await b.poll(live=LIVE)  # a's claim is current: b waits it out
        fake(r).advance(10.0)
        assert await b.poll(live=LIVE)
        assert await a.poll(live=LIVE)
        assert await b.poll(live=LIVE)
        rec3 = await r.ex.read_round(3)
        assert rec3 is not None and rec3.step is not None
        assert rec3.step.payload.key.endswith("-000001.safetensors")

    run(go())
    report = verify(mailbox)
    assert report.ok and statuses(report) == ["verified"] * 6


def test_the_oldest_rounds_are_swept_and_the_kept_ones_verify(mailbox: Mailbox) -> None:
    closed_run(mailbox, audited(keep_rounds=3, checkpoint_every=3), rounds=9)
    report = verify(mailbox)
    assert statuses(report) == ["swept"] * 6 + ["verified"] * 3 and report.ok
    assert "swept" in report.rounds[0].note
    # --from skips what the caller does not ask for.
    later = verify(mailbox, start=7)
    assert [v.round for v in later.rounds] == [7, 8] and later.ok


def test_a_run_that_sweeps_leaves_nothing_to_verify_and_says_so(mailbox: Mailbox) -> None:
    closed_run(mailbox, audited(keep_rounds=None), rounds=3)
    report = verify(mailbox)
    assert report.ok and statuses(report) == ["swept"] * 3
    assert "nothing left to re-derive" in format_report(report)
    assert "keep_rounds" in format_report(report)


def test_held_rounds_are_unverifiable_not_failures(mailbox: Mailbox) -> None:
    async def go() -> None:
        r = Run(mailbox, audited(checkpoint_every=20, keep_rounds=None))
        await r.create()
        s = r.syncer("a", embedded=True, sweep=False)
        await r.contribute(0, "b", tokens=90)
        draft = r.ex.draft(0, "a", fragment=0, base_version=0, local_step=4, steps=4,
                           tokens=40, final=False, schema_digest=SCHEMA.digest(),
                           delta_format="F32")
        taken = s.host.offer(draft, delta(0, "a", r.plan[0]))
        assert await s.poll(live=LIVE)
        assert taken.result() is True
        for rnd in (1, 2, 3):  # round 2 is fragment 0 again, from the held round's state
            for learner in ("a", "b"):
                await contribute(r, rnd, learner)
            assert await s.poll(live=LIVE)

    run(go())
    report = verify(mailbox)
    assert statuses(report) == ["held", "verified", "verified", "verified"]
    assert report.ok and report.count("held") == 1
    assert "a merged its own delta from memory" in report.rounds[0].note


# -- real learners ------------------------------------------------------------------------


def learner_run(url: str, alg: DiLoCo, steps: int, learners: int = 2,
                standard: bool = False) -> None:
    """`learners` Learner threads train the toy model for `steps` steps on `url`."""
    models = [make_model() for _ in range(learners)]
    ready = threading.Barrier(learners)

    def work(w: int) -> Callable[[], None]:
        def go() -> None:
            model = models[w]
            learner = Learner(
                TorchAdapter(model),
                alg,
                url,
                f"learner-{w}",
                options=LearnerOptions(poll_interval=0.01, lease_every=5.0, lease_timeout=30.0),
            )
            learner.start()
            ready.wait(timeout=60)
            if standard:
                learner.wait_for_learners(learners, timeout=60)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            for step in range(steps):
                inner_step(model, opt, w, step)
                learner.step(5)
            learner.close()

        return go

    in_threads(*(work(w) for w in range(learners)))


def records_of(mailbox: Mailbox) -> list[RoundRecord]:
    return run(Exchange(mailbox).rounds_after(-1))


def test_a_run_of_the_oracles_learners_verifies() -> None:
    """Standard DiLoCo as tests/test_learner_oracle.py runs it, kept auditable: its
    learners upload every contribution (none held), and every round re-derives."""
    MemoryMailbox.forget("verify-oracle")
    alg = DiLoCo(sync_every=3, fragments=1, in_flight=1, overlap_steps=0,
                 merge=WeightedMean(), quorum_size=2, keep_rounds=100)
    learner_run("memory://verify-oracle", alg, steps=12, standard=True)
    mailbox = MemoryMailbox("verify-oracle")
    recs = records_of(mailbox)
    assert len(recs) >= 4
    assert not any(p.held for rec in recs for p in rec.participants)
    assert [len(rec.participants) for rec in recs[:4]] == [2, 2, 2, 2]
    report = verify(mailbox)
    assert report.ok and statuses(report) == ["verified"] * len(recs)
    MemoryMailbox.forget("verify-oracle")


@pytest.mark.parametrize("options", [{}, {"delta_dtype": "F4", "commit_dtype": "F4",
                                          "checkpoint_every": 2}], ids=["defaults", "f4"])
def test_a_decoupled_run_of_learners_verifies(options: dict[str, Any]) -> None:
    """Decoupled DiLoCo's defaults (quorum 1, two rounds in flight, RDA, replicated outer
    step): no barrier, rounds close on whoever is in, stale contributions are dropped."""
    MemoryMailbox.forget("verify-decoupled")
    alg = DiLoCo(sync_every=4, fragments=2, keep_rounds=1000, **options)
    learner_run("memory://verify-decoupled", alg, steps=24)
    mailbox = MemoryMailbox("verify-decoupled")
    recs = records_of(mailbox)
    assert len(recs) >= 3  # how many rounds close depends on the threads' timing
    assert not any(p.held for rec in recs for p in rec.participants)
    report = verify(mailbox)
    assert report.ok, [str(m) for v in report.rounds for m in v.mismatches]
    assert statuses(report) == ["verified"] * len(recs)
    MemoryMailbox.forget("verify-decoupled")


# -- runs that sweep: the chain of steps is checked instead ---------------------------


async def forge_step(mailbox: Mailbox, r: int) -> str:
    """Change a bit of round `r`'s step payload and rewrite its record to match (a
    run without a run key: its records are plain JSON, anyone may rewrite them), as a
    consistent forger would: block digests and header digest made anew. Returns the key."""
    rec = await Exchange(mailbox).read_round(r)
    assert rec is not None and rec.step is not None
    ref = rec.step.payload
    blob = await mailbox.get(ref.key)
    assert blob is not None
    compression = codec.compression_of(ref.key)
    tensors, meta = codec.decode_with_metadata(blob, compression, key=ref.key,
                                               max_bytes=4 * len(blob))
    meta.pop(BLOCKS_KEY, None)
    name = next(iter(tensors))
    t = tensors[name]
    raw = bytearray(t.buffer)
    raw[2] ^= 0x40  # a high mantissa bit of an F32's first element: no rounding hides it
    forged = codec.encode({**tensors, name: TensorBytes(t.dtype, t.shape, bytes(raw))},
                          compression, meta,
                          blocks=BLOCK_BYTES if ref.header_sha256 is not None else None)
    await mailbox.put(ref.key, forged)
    new_ref = PayloadRef.of(ref.key, forged, header=ref.header_sha256 is not None)
    step = dataclasses.replace(rec.step, payload=new_ref)
    await mailbox.put(round_key(r), dataclasses.replace(rec, step=step).encode())
    return ref.key


def test_a_run_that_sweeps_has_its_chain_checked_and_says_what_was_not(
        mailbox: Mailbox) -> None:
    """Contributions swept after each commit, a checkpoint every 2 versions: rounds
    before each fragment's newest checkpoint are gone entirely; from it on, every
    commit's payloads and step are checked against the theta its record names."""
    closed_run(mailbox, audited(keep_rounds=None), rounds=8)
    report = verify(mailbox)
    assert report.ok and statuses(report) == ["swept"] * 8
    # Fragment 0's rounds 0, 2, 4, 6 commit versions 1..4; its newest checkpoint is
    # version 4 (round 6): the checkpoint of version 2, which version 3's step needs, is
    # swept.
    assert [v.chain for v in report.rounds] == ["swept"] * 6 + ["checked"] * 2
    assert report.unmerged("checked") == [6, 7]
    summary = report.to_json()
    assert (summary["rounds_swept"], summary["rounds_chain_checked"],
            summary["rounds_unchecked"]) == (8, 2, 6)
    assert [v["chain"] for v in summary["rounds"]][5:] == ["swept", "checked", "checked"]
    text = format_report(report)
    assert ("not re-derived: the merges of 8 rounds (rounds 0..7): their contributions "
            "are swept or were never uploaded") in text
    assert ("checked instead: 2 rounds (rounds 6..7): their payloads' digests and the "
            "chain of steps from the newest checkpoint to each committed theta") in text
    assert "not checked at all: 6 rounds (rounds 0..5)" in text
    assert text.splitlines()[-1].startswith("OK: ")


def test_a_forged_step_of_a_run_that_sweeps_fails_naming_the_round(
        mailbox: Mailbox) -> None:
    closed_run(mailbox, audited(keep_rounds=None, checkpoint_every=20), rounds=6)
    assert verify(mailbox).ok
    run(forge_step(mailbox, 5))
    report = verify(mailbox)
    assert not report.ok
    assert [v.round for v in report.rounds if v.status == "failed"] == [5]
    first = report.first_mismatch
    assert first is not None and (first.round, first.fragment, first.what) == (5, 1, "chain")
    assert "round 5: applying its step to version 2 of fragment 1 gives theta" in first.detail
    # A step changed without its record: its digest names it.
    rec4 = run(Exchange(mailbox).read_round(4))
    assert rec4 is not None and rec4.step is not None
    run(flip_last_byte(mailbox, rec4.step.payload.key))
    report = verify(mailbox)
    assert [v.round for v in report.rounds if v.status == "failed"] == [4, 5]
    first = report.first_mismatch
    assert first is not None and (first.round, first.what) == (4, "chain")
    assert f"payload {rec4.step.payload.key!r} has SHA-256" in first.detail


def test_the_command_fails_a_forged_default_run_of_learners(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Learners on DiLoCo's defaults (contributions swept after each commit): the newest
    round's step forged, its record's digest rewritten. Reading the committed model
    refuses the chain, and so does `gradientmail verify`, naming the round."""
    path = tmp_path / "run"
    learner_run(str(path), DiLoCo(sync_every=4, fragments=2), steps=24)
    assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert "not re-derived: the merges of" in out and "checked instead:" in out
    assert "not checked at all" not in out  # no checkpoint yet but Θ⁰: every step is kept
    newest = run(Exchange(LocalMailbox(str(path))).newest_round())
    run(forge_step(LocalMailbox(str(path)), newest))
    with pytest.raises(RemoteProtocolError, match=f"round {newest}: applying its step"):
        read_committed(str(path))
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"round {newest}: FAILED (1 mismatch)" in out
    assert f"first mismatch: round {newest}, fragment {newest % 2}, chain: version " in out
    assert out.strip().splitlines()[-1].startswith(f"FAILED: {path} rounds 0..{newest}: ")


# -- tampered runs fail, naming the round and the tensor ------------------------------


async def flip_last_byte(mailbox: Mailbox, key: str) -> None:
    blob = await mailbox.get(key)
    assert blob is not None
    await mailbox.put(key, blob[:-1] + bytes([blob[-1] ^ 0x01]))


@pytest.mark.parametrize(("kind", "round_", "what", "tensor"), [
    ("theta", 2, "theta", "w"),           # fragment 0's checkpoint at version 2
    ("outer", 3, "outer", "momentum/b"),  # fragment 1's checkpoint at version 2
    ("step", 5, "step", "b"),
    ("contribution", 4, "contribution of b", "w"),
])
def test_one_changed_byte_fails_naming_round_and_tensor(
        mailbox: Mailbox, kind: str, round_: int, what: str, tensor: str) -> None:
    closed_run(mailbox, audited())
    rec = run(Exchange(mailbox).read_round(round_))
    key = {"theta": lambda: rec.theta.key, "outer": lambda: rec.outer.key,
           "step": lambda: rec.step.payload.key,
           "contribution": lambda: f"payloads/{round_:010d}/b.safetensors"}[kind]()
    run(flip_last_byte(mailbox, key))
    report = verify(mailbox)
    assert not report.ok
    failed = [v.round for v in report.rounds if v.status == "failed"]
    assert failed == [round_]  # the run's later rounds still re-derive
    first = report.first_mismatch
    assert first is not None
    assert (first.round, first.fragment, first.what, first.tensor) == (
        round_, round_ % 2, what, tensor)
    assert "SHA-256" in first.detail and key in first.detail
    if kind != "contribution":
        assert "1 of" in first.detail and "elements differ" in first.detail


@pytest.mark.parametrize("fault", ["blocks", "header"])
def test_a_closer_that_wrote_wrong_digests_is_caught(mailbox: Mailbox, fault: str) -> None:
    # A payload whose bytes are its record's, but whose block digests (or the record's
    # header digest) are wrong: unsharded learners would accept it, every sharded one
    # would refuse its ranges. Round 2 is fragment 0's checkpoint at version 2.
    closed_run(mailbox, audited())
    ex = Exchange(mailbox)
    rec = run(ex.read_round(2))
    assert rec.theta is not None and rec.theta.header_sha256 is not None
    blob = run(mailbox.get(rec.theta.key))
    tensors = unpack(blob)
    if fault == "blocks":
        other = {n: TensorBytes(t.dtype, t.shape, bytes(t.nbytes)) for n, t in tensors.items()}
        blob = pack(tensors, {BLOCKS_KEY: blocks_entry(other)})
        ref = PayloadRef.of(rec.theta.key, blob, header=True)
        run(mailbox.put(rec.theta.key, blob))
    else:
        ref = dataclasses.replace(rec.theta, header_sha256="0" * 64)
    run(mailbox.put(round_key(2), dataclasses.replace(rec, theta=ref).encode()))
    with pytest.raises(CorruptPayload, match="block 0 of tensor 'w'" if fault == "blocks"
                       else "its record says 0000000000000000"):
        run(fetch_rows(mailbox, ref.key, ref.size, {"w": (0, 1)},
                       header_sha256=ref.header_sha256))
    report = verify(mailbox)
    assert [v.round for v in report.rounds if v.status == "failed"] == [2]
    first = report.first_mismatch
    assert first is not None and (first.round, first.what) == (2, "theta")
    assert ref.key in first.detail
    assert ("block 0 of tensor 'w'" if fault == "blocks"
            else "its record says 0000000000000000") in first.detail


def test_a_record_resealed_with_another_key_fails(mailbox: Mailbox) -> None:
    closed_run(mailbox, audited(), run_key=KEY)
    assert verify(mailbox, run_key=KEY).ok

    async def reseal(key: str) -> None:
        body = HmacSeal(KEY).open(key, await mailbox.get(key) or b"")
        await mailbox.put(key, HmacSeal(OTHER_KEY).seal(key, body))

    run(reseal(round_key(6)))
    report = verify(mailbox, run_key=KEY)
    assert report.sealed and not report.ok
    first = report.first_mismatch
    assert first is not None and (first.round, first.what) == (6, "record")
    assert "fails authentication" in first.detail
    # A contribution resealed: the closer merged it, its record no longer opens.
    run(reseal("snapshots/0000000003/b.json"))
    report = verify(mailbox, run_key=KEY)
    first = report.first_mismatch
    assert first is not None and (first.round, first.what) == (3, "participants")
    assert "recorded ['a', 'b'], re-derived ['a']" in first.detail
    dropped = [m for m in report.rounds[3].mismatches if m.what == "dropped"]
    assert dropped and "fails authentication" in dropped[0].detail


def test_without_the_run_key_an_authenticated_run_is_not_read(mailbox: Mailbox) -> None:
    closed_run(mailbox, audited(), rounds=2, run_key=KEY)
    with pytest.raises(RemoteProtocolError, match="this process has no run key"):
        verify(mailbox)


def test_a_closer_that_merges_differently_is_caught(
        mailbox: Mailbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 4's closer merges with the weighted mean where the run says RDA: its record,
    step and theta digest agree with each other, and not with the inputs."""
    honest = syncer_module.merge_round

    def plausible(alg: Any, state: Any, contributions: Any, schema: Any, *cohort: Any) -> Any:
        if state.fragment == 0 and state.version == 2:
            alg = dataclasses.replace(alg, merge=WeightedMean())
        return honest(alg, state, contributions, schema, *cohort)

    monkeypatch.setattr(syncer_module, "merge_round", plausible)
    closed_run(mailbox, audited(Rda(direct_pattern=None, min_deltas=2), checkpoint_every=20))
    report = verify(mailbox)
    assert [v.round for v in report.rounds if v.status == "failed"] == [4]
    whats = [(m.what, m.tensor) for m in report.rounds[4].mismatches]
    assert whats == [("step", "w"), ("theta digest", None)]
    assert "elements differ" in report.rounds[4].mismatches[0].detail


def test_a_closer_that_drops_a_contribution_as_stale_is_caught(
        mailbox: Mailbox, monkeypatch: pytest.MonkeyPatch) -> None:
    honest = syncer_module.screen_round

    async def leave_b_out(snaps: Any, **kw: Any) -> Any:
        if kw["state"].fragment == 1 and kw["state"].version == 1:
            kw["drop"]("b", "payloads/x", "stale: base version 0, the fragment is at "
                       "version 1")
            snaps = [s for s in snaps if s.learner != "b"]
        return await honest(snaps, **kw)

    monkeypatch.setattr(syncer_module, "screen_round", leave_b_out)
    closed_run(mailbox, audited(checkpoint_every=20))
    report = verify(mailbox)
    assert [v.round for v in report.rounds if v.status == "failed"] == [3]
    first = report.first_mismatch
    assert first is not None and first.what == "participants"
    assert any(m.what == "dropped" and "recorded 'stale" in m.detail
               for m in report.rounds[3].mismatches)


def test_first_difference_names_the_entry_and_the_element() -> None:
    from gradientmail.wire.tensor_bytes import TensorBytes

    a = TensorBytes.from_numpy(torch.arange(6, dtype=torch.float32).reshape(2, 3).numpy())
    b = TensorBytes.from_numpy((torch.arange(6, dtype=torch.float32)
                                + torch.tensor([0, 0, 0, 0, 0.5, 0])).reshape(2, 3).numpy())
    assert first_difference({"x": a}, {"x": a}) is None
    name, how = first_difference({"x": a}, {"x": b}) or ("", "")
    assert name == "x"
    assert how.startswith("1 of 6 elements differ; the first, [1, 1], is stored 4 (")
    assert "re-derived 4.5 (" in how
    assert first_difference({}, {"x": a}) == ("x", "missing from the stored payload")
    assert first_difference({"x": a, "y": a}, {"x": a}) == (
        "y", "in the stored payload, not in the re-derived one")


# -- the command --------------------------------------------------------------------------


def test_the_command_exits_0_when_all_held_and_1_naming_the_first_mismatch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run"
    closed_run(LocalMailbox(str(path)), audited(), rounds=4, run_key=KEY)
    monkeypatch.setenv("GRADIENTMAIL_RUN_KEY", KEY)
    assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("OK: " + str(path) + " rounds 0..3: 4 verified, 0 failed, "
                                "0 skipped because swept, 0 unverifiable (held); every "
                                "record's seal checked")
    rec = run(Exchange(LocalMailbox(str(path)), run_key=KEY).read_round(2))
    assert rec is not None and rec.theta is not None
    run(flip_last_byte(LocalMailbox(str(path)), rec.theta.key))
    assert main(["verify", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["ok"], report["rounds_verified"], report["rounds_failed"]) == (False, 3, 1)
    assert report["seals_checked"] is True
    first = report["first_mismatch"]
    assert (first["round"], first["fragment"], first["what"], first["tensor"]) == (
        2, 0, "theta", "w")
    assert main(["verify", str(path), "--from", "3"]) == 0
    assert "rounds 3..3: 1 verified" in capsys.readouterr().out
    monkeypatch.delenv("GRADIENTMAIL_RUN_KEY")
    assert main(["verify", str(path)]) == 1
    assert "this process has no run key" in capsys.readouterr().err


# -- keep_rounds --------------------------------------------------------------------------


def test_keep_rounds_is_written_only_when_set() -> None:
    plain = DiLoCo(4, 2)
    assert "keep_rounds" not in plain.to_json()
    kept = DiLoCo(4, 2, keep_rounds=5)
    assert kept.to_json()["keep_rounds"] == 5
    assert DiLoCo.from_json(kept.to_json()) == kept
    with pytest.raises(RemoteProtocolError, match="keep_rounds=None is not an integer"):
        DiLoCo.from_json({**plain.to_json(), "keep_rounds": None})
    with pytest.raises(Exception, match="keep_rounds=0 is below 1"):
        DiLoCo(4, 2, keep_rounds=0)


def _record(round_: int, fragment: int, version: int) -> RoundRecord:
    from gradientmail.wire.refs import PayloadRef, StepRef

    ref = PayloadRef(f"steps/{fragment}/{version:010d}-000000.safetensors", 1, "0" * 64)
    return RoundRecord(round_, fragment, version, None, None, None, (), Estimates(), None, (),
                       "s", False, step=StepRef(ref, "F32", "nesterov", "0" * 64))


def test_plan_sweep_keeps_the_inputs_of_the_newest_rounds_and_the_state_before_them() -> None:
    # Two fragments, rounds 0..9 closed: fragment 0 at version 5 (round 8), fragment 1 at
    # version 5 (round 9); checkpoints every 2 versions.
    latest = {0: _record(8, 0, 5), 1: _record(9, 1, 5)}
    keys = [f"{area}/{r:010d}/a.{ext}" for r in range(11)
            for area, ext in (("snapshots", "json"), ("payloads", "safetensors"))]
    keys += [f"claims/round/{r:010d}/000000" for r in range(11)]
    keys += [f"{kind}/{p}/{v:010d}-000000.safetensors" for p in (0, 1) for v in range(1, 6)
             for kind in ("steps", "theta", "outer")]
    swept = set(plan_sweep(keys, latest, 1, 2))
    default_kept = set(keys) - swept
    assert not any(k.startswith(("snapshots/", "payloads/")) and "/0000000010/" not in k
                   for k in default_kept)
    doomed = set(plan_sweep(keys, latest, 1, 2, keep_rounds=3, fragments=2))
    kept = set(keys) - doomed
    # Rounds 7, 8, 9 keep their contributions; round 10 is still open; claims of closed
    # rounds go as before.
    assert sorted({k.split("/")[1] for k in kept if k.startswith("snapshots/")}) == [
        f"{r:010d}" for r in (7, 8, 9, 10)]
    assert not any(k.startswith("claims/round/0000000009") for k in kept)
    # Fragment 0's kept round is 8 (version 5): the state before is version 4, a
    # checkpoint. Fragment 1's are 7 and 9 (versions 4, 5): before is version 3, so from
    # checkpoint 2 on.
    assert audit_floor(latest[0], 7, 2, 2) == 3
    assert audit_floor(latest[1], 7, 2, 2) == 1
    # (Version 5's theta is no checkpoint: no record references it, so it goes.)
    assert {k for k in kept if k.startswith(("steps/0", "theta/0"))} == {
        "theta/0/0000000004-000000.safetensors", "steps/0/0000000004-000000.safetensors",
        "steps/0/0000000005-000000.safetensors"}
    assert {k for k in kept if k.startswith("steps/1")} == {
        f"steps/1/{v:010d}-000000.safetensors" for v in (2, 3, 4, 5)}
    with pytest.raises(Exception, match="needs the plan's fragments"):
        plan_sweep(keys, latest, 1, 2, keep_rounds=3)


def test_learners_of_an_auditable_run_do_not_hold_their_contributions() -> None:
    """The same standard-DiLoCo run without keep_rounds holds contributions (its embedded
    closers merge their own from memory), and sweeps every round's inputs."""
    MemoryMailbox.forget("verify-holding")
    alg = DiLoCo(sync_every=3, fragments=1, in_flight=1, overlap_steps=0,
                 merge=WeightedMean(), quorum_size=2)
    learner_run("memory://verify-holding", alg, steps=12, standard=True)
    mailbox = MemoryMailbox("verify-holding")
    recs = records_of(mailbox)
    assert any(p.held for rec in recs for p in rec.participants)
    report = verify(mailbox)
    assert report.ok and report.count("verified") == 0
    assert report.count("held") + report.count("swept") == len(recs)
    MemoryMailbox.forget("verify-holding")


# -- the benchmark ------------------------------------------------------------------------


@pytest.mark.slow
def test_the_benchmark_quick_mode_verifies_each_round_and_appends_its_table(
        tmp_path: Path) -> None:
    import subprocess
    import sys

    results = tmp_path / "RESULTS.md"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "verify.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--rounds", "3",
                           "--results", str(results)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = results.read_text()
    assert "## verify: re-deriving a round vs closing it" in text
    assert "Command: `python benchmarks/verify.py --quick`" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["0", "1", "2", "all"]
    assert "- verify / close over 3 rounds: " in text
