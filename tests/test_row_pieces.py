"""The closer's windowed merge (docs/sharded.md §3): a contribution made of parts is merged
from its `RowPieces` where they lie, never joined, and gives the bytes of the same delta
merged whole.

The numpy backend's Gram sums in fixed `BLOCK` windows of the logical tensor, so cuts are
placed inside blocks and inside chunks, where a window straddles two pieces; the merge's
extra memory is measured against the merge of deltas already whole.
"""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from gradientmail.algorithms.base import Contribution
from gradientmail.algorithms.diloco import DiLoCo, Rda, WeightedMean
from gradientmail.backends.numpy_backend import BLOCK, NumpyBackend, NumpyRows
from gradientmail.errors import ConfigError
from gradientmail.syncer.screening import delta_norms, screen_delta
from gradientmail.wire.parts import assemble, pieces_of
from gradientmail.wire.payload_ranges import rows_of
from gradientmail.wire.quantization import Quantized, quantize
from gradientmail.wire.row_pieces import DeltaTensor, RowPieces
from gradientmail.wire.serialization import ParameterSpec, Schema, TensorBytes

#: 1,500 rows of 1,000: the tensor spans two Gram blocks (BLOCK = 2^20 elements).
SHAPE = (1500, 1000)
#: Row cuts of three learners: 2 ranks (a cut inside block 0), 3 ranks with an empty part
#: (cuts inside block 1, off every chunk boundary), and whole.
CUTS = [[0, 700, 1500], [0, 401, 401, 1133, 1500], [0, 1500]]


def values(m: int, dtype: str = "F32", shape: tuple[int, ...] = SHAPE) -> list[TensorBytes]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(m):
        a = (0.01 * (i + 1) * rng.standard_normal(shape)).astype(np.float32)
        t = TensorBytes.from_numpy(a)
        out.append(t if dtype == "F32" else NumpyBackend().load(t).to_bytes(dtype))
    return out


def cut(t: TensorBytes, rows: Sequence[int]) -> DeltaTensor:
    """`t` as the pieces a learner cut at `rows` mails (empty parts tile nothing)."""
    pieces = tuple((a, rows_of(t, a, b).tensor) for a, b in itertools.pairwise(rows) if b > a)
    if len(pieces) == 1:
        return t
    return RowPieces(t.dtype, t.shape, pieces)


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_gram_and_lincomb_of_pieces_are_those_of_the_tensor_whole(dtype: str) -> None:
    be = NumpyBackend(threads=2)
    whole = values(3, dtype)
    parted = [cut(t, rows) for t, rows in zip(whole, CUTS, strict=True)]
    a = [be.load(t) for t in whole]
    b = [be.load(t) for t in parted]
    assert isinstance(b[0], NumpyRows) and isinstance(b[1], NumpyRows)
    assert SHAPE[0] * SHAPE[1] > BLOCK
    # Bit for bit: the float64 sums run over the same windows in the same order.
    assert be.gram(b) == be.gram(a)
    coeffs = [0.25, -1.5, 0.75]
    assert be.lincomb(b, coeffs).to_bytes("F32") == be.lincomb(a, coeffs).to_bytes("F32")
    assert b[1].dot(b[0]) == a[1].dot(a[0]) and b[1].norm() == a[1].norm()
    assert be.all_finite(b[1]) and b[1].isfinite()
    # The plain operations join the pieces: same bytes, one copy.
    assert (b[0] * 0.5 + b[1]).to_bytes("F32") == (a[0] * 0.5 + a[1]).to_bytes("F32")


def test_a_non_finite_value_in_a_piece_is_found() -> None:
    a = np.zeros(SHAPE, np.float32)
    a[1200, 3] = np.inf
    rows = cut(TensorBytes.from_numpy(a), CUTS[1])
    be = NumpyBackend()
    assert not be.load(rows).isfinite() and not be.all_finite(be.load(rows))
    assert screen_delta({"w": rows}, ["w"], "F32") == "non-finite values in ['w']"


def test_row_pieces_must_tile_the_tensor_in_order() -> None:
    t = values(1, shape=(4, 2))[0]
    with pytest.raises(ConfigError, match="does not continue a F32\\[4, 2\\] tensor at row 1"):
        RowPieces("F32", (4, 2), ((0, rows_of(t, 0, 1).tensor), (2, rows_of(t, 2, 4).tensor)))
    with pytest.raises(ConfigError, match="pieces hold 3 rows of a tensor of 4"):
        RowPieces("F32", (4, 2), ((0, rows_of(t, 0, 3).tensor),))
    with pytest.raises(ConfigError, match="in an F32 RowPieces as a `Quantized`"):
        RowPieces("F8_E4M3", (4, 2), ())


