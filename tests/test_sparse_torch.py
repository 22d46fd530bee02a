"""The torch encoder of ``TOPK_F8`` (`wire.sparse_torch.sparsify_tensor`) gives numpy's
bytes (`wire.sparse.sparsify`): on adversarial inputs (ties at the threshold, zeros and
negative zeros, subnormals, values near float32's maximum), odd lengths and several
chunk counts, F16/BF16 input, the golden payload; the same positions and sent values as
`sparsify_sent`; the same errors. The `device` fixture runs each case on a GPU too."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from test_sparse import GOLDEN_SHA256

torch = pytest.importorskip("torch")

from gradientmail.errors import NonFiniteError  # noqa: E402
from gradientmail.wire.serialization import pack  # noqa: E402
from gradientmail.wire.sparse import CHUNK, sparsify, sparsify_sent  # noqa: E402
from gradientmail.wire.sparse_torch import sparsify_tensor  # noqa: E402
from gradientmail.wire.tensor_bytes import TensorBytes  # noqa: E402

_F32_MAX = float(np.finfo(np.float32).max)


def _ties(rng: np.random.Generator, n: int) -> np.ndarray:
    # A few magnitudes, both signs: most chunks have many more ties at the threshold
    # than places left, so which of them is kept decides the bytes.
    return (rng.choice([0.5, 0.25, 1.0], n) * rng.choice([-1, 1], n)).astype(np.float32)


def _zeros(rng: np.random.Generator, n: int) -> np.ndarray:
    # Mostly +0 and −0 (equal magnitudes, different codes), a few values: chunks where
    # k exceeds the non-zeros keep zeros, by index.
    x = np.where(rng.random(n) < 0.5, np.float32(0.0), np.float32(-0.0)).astype(np.float32)
    hot = rng.random(n) < 0.002
    x[hot] = rng.standard_normal(int(hot.sum())).astype(np.float32)
    return x


def _scales(rng: np.random.Generator, n: int) -> np.ndarray:
    # Chunks of very different scales, subnormals, and large but safe values.
    x = rng.standard_normal(n).astype(np.float32)
    x *= rng.choice([1e-42, 1e-38, 1e-3, 1.0, 3e37], n).astype(np.float32)
    return x


def _distinct(rng: np.random.Generator, n: int) -> np.ndarray:
    return (rng.permutation(n).astype(np.float32) - n / 2) * np.float32(1e-4)


def _quantized(rng: np.random.Generator, n: int) -> np.ndarray:
    # Values on a coarse grid (what a decoded payload looks like): ties everywhere.
    return (rng.integers(-8, 9, n) * 0.125).astype(np.float32)


INPUTS: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "ties": _ties, "zeros": _zeros, "scales": _scales, "distinct": _distinct,
    "quantized": _quantized,
}
LENGTHS = [1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17, 9 * CHUNK + 4095]
DENSITIES = [1 / CHUNK, 0.01, 1 / 32, 0.5, 1.0]


def numpy_entries(x: np.ndarray, density: float) -> dict[str, TensorBytes]:
    return sparsify("t", TensorBytes.from_numpy(x), density)


@pytest.mark.parametrize("kind", sorted(INPUTS))
@pytest.mark.parametrize("n", LENGTHS)
def test_the_bytes_are_numpys(device: str, kind: str, n: int) -> None:
    rng = np.random.default_rng(n)
    x = INPUTS[kind](rng, n)
    t = torch.from_numpy(x.copy()).to(device)
    for density in DENSITIES:
        entries, positions, sent = sparsify_tensor("t", t, density)
        assert entries == numpy_entries(x, density), (kind, n, density)
        _, want_pos, want_sent = sparsify_sent("t", TensorBytes.from_numpy(x), density)
        assert positions.device == sent.device == t.device
        assert np.array_equal(positions.cpu().numpy(), want_pos)
        assert np.array_equal(sent.cpu().numpy().view(np.uint32), want_sent.view(np.uint32))


def test_the_golden_payload_and_other_shapes_and_dtypes(device: str) -> None:
    x = (np.sin(np.arange(2 * CHUNK + 300, dtype=np.float64) * 0.37) * 1e-3).astype(np.float32)
    entries, _, _ = sparsify_tensor("h.0.w", torch.from_numpy(x).to(device), 0.01)
    assert hashlib.sha256(pack(entries)).hexdigest() == GOLDEN_SHA256
    # A 2-D tensor is encoded flat, as numpy encodes it.
    m = np.random.default_rng(1).standard_normal((37, 300)).astype(np.float32)
    got, _, _ = sparsify_tensor("m", torch.from_numpy(m).to(device), 0.05)
    assert got == sparsify("m", TensorBytes.from_numpy(m), 0.05)
    # F16 and BF16 are read as float32, as numpy reads them.
    for np_dtype, torch_dtype in ((np.float16, torch.float16),
                                  (ml_dtypes.bfloat16, torch.bfloat16)):
        h = np.random.default_rng(2).standard_normal(CHUNK + 9).astype(np_dtype)
        t = torch.from_numpy(h.astype(np.float32)).to(device=device, dtype=torch_dtype)
        got, _, _ = sparsify_tensor("h", t, 0.01)
        assert got == sparsify("h", TensorBytes.from_numpy(h), 0.01)
    # An empty tensor: no values, no chunks.
    got, positions, _ = sparsify_tensor("e", torch.zeros(0, device=device), 0.01)
    assert got == sparsify("e", TensorBytes.from_numpy(np.zeros(0, np.float32)), 0.01)
    assert positions.numel() == 0


def _refused(case: str) -> tuple[np.ndarray, list[int], str]:
    """A tensor numpy's encoder refuses, the indices of what it refuses, and its message."""
    if case == "overflow":
        x = np.zeros(CHUNK + 3, np.float32)
        x[CHUNK + 1] = np.float32(_F32_MAX)  # codes to 2^128: past float32
        x[7] = np.float32(3e38)  # codes to 240 · 2^120: fine
        return x, [CHUNK + 1], "overflow to infinity when rounded to TOPK_F8"
    x = np.random.default_rng(3).standard_normal(2 * CHUNK + 5).astype(np.float32)
    x[[5000, 6000, 8190]] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[case]
    return x, [5000, 6000, 8190], "holds 3 NaN or infinite values (first at flat index 5000)"


