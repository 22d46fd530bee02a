"""The fast quantizers against an oracle: numpy, torch (one tensor, a batch) and the
plain ml_dtypes casts give the same bytes on the edge cases, and refuse the same input."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest

from gradientmail.errors import NonFiniteError
from gradientmail.wire.quantization import BLOCK, quantize
from gradientmail.wire.quantization_torch import quantize_bytes
from gradientmail.wire.tensor_bytes import TensorBytes

torch = pytest.importorskip("torch")
from gradientmail.wire.quantization_torch import quantize_tensor, quantize_tensors  # noqa: E402

PATHS = ("numpy", "torch")
CODED = ("F8_E4M3", "F4")


def quantize_on(path: str, name: str, tensor: TensorBytes, fmt: str) -> dict[str, TensorBytes]:
    """`quantize` on the numpy path, or the torch kernels' `quantize_bytes`."""
    return (quantize_bytes if path == "torch" else quantize)(name, tensor, fmt)


def _oracle(x: npt.NDArray[np.float32], fmt: str) -> tuple[bytes, bytes]:
    """(codes, scale) by the definition: the smallest power-of-two scale (frexp), the
    scaled values cast by ml_dtypes (round to nearest even), F4 packed low nibble first."""
    x = x.reshape(-1).astype(np.float64)

    def k_of(amax: npt.NDArray[np.float64], top: float, lo: int) -> npt.NDArray[np.int64]:
        with np.errstate(divide="ignore"):
            k = np.ceil(np.log2(amax / top))
        for _ in range(2):  # log2 may be off by one at the edges: settle exactly
            k = np.where(amax > top * 2.0**k, k + 1, k)
            k = np.where((k > lo) & (amax <= top * 2.0 ** (k - 1)), k - 1, k)
        return np.where(amax == 0, 0, np.clip(k, lo, 127)).astype(np.int64)

    if fmt == "F8_E4M3":
        k = k_of(np.array([np.abs(x).max() if x.size else 0.0]), 448.0, -126)
        y = (x * 2.0 ** -float(k[0])).astype(np.float32)
        return (y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).tobytes(),
                np.float32(2.0 ** float(k[0])).tobytes())
    padded = np.pad(x, (0, -x.size % BLOCK)).reshape(-1, BLOCK)
    k = k_of(np.abs(padded).max(axis=1), 6.0, -127)
    y = (padded * 2.0 ** -k[:, None].astype(np.float64)).astype(np.float32).reshape(-1)
    codes = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)[: x.size]
    codes = np.pad(codes, (0, codes.size % 2))
    return (codes[0::2] | (codes[1::2] << 4)).tobytes(), (k + 127).astype(np.uint8).tobytes()


def _edge_values() -> npt.NDArray[np.float32]:
    """Ties of both formats at several scales, subnormals, signed zeros, odd runs, and
    blocks whose scales sit at the ends of the range."""
    ties8 = np.array([1 + 1 / 16, 1 + 3 / 16, 2 ** -7 + 2 ** -10, 2 ** -10, 3 * 2 ** -10, 464.0,
                      440.0, 2 ** -6 - 2 ** -10], np.float64)
    ties4 = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float64)
    just = np.array([1 + 2 ** -23, 1 - 2 ** -24], np.float64)
    parts = [
        np.concatenate([ties4, -ties4, ties4 * (1 + 2 ** -20), ties4 * (1 - 2 ** -20)]) * 2.0 ** 3,
        np.concatenate([ties8 / 448 * 6, -ties8, ties8 * just[0], ties8 * just[1]]),
        np.array([0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 2.0 ** -149 * 3] * 6),
        np.full(BLOCK, 2.5e38), np.full(BLOCK, -1e-40), np.zeros(BLOCK),
        np.linspace(-1, 1, 77) * 2.0 ** -130,  # subnormal blocks: the smallest scale
        np.linspace(-6, 6, 95) * 2.0 ** 125,  # the largest scales that stay finite
    ]
    return np.concatenate(parts).astype(np.float32)


@pytest.mark.parametrize("fmt", CODED)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cut", [0, 1, 7, 31, 33, 100, None])
def test_edge_cases_match_the_oracle(fmt: str, path: str, cut: int | None) -> None:
    x = _edge_values()[:cut]
    entries = quantize_on(path, "e", TensorBytes.from_numpy(x), fmt)
    assert (entries["e"].data, entries["e.scale"].data) == _oracle(x, fmt)


@pytest.mark.parametrize("fmt", CODED)
@pytest.mark.parametrize("n", [(1 << 16) + 33, (1 << 15) * 3 - 1])
def test_chunk_boundaries_match_the_oracle_on_both_paths(fmt: str, n: int) -> None:
    # Larger than a numpy chunk and several torch CPU chunks, with a short last block;
    # magnitudes vary block to block so neighbouring chunks get different scales.
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n // BLOCK + 1).repeat(BLOCK)[:n])
    x = x.astype(np.float32)
    want = _oracle(x, fmt)
    for path in PATHS:
        entries = quantize_on(path, "c", TensorBytes.from_numpy(x), fmt)
        assert (entries["c"].data, entries["c.scale"].data) == want


