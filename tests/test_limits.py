"""Every limit on what a peer or the store can hand us, and its message.

Payloads: every fetch is bounded by what the schema allows (deltas by `delta_bound`;
theta, Θ⁰, outer state and updates by `payload_bound`), at the learner's join, the
learner's commit fetch, the syncer and the command line. zstd: the declared decompressed
size is checked against the same bound before decompressing. Records: bounded JSON
(1 MiB, a manifest 16 MiB, a sealed one a little more). Learner ids: validated wherever
they enter (constructors, keys, listings).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from test_learner_runtime import Recorder, wait_for
from test_syncer import SCHEMA, Run, algorithm

from gradientmail import events as ev
from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.errors import (
    AuthenticationError,
    CorruptPayload,
    LocalProtocolError,
    RemoteProtocolError,
)
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import MemoryMailbox
from gradientmail.run.bounds import delta_bound, payload_bound
from gradientmail.run.keyspace import round_key
from gradientmail.run.lease import lease_counters
from gradientmail.run.protocol import Exchange
from gradientmail.syncer.runtime import Syncer
from gradientmail.wire import compression as codec
from gradientmail.wire.auth import MAX_SEALED_BYTES, HmacSeal
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.quantization import quantize
from gradientmail.wire.record_json import MAX_MANIFEST_BYTES, MAX_RECORD_BYTES, check_learner_id
from gradientmail.wire.records import Manifest, Participant, RoundRecord, SnapshotRecord
from gradientmail.wire.refs import PayloadRef
from gradientmail.wire.serialization import ParameterSpec, Schema
from gradientmail.wire.tensor_bytes import TensorBytes

FAST: dict[str, Any] = {"poll_interval": 0.005, "lease_every": 5.0, "lease_timeout": 30.0}
NAMES = ("w", "b")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def refused(key: str, size: int, bound: int) -> str:
    return (f"payload {key!r} is declared {size} bytes, over the bound of {bound} bytes for "
            "what it should hold; refusing to download it")


class WB(torch.nn.Module):
    """A model whose schema is test_syncer's SCHEMA (w: F32[2, 3], b: F32[3])."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2, 3))
        self.b = torch.nn.Parameter(torch.zeros(3))


# -- payloads ----------------------------------------------------------------------------


def test_the_bounds_hold_every_honest_payload_even_incompressible_under_zstd() -> None:
    name = 'layer."quoted"\\name/' * 12  # escaped names take more header room
    schema = Schema((ParameterSpec(name, "F32", (3, 1000)), ParameterSpec("s", "BF16", ())))
    names = [name, "s"]
    rng = np.random.default_rng(0)
    noise = {n: TensorBytes(schema[n].dtype, schema[n].shape,
                            rng.bytes(schema.nbytes(n))) for n in names}
    outer = {f"{prefix}{n}": TensorBytes("F32", schema[n].shape,
                                         rng.bytes(4 * schema[n].numel))
             for n in names for prefix in ("momentum/", "master/")}
    floats = {n: TensorBytes.from_numpy(rng.standard_normal(schema[n].shape).astype(np.float32))
              for n in names}
    update = {k: v for n in names for k, v in quantize(n, floats[n], "F4").items()}
    for compression in codec.COMPRESSIONS:
        for kind, tensors in (("theta", noise), ("outer", outer), ("updates", update),
                              ("steps", update), ("steps", floats)):
            blob = codec.encode(tensors, compression)
            assert len(blob) <= payload_bound(schema, names, kind), (kind, compression)
            assert codec.decode(blob, compression,
                                max_bytes=payload_bound(schema, names, kind)) == tensors
    with pytest.raises(LocalProtocolError) as e:
        payload_bound(schema, names, "delta")
    assert str(e.value) == ("payload kind 'delta' must be 'theta', 'outer', 'updates' or "
                            "'steps'")


def test_a_delta_declared_over_its_bound_is_not_downloaded() -> None:
    async def main() -> None:
        ex = Exchange(MemoryMailbox())
        snap = await ex.publish(0, "a", {n: TensorBytes.from_numpy(
            np.zeros(SCHEMA[n].shape, np.float32)) for n in NAMES}, fragment=0,
            base_version=0, local_step=1, steps=1, tokens=1, final=False,
            schema_digest=SCHEMA.digest(), delta_format="F32")
        bound = delta_bound(SCHEMA, NAMES)
        huge = dataclasses.replace(snap, payload=dataclasses.replace(snap.payload,
                                                                     size=bound + 1))
        with pytest.raises(CorruptPayload) as e:
            await ex.fetch_delta(huge, SCHEMA, NAMES)
        assert str(e.value) == refused(snap.payload.key, bound + 1, bound)

    run(main())


