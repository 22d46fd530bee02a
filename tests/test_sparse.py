"""The sparse delta format (`wire.sparse`, ``TOPK_F8``), its merge by a closer, and the
learner's error feedback (`learner.feedback.Residuals`).

Golden bytes; decode(encode(x)) keeps exactly the top k of each chunk; hostile payloads
refused with the rule they break; a round of sparse contributions commits the same bytes
as the round of their decoded F32 deltas; the values sent plus the residual left add up
to the deltas trained, and a payload that was not merged gives its residual back.
"""

from __future__ import annotations

import hashlib
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from test_syncer import SCHEMA

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.errors import ConfigError, CorruptPayload, GradientmailError, NonFiniteError
from gradientmail.learner.feedback import Residuals
from gradientmail.mailbox import MemoryMailbox
from gradientmail.run.bounds import check_delta
from gradientmail.wire.quantization import roundtrip
from gradientmail.wire.records import SnapshotRecord
from gradientmail.wire.serialization import ParameterSpec, Schema, pack, unpack
from gradientmail.wire.sparse import CHUNK, chunk_k, densify, sparse_nbytes, sparsify
from gradientmail.wire.tensor_bytes import TensorBytes


def f32(x: Any, shape: tuple[int, ...] | None = None) -> TensorBytes:
    a = np.asarray(x, np.float32)
    return TensorBytes.from_numpy(a if shape is None else a.reshape(shape))


def dense(entries: dict[str, TensorBytes], name: str, shape: tuple[int, ...]) -> np.ndarray:
    return densify(entries, name, shape).to_numpy().reshape(-1)


# -- the format ---------------------------------------------------------------------------


def test_golden_entries_of_a_small_tensor() -> None:
    # k = 3 of 8 elements in one chunk; |3| ties with |-3|, both kept; the chunk's
    # absmax 3 = 0.75 · 2^2 gives the scale 2^-7 (3 · 2^7 = 384 <= 448).
    e = sparsify("w", f32([0.1, -2, 0.5, 3, 0, -3, 1, 0.25], (2, 4)), 3 / CHUNK)
    assert {n: (t.dtype, t.shape) for n, t in e.items()} == {
        "w": ("F8_E4M3", (3,)), "w.index": ("U16", (3,)), "w.count": ("U16", (1,)),
        "w.scale": ("F32", (1,))}
    assert e["w"].buffer == bytes([0xF8, 0x7C, 0xFC])  # -256, 384, -384 in E4M3
    assert e["w.index"].buffer == bytes([1, 0, 3, 0, 5, 0])
    assert e["w.count"].buffer == bytes([3, 0])
    assert e["w.scale"].buffer == np.float32(2.0 ** -7).tobytes()
    assert list(dense(e, "w", (2, 4))) == [0, -2, 0, 3, 0, -3, 0, 0]


def test_golden_payload_bytes() -> None:
    x = (np.sin(np.arange(2 * CHUNK + 300, dtype=np.float64) * 0.37) * 1e-3).astype(np.float32)
    blob = pack(sparsify("h.0.w", f32(x), 0.01))
    assert len(blob) == sparse_nbytes(x.size, 0.01) + len(blob) - sum(
        t.nbytes for t in unpack(blob).values())
    assert hashlib.sha256(blob).hexdigest() == GOLDEN_SHA256


GOLDEN_SHA256 = "f91852f77c6fa62519fba693274e8aae2fa42cd836a65d5b7880b002df01f339"


