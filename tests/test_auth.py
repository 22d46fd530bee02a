"""Authenticated runs: the seal's bytes, forged and foreign records, key checks at join,
learners sharing a key, the syncer and the command line on an authenticated run."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_learner_runtime import FAST as _FAST
from test_learner_runtime import Recorder, in_threads, make_model, train_step, wait_for
from test_syncer import SCHEMA, Run, algorithm, init_tensors

from gradientmail import events as ev
from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.app.cli import main
from gradientmail.errors import AuthenticationError, ConfigError
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import LocalMailbox, Mailbox, MemoryMailbox
from gradientmail.run.keyspace import MANIFEST_KEY, round_key
from gradientmail.run.protocol import Exchange
from gradientmail.syncer.runtime import Syncer
from gradientmail.wire.auth import (
    MAX_SEALED_BYTES,
    HmacSeal,
    PlainSeal,
    check_run_key,
    is_sealed,
    key_fingerprint,
    short_fingerprint,
)
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.records import CreationClaim, Manifest, RoundRecord
from gradientmail.wire.tensor_bytes import TensorBytes

KEY = b"0123456789abcdef0123456789abcdef"
OTHER = b"fedcba9876543210fedcba9876543210"
FP = "d76e5f64b82712b2"  # short fingerprint of KEY
OTHER_FP = short_fingerprint(key_fingerprint(OTHER))
FAST: dict[str, Any] = dict(_FAST)
CLAIM_KEY = "claims/create/000000"
GOLDEN_SEALED = (
    b'{"auth":"hmac-sha256","mac":"1edb714937807466906b7d0973b79ec828496cbad46758cc4b870ecc74d'
    b'221c6","record":{"attempt":0,"learner":"w0","v":1}}'
)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- the seal ----------------------------------------------------------------------------


def test_sealed_record_bytes_are_pinned() -> None:
    body = CreationClaim(0, "w0").encode()
    sealed = HmacSeal(KEY).seal(CLAIM_KEY, body)
    assert sealed == GOLDEN_SEALED
    # The MAC is HMAC-SHA256 over the domain, the record's key and its canonical JSON.
    mac = hmac.new(KEY, b"gradientmail/record/v1\0" + CLAIM_KEY.encode() + b"\0" + body,
                   hashlib.sha256).hexdigest()
    assert sealed == b'{"auth":"hmac-sha256","mac":"' + mac.encode() + b'","record":' + body + b"}"
    assert json.loads(sealed) == {"auth": "hmac-sha256", "mac": mac,
                                  "record": {"attempt": 0, "learner": "w0", "v": 1}}
    assert HmacSeal(KEY).open(CLAIM_KEY, sealed) == body
    assert is_sealed(sealed) and not is_sealed(body)


def test_fingerprints_are_pinned_and_name_the_key_not_reveal_it() -> None:
    assert key_fingerprint(KEY) == (
        "d76e5f64b82712b2a7bbe719e466e577acb3dc366bdf2368fc374f04ead4841e")
    assert key_fingerprint(KEY.decode()) == key_fingerprint(KEY)  # a str is its UTF-8
    assert key_fingerprint(KEY) != hashlib.sha256(KEY).hexdigest()  # domain-separated
    assert short_fingerprint(key_fingerprint(KEY)) == FP and short_fingerprint(None) == "none"
    assert repr(HmacSeal(KEY)) == f"HmacSeal(fingerprint='{FP}')"
    assert KEY.decode() not in repr(HmacSeal(KEY))


def test_a_short_or_mistyped_key_is_refused() -> None:
    with pytest.raises(ConfigError) as e:
        HmacSeal("secret")
    assert str(e.value) == (
        "the run key is 6 bytes; a run key needs at least 16 bytes. Use 32 random bytes, "
        "e.g. the output of `python -c 'import secrets; print(secrets.token_hex(32))'`")
    with pytest.raises(ConfigError, match="run_key must be a str or bytes, got a int"):
        check_run_key(12345678901234567890)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="a seal or a run_key, not both"):
        Exchange(MemoryMailbox(), seal=PlainSeal(), run_key=KEY)
    with pytest.raises(ConfigError, match="the run key is 3 bytes"):
        Learner(TorchAdapter(make_model()), DiLoCo(4, 2), MemoryMailbox(), "w", run_key="abc")


def forged_message(key: str, fp: str = FP) -> str:
    return (f"record {key!r} fails authentication with run key {fp}: its MAC does not match "
            "its contents. It was altered after sealing, sealed with another key, or forged "
            "by a writer without the key; it is ignored")


@pytest.mark.parametrize("where", range(0, len(GOLDEN_SEALED), 7))
def test_any_byte_changed_after_sealing_is_refused(where: int) -> None:
    data = bytearray(GOLDEN_SEALED)
    data[where] ^= 0x01
    with pytest.raises(AuthenticationError) as e:
        HmacSeal(KEY).open(CLAIM_KEY, bytes(data))
    msg = str(e.value)
    assert CLAIM_KEY in msg and FP in msg and msg.endswith("it is ignored")


def test_records_sealed_with_another_key_replayed_or_unsealed_are_refused() -> None:
    seal = HmacSeal(KEY)
    with pytest.raises(AuthenticationError) as e:
        seal.open(CLAIM_KEY, HmacSeal(OTHER).seal(CLAIM_KEY, CreationClaim(0, "w0").encode()))
    assert str(e.value) == forged_message(CLAIM_KEY)
    # A valid record moved to another key of the run is a forgery there.
    with pytest.raises(AuthenticationError) as e:
        seal.open("claims/create/000001", GOLDEN_SEALED)
    assert str(e.value) == forged_message("claims/create/000001")
    with pytest.raises(AuthenticationError) as e:
        seal.open(CLAIM_KEY, CreationClaim(0, "w0").encode())
    assert str(e.value) == (
        f"record {CLAIM_KEY!r} is not authenticated: this run uses run key {FP} and the record "
        "carries no MAC. It was written by a process without the run key (or the bucket was "
        "tampered with); it is ignored")
    with pytest.raises(AuthenticationError, match="carries a malformed seal or another scheme "
                       "than 'hmac-sha256'"):
        seal.open(CLAIM_KEY, GOLDEN_SEALED.replace(b"hmac-sha256", b"hmac-sha512"))
    with pytest.raises(AuthenticationError, match="carries a malformed seal"):
        seal.open(CLAIM_KEY, GOLDEN_SEALED[:100])
    with pytest.raises(AuthenticationError) as e:
        seal.open(CLAIM_KEY, b"{" + b" " * MAX_SEALED_BYTES + b"}")
    assert str(e.value) == (f"record {CLAIM_KEY!r} is {MAX_SEALED_BYTES + 2} bytes; a sealed "
                            f"record is at most {MAX_SEALED_BYTES} bytes. It is ignored")
    # A process without a key refuses sealed records by name, not as malformed JSON.
    with pytest.raises(AuthenticationError) as e:
        PlainSeal().open(CLAIM_KEY, GOLDEN_SEALED)
    assert str(e.value) == (
        f"record {CLAIM_KEY!r} is sealed with a run key (an authenticated run), but this "
        "process has none; set GRADIENTMAIL_RUN_KEY to the run's key "
        "(Learner, the gradientmail command and the integrations read it) or pass it as "
        "run_key=")


def test_an_exchange_seals_every_record_and_reads_back_only_what_verifies() -> None:
    async def main() -> None:
        mailbox = MemoryMailbox()
        ex = Exchange(mailbox, run_key=KEY)
        assert await ex.claim_creation("w0", 0)
        assert await mailbox.get(CLAIM_KEY) == GOLDEN_SEALED
        assert await ex.read_creation_claim(0) == CreationClaim(0, "w0")
        r = AuthRun(mailbox)
        await r.create()
        await r.contribute(0, "a")
        assert await Syncer.open(mailbox, run_key=KEY, closer_id="s").poll(live=frozenset({"a"}))
        raw = await mailbox.get(round_key(0))
        assert raw is not None and raw.startswith(b'{"auth":"hmac-sha256","mac":"')
        back = await r.ex.read_round(0)
        assert back is not None and back.round == 0
        # Tampering with a commit (one digit of a participant's tokens) is refused by name.
        await mailbox.delete(round_key(0))
        await mailbox.put(round_key(0), raw.replace(b'"tokens":64', b'"tokens":65'))
        with pytest.raises(AuthenticationError) as e:
            await r.ex.read_round(0)
        assert str(e.value) == forged_message(round_key(0))

    run(main())


# -- the manifest: the run's key at join -------------------------------------------------


class AuthRun(Run):
    """test_syncer's hand-written run, with records sealed under `key`."""

    def __init__(self, mailbox: Mailbox, key: bytes | None = KEY, **kw: Any) -> None:
        super().__init__(mailbox, kw.pop("alg", algorithm(fragments=1, quorum_size=1)), **kw)
        self.key = key
        self.ex = Exchange(mailbox, clock=self.clock, run_key=key)

    async def create(self) -> Manifest:
        init = init_tensors()
        refs = [await self.ex.put_init(p, {n: init[n] for n in names}, attempt=0)
                for p, names in enumerate(self.plan)]
        fp = None if self.key is None else key_fingerprint(self.key)
        manifest = Manifest(SCHEMA, self.plan, self.alg.to_json(), "creator", tuple(refs),
                            "off", key_fingerprint=fp)
        assert await self.ex.create_manifest(manifest)
        return manifest


