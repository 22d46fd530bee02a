"""The 2-bit sparse delta format (`wire.sparse`, ``TOPK_Q2``) and the decay of the error
feedback (`DiLoCo.feedback_decay`, `learner.feedback.Residuals`).

Golden bytes; decode(encode(x)) keeps exactly the top k of each chunk, each value ± one
of its chunk's two levels; hostile payloads refused with the rule they break; a round of
Q2 deltas commits the bytes of their decoded deltas; with decay β the values sent plus
the residual left are each round's delta plus β times the residual before.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
from typing import Any

import numpy as np
import pytest
from test_sparse import dense, f32
from test_syncer import SCHEMA

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.errors import ConfigError, CorruptPayload, RemoteProtocolError
from gradientmail.learner.feedback import Residuals
from gradientmail.mailbox import MemoryMailbox
from gradientmail.run.bounds import check_delta
from gradientmail.wire.serialization import ParameterSpec, Schema, pack, unpack
from gradientmail.wire.sparse import CHUNK, chunk_k, densify, sparse_nbytes, sparsify
from gradientmail.wire.tensor_bytes import TensorBytes

Q2 = "TOPK_Q2"


def q2dense(entries: dict[str, TensorBytes], name: str, shape: tuple[int, ...]) -> np.ndarray:
    return densify(entries, name, shape, Q2).to_numpy().reshape(-1)


# -- the format ---------------------------------------------------------------------------


def test_golden_entries_of_a_small_tensor() -> None:
    # k = 3 of 8: -2, 3, -3 kept; their mean magnitude 8/3 splits them into the low level
    # 2 (-2) and the high level 3 (3, -3). Codes (bit 0 sign, bit 1 level): 1, 2, 3.
    e = sparsify("w", f32([0.1, -2, 0.5, 3, 0, -3, 1, 0.25], (2, 4)), 3 / CHUNK, Q2)
    assert {n: (t.dtype, t.shape) for n, t in e.items()} == {
        "w": ("U8", (1,)), "w.index": ("U8", (5,)), "w.count": ("U16", (1,)),
        "w.scale": ("F32", (2,))}
    assert e["w"].buffer == bytes([1 | 2 << 2 | 3 << 4])
    # Offsets 1, 3, 5 in 12 bits: (1 | 3 << 12) in 3 bytes, then 5 in 2.
    assert e["w.index"].buffer == bytes([0x01, 0x30, 0x00, 0x05, 0x00])
    assert e["w.count"].buffer == bytes([3, 0])
    assert e["w.scale"].buffer == np.array([2.0, 3.0], "<f4").tobytes()
    assert list(q2dense(e, "w", (2, 4))) == [0, -2, 0, 3, 0, -3, 0, 0]


def test_golden_payload_bytes() -> None:
    x = (np.sin(np.arange(2 * CHUNK + 300, dtype=np.float64) * 0.37) * 1e-3).astype(np.float32)
    blob = pack(sparsify("h.0.w", f32(x), 0.01, Q2))
    assert sum(t.nbytes for t in unpack(blob).values()) == sparse_nbytes(x.size, 0.01, Q2)
    assert hashlib.sha256(blob).hexdigest() == GOLDEN_SHA256


GOLDEN_SHA256 = "55a1ccd5d6561a92903e6c4d0048afce3b75890a80e5706ffcdcc2a2ea1f748e"


@pytest.mark.parametrize("n", [1, 2, 3, 5, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17])
@pytest.mark.parametrize("density", [1 / CHUNK, 0.01, 1 / 32, 0.5, 1.0])
def test_decode_keeps_exactly_the_top_k_of_each_chunk(n: int, density: float) -> None:
    rng = np.random.default_rng(n)
    x = rng.permutation(n).astype(np.float32) - n / 2 + 0.25  # distinct, none zero
    x *= rng.choice([1e-4, 1.0, 3e3], size=n).astype(np.float32)
    e = sparsify("t", f32(x), density, Q2)
    got = q2dense(e, "t", (n,))
    k = chunk_k(density)
    levels = np.frombuffer(e["t.scale"].buffer, "<f4").reshape(-1, 2)
    for c in range(0, n, CHUNK):
        part, out = x[c : c + CHUNK], got[c : c + CHUNK]
        keep = np.sort(np.argsort(-np.abs(part), kind="stable")[: min(k, part.size)])
        assert list(np.flatnonzero(out)) == list(keep)
        assert np.array_equal(np.sign(out[keep]), np.sign(part[keep]))
        low, high = levels[c // CHUNK]
        assert set(np.abs(out[keep]).tolist()) <= {float(low), float(high)}
        # Each level is the mean magnitude of the values it stands for.
        mags = np.abs(part[keep]).astype(np.float64)
        split = mags > mags.mean()
        assert np.isclose(high, mags[split].mean() if split.any() else mags.mean(), rtol=1e-6)
        assert np.isclose(low, mags[~split].mean(), rtol=1e-6)
    assert sum(t.nbytes for t in e.values()) == sparse_nbytes(n, density, Q2)


def test_q2_takes_fewer_bytes_than_f8_at_the_same_density() -> None:
    n = 1_000_000
    for d in (1 / 32, 0.01):
        f8, q2 = sparse_nbytes(n, d), sparse_nbytes(n, d, Q2)
        assert q2 <= 0.65 * f8, (d, f8, q2)  # 1.75 bytes a value against 3
    # At 1/32: 128 values a chunk in 2 + 12 bits, 2 counts bytes and 8 of levels.
    assert sparse_nbytes(CHUNK, 1 / 32, Q2) == 32 + 192 + 10
    assert 4 * n / sparse_nbytes(n, 1 / 32, Q2) > 69


def test_unknown_formats_and_misplaced_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="'TOPK_F4' is not a sparse format; use one of "
                                          "TOPK_F8, TOPK_Q2, SIGN1"):
        sparsify("t", f32([1.0]), 1.0, "TOPK_F4")
    with pytest.raises(ConfigError, match="'F4' is not a sparse format"):
        densify({}, "t", (1,), "F4")
    assert DiLoCo(delta_dtype=Q2, delta_density=0.01).delta_dtype == Q2
    with pytest.raises(ConfigError,
                       match="use a sparse delta_dtype \\('TOPK_F8', 'TOPK_Q2', 'SIGN1'\\)"):
        DiLoCo(delta_dtype="F4", delta_density=0.1)


# -- hostile payloads -------------------------------------------------------------------------

N = 2 * CHUNK + 10


def good() -> dict[str, TensorBytes]:
    x = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    return sparsify("t", f32(x), 5 / CHUNK, Q2)  # 5 + 5 + 5 = 15 values


def raw(entries: dict[str, TensorBytes], name: str, dtype: str, values: Any) -> dict[
        str, TensorBytes]:
    a = np.asarray(values, {"U8": np.uint8, "U16": "<u2", "F32": "<f4"}[dtype])
    return {**entries, name: TensorBytes(dtype, (a.size,), a.tobytes())}


def offsets12(values: list[int]) -> list[int]:
    """`values` packed as TOPK_Q2 offsets."""
    out = []
    for i in range(0, len(values), 2):
        a = values[i]
        if i + 1 < len(values):
            pair = a | values[i + 1] << 12
            out += [pair & 0xFF, pair >> 8 & 0xFF, pair >> 16]
        else:
            out += [a & 0xFF, a >> 8]
    return out


def hostile() -> list[tuple[dict[str, TensorBytes], str]]:
    e = good()
    idx = [int(v) for v in np.frombuffer(e["t.index"].buffer, np.uint8)]
    offs = [int(v) for v in
            (np.nonzero(q2dense(e, "t", (N,)))[0] % CHUNK)]  # chunk by chunk, ascending
    codes = list(e["t"].buffer)
    levels = np.frombuffer(e["t.scale"].buffer, "<f4").tolist()
    return [
        ({k: v for k, v in e.items() if k != "t"}, "tensor 't' is missing"),
        ({**e, "t.index": e["t.count"]}, "tensor 't.index' is U16\\[3\\]; expected a 1-D U8"),
        (raw(e, "t.scale", "F32", levels[:3]),
         "count \\[3\\] and scale \\[3\\] must be \\[3\\] and \\[6\\]"),
        (raw(e, "t.count", "U16", [5, 5, 11]), "chunk 2 claims 11 values; it has 10"),
        (raw(e, "t.count", "U16", [5, 5, 6]),
         "counts add up to 16 values; codes \\[4\\] and index \\[23\\] must be \\[4\\] and "
         "\\[24\\]"),
        (raw(e, "t.count", "U16", [65535, 0, 0]), "chunk 0 claims 65535 values"),
        (raw(e, "t.index", "U8", idx[:-1]), "index \\[22\\] must be \\[4\\] and \\[23\\]"),
        (raw(e, "t.index", "U8", offsets12([*offs[:12], 10, *offs[13:]])),
         "value 12 has offset 10 in chunk 2 of 10 elements"),
        (raw(e, "t.index", "U8", offsets12([*offs[:5], offs[6] + 1, *offs[6:]])),
         "value 6's offset .* is below the one before it in chunk 1"),
        (raw(e, "t.index", "U8", offsets12([offs[0], offs[0], *offs[2:]])),
         "value 1's offset .* repeats the one before it in chunk 0"),
        (raw(e, "t.index", "U8", [*idx[:-1], idx[-1] | 0x10]),
         "the last offset's unused bits are not zero"),
        (raw(e, "t", "U8", [*codes[:-1], codes[-1] | 0x40]),
         "the last code byte's unused bits are not zero"),
        (raw(e, "t.scale", "F32", [*levels[:2], -1.0, *levels[3:]]),
         "chunk 1's levels \\[-1.0, .*\\] must be finite and >= 0"),
        (raw(e, "t.scale", "F32", [*levels[:5], np.nan]), "chunk 2's levels .* must be finite"),
        (raw(e, "t.scale", "F32", [np.inf, *levels[1:]]), "chunk 0's levels \\[inf, "),
    ]


@pytest.mark.parametrize("case", range(len(hostile())))
def test_hostile_payloads_are_refused_with_the_rule_they_break(case: int) -> None:
    entries, why = hostile()[case]
    with pytest.raises(CorruptPayload, match=why):
        densify(entries, "t", (N,), Q2, key="payloads/7/a")


def q2_record() -> Any:
    from gradientmail.run.protocol import Exchange
    return Exchange.draft(0, "a", fragment=0, base_version=0, local_step=4, steps=4,
                          tokens=64, final=False, schema_digest="0" * 64, delta_format=Q2)


def test_check_delta_decodes_a_q2_payload() -> None:
    schema = Schema((ParameterSpec("t", "F32", (N,)),))
    e = good()
    assert check_delta(dict(e), q2_record(), schema, ["t"])["t"] == densify(e, "t", (N,), Q2)


# -- error feedback with decay -------------------------------------------------------------------


def test_the_decay_setting_is_checked_and_recorded_only_when_set() -> None:
    assert "feedback_decay" not in DiLoCo(delta_dtype="TOPK_F8").to_json()
    alg = DiLoCo(delta_dtype=Q2, feedback_decay=0.95)
    assert alg.to_json()["feedback_decay"] == 0.95
    assert DiLoCo.from_json(alg.to_json()) == alg
    for bad in (0, -0.5, 1.01, float("nan"), True, "0.9"):
        with pytest.raises(ConfigError, match=r"feedback_decay=.* must be a number in \(0, 1\], "
                                              r"e\.g\. 0\.95 \(None keeps the residual whole\)"):
            DiLoCo(delta_dtype="TOPK_F8", feedback_decay=bad)
    with pytest.raises(ConfigError, match=r"feedback_decay=0\.9 is set but delta_dtype='F4' keeps "
                                          r"no error feedback; use a sparse delta_dtype"):
        DiLoCo(delta_dtype="F4", feedback_decay=0.9)
    with pytest.raises(RemoteProtocolError, match="feedback_decay=2"):
        DiLoCo.from_json({**alg.to_json(), "feedback_decay": 2})


@pytest.mark.parametrize("fmt", ["TOPK_F8", Q2])
def test_with_decay_what_is_sent_plus_the_residual_is_the_delta_plus_the_decayed_residual(
        fmt: str) -> None:
    rng = np.random.default_rng(6)
    shape = (CHUNK + 70,)
    res = Residuals("a")
    before = np.zeros(shape, np.float64)
    for r in range(6):
        d = rng.standard_normal(shape) * 1e-3
        e = res.encode(r, 0, {"w": f32(d)}, 0.02, 0.5, fmt)
        after = res.residual(0)["w"].astype(np.float64)
        np.testing.assert_allclose(dense_of(e, fmt, shape) + after, d + 0.5 * before,
                                   rtol=0, atol=1e-9)
        res.recorded(r, ("a",))
        before = after
    # Without decay the same deltas leave a larger residual behind (it piles up).
    whole = Residuals("a")
    rng = np.random.default_rng(6)
    for r in range(6):
        whole.encode(r, 0, {"w": f32(rng.standard_normal(shape) * 1e-3)}, 0.02, 1.0, fmt)
    assert np.linalg.norm(whole.residual(0)["w"]) > 1.3 * np.linalg.norm(before)


def dense_of(e: dict[str, TensorBytes], fmt: str, shape: tuple[int, ...]) -> np.ndarray:
    return q2dense(e, "w", shape) if fmt == Q2 else dense(e, "w", shape)


def test_a_poster_encodes_with_the_runs_format_and_decay() -> None:
    from gradientmail.learner.messages import Outgoing
    from gradientmail.learner.poster import Poster
    from gradientmail.run.protocol import Exchange

    class Adapter:
        schema = SCHEMA

        def delta(self, anchor: dict[str, np.ndarray], snapshot: dict[str, np.ndarray]
                  ) -> dict[str, TensorBytes]:
            return {n: f32(anchor[n] - snapshot[n]) for n in snapshot}

    alg = DiLoCo(4, 1, in_flight=1, delta_dtype=Q2, delta_density=1 / CHUNK,
                 feedback_decay=0.25)
    rng = np.random.default_rng(7)
    snaps = [{n: rng.standard_normal(SCHEMA[n].shape).astype(np.float32) for n in SCHEMA.names}
             for _ in range(2)]
    zeros = {n: np.zeros(SCHEMA[n].shape, np.float32) for n in SCHEMA.names}

    async def main() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[Any]]:
        MemoryMailbox.forget("poster-q2")
        ex = Exchange(MemoryMailbox("poster-q2"))
        events: list[Any] = []
        poster = Poster(ex, Adapter(), alg, "a", ((*SCHEMA.names,),), clock=ex.clock,
                        on_event=events.append, hold_own=False, closed=lambda: -1,
                        host=None, wake=asyncio.Event(), failed=queue.SimpleQueue(),
                        poll_interval=0.01)
        await poster.post(Outgoing(0, 0, 0, 4, 4, 64, False, None, snaps[0], zeros))
        first = dict(poster.residuals.residual(0))
        await poster.post(Outgoing(1, 0, 1, 8, 4, 64, False, None, snaps[1], zeros))
        records = [await ex.contribution(r, "a") for r in (0, 1)]
        MemoryMailbox.forget("poster-q2")
        return first, dict(poster.residuals.residual(0)), records

    first, second, records = asyncio.run(main())
    assert [rec.delta_format for rec in records] == [Q2, Q2]
    for n in SCHEMA.names:
        # Round 1 encoded its delta (−snapshot) plus a quarter of round 0's residual, sent
        # the largest value of each chunk (one chunk here) and kept the rest.
        x = -snaps[1][n].reshape(-1).astype(np.float64) + 0.25 * first[n]
        sent = x - second[n]
        assert list(np.flatnonzero(np.abs(sent) > 1e-6)) == [int(np.argmax(np.abs(x)))]


# -- error feedback with the learner's momentum -------------------------------------------------


def test_the_momentum_setting_is_checked_and_recorded_only_when_set() -> None:
    assert "feedback_momentum" not in DiLoCo(delta_dtype="SIGN1").to_json()
    alg = DiLoCo(delta_dtype="SIGN1", feedback_momentum=0.9, outer_momentum=0.0)
    assert alg.to_json()["feedback_momentum"] == 0.9
    assert DiLoCo.from_json(alg.to_json()) == alg
    for bad in (0, 1, 1.5, -0.1):
        with pytest.raises(ConfigError, match=r"feedback_momentum=.* must be in \(0, 1\), "
                                              r"e\.g\. 0\.9, or None \(off\)"):
            DiLoCo(delta_dtype="SIGN1", feedback_momentum=bad, outer_momentum=0.0)
    with pytest.raises(ConfigError, match=r"feedback_momentum=0\.9 is set but delta_dtype=None "
                                          r"keeps no error feedback"):
        DiLoCo(feedback_momentum=0.9, outer_momentum=0.0)
    with pytest.raises(ConfigError, match=r"feedback_momentum=0\.9 and outer_momentum=0\.9: the "
                                          r"learners keep the momentum, so the outer step must "
                                          r"not keep another; set outer_momentum=0"):
        DiLoCo(delta_dtype="SIGN1", feedback_momentum=0.9)


def test_the_learners_momentum_is_torchs_nesterov_step_and_a_dropped_payload_undoes_it() -> None:
    import torch

    rng = np.random.default_rng(9)
    n = CHUNK + 30
    res = Residuals("a")
    p = torch.zeros(n, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0, momentum=0.9, nesterov=True)
    before = np.zeros(n)
    for r in range(5):
        d = rng.standard_normal(n) * 1e-3
        e = res.encode(r, 0, {"w": f32(d)}, 1 / 32, 1.0, "SIGN1", momentum=0.9)
        after = res.residual(0)["w"].astype(np.float64)
        # What was compressed (sent + the new residual − the old one) is the Nesterov step
        # torch's SGD takes for the gradient `d`.
        step = decoded(e, "w", n) + after - before
        was = p.detach().clone()
        p.grad = torch.from_numpy(d)
        opt.step()
        np.testing.assert_allclose(step, (was - p.detach()).numpy(), rtol=0, atol=1e-8)
        res.recorded(r, ("a",))
        before = after
    kept = (dict(res.residual(0)), dict(res.momentum(0)))
    res.encode(5, 0, {"w": f32(rng.standard_normal(n))}, 1 / 32, 1.0, "SIGN1", momentum=0.9)
    res.recorded(5, ("b",))  # merged without this learner: its state returns
    assert np.array_equal(res.residual(0)["w"], kept[0]["w"])
    assert np.array_equal(res.momentum(0)["w"], kept[1]["w"])


def decoded(e: dict[str, TensorBytes], name: str, n: int) -> np.ndarray:
    return densify(e, name, (n,), "SIGN1").to_numpy().reshape(-1).astype(np.float64)