@pytest.mark.parametrize("case", ["nan", "inf", "-inf", "overflow"])
def test_what_numpy_refuses_is_refused_with_numpys_message(device: str, case: str) -> None:
    x, bad, message = _refused(case)
    with pytest.raises(NonFiniteError) as want:
        numpy_entries(x, 0.01)
    assert message in str(want.value)
    with pytest.raises(NonFiniteError) as got:
        sparsify_tensor("t", torch.from_numpy(x).to(device), 0.01)
    assert str(got.value) == str(want.value)
    x[bad] = 0  # the rest encodes, to numpy's bytes
    assert sparsify_tensor("t", torch.from_numpy(x).to(device), 0.01)[0] == numpy_entries(
        x, 0.01)


def test_random_values_from_a_few_magnitudes_give_numpys_bytes() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from hypothesis.extra.numpy import arrays

    values = st.sampled_from([0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 1e-40, -3e-39, 448.0, 2.5e30])

    @settings(max_examples=60, deadline=None)
    @given(arrays(np.float32, st.integers(1, 2 * CHUNK + 9), elements=values),
           st.sampled_from([1 / CHUNK, 3 / CHUNK, 0.3, 1.0]))
    def check(x: np.ndarray, density: float) -> None:
        got, _, _ = sparsify_tensor("t", torch.from_numpy(x.copy()), density)
        assert got == numpy_entries(x, density)

    check()