NO_KEY_MESSAGE = (
    f"the run in memory:// is authenticated with run key {FP}, but this process has no run "
    "key; set GRADIENTMAIL_RUN_KEY to the run's key (Learner, the gradientmail command and "
    "the integrations read it) or pass it as run_key=")
OTHER_KEY_MESSAGE = (
    f"the run in memory:// uses run key {FP}, but this process has run key {OTHER_FP}; set "
    "GRADIENTMAIL_RUN_KEY to the run's key (Learner, the gradientmail command and the "
    "integrations read it) or pass it as run_key=")
UNAUTHENTICATED_MESSAGE = (
    f"the run in memory:// is not authenticated (its manifest names no run key), but this "
    f"process has run key {FP}; join it without a run key, or start an authenticated run "
    "under another prefix")


def test_reading_the_manifest_checks_the_key_naming_both_fingerprints() -> None:
    async def main() -> None:
        authed, plain = MemoryMailbox(), MemoryMailbox()
        manifest = await AuthRun(authed).create()
        assert manifest.key_fingerprint == key_fingerprint(KEY)
        assert await Exchange(authed, run_key=KEY).read_manifest() == manifest
        with pytest.raises(AuthenticationError) as e:
            await Exchange(authed).read_manifest()
        assert str(e.value) == NO_KEY_MESSAGE
        with pytest.raises(AuthenticationError) as e:
            await Exchange(authed, run_key=OTHER).read_manifest()
        assert str(e.value) == OTHER_KEY_MESSAGE
        await AuthRun(plain, key=None).create()
        with pytest.raises(AuthenticationError) as e:
            await Exchange(plain, run_key=KEY).read_manifest()
        assert str(e.value) == UNAUTHENTICATED_MESSAGE
        # A manifest altered without the key (its codec field) fails by name.
        raw = await authed.get(MANIFEST_KEY)
        assert raw is not None
        await authed.put(MANIFEST_KEY, raw.replace(b'"codec":"off"', b'"codec":"zstd"'))
        with pytest.raises(AuthenticationError) as e:
            await Exchange(authed, run_key=KEY).read_manifest()
        assert str(e.value).startswith(
            f"the manifest of the run in memory:// fails authentication (this process has run "
            f"key {FP}, the manifest claims {FP}): record 'manifest.json' fails authentication")
        # An unsealed manifest claiming a key (a downgrade) is refused too.
        unsealed = manifest.encode()
        await authed.put(MANIFEST_KEY, unsealed)
        with pytest.raises(AuthenticationError, match="is not authenticated: this run uses"):
            await Exchange(authed, run_key=KEY).read_manifest()
        with pytest.raises(AuthenticationError, match="its manifest names another key than "
                           "its seal"):
            await Exchange(authed).read_manifest()

    run(main())


