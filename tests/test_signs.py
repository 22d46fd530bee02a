"""The 1-bit delta format (`wire.signs`, ``SIGN1``, through `wire.sparse`).

Golden bytes and selection hashes; the decoded values are ± each chunk's mean magnitude on
exactly the elements the seed selects; a share `density` of them; hostile payloads refused
with the rule they break; fuzzed payloads refused cleanly; a round of SIGN1 deltas commits
the bytes of their decoded deltas; error feedback seeds by round.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from test_sparse import f32

from gradientmail.errors import CorruptPayload, GradientmailError
from gradientmail.learner.feedback import Residuals
from gradientmail.run.bounds import check_delta
from gradientmail.wire.serialization import ParameterSpec, Schema, pack, unpack
from gradientmail.wire.signs import select_hash, threshold
from gradientmail.wire.sparse import CHUNK, densify, entry_names, sparse_nbytes, sparsify
from gradientmail.wire.tensor_bytes import TensorBytes

S1 = "SIGN1"


def decoded(e: dict[str, TensorBytes], name: str, n: int) -> np.ndarray:
    return densify(e, name, (n,), S1).to_numpy().reshape(-1)


def test_golden_hashes_and_entries() -> None:
    # The selection is part of the format: pinned on every platform.
    assert [int(v) for v in select_hash(0, 0, 4)] == [0, 301794027, 3140136926, 3601063660]
    assert [int(v) for v in select_hash(29, 1000, 1003)] == [2698804809, 1284622917, 572298285]
    assert (threshold(0.5), threshold(1.0)) == (2**31, 2**32 - 1)
    x = [0.5, -1, 2, -0.25, 0, 3, -4, 1, 0.75]
    e = sparsify("w", f32(x), 0.5, S1, seed=3)
    # Seed 3 at 1/2 selects 1, 5, 6, 8 (-1, 3, -4, 0.75): mean magnitude 2.1875; signs
    # -, +, -, + in bits 0-3.
    assert {n: (t.dtype, t.shape) for n, t in e.items()} == {
        "w": ("U8", (1,)), "w.scale": ("F32", (1,)), "w.select": ("U32", (2,))}
    assert e["w"].buffer == bytes([0b0101])
    assert e["w.scale"].buffer == np.float32(2.1875).tobytes()
    assert e["w.select"].buffer == np.array([3, 2**31], "<u4").tobytes()
    assert list(decoded(e, "w", 9)) == [0, -2.1875, 0, 0, 0, 2.1875, -2.1875, 0, 2.1875]
    assert entry_names("w", S1) == ("w", "w.scale", "w.select")


def test_golden_payload_bytes() -> None:
    x = (np.sin(np.arange(2 * CHUNK + 300, dtype=np.float64) * 0.37) * 1e-3).astype(np.float32)
    blob = pack(sparsify("h.0.w", f32(x), 1 / 3, S1, seed=11))
    assert sum(t.nbytes for t in unpack(blob).values()) == sparse_nbytes(x.size, 1 / 3, S1, 11)
    assert hashlib.sha256(blob).hexdigest() == GOLDEN_SHA256


GOLDEN_SHA256 = "3f1f71b6fa0b6408aa6d502ae007e8e659cb04ae33a80276ad632329534048c5"


@pytest.mark.parametrize("n", [1, 9, CHUNK - 1, CHUNK, 3 * CHUNK + 17])
@pytest.mark.parametrize("density", [1.0, 0.5, 0.1])
def test_each_selected_element_travels_as_its_sign_times_its_chunks_mean(
        n: int, density: float) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * rng.choice([1e-4, 1.0], size=n)).astype(np.float32)
    x[x == 0] = 1.0
    e = sparsify("t", f32(x), density, S1, seed=n)
    got = decoded(e, "t", n)
    sel = select_hash(n, 0, n) <= threshold(density)
    assert list(np.flatnonzero(got)) == list(np.flatnonzero(sel))
    assert np.array_equal(np.sign(got[sel]), np.sign(x[sel]))
    for c in range(0, n, CHUNK):
        part = sel[c : c + CHUNK]
        if part.any():
            mean = np.abs(x[c : c + CHUNK][part]).astype(np.float64).mean()
            assert np.allclose(np.abs(got[c : c + CHUNK][part]), mean, rtol=1e-6)
    assert sum(t.nbytes for t in e.values()) == sparse_nbytes(n, density, S1, n)
    if n > 10_000:
        assert abs(sel.mean() - density) < 0.02


def test_one_bit_a_value_at_density_one() -> None:
    n = 1_000_000
    assert sparse_nbytes(n, 1.0, S1) == n // 8 + 4 * -(-n // CHUNK) + 8
    assert 4 * n / sparse_nbytes(n, 1.0, S1) > 31.7
    assert 4 * n / sparse_nbytes(n, 0.25, S1, seed=5) > 120


# -- hostile payloads -------------------------------------------------------------------------

N = 2 * CHUNK + 10


def good() -> dict[str, TensorBytes]:
    x = np.random.default_rng(2).standard_normal(N).astype(np.float32)
    return sparsify("t", f32(x), 0.5, S1, seed=4)


def raw(entries: dict[str, TensorBytes], name: str, dtype: str, values: Any) -> dict[
        str, TensorBytes]:
    a = np.asarray(values, {"U8": np.uint8, "U32": "<u4", "F32": "<f4"}[dtype])
    return {**entries, name: TensorBytes(dtype, (a.size,), a.tobytes())}


def hostile() -> list[tuple[dict[str, TensorBytes], str]]:
    e = good()
    signs = list(e["t"].buffer)
    sel = int((select_hash(4, 0, N) <= threshold(0.5)).sum())
    assert sel % 8  # the last byte has padding bits to set
    mags = np.frombuffer(e["t.scale"].buffer, "<f4").tolist()
    return [
        ({k: v for k, v in e.items() if k != "t.select"}, "tensor 't.select' is missing"),
        ({**e, "t": e["t.scale"]}, "tensor 't' is F32\\[3\\]; expected a 1-D U8"),
        (raw(e, "t.scale", "F32", mags[:2]), "scale \\[2\\] and select \\[2\\] must be \\[3\\] "
                                             "and \\[2\\]"),
        (raw(e, "t.select", "U32", [4]), "select \\[1\\] must be \\[3\\] and \\[2\\]"),
        (raw(e, "t.select", "U32", [4, 2**32 - 1]),
         f"seed 4 and threshold 4294967295 select {N} elements; signs \\[{len(signs)}\\] "
         f"must be \\[{-(-N // 8)}\\]"),
        (raw(e, "t.select", "U32", [5, 2**31]), "seed 5 and threshold 2147483648 select"),
        (raw(e, "t", "U8", signs[:-1]), f"select {sel} elements; signs"),
        (raw(e, "t", "U8", [*signs[:-1], signs[-1] | 0x80]),
         "the last sign byte's unused bits are not zero"),
        (raw(e, "t.scale", "F32", [mags[0], -1.0, mags[2]]),
         "chunk 1's magnitude -1.0 must be finite and >= 0"),
        (raw(e, "t.scale", "F32", [mags[0], mags[1], np.nan]), "chunk 2's magnitude nan"),
        (raw(e, "t.scale", "F32", [np.inf, mags[1], mags[2]]), "chunk 0's magnitude inf"),
    ]


@pytest.mark.parametrize("case", range(len(hostile())))
def test_hostile_payloads_are_refused_with_the_rule_they_break(case: int) -> None:
    entries, why = hostile()[case]
    with pytest.raises(CorruptPayload, match=why):
        densify(entries, "t", (N,), S1, key="payloads/7/a")


def sign_record() -> Any:
    from gradientmail.run.protocol import Exchange
    return Exchange.draft(0, "a", fragment=0, base_version=0, local_step=4, steps=4,
                          tokens=64, final=False, schema_digest="0" * 64, delta_format=S1)


def test_check_delta_decodes_a_sign1_payload_and_names_what_does_not_fit() -> None:
    schema = Schema((ParameterSpec("t", "F32", (N,)),))
    e = good()
    assert check_delta(dict(e), sign_record(), schema, ["t"])["t"] == densify(e, "t", (N,), S1)
    with pytest.raises(GradientmailError, match=r"missing \['t\.select'\], extra \['t\.count'\]"):
        check_delta({**{k: v for k, v in e.items() if k != "t.select"}, "t.count": e["t"]},
                    sign_record(), schema, ["t"])


def test_error_feedback_seeds_by_round_and_keeps_what_signs_do_not_carry() -> None:
    rng = np.random.default_rng(8)
    n = CHUNK + 100
    res = Residuals("a")
    trained, sent = np.zeros(n), np.zeros(n)
    for r in range(12):
        d = rng.standard_normal(n) * 1e-3
        e = res.encode(r, 0, {"w": f32(d)}, 0.5, 1.0, S1)
        assert e["w.select"].buffer == np.array([r, 2**31], "<u4").tobytes()
        trained += d
        sent += decoded(e, "w", n)
        res.recorded(r, ("a",))
    np.testing.assert_allclose(sent + res.residual(0)["w"], trained, rtol=0, atol=1e-8)
    # Error feedback keeps the sum sent close to the sum trained: over 12 rounds the
    # residual is a fraction of what was trained.
    assert np.linalg.norm(res.residual(0)["w"]) < 0.5 * np.linalg.norm(trained)