@pytest.mark.parametrize("n", [1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17])
@pytest.mark.parametrize("density", [1 / CHUNK, 0.01, 1 / 32, 0.5, 1.0])
def test_decode_keeps_exactly_the_top_k_of_each_chunk(n: int, density: float) -> None:
    rng = np.random.default_rng(n)
    x = rng.permutation(n).astype(np.float32) - n / 2 + 0.5  # distinct magnitudes
    x *= rng.choice([1e-4, 1.0, 3e3], size=n).astype(np.float32)
    e = sparsify("t", f32(x), density)
    got = dense(e, "t", (n,))
    k = chunk_k(density)
    for c in range(0, n, CHUNK):
        part, out = x[c : c + CHUNK], got[c : c + CHUNK]
        keep = np.sort(np.argsort(-np.abs(part), kind="stable")[: min(k, part.size)])
        # The kept values are their chunk's F8_E4M3 values (one scale per chunk; a value
        # far below the chunk's largest rounds to 0), every other element is 0.
        want = roundtrip(f32(part[keep]), "F8_E4M3").to_numpy()
        assert np.array_equal(out[keep], want)
        assert list(np.flatnonzero(out)) == list(keep[want != 0])
        assert not out[np.setdiff1d(np.arange(part.size), keep)].any()
    assert sum(t.nbytes for t in e.values()) == sparse_nbytes(n, density)
    # What was decoded encodes to itself.
    again = sparsify("t", densify(e, "t", (n,)), density)
    assert np.array_equal(dense(again, "t", (n,)), got)


def test_ties_go_to_the_lower_index_and_bf16_input_is_read() -> None:
    x = np.ones(10, ml_dtypes.bfloat16)
    e = sparsify("t", TensorBytes.from_numpy(x), 4 / CHUNK)
    assert list(np.frombuffer(e["t.index"].buffer, "<u2")) == [0, 1, 2, 3]


def test_bad_input_and_settings_are_refused() -> None:
    with pytest.raises(NonFiniteError, match="tensor 't' holds 1 NaN or infinite values"):
        sparsify("t", f32([1, np.nan, 2]), 0.5)
    for bad in (0, -0.1, 1.5, float("nan"), True, "0.1"):
        with pytest.raises(ConfigError, match=r"delta_density=.* must be a number in"):
            chunk_k(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"delta_density=0\.1 is set but delta_dtype=.F4."):
        DiLoCo(delta_dtype="F4", delta_density=0.1)


def test_the_setting_is_recorded_only_when_set() -> None:
    assert "delta_density" not in DiLoCo(delta_dtype="TOPK_F8").to_json()
    alg = DiLoCo(delta_dtype="TOPK_F8", delta_density=0.02)
    assert alg.to_json()["delta_density"] == 0.02
    assert DiLoCo.from_json(alg.to_json()) == alg


# -- hostile payloads -------------------------------------------------------------------------

N = 2 * CHUNK + 10


def good() -> dict[str, TensorBytes]:
    x = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    return sparsify("t", f32(x), 4 / CHUNK)


def with_(entries: dict[str, TensorBytes], name: str, dtype: str, values: Any) -> dict[
        str, TensorBytes]:
    a = np.asarray(values, {"U16": "<u2", "F32": "<f4", "F8_E4M3": np.uint8}[dtype])
    return {**entries, name: TensorBytes(dtype, (a.size,), a.tobytes())}


def u16(entries: dict[str, TensorBytes], name: str) -> list[int]:
    return [int(v) for v in np.frombuffer(entries[name].buffer, "<u2")]


def hostile() -> list[tuple[dict[str, TensorBytes], str]]:
    e = good()
    idx, cnt = u16(e, "t.index"), u16(e, "t.count")
    out = [
        ({k: v for k, v in e.items() if k != "t.index"}, "tensor 't.index' is missing"),
        ({**e, "t.index": e["t.scale"]}, "tensor 't.index' is F32\\[3\\]; expected a 1-D U16"),
        (with_(e, "t.count", "U16", cnt[:2]), "count \\[2\\] and scale \\[3\\] must be \\[3\\]"),
        (with_(e, "t.count", "U16", [4, 4, 11]), "chunk 2 claims 11 values; it has 10"),
        (with_(e, "t.count", "U16", [4, 4, 5]), "counts add up to 13 values; codes \\[12\\]"),
        (with_(e, "t.count", "U16", [65535, 0, 0]), "chunk 0 claims 65535 values"),
        (with_(e, "t.index", "U16", [*idx[:4], 4096, *idx[5:]]),
         "value 4 has offset 4096 in chunk 1 of 4096 elements"),
        (with_(e, "t.index", "U16", [*idx[:9], 10, *idx[10:]]),
         "value 9 has offset 10 in chunk 2 of 10 elements"),
        (with_(e, "t.index", "U16", [idx[0], idx[0], *idx[2:]]),
         "value 1's offset .* repeats the one before it in chunk 0"),
        (with_(e, "t.index", "U16", [idx[1], idx[0], *idx[2:]]),
         "value 1's offset .* is below the one before it in chunk 0"),
        (with_(e, "t.scale", "F32", [1.0, 3.0, 1.0]), "chunk 1's scale 3.0 is not a power of two"),
        (with_(e, "t.scale", "F32", [1.0, np.inf, 1.0]), "chunk 1's scale inf is not a power"),
        (with_(e, "t.scale", "F32", [1.0, 0.0, 1.0]), "chunk 1's scale 0.0 is not a power"),
        (with_(e, "t.scale", "F32", [1.0, 2.0 ** -130, 1.0]), "is not a power of two 2\\^k"),
        (with_(e, "t", "F8_E4M3", [0x7F] * 12), "TOPK_F8 codes decode to NaN"),
    ]
    return out