@pytest.mark.parametrize("fmt", ("BF16", *CODED))
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_sources_on_both_paths(fmt: str, dtype: object) -> None:
    x = (np.random.default_rng(1).standard_normal(3001) * 50).astype(dtype)
    t = TensorBytes.from_numpy(x)
    assert quantize_bytes("h", t, fmt) == quantize("h", t, fmt)


@pytest.mark.parametrize("fmt", ("BF16", *CODED))
@pytest.mark.parametrize("shape", [(0,), (3, 0), (), (1,), (5, 7)])
def test_empty_scalar_and_odd_shapes_on_both_paths(fmt: str, shape: tuple[int, ...]) -> None:
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape) - 3
    t = TensorBytes.from_numpy(x)
    numpy_entries = quantize("s", t, fmt)
    assert quantize_bytes("s", t, fmt) == numpy_entries
    assert numpy_entries["s"].shape == shape


@pytest.mark.parametrize("fmt", ("BF16", *CODED))
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_non_finite_past_the_first_chunk_is_refused_alike(fmt: str, path: str,
                                                          bad: float) -> None:
    x = np.ones(200_000, np.float32)
    x[[70_000, 70_001, 199_999]] = bad
    with pytest.raises(NonFiniteError, match=r"^tensor 'w' holds 3 NaN or infinite values "
                       rf"\(first at flat index 70000\); cannot quantize to {fmt}\."):
        quantize_on(path, "w", TensorBytes.from_numpy(x), fmt)


@pytest.mark.parametrize("fmt", ("BF16", *CODED))
@pytest.mark.parametrize("path", PATHS)
def test_rounding_past_float32_max_is_refused_alike(fmt: str, path: str) -> None:
    x = np.zeros(100, np.float32)
    x[40] = 3.4e38
    with pytest.raises(NonFiniteError, match=f"'big'.*overflow to infinity when rounded to {fmt}"):
        quantize_on(path, "big", TensorBytes.from_numpy(x), fmt)


@pytest.mark.parametrize("fmt", ("BF16", *CODED))
def test_torch_tensors_and_batches_give_the_same_entries(fmt: str) -> None:
    rng = np.random.default_rng(2)
    arrays = {"a": rng.standard_normal((33, 5)).astype(np.float32),
              "b": (rng.standard_normal(70) * 1e-3).astype(np.float32),
              "c": np.zeros(0, np.float32)}
    want: dict[str, TensorBytes] = {}
    for name, a in arrays.items():
        want |= quantize(name, TensorBytes.from_numpy(a), fmt)
    tensors = {name: torch.from_numpy(a.copy()) for name, a in arrays.items()}
    assert quantize_tensors(tensors, fmt) == want
    assert quantize_tensor("a", tensors["a"].to(torch.bfloat16), fmt) == quantize(
        "a", TensorBytes.from_numpy(arrays["a"].astype(ml_dtypes.bfloat16)), fmt)
    tensors["b"][3] = math.nan
    with pytest.raises(NonFiniteError, match="tensor 'b' holds 1 NaN"):
        quantize_tensors(tensors, fmt)


@pytest.mark.parametrize("fmt", ("BF16", *CODED))
def test_on_the_device_the_bytes_are_numpys(device: str, fmt: str) -> None:
    # On a GPU the same kernels run as one batch with one wait; the bytes stay numpy's.
    rng = np.random.default_rng(3)
    arrays = {"edge": _edge_values(), "odd": rng.standard_normal((7, 9)).astype(np.float32),
              "none": np.zeros((0, 4), np.float32),
              "wide": (rng.standard_normal(100_003) * 1e-4).astype(np.float32)}
    want: dict[str, TensorBytes] = {}
    for name, a in arrays.items():
        want |= quantize(name, TensorBytes.from_numpy(a), fmt)
    on_device = {name: torch.from_numpy(a.copy()).to(device) for name, a in arrays.items()}
    assert quantize_tensors(on_device, fmt) == want
    assert quantize_tensor("odd", on_device["odd"], fmt) == quantize(
        "odd", TensorBytes.from_numpy(arrays["odd"]), fmt)
    on_device["wide"][99_999] = math.inf
    with pytest.raises(NonFiniteError, match=r"'wide' holds 1 NaN .*flat index 99999"):
        quantize_tensors(on_device, fmt)


@pytest.mark.parametrize("fmt", CODED)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("values", [[1e-45, -3e-45], [1.17e-38, -2e-40, 0.0], [-2.5e38, 1.0],
                                    [0.0, -0.0], [448.0, -447.9], [6.0, 5.99]])
def test_whole_tensor_scales_at_the_ends(fmt: str, path: str, values: list[float]) -> None:
    # F8's one scale from a subnormal absmax (k clamps at -126), from one near float32's
    # maximum, from zeros; and absmaxes right at the formats' largest codes.
    x = np.array(values, np.float32)
    entries = quantize_on(path, "s", TensorBytes.from_numpy(x), fmt)
    assert (entries["s"].data, entries["s.scale"].data) == _oracle(x, fmt)