def test_a_joining_learner_refuses_an_init_payload_over_its_bound() -> None:
    mailbox = MemoryMailbox()
    alg = DiLoCo(sync_every=4, fragments=1, in_flight=1)
    key = "init/000000/0.safetensors"
    manifest = Manifest(SCHEMA, alg.plan(SCHEMA), alg.to_json(), "mallory",
                        (PayloadRef(key, 10**12, "0" * 64),), "off")
    assert run(Exchange(mailbox).create_manifest(manifest))
    learner = Learner(TorchAdapter(WB()), alg, mailbox, "w0", on_event=lambda e: None,
                      options=LearnerOptions(**FAST))
    with pytest.raises(CorruptPayload) as e:
        learner.start()
    assert str(e.value) == refused(key, 10**12, payload_bound(SCHEMA, NAMES, "theta"))


async def hostile_commit(r: Run, **sizes: int) -> RoundRecord:
    """Round 0's record, with the payloads named in `sizes` declared that large."""
    theta = await r.ex.put_theta(0, 1, {n: TensorBytes.from_numpy(
        np.ones(SCHEMA[n].shape, np.float32)) for n in NAMES}, attempt=0)
    refs = {kind: dataclasses.replace(theta, key=f"{kind}/0/0000000001-000000.safetensors",
                                      size=sizes.get(kind, theta.size))
            for kind in ("theta", "outer")}
    record = RoundRecord(round=0, fragment=0, version=1, theta=refs["theta"],
                         outer=refs["outer"], update=None, participants=(),
                         estimates=Estimates(), mean_cosine=None, dropped=(),
                         closer="mallory", all_final=False)
    assert await r.ex.commit(record)
    return record


def test_the_syncer_refuses_outer_state_over_its_bound() -> None:
    async def main() -> None:
        r = Run(MemoryMailbox(), algorithm(fragments=1, quorum_size=1))
        await r.create()
        await hostile_commit(r, outer=10**11)
        await r.contribute(1, "a", base_version=1)
        with pytest.raises(CorruptPayload) as e:
            await r.syncer().poll(live=frozenset({"a"}))
        assert str(e.value) == refused("outer/0/0000000001-000000.safetensors", 10**11,
                                       payload_bound(SCHEMA, NAMES, "outer"))

    run(main())


def test_a_learner_refuses_a_committed_theta_over_its_bound() -> None:
    mailbox = MemoryMailbox()
    alg = DiLoCo(sync_every=4, fragments=1, in_flight=1, merge=WeightedMean())
    rec = Recorder()
    learner = Learner(
        TorchAdapter(WB()),
        alg,
        mailbox,
        "w0",
        on_event=rec,
        options=LearnerOptions(**FAST, sync=False),
    )
    learner.start()
    try:
        r = Run(mailbox, alg)
        run(hostile_commit(r, theta=10**11))
        bound = payload_bound(SCHEMA, NAMES, "theta")
        message = refused("theta/0/0000000001-000000.safetensors", 10**11, bound)
        assert wait_for(lambda: any(message in e.error for e in rec.of(ev.PollFailed)))
        learner.step(1)
        assert learner.rounds_seen == -1
    finally:
        learner.close(flush=False)  # no closer here: a flush's round would wait out the lease


def test_zstd_output_is_bounded_before_decompressing() -> None:
    async def main() -> None:
        ex = Exchange(MemoryMailbox(), compression="zstd")
        zeros = {"z": TensorBytes.from_numpy(np.zeros(100_000, np.float32))}
        ref = await ex.store.put_payload("bomb", zeros)
        assert ref is not None and ref.size < 1000  # 400 kB of zeros compress to almost nothing
        with pytest.raises(CorruptPayload) as e:
            await ex.store.fetch_tensors(ref, max_bytes=10_000)
        import zstandard

        blob = await ex.mailbox.get(ref.key)
        assert blob is not None
        size = len(zstandard.ZstdDecompressor().decompress(blob))
        assert str(e.value) == (f"{ref.key}: the zstd frame would decompress to {size} bytes, "
                                "past the bound of 10000 for this payload")

        unsized = zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 100)
        with pytest.raises(CorruptPayload) as e:
            codec.decode(unsized, "zstd", key="k")
        assert str(e.value) == ("k: the zstd frame does not declare its decompressed size; "
                                "gradientmail payloads always do")

    run(main())


