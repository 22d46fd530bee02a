"""The math of a round: weights, merges, Nesterov against torch's SGD, cosines."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.algorithms.merge import (
    CANCEL_NORM,
    gram_of,
    mean_cosine,
    nesterov,
    normalized_weights,
    rda,
    rda_coefficients,
    weight,
    weighted_mean,
)
from gradientmail.backends import NumpyBackend, TorchBackend
from gradientmail.backends.base import Backend, Value
from gradientmail.errors import ConfigError
from gradientmail.wire.tensor_bytes import TensorBytes

NP = NumpyBackend()


def val(a: object, be: Backend = NP) -> Value:
    return be.load(TensorBytes.from_numpy(np.asarray(a, np.float32)))


def arr(v: Value) -> np.ndarray:
    return np.frombuffer(v.to_bytes("F32").data, np.float32).reshape(v.shape)


def randn(n: int, seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


# -- weights ---------------------------------------------------------------------------


def test_weight_is_exact_on_large_integers() -> None:
    t, s = 83030920993190389, 888599
    assert weight(t, s) == float(Fraction(t * t, s)) == 7.758430789340777e27
    assert float(t) ** 2 / s != weight(t, s)  # the float formula rounds twice
    assert weight(0, 5) == 0.0 and weight(3, 2) == 4.5
    with pytest.raises(ConfigError, match="steps=0 must be an int >= 1"):
        weight(10, 0)
    with pytest.raises(ConfigError, match="tokens=-1 must be an int >= 0"):
        weight(-1, 1)


def test_normalized_weights() -> None:
    assert normalized_weights([1, 2]) == [1 / 3, 2 / 3]
    big = [Fraction(10**40, 3), Fraction(10**40, 3) + 1]
    assert sum(normalized_weights(big)) == pytest.approx(1.0, abs=1e-15)
    assert normalized_weights([0, 0, 0]) == [1 / 3] * 3
    with pytest.raises(ConfigError, match=r"weights\[1\]=-1 must be finite and >= 0"):
        normalized_weights([1, -1])
    with pytest.raises(ConfigError, match="need at least one weight"):
        normalized_weights([])


# -- merges ----------------------------------------------------------------------------


def test_weighted_mean() -> None:
    a, b = val(randn(100, 1)), val(randn(100, 2))
    assert weighted_mean([a], [7]) is a
    out = weighted_mean([a, b], [1, 3])
    assert out.to_bytes("F32") == (a * 0.25 + b * 0.75).to_bytes("F32")
    with pytest.raises(ConfigError, match="2 values but 1 weights"):
        weighted_mean([a, b], [1])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(1e-3, 1e3), st.integers(0, 10**6)), min_size=2, max_size=6),
    st.integers(0, 2**31),
)
def test_rda_norm_is_the_weighted_mean_of_norms(specs: list[tuple[float, int]], seed: int) -> None:
    rng = np.random.default_rng(seed)
    vals = [val(rng.standard_normal(257).astype(np.float32) * s) for s, _ in specs]
    ws = [w for _, w in specs]
    p = normalized_weights(ws)
    want = math.fsum(pi * v.norm() for pi, v in zip(p, vals, strict=True))
    assert rda(vals, ws).norm() == pytest.approx(want, rel=1e-5)


def test_rda_direction_is_the_weighted_mean_of_directions() -> None:
    a, b = randn(1000, 3), randn(1000, 4) * 50
    out = arr(rda([val(a), val(b)], [1, 3]))
    direction = 0.25 * a / np.linalg.norm(a) + 0.75 * b / np.linalg.norm(b)
    cos = out @ direction / (np.linalg.norm(out) * np.linalg.norm(direction))
    assert cos == pytest.approx(1.0, abs=1e-6)
    # A plain mean would be dominated by b's norm; RDA keeps the mean norm.
    assert np.linalg.norm(out) == pytest.approx(
        0.25 * np.linalg.norm(a) + 0.75 * np.linalg.norm(b), rel=1e-5
    )


def test_rda_of_one_contribution_is_itself() -> None:
    a = val(randn(100, 5))
    assert rda([a], [9]) is a
    assert rda_coefficients([[a.dot(a)]], [1.0]) == [1.0]


def test_rda_of_cancelling_directions_is_zero() -> None:
    a = randn(100, 6)
    assert arr(rda([val(a), val(-a)], [2, 2])).tolist() == [0.0] * 100
    # Opposite directions cancel whatever the norms when the weights balance them.
    assert not arr(rda([val(a), val(-3 * a)], [1, 1])).any()
    # Nearly cancelling: below CANCEL_NORM the float32 sum would be rounding noise.
    b = a + randn(100, 7, scale=1e-7)
    g = gram_of([val(a), val(-b)])
    assert rda_coefficients(g, [0.5, 0.5]) == [0.0, 0.0]
    assert CANCEL_NORM == 1e-5


def test_rda_ignores_zero_deltas_direction_but_counts_their_weight() -> None:
    a = randn(64, 8)
    out = arr(rda([val(a), val(np.zeros(64))], [1, 1]))
    # φ(0) = 0: the direction is a's, the norm the mean of ‖a‖ and 0.
    np.testing.assert_allclose(out, a / 2, rtol=1e-6, atol=1e-7)


def test_rda_matches_across_backends() -> None:
    raws = [randn(3000, 10 + i, scale=10.0**i) for i in range(4)]
    outs = [rda([val(r, be) for r in raws], [5, 1, 2, 0]).to_bytes("F32") for be in
            (NumpyBackend(), TorchBackend())]
    assert outs[0] == outs[1]


def test_rda_coefficients_checks_the_gram_shape() -> None:
    with pytest.raises(ConfigError, match="gram must be 2x2 for 2 shares"):
        rda_coefficients([[1.0]], [0.5, 0.5])


# -- Nesterov --------------------------------------------------------------------------


@pytest.mark.parametrize("be", [NumpyBackend(), TorchBackend()], ids=["numpy", "torch"])
def test_nesterov_equals_torch_sgd_within_float32_rounding(be: Backend) -> None:
    """20 outer steps against SGD(lr, momentum, nesterov=True) fed Δ as the gradient.

    Not bit-exact: torch's CPU kernels compute `grad.add(buf, alpha=β)` and
    `param.add_(grad, alpha=-lr)` with a fused multiply-add (one rounding), where the
    backends round the product and the sum separately so numpy and torch agree.
    """
    lr, beta, shape = 0.7, 0.9, (64, 33)
    rng = np.random.default_rng(0)
    theta0 = rng.standard_normal(shape).astype(np.float32)
    p = torch.nn.Parameter(torch.from_numpy(theta0.copy()))
    sgd = torch.optim.SGD([p], lr=lr, momentum=beta, nesterov=True)
    theta, m = val(theta0, be), be.zeros(shape)
    for _ in range(20):
        delta = (rng.standard_normal(shape) * 0.01).astype(np.float32)
        p.grad = torch.from_numpy(delta.copy())
        sgd.step()
        theta, m = nesterov(theta, m, val(delta, be), lr, beta)
        ours, theirs = arr(theta), p.detach().numpy()
        # A few float32 ulps of |θ| ~ 1 per step at most, accumulated over 20 steps.
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-6)
        buf = sgd.state[p]["momentum_buffer"].numpy()
        np.testing.assert_allclose(arr(m), buf, rtol=0, atol=1e-6)


def test_nesterov_arithmetic_is_exact_float32_steps() -> None:
    t, m, d = (np.float32(x) for x in (1.5, 0.25, -0.125))
    th2, m2 = nesterov(val([t]), val([m]), val([d]), 0.7, 0.9)
    b, eta = np.float32(0.9), np.float32(0.7)
    m_want = np.float32(np.float32(m * b) + d)
    g = np.float32(d + np.float32(m_want * b))
    assert arr(m2)[0] == m_want
    assert arr(th2)[0] == np.float32(t - np.float32(g * eta))


def test_first_step_from_zero_momentum_is_delta_times_one_plus_beta() -> None:
    d = randn(50, 9, 1e-2)
    th, m = nesterov(val(np.zeros(50)), NP.zeros((50,)), val(d), 1.0, 0.5)
    assert arr(m).tobytes() == d.tobytes()
    np.testing.assert_allclose(arr(th), -1.5 * d, rtol=1e-7)


# -- cosine ----------------------------------------------------------------------------


def test_mean_cosine() -> None:
    a, b = val(randn(100, 1)), val(randn(100, 2))
    assert mean_cosine(gram_of([a])) is None
    assert mean_cosine(gram_of([a, a * 3.0])) == pytest.approx(1.0, abs=1e-7)
    assert mean_cosine(gram_of([a, a * -1.0])) == pytest.approx(-1.0, abs=1e-7)
    z = NP.zeros((100,))
    assert mean_cosine(gram_of([a, z])) == 0.0
    cab = a.dot(b) / (a.norm() * b.norm())
    want = (1.0 + cab + cab) / 3  # pairs (a, a), (a, b), (a, b)
    assert mean_cosine(gram_of([a, a, b])) == pytest.approx(want, abs=1e-7)
    got = mean_cosine(gram_of([a, b]))
    assert got is not None and got == float(np.float32(got))  # recorded as a float32