def test_a_learner_without_the_key_or_with_another_is_refused_at_join() -> None:
    mailbox = MemoryMailbox()
    alg = DiLoCo(sync_every=4, fragments=2)
    first = Learner(TorchAdapter(make_model()), alg, mailbox, "a", run_key=KEY,
                    on_event=lambda e: None, options=LearnerOptions(**FAST))
    first.start()
    try:
        for key, message in ((None, NO_KEY_MESSAGE), (OTHER, OTHER_KEY_MESSAGE)):
            other = Learner(TorchAdapter(make_model()), alg, mailbox, "b", run_key=key,
                            on_event=lambda e: None, options=LearnerOptions(**FAST))
            with pytest.raises(AuthenticationError) as e:
                other.start()
            assert str(e.value) == message
    finally:
        first.close()
    plain = MemoryMailbox()
    lone = Learner(TorchAdapter(make_model()), alg, plain, "a", on_event=lambda e: None,
                   options=LearnerOptions(**FAST))
    lone.start()
    try:
        keyed = Learner(TorchAdapter(make_model()), alg, plain, "b", run_key=KEY,
                        on_event=lambda e: None, options=LearnerOptions(**FAST))
        with pytest.raises(AuthenticationError) as e:
            keyed.start()
        assert str(e.value) == UNAUTHENTICATED_MESSAGE
    finally:
        lone.close()