# -- records -----------------------------------------------------------------------------


def test_records_are_bounded_in_bytes() -> None:
    hint = "the writer does not speak gradientmail record format v1, or the object was damaged"
    big = b"{" + b" " * MAX_RECORD_BYTES + b"}"
    with pytest.raises(RemoteProtocolError) as e:
        SnapshotRecord.decode(big, "snapshots/0000000000/a.json")
    assert str(e.value) == (f"record 'snapshots/0000000000/a.json' is {MAX_RECORD_BYTES + 2} "
                            f"bytes; records are at most {MAX_RECORD_BYTES} bytes ({hint})")
    with pytest.raises(RemoteProtocolError, match=f"is {MAX_MANIFEST_BYTES + 1} bytes; records "
                       f"are at most {MAX_MANIFEST_BYTES} bytes"):
        Manifest.decode(b"{" + b" " * (MAX_MANIFEST_BYTES - 1) + b"}", "manifest.json")
    ref = PayloadRef("theta/0/0000000001-000000.safetensors", 1, "0" * 64)
    crowd = tuple(Participant(f"learner-{i:06d}", 1, 1, 1, 1.0) for i in range(15_000))
    record = RoundRecord(0, 0, 1, ref, ref, None, crowd, Estimates(), None, (), "s", False)
    with pytest.raises(LocalProtocolError) as e2:
        record.encode()
    assert str(e2.value).startswith("RoundRecord encodes to ")
    assert str(e2.value).endswith(f" bytes; at most {MAX_RECORD_BYTES}")
    with pytest.raises(AuthenticationError, match=f"a sealed record is at most "
                       f"{MAX_SEALED_BYTES} bytes"):
        HmacSeal(b"k" * 32).open("manifest.json", b"{" + b" " * MAX_SEALED_BYTES + b"}")

    async def stored() -> None:
        box = MemoryMailbox()
        await box.put(round_key(0), big)
        with pytest.raises(RemoteProtocolError, match="record 'rounds/0000000000.json' is "
                           f"{MAX_RECORD_BYTES + 2} bytes; records are at most"):
            await Exchange(box).read_round(0)

    run(stored())


# -- learner ids -------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "-lead", ".hidden", "a/b", "a b", "x" * 65, "é", 7, None])
def test_learner_ids_are_validated_with_the_rule_and_an_example(bad: Any) -> None:
    with pytest.raises(LocalProtocolError) as e:
        check_learner_id(bad)
    assert str(e.value) == (
        f"learner id {bad!r} is invalid; an id must match [A-Za-z0-9][A-Za-z0-9._-]{{0,63}} "
        "(a letter or digit, then up to 63 letters, digits, '.', '_' or '-'), e.g. 'node-3.gpu0'")


def test_ids_are_checked_wherever_they_enter() -> None:
    with pytest.raises(LocalProtocolError, match="learner id 'a/b' is invalid"):
        Learner(TorchAdapter(WB()), DiLoCo(4, 1, in_flight=1), MemoryMailbox(), "a/b")
    with pytest.raises(LocalProtocolError, match=r"learner id '\.\./x' is invalid"):
        Syncer.open(MemoryMailbox(), closer_id="../x")
    assert check_learner_id("x" * 64) == "x" * 64
    # Keys of a listing that name no valid learner are ignored (leases) or rejected by
    # name (contributions): a stray key never denies the others.
    assert lease_counters(["leases/a:b/000000000001", "leases/ok/000000000002"]) == {"ok": 2}

    async def main() -> None:
        box = MemoryMailbox()
        ex = Exchange(box)
        with pytest.raises(LocalProtocolError, match="learner id 'a b' is invalid"):
            await ex.beat("a b")
        await box.put("snapshots/0000000000/a:b.json", b"{}")
        got = await ex.contributions(0)
        assert got.records == ()
        [bad] = got.rejected
        assert (bad.learner, bad.reason) == (
            None, "'snapshots/0000000000/a:b.json' does not name a learner")
        assert await ex.publishers(0) == frozenset()

    run(main())