def contributions(deltas: Sequence[DeltaTensor]) -> list[Contribution]:
    return [Contribution(f"l{i}", 8, 4, 40 + 30 * i, False, {"w": d})
            for i, d in enumerate(deltas)]


def close(merge: Any, deltas: Sequence[DeltaTensor]) -> list[bytes]:
    cfg = DiLoCo(4, 1, in_flight=1, merge=merge)
    schema = Schema((ParameterSpec("w", "F32", SHAPE),))
    theta = TensorBytes.from_numpy(np.ones(SHAPE, np.float32))
    res = cfg.aggregator(NumpyBackend(threads=2)).close_round(
        cfg.initial_state(0, {"w": theta}), contributions(deltas), schema)
    assert res.step is not None
    return [res.step["w"].data, res.state.theta["w"].data, res.state.momentum["w"].data,
            repr(res.mean_cosine).encode()]


@pytest.mark.parametrize("merge", [WeightedMean(), Rda(direct_pattern=None)])
def test_a_round_of_pieces_closes_to_the_bytes_of_the_round_whole(merge: Any) -> None:
    whole = values(3)
    parted = [cut(t, rows) for t, rows in zip(whole, CUTS, strict=True)]
    assert close(merge, parted) == close(merge, whole)
    assert delta_norms(contributions(parted)) == delta_norms(contributions(whole))


def peak(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("merge", [WeightedMean(), Rda(direct_pattern=None)])
def test_merging_pieces_costs_no_tensor_per_contribution(merge: Any) -> None:
    """The closer's extra memory for contributions of parts is a few chunks, where
    joining them would cost a full tensor each (what `assemble` did before)."""
    whole = values(3)
    parted = [cut(t, rows) for t, rows in zip(whole, CUTS, strict=True)]
    tensor = 4 * SHAPE[0] * SHAPE[1]
    close(merge, whole)  # warm the backend's pool and threads alike for both
    base = peak(lambda: close(merge, whole))
    windowed = peak(lambda: close(merge, parted))
    assert windowed - base < tensor // 8, (windowed, base, tensor)
    joined = peak(lambda: close(merge, [t.joined() if isinstance(t, RowPieces) else t
                                        for t in parted]))
    # The two parted contributions joined (give or take the baseline's own jitter).
    assert joined - base > 2 * tensor - tensor // 8, (joined, base, tensor)


@pytest.mark.parametrize("fmt", ["F32", "BF16", "F8_E4M3", "F4"])
def test_parts_are_merged_from_their_pieces_to_the_bytes_of_assembled_parts(
        fmt: str) -> None:
    """`pieces_of` (what the closer merges now) against `assemble` (the joined tensors
    the closer merged before), for raw and quantized parts of every cut."""
    whole = values(3)
    schema = Schema((ParameterSpec("w", "F32", SHAPE),))
    joined, pieces = [], []
    for t, rows in zip(whole, CUTS, strict=True):
        parts = []
        for k, (a, b) in enumerate(itertools.pairwise(rows)):
            piece = rows_of(t, a, b).tensor
            if fmt == "BF16":
                entries = {"w": NumpyBackend().load(piece).to_bytes("BF16")}
            else:
                entries = {"w": piece} if fmt == "F32" else quantize("w", piece, fmt)
            parts.append((f"part-{k}", entries, {"w": (a, b)}))
        joined.append(assemble(parts, schema, ["w"], fmt)["w"])
        pieces.append(pieces_of(parts, schema, ["w"], fmt)["w"])
    quantized = fmt in ("F8_E4M3", "F4")
    # A quantized part is never decoded whole, even one holding a tensor alone.
    assert [type(p) for p in pieces] == [RowPieces, RowPieces,
                                         RowPieces if quantized else TensorBytes]
    if quantized:
        assert all(isinstance(q, Quantized) for p in pieces for _, q in p.pieces)
    for merge in (WeightedMean(), Rda(direct_pattern=None)):
        assert close(merge, pieces) == close(merge, joined)


def test_the_torch_backend_joins_pieces_to_the_bytes_of_the_tensor_whole() -> None:
    torch_backend = pytest.importorskip("gradientmail.backends.torch_backend")
    be = torch_backend.TorchBackend()
    whole = values(3, shape=(300, 100))
    parted = [cut(t, rows) for t, rows in zip(whole, [[0, 140, 300], [0, 1, 1, 299, 300],
                                                     [0, 300]], strict=True)]
    a = [be.load(t) for t in whole]
    b = [be.load(t) for t in parted]
    assert be.gram(b) == be.gram(a)
    assert be.lincomb(b, [0.5, 0.25, -1.0]).to_bytes("F32") == \
        be.lincomb(a, [0.5, 0.25, -1.0]).to_bytes("F32")