def test_a_learner_without_run_key_takes_the_variable_and_without_it_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mailbox = MemoryMailbox()
    alg = DiLoCo(sync_every=4, fragments=2)
    first = Learner(TorchAdapter(make_model()), alg, mailbox, "a", run_key=KEY,
                    on_event=lambda e: None, options=LearnerOptions(**FAST))
    first.start()
    try:
        monkeypatch.delenv("GRADIENTMAIL_RUN_KEY", raising=False)
        unkeyed = Learner(TorchAdapter(make_model()), alg, mailbox, "b",
                          on_event=lambda e: None, options=LearnerOptions(**FAST))
        with pytest.raises(AuthenticationError) as e:
            unkeyed.start()
        # The fix names both ways to give the key.
        assert "set GRADIENTMAIL_RUN_KEY to the run's key" in str(e.value)
        assert "pass it as run_key=" in str(e.value)
        monkeypatch.setenv("GRADIENTMAIL_RUN_KEY", KEY.decode())
        keyed = Learner(TorchAdapter(make_model()), alg, mailbox, "c",
                        on_event=lambda e: None, options=LearnerOptions(**FAST))
        keyed.start()
        try:
            assert keyed.rounds_seen == -1 and "c" in keyed.wait_for_learners(2, timeout=10)
        finally:
            keyed.close()
    finally:
        first.close()


# -- contributions and commits ---------------------------------------------------------


def test_the_syncer_drops_forged_foreign_and_unsealed_contributions() -> None:
    async def main() -> None:
        mailbox = MemoryMailbox()
        r = AuthRun(mailbox)
        await r.create()
        await r.contribute(0, "good")
        snap = await r.contribute(0, "tampered")
        key = "snapshots/0000000000/tampered.json"
        raw = await mailbox.get(key)
        assert raw is not None and snap.tokens == 64
        await mailbox.delete(key)
        await mailbox.put(key, raw.replace(b'"tokens":64', b'"tokens":640'))
        for who, ex in (("foreign", Exchange(mailbox, run_key=OTHER)),
                        ("unsealed", Exchange(mailbox))):
            await ex.publish(0, who, {n: t for n, t in init_tensors().items()},
                             fragment=0, base_version=0, local_step=4, steps=4, tokens=64,
                             final=False, schema_digest=SCHEMA.digest(), delta_format="F32")
        s = r.syncer(run_key=KEY)
        assert await s.poll(live=frozenset({"good", "tampered", "foreign", "unsealed"}))
        rec = await r.ex.read_round(0)
        assert rec is not None
        assert [p.learner for p in rec.participants] == ["good"]
        reasons = {d.learner: d.reason for d in rec.dropped}
        assert reasons == {
            "tampered": forged_message(key),
            "foreign": forged_message("snapshots/0000000000/foreign.json"),
            "unsealed": (
                "record 'snapshots/0000000000/unsealed.json' is not authenticated: this run "
                f"uses run key {FP} and the record carries no MAC. It was written by a process "
                "without the run key (or the bucket was tampered with); it is ignored"),
        }
        events = {e.learner: e for e in r.of(ev.ContributionDropped)}
        assert sorted(events) == ["foreign", "tampered", "unsealed"]
        assert events["tampered"].key == key and events["tampered"].reason == reasons["tampered"]

    run(main())


async def forge_commit(mailbox: Mailbox, theta: dict[str, TensorBytes]) -> RoundRecord:
    """What a writer without the key can do: upload parameters and a commit record of
    round 0 that references them, sealed with a key of its own."""
    ex = Exchange(mailbox, run_key=OTHER)
    manifest_raw = await mailbox.get(MANIFEST_KEY)
    assert manifest_raw is not None
    ref = await ex.put_theta(0, 1, theta, attempt=0)
    record = RoundRecord(round=0, fragment=0, version=1, theta=ref, outer=ref, update=None,
                         participants=(), estimates=Estimates(), mean_cosine=None,
                         dropped=(), closer="mallory", all_final=False)
    assert await ex.commit(record)
    return record


