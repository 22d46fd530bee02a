"""Backends: float32 Value arithmetic, byte-identical between numpy and torch on CPU."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.backends import NumpyBackend, TorchBackend, default_backend
from gradientmail.backends import numpy_backend as nbk
from gradientmail.backends.base import Backend, Value
from gradientmail.errors import ConfigError
from gradientmail.wire.tensor_bytes import TensorBytes

BACKENDS: list[Backend] = [NumpyBackend(), TorchBackend()]
IDS = ["numpy", "torch"]


def tb(a: np.ndarray) -> TensorBytes:
    return TensorBytes.from_numpy(a)


def randn(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def both(fn: Callable[[Backend], bytes]) -> bytes:
    """The bytes fn(backend) gives on numpy and on torch; asserts they are equal."""
    a, b = (fn(be) for be in BACKENDS)
    assert a == b
    return a


def test_backends_satisfy_the_protocols() -> None:
    for be in BACKENDS:
        assert isinstance(be, Backend)
        assert isinstance(be.zeros((2,)), Value)
    assert isinstance(default_backend(), NumpyBackend)


@pytest.mark.slow
def test_importing_backends_does_not_import_torch() -> None:
    code = (
        "import sys, gradientmail.backends as b, gradientmail.algorithms.diloco\n"
        "b.NumpyBackend().load\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"


def test_numpy_hands_back_loaded_f32_bytes_without_copying() -> None:
    t = tb(randn((4, 3), 1))
    assert NumpyBackend().load(t).to_bytes("F32").data is t.data


@pytest.mark.parametrize("be", BACKENDS, ids=IDS)
def test_load_widens_exactly(be: Backend) -> None:
    x = randn((7, 5), 1)
    for arr in (x, x.astype(np.float16), x.astype(ml_dtypes.bfloat16)):
        v = be.load(tb(arr))
        assert v.shape == (7, 5)
        assert v.to_bytes("F32").data == arr.astype(np.float32).tobytes()
    with pytest.raises(ConfigError, match="cannot load a F8_E4M3 tensor as a Value; dequantize"):
        be.load(tb(x.astype(ml_dtypes.float8_e4m3fn)))


def test_elementwise_ops_are_byte_identical() -> None:
    a, b = tb(randn((33, 17), 2)), tb(randn((33, 17), 3, scale=1e-3))

    def ops(be: Backend) -> bytes:
        x, y = be.load(a), be.load(b)
        out = [x + y, x - y, x * 0.7, 0.9 * y, (x * 1e-30) * 1e-20, x * (1 / 3) + y * 0.1]
        return b"".join(v.to_bytes(d).data for v in out for d in ("F32", "F16", "BF16"))

    both(ops)


def test_scalars_are_rounded_to_float32_first() -> None:
    x = tb(np.array([3.0, 1e-3, -7.25], np.float32))
    k = 0.1  # not a float32: the product must be x * float32(0.1), rounded once
    want = (np.frombuffer(x.data, np.float32) * np.float32(k)).tobytes()
    for be in BACKENDS:
        assert (be.load(x) * k).to_bytes("F32").data == want


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_bf16_and_f16_round_to_nearest_even_on_any_bits(bits: list[int]) -> None:
    x = np.array(bits, np.uint32).view(np.float32)
    finite = np.isfinite(x)
    for be in BACKENDS:
        v = be.load(tb(x))
        got = np.frombuffer(v.to_bytes("BF16").data, np.uint16)
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
        assert (got[finite] == want[finite]).all()
        assert (got[np.isnan(x)] == 0x7FC0).all()
        inf = np.isinf(x)
        assert (got[inf] == want[inf]).all()
        with np.errstate(over="ignore"):
            want16 = x.astype(np.float16).view(np.uint16)
        got16 = np.frombuffer(v.to_bytes("F16").data, np.uint16)
        assert (got16[finite] == want16[finite]).all()
        assert (got16[np.isnan(x)] == 0x7E00).all()


def test_bf16_ties_go_to_even() -> None:
    # 1 + 2^-8 lies halfway between bf16 1.0 and 1.0078125: even mantissa (1.0) wins;
    # 1 + 3·2^-8 lies halfway between 1.0078125 and 1.015625: 1.015625 is even.
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4e38], np.float32)
    got = both(lambda be: be.load(tb(x)).to_bytes("BF16").data)
    assert np.frombuffer(got, ml_dtypes.bfloat16).astype(np.float32).tolist() == [
        1.0, 1.015625, -1.0, math.inf
    ]


@pytest.mark.parametrize("be", BACKENDS, ids=IDS)
def test_reductions_accumulate_exact_products_in_float64(be: Backend) -> None:
    big = np.float32(2**20)
    x = np.array([big, 1.0, -big], np.float32)
    v = be.load(tb(x))
    # float32 accumulation would lose the 1: 2^40 + 1 - 2^40.
    assert v.dot(v) == 2.0**41 + 1
    assert v.norm() == math.sqrt(2.0**41 + 1)
    a, b = randn((1000,), 4), randn((1000,), 5)
    want = math.fsum(float(p) * float(q) for p, q in zip(a, b, strict=True))
    assert be.load(tb(a)).dot(be.load(tb(b))) == pytest.approx(want, rel=1e-14)
    assert be.zeros((3, 2)).to_bytes("F32").data == bytes(24)


@pytest.mark.parametrize("be", BACKENDS, ids=IDS)
def test_isfinite(be: Backend) -> None:
    x = randn((nbk.CHUNK * 2 + 3,), 6)
    assert be.load(tb(x)).isfinite()
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[-1] = bad
        assert not be.load(tb(y)).isfinite()


@pytest.mark.parametrize("be", BACKENDS, ids=IDS)
def test_fused_helpers_equal_the_value_chains(be: Backend) -> None:
    n = nbk.CHUNK * 5 + 11  # several chunks and a ragged tail on both backends
    vs = [be.load(tb(randn((n,), 10 + i, scale=10.0 ** -i))) for i in range(4)]
    coeffs = [0.3, -1.7, 1 / 3, 2.5e3]
    chain = vs[0] * coeffs[0] + vs[1] * coeffs[1] + vs[2] * coeffs[2] + vs[3] * coeffs[3]
    assert be.lincomb(vs, coeffs).to_bytes("F32") == chain.to_bytes("F32")
    theta, mom = be.load(tb(randn((n,), 20))), be.load(tb(randn((n,), 21, 1e-2)))
    th, m = be.outer_step(theta, mom, vs, coeffs, 0.7, 0.9)
    m_ref = mom * 0.9 + chain
    th_ref = theta - (chain + m_ref * 0.9) * 0.7
    assert th.to_bytes("F32") == th_ref.to_bytes("F32")
    assert m.to_bytes("F32") == m_ref.to_bytes("F32")
    g = be.gram(vs)
    for i in range(4):
        for j in range(4):
            assert g[i][j] == pytest.approx(vs[i].dot(vs[j]), rel=1e-12, abs=1e-300)


def test_fused_helpers_are_byte_identical_across_backends() -> None:
    n = 3 * nbk.CHUNK + 5
    raw = [tb(randn((n,), 30 + i)) for i in range(3)]

    def run(be: Backend) -> bytes:
        vs = [be.load(t) for t in raw]
        th, m = be.outer_step(vs[0], vs[1], vs, [0.25, 0.5, 0.25], 0.7, 0.9)
        x = be.lincomb(vs, [1.0, -1.0, 0.1])
        return th.to_bytes("F32").data + m.to_bytes("BF16").data + x.to_bytes("F16").data

    both(run)
    g_np, g_t = (be.gram([be.load(t) for t in raw]) for be in BACKENDS)
    assert [nbk.f32(x) for r in g_np for x in r] == [nbk.f32(x) for r in g_t for x in r]


def test_misuse_is_named() -> None:
    np_v = NumpyBackend().load(tb(randn((3,), 1)))
    t_v = TorchBackend().load(tb(randn((3,), 1)))
    with pytest.raises(ConfigError, match="cannot combine a numpy Value with TorchValue"):
        np_v + t_v
    with pytest.raises(ConfigError, match=r"shape \(4,\) does not match \(3,\)"):
        np_v - NumpyBackend().zeros((4,))
    with pytest.raises(ConfigError, match="to_bytes: dtype 'F8_E4M3' is not one of"):
        t_v.to_bytes("F8_E4M3")
    with pytest.raises(ConfigError, match="2 coefficients for 1 values"):
        NumpyBackend().lincomb([np_v], [1.0, 2.0])
    with pytest.raises(ConfigError, match="need at least one Value"):
        TorchBackend().gram([])


def test_empty_and_scalar_tensors() -> None:
    for shape in ((0,), (), (0, 4)):
        x = np.zeros(shape, np.float32) + 1.5

        def doubled(be: Backend, x: np.ndarray = x) -> bytes:
            return (be.load(tb(x)) * 2.0).to_bytes("F32").data

        out = both(doubled)
        assert out == (x * 2).tobytes()
        for be in BACKENDS:
            v = be.load(tb(x))
            assert be.gram([v, v]) == [[v.dot(v)] * 2] * 2
            assert be.outer_step(v, v, [v], [1.0], 0.5, 0.5)[0].shape == shape


def test_numpy_results_do_not_depend_on_the_thread_count() -> None:
    n = 2 * nbk.BLOCK + 7  # three blocks
    raw = [tb(randn((n,), 40 + i)) for i in range(3)]
    outs = []
    for threads in (1, 3):
        be = NumpyBackend(threads=threads)
        vs = [be.load(t) for t in raw]
        th, m = be.outer_step(vs[0], vs[1], vs, [0.5, 0.25, 0.125], 0.7, 0.9)
        outs.append((be.gram(vs), th.to_bytes("F32"), m.to_bytes("F32"),
                     be.lincomb(vs, [1.0, 2.0, 3.0]).to_bytes("F32")))
        assert be.gram(vs)[0][1] == pytest.approx(vs[0].dot(vs[1]), rel=1e-13)
    assert outs[0] == outs[1]
    with pytest.raises(ConfigError, match="threads=0 must be an int >= 1"):
        NumpyBackend(threads=0)


@pytest.mark.parametrize("be", BACKENDS, ids=IDS)
def test_all_finite(be: Backend) -> None:
    x = randn((nbk.BLOCK + 5,), 7)
    assert be.all_finite(be.load(tb(x)))
    assert be.all_finite(be.zeros((0,)))
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[nbk.BLOCK + 1] = bad
        assert not be.all_finite(be.load(tb(y)))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_values_match_numpy_bytes() -> None:
    n = 3 * nbk.CHUNK + 5
    raw = [tb(randn((n,), 50 + i, scale=10.0**-i)) for i in range(3)]

    def run(be: Backend) -> bytes:
        vs = [be.load(t) for t in raw]
        th, m = be.outer_step(vs[0], vs[1], vs, [0.25, -0.5, 1 / 3], 0.7, 0.9)
        x = vs[0] * 0.1 + vs[1] - vs[2]
        return b"".join(
            v.to_bytes(d).data for v in (th, m, x, be.lincomb(vs, [1.0, 2.0, 0.3]))
            for d in ("F32", "F16", "BF16")
        )

    assert run(NumpyBackend()) == run(TorchBackend("cuda"))
    x = np.array([np.nan, np.inf, -np.inf, 1 + 2**-8, 65520.0], np.float32)
    for d in ("BF16", "F16"):
        assert TorchBackend("cuda").load(tb(x)).to_bytes(d) == NumpyBackend().load(
            tb(x)).to_bytes(d)
