"""What every sparse delta format (TOPK_F8, TOPK_Q2, SIGN1) owes the closer alike: a
payload with random bytes flipped is refused with a payload error or reads as a finite
tensor of the right shape, never anything else; and a round of such deltas commits the
bytes that the round of their decoded F32 deltas commits (weighted mean and RDA).

Each format's own layout, its hostile payloads and its error feedback are tested in
tests/test_sparse.py, tests/test_sparse_q2.py and tests/test_signs.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import numpy as np
import pytest
from test_sparse import f32
from test_syncer import SCHEMA, Run, delta, fingerprint

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Rda, WeightedMean
from gradientmail.errors import GradientmailError
from gradientmail.mailbox import MemoryMailbox
from gradientmail.run.bounds import check_delta
from gradientmail.run.protocol import Exchange
from gradientmail.wire.serialization import ParameterSpec, Schema, pack, unpack
from gradientmail.wire.sparse import CHUNK, densify, sparsify
from gradientmail.wire.tensor_bytes import TensorBytes

N = 2 * CHUNK + 10
#: The density each format's payloads here keep: a few values a chunk for the top-k
#: formats, half the elements' signs for SIGN1.
DENSITY = {"TOPK_F8": 4 / CHUNK, "TOPK_Q2": 5 / CHUNK, "SIGN1": 0.5}
FORMATS = sorted(DENSITY)


def payload(fmt: str) -> dict[str, TensorBytes]:
    x = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    return sparsify("t", f32(x), DENSITY[fmt], fmt, seed=4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fuzzed_payloads_are_refused_cleanly_or_read(fmt: str) -> None:
    schema = Schema((ParameterSpec("t", "F32", (N,)),))
    record = Exchange.draft(0, "a", fragment=0, base_version=0, local_step=4, steps=4,
                            tokens=64, final=False, schema_digest="0" * 64, delta_format=fmt)
    blob = pack(payload(fmt))
    rnd = random.Random(29)
    read = 0
    for _ in range(400):
        b = bytearray(blob)
        for _ in range(rnd.randint(1, 4)):
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        try:
            out = check_delta(unpack(bytes(b)), record, schema, ["t"])
        except GradientmailError:
            continue
        read += 1
        assert out["t"].shape == (N,) and out["t"].dtype == "F32"
        assert np.isfinite(out["t"].to_numpy()).all()
    assert 0 < read < 400  # flips in the values read; flips in the layout are refused


@pytest.mark.parametrize("merge", [WeightedMean(), Rda(direct_pattern=None)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_round_of_sparse_deltas_commits_the_bytes_of_their_decoded_deltas(
        fmt: str, merge: Any) -> None:
    async def close(name: str, decoded: bool) -> tuple[Any, list[int]]:
        MemoryMailbox.forget(name)
        alg = DiLoCo(4, 1, quorum_size=3, in_flight=1, overlap_steps=None, merge=merge,
                     delta_dtype=fmt, delta_density=DENSITY[fmt])
        r = Run(MemoryMailbox(name), alg)
        await r.create()
        s = r.syncer()
        for learner in ("a", "b", "c"):
            d = {n: f32(t.to_numpy() * 1e3) for n, t in delta(0, learner, SCHEMA.names).items()}
            tensors: dict[str, TensorBytes] = {}
            for n, t in d.items():
                tensors.update(sparsify(n, t, DENSITY[fmt], fmt))
            if decoded:
                tensors = {n: densify(tensors, n, t.shape, fmt) for n, t in d.items()}
            await r.ex.publish(0, learner, tensors, fragment=0, base_version=0, local_step=4,
                               steps=4, tokens=64 * (1 + ord(learner) % 3), final=False,
                               schema_digest=SCHEMA.digest(),
                               delta_format="F32" if decoded else fmt)
        assert await s.poll(live=frozenset({"a", "b", "c"}))
        records = await r.records()
        assert [p.learner for p in records[0].participants] == ["a", "b", "c"]
        MemoryMailbox.forget(name)
        sizes = [p.payload_size for p in records[0].participants]
        return fingerprint([dataclasses.replace(rec, participants=tuple(
            dataclasses.replace(p, payload_size=0) for p in rec.participants))
            for rec in records]), sizes

    (a, sparse_sizes), (b, dense_sizes) = (asyncio.run(close(f"{fmt}-a", False)),
                                           asyncio.run(close(f"{fmt}-b", True)))
    # The committed bytes (by SHA-256), weights, cosine: all but the payloads' sizes.
    assert a == b
    # ... and what was merged were the sparse payloads, not dense ones.
    assert all(s > 0 for s in sparse_sizes + dense_sizes) and sparse_sizes != dense_sizes