@pytest.mark.slow
def test_a_learner_never_applies_a_forged_commit_and_goes_on_once_it_is_removed() -> None:
    mailbox = MemoryMailbox()
    alg = DiLoCo(sync_every=4, fragments=1, in_flight=1, overlap_steps=None,
                 merge=WeightedMean())
    rec = Recorder()
    model = make_model()
    learner = Learner(
        TorchAdapter(model),
        alg,
        mailbox,
        "w0",
        run_key=KEY,
        on_event=rec,
        options=LearnerOptions(**FAST, sync=False),
    )
    learner.start()
    try:
        zeros = {n: TensorBytes.from_numpy(np.zeros(tuple(p.shape), np.float32))
                 for n, p in model.named_parameters()}
        run(forge_commit(mailbox, zeros))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(4):
            train_step(model, opt, step)
            learner.step(8)
        assert wait_for(lambda: bool(rec.of(ev.SnapshotPublished)))
        assert wait_for(lambda: any("AuthenticationError" in e.error
                                    for e in rec.of(ev.PollFailed)))
        train_step(model, opt, 4)
        learner.step(8)
        failed = next(e for e in rec.of(ev.PollFailed) if "AuthenticationError" in e.error)
        assert forged_message(round_key(0)) in failed.error
        assert learner.rounds_seen == -1 and rec.of(ev.FragmentAligned) == []
        assert all(p.abs().sum() > 0 for p in model.parameters())
        # The operator deletes the forgery; a closer holding the key commits round 0 from
        # the learner's contribution, and the learner applies that.
        run(mailbox.delete(round_key(0)))
        syncer = Syncer.open(mailbox, run_key=KEY, closer_id="op", on_event=lambda e: None)
        assert run(syncer.poll(live=frozenset({"w0"})))
        deadline = time.monotonic() + 20
        while learner.rounds_seen < 0 and time.monotonic() < deadline:
            learner.step(8)
            time.sleep(0.005)
        assert learner.rounds_seen == 0
        [aligned] = rec.of(ev.FragmentAligned)
        assert (aligned.round, aligned.version) == (0, 1)
        close_beside(learner, syncer, "w0")
    finally:
        learner.close()


def close_beside(learner: Learner, syncer: Syncer, learner_id: str) -> None:
    """Close `learner` while `syncer` closes the rounds it still publishes: a learner with
    no closer of its own otherwise waits out its lease timeout for them."""
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            run(syncer.poll(live=frozenset({learner_id})))
            done.wait(0.02)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        learner.close()
    finally:
        done.set()
        thread.join()


def test_two_learners_with_the_same_key_train_together() -> None:
    mailbox = MemoryMailbox()
    alg = DiLoCo(sync_every=4, fragments=2, in_flight=1, overlap_steps=None, quorum_size=2,
                 merge=WeightedMean())
    rec = Recorder()
    models = [make_model(seed=w) for w in range(2)]
    learners = [Learner(
        TorchAdapter(models[w]),
        alg,
        mailbox,
        f"w{w}",
        run_key=KEY,
        on_event=rec,
        options=LearnerOptions(**FAST, keep_versions=1000),
    ) for w in range(2)]

    def work(w: int) -> Any:
        def go() -> None:
            learners[w].start()
            opt = torch.optim.SGD(models[w].parameters(), lr=0.05)
            for step in range(40):
                train_step(models[w], opt, 1000 * w + step)
                learners[w].step(8)
                time.sleep(0.004)
            learners[w].close()

        return go

    in_threads(work(0), work(1))
    records = run(Exchange(mailbox, run_key=KEY).rounds_after(-1))
    assert len(records) >= 4
    assert [r.round for r in records] == list(range(len(records)))
    assert {p.learner for r in records for p in r.participants} == {"w0", "w1"}
    assert all(r.dropped == () for r in records)
    keys = [k for k in run(mailbox.list("")) if k.endswith(".json")]
    assert MANIFEST_KEY in keys and round_key(0) in keys
    for k in keys:
        assert run(mailbox.get(k)).startswith(b'{"auth":"hmac-sha256","mac":"'), k
    with pytest.raises(AuthenticationError, match="is sealed with a run key"):
        run(Exchange(mailbox).read_round(0))
    assert rec.of(ev.PollFailed) == [] and rec.of(ev.ContributionDropped) == []


# -- the command line --------------------------------------------------------------------


def test_the_command_reads_the_key_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def make() -> None:
        mailbox = LocalMailbox(tmp_path)
        r = AuthRun(mailbox)
        await r.create()
        await r.contribute(0, "a")
        assert await r.syncer(run_key=KEY).poll(live=frozenset({"a"}))

    run(make())
    monkeypatch.setenv("GRADIENTMAIL_RUN_KEY", KEY.decode())
    assert main(["status", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds_committed"] == 1
    monkeypatch.setenv("GRADIENTMAIL_RUN_KEY", OTHER.decode())
    assert main(["status", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"gradientmail: error: the run in file://{tmp_path} uses run key "
                          f"{FP}, but this process has run key {OTHER_FP}")
    monkeypatch.delenv("GRADIENTMAIL_RUN_KEY")
    assert main(["export", str(tmp_path), str(tmp_path / "out.safetensors")]) == 1
    err = capsys.readouterr().err
    assert f"is authenticated with run key {FP}, but this process has no run key" in err