@pytest.mark.parametrize("case", range(len(hostile())))
def test_hostile_payloads_are_refused_with_the_rule_they_break(case: int) -> None:
    entries, why = hostile()[case]
    with pytest.raises(CorruptPayload, match=why):
        densify(entries, "t", (N,), key="payloads/7/a")


def sparse_record() -> SnapshotRecord:
    from gradientmail.run.protocol import Exchange
    return Exchange.draft(0, "a", fragment=0, base_version=0, local_step=4, steps=4,
                          tokens=64, final=False, schema_digest="0" * 64,
                          delta_format="TOPK_F8")


def test_check_delta_decodes_a_sparse_payload_and_names_what_does_not_fit() -> None:
    schema = Schema((ParameterSpec("t", "F32", (N,)),))
    e = good()
    out = check_delta(dict(e), sparse_record(), schema, ["t"])
    assert out["t"] == densify(e, "t", (N,))
    with pytest.raises(GradientmailError, match=r"missing \['t\.count'\], extra \['u'\]"):
        check_delta({**{k: v for k, v in e.items() if k != "t.count"}, "u": e["t"]},
                    sparse_record(), schema, ["t"])


# -- error feedback -------------------------------------------------------------------------------


def test_what_was_sent_plus_the_residual_is_what_was_trained() -> None:
    rng = np.random.default_rng(3)
    shapes = {"w": (CHUNK + 50,), "b": (30,)}
    res = Residuals("a")
    trained = {n: np.zeros(s, np.float64) for n, s in shapes.items()}
    sent = {n: np.zeros(s, np.float64) for n, s in shapes.items()}
    for r in range(20):
        d = {n: f32(rng.standard_normal(s) * 1e-3) for n, s in shapes.items()}
        e = res.encode(r, 0, d, 0.02)
        for n, s in shapes.items():
            trained[n] += d[n].to_numpy().reshape(-1)
            sent[n] += dense(e, n, s)
        res.recorded(r, ("a", "b"))
    left = res.residual(0)
    for n in shapes:
        np.testing.assert_allclose(sent[n] + left[n], trained[n], rtol=0, atol=1e-8)
    # The residual is not negligible where a chunk keeps 82 of 4096 (the 30 elements of
    # "b" all travel, only their F8 rounding stays behind).
    assert np.abs(left["w"]).sum() > np.abs(sent["w"]).sum()


def test_a_payload_not_merged_gives_its_residual_back() -> None:
    rng = np.random.default_rng(4)
    res = Residuals("a")
    d0 = {"w": f32(rng.standard_normal(100))}
    res.encode(0, 0, d0, 0.02)
    res.recorded(0, ("a",))
    kept = {n: v.copy() for n, v in res.residual(0).items()}
    assert kept["w"].any()
    # Round 2 (fragment 0) fails to upload; round 4 is merged without this learner.
    res.encode(2, 0, {"w": f32(rng.standard_normal(100))}, 0.02)
    assert not np.array_equal(res.residual(0)["w"], kept["w"])
    res.failed(2)
    assert np.array_equal(res.residual(0)["w"], kept["w"])
    res.encode(4, 0, {"w": f32(rng.standard_normal(100))}, 0.02)
    res.recorded(4, ("b", "c"))
    assert np.array_equal(res.residual(0)["w"], kept["w"])
    # Fragments keep their own residuals; settling an unknown round changes nothing.
    res.encode(5, 1, {"w": f32(rng.standard_normal(100))}, 0.02)
    res.failed(5)
    res.failed(99)
    assert res.residual(1) == {}
    assert np.array_equal(res.residual(0)["w"], kept["w"])


def test_a_learner_publishes_sparse_deltas_that_commit() -> None:
    import torch
    from test_learner_runtime import FAST, Recorder, all_records, make_model

    from gradientmail import events as ev
    from gradientmail.adapters.torch import TorchAdapter
    from gradientmail.learner.options import LearnerOptions
    from gradientmail.learner.runtime import Learner

    mailbox = MemoryMailbox()
    alg = DiLoCo(sync_every=4, fragments=1, in_flight=1, overlap_steps=0,
                 delta_dtype="TOPK_F8", delta_density=0.01, flush_on_close=False)
    model = make_model(width=512)
    start = [p.detach().clone() for p in model.parameters()]
    rec = Recorder()
    learner = Learner(TorchAdapter(model), alg, mailbox, "solo", on_event=rec,
                      options=LearnerOptions(**FAST, hold_own=False))
    learner.start()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(8):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        learner.step(4)
    learner.close()
    records = all_records(mailbox)
    assert [[p.learner for p in r.participants] for r in records] == [["solo"], ["solo"]]
    published = rec.of(ev.SnapshotPublished)
    n = sum(p.numel() for p in model.parameters())
    # Each of the 4 tensors keeps 41 of its first 4096 elements (3 bytes each), plus
    # counts, scales and a header: far below F32's 4 bytes per element.
    assert len(published) == 2 and all(e.bytes < 4 * n / 10 for e in published)
    assert any(not torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True))


def test_a_poster_whose_upload_fails_keeps_the_residual_it_had() -> None:
    import asyncio
    import queue

    from gradientmail.learner.messages import Outgoing
    from gradientmail.learner.poster import Poster
    from gradientmail.mailbox.wrappers import FaultPlan, FaultyMailbox
    from gradientmail.run.protocol import Exchange

    class Adapter:
        schema = SCHEMA

        def delta(self, anchor: dict[str, np.ndarray], snapshot: dict[str, np.ndarray]
                  ) -> dict[str, TensorBytes]:
            return {n: f32(anchor[n] - snapshot[n]) for n in snapshot}

    alg = DiLoCo(4, 1, in_flight=1, delta_dtype="TOPK_F8", delta_density=1 / CHUNK)
    rng = np.random.default_rng(5)

    def job(r: int) -> Outgoing:
        snap = {n: rng.standard_normal(SCHEMA[n].shape).astype(np.float32)
                for n in SCHEMA.names}
        return Outgoing(r, 0, r, 4 * (r + 1), 4, 64, False, None, snap,
                        {n: np.zeros(SCHEMA[n].shape, np.float32) for n in SCHEMA.names})

    async def main() -> None:
        MemoryMailbox.forget("poster-sparse")
        plan = FaultPlan().fail("create", "payloads/*", nth=2)  # round 1's upload fails
        ex = Exchange(FaultyMailbox(MemoryMailbox("poster-sparse"), plan))
        failed: queue.SimpleQueue[int] = queue.SimpleQueue()
        events: list[Any] = []
        poster = Poster(ex, Adapter(), alg, "a", ((*SCHEMA.names,),), clock=ex.clock,
                        on_event=events.append, hold_own=False, closed=lambda: -1,
                        host=None, wake=asyncio.Event(), failed=failed, poll_interval=0.01)
        await poster.post(job(0))
        kept = {n: v.copy() for n, v in poster.residuals.residual(0).items()}
        assert kept and all(v.any() for v in kept.values())
        await poster.post(job(1))
        assert failed.get_nowait() == 1
        after = poster.residuals.residual(0)
        assert all(np.array_equal(after[n], kept[n]) for n in kept)
        MemoryMailbox.forget("poster-sparse")

    asyncio.run(main())
