"""The closer's windowed merge (docs/design/sharded.md §3): a contribution made of parts is merged
from its `RowPieces` where they lie, never joined, and gives the bytes of the same delta
merged whole.

The numpy backend's Gram sums in fixed `BLOCK` windows of the logical tensor, so cuts are
placed inside blocks and inside chunks, where a window straddles two pieces; the merge's
extra memory is measured against the merge of deltas already whole.
"""

from __future__ import annotations

import itertools
import math
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from gradientmail.algorithms.base import Contribution
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Rda, WeightedMean
from gradientmail.backends.numpy_backend import BLOCK, NumpyBackend, NumpyRows
from gradientmail.errors import ConfigError, CorruptPayload
from gradientmail.syncer.screening import delta_norms, screen_delta
from gradientmail.wire.quantization import Quantized, dequantize, dequantizing, quantize
from gradientmail.wire.serialization import ParameterSpec, Schema
from gradientmail.wire.sharded_parts import assemble, pieces_of
from gradientmail.wire.sharded_pieces import DeltaTensor, RowPieces
from gradientmail.wire.sharded_ranges import rows_of
from gradientmail.wire.tensor_bytes import TensorBytes

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


def parted_as(fmt: str, t: TensorBytes, rows: Sequence[int]) -> DeltaTensor:
    """`t` cut at `rows` as the closer reads it: stored pieces, or quantized parts."""
    if fmt in ("F32", "BF16"):
        return cut(t if fmt == "F32" else NumpyBackend().load(t).to_bytes("BF16"), rows)
    parts = [(f"part-{k}", quantize("w", rows_of(t, a, b).tensor, fmt), {"w": (a, b)})
             for k, (a, b) in enumerate(itertools.pairwise(rows))]
    return pieces_of(parts, Schema((ParameterSpec("w", "F32", t.shape),)), ["w"], fmt)["w"]


@pytest.mark.parametrize("fmt", ["F32", "BF16", "F4"])
def test_the_torch_backend_reads_pieces_where_they_lie_to_the_bytes_of_the_tensor_whole(
        fmt: str) -> None:
    """On the CPU the torch backend reads `RowPieces` a `CPU_CHUNK` window at a time
    (cuts on either side of its 2^20-element boundary, windows across pieces): the same
    Gram, `lincomb`, outer step and round bytes as the same tensors joined."""
    torch_backend = pytest.importorskip("gradientmail.backends.torch_backend")
    be = torch_backend.TorchBackend()
    assert SHAPE[0] * SHAPE[1] > torch_backend.CPU_CHUNK
    parted = [parted_as(fmt, t, rows) for t, rows in zip(values(3), CUTS, strict=True)]
    whole = [t.joined() if isinstance(t, RowPieces) else t for t in parted]
    a = [be.load(t) for t in whole]
    b = [be.load(t) for t in parted]
    assert [type(v).__name__ for v in b] == \
        ["TorchRows", "TorchRows", "TorchRows" if fmt == "F4" else "TorchValue"]
    assert be.gram(b) == be.gram(a)
    coeffs = [0.5, 0.25, -1.0]
    assert be.lincomb(b, coeffs).to_bytes("F32") == be.lincomb(a, coeffs).to_bytes("F32")
    theta, mom = be.load(values(1)[0]), be.zeros(SHAPE)
    assert [v.to_bytes("F32") for v in be.outer_step(theta, mom, b, coeffs, 0.7, 0.9)] == \
        [v.to_bytes("F32") for v in be.outer_step(theta, mom, a, coeffs, 0.7, 0.9)]
    assert b[1].dot(b[0]) == a[1].dot(a[0]) and b[1].norm() == a[1].norm()
    assert be.all_finite(b[1]) and b[1].isfinite()
    assert (b[0] * 0.5 + b[1]).to_bytes("F32") == (a[0] * 0.5 + a[1]).to_bytes("F32")
    assert (a[0] - b[1]).to_bytes("F32") == (a[0] - a[1]).to_bytes("F32")
    for merge in (WeightedMean(), Rda(direct_pattern=None)):
        cfg = DiLoCo(4, 1, in_flight=1, merge=merge)
        schema = Schema((ParameterSpec("w", "F32", SHAPE),))
        state = cfg.initial_state(0, {"w": values(1)[0]})
        res = [cfg.aggregator(be).close_round(state, contributions(d), schema)
               for d in (parted, whole)]
        assert res[0].state.theta == res[1].state.theta
        assert res[0].state.momentum == res[1].state.momentum


def test_the_torch_backend_finds_a_non_finite_value_in_a_piece() -> None:
    torch_backend = pytest.importorskip("gradientmail.backends.torch_backend")
    a = np.zeros(SHAPE, np.float32)
    a[1200, 3] = np.nan  # in the last CPU_CHUNK window, in the last piece
    rows = torch_backend.TorchBackend().load(cut(TensorBytes.from_numpy(a), CUTS[1]))
    assert not rows.isfinite() and not torch_backend.TorchBackend().all_finite(rows)
    assert math.isnan(rows.norm())


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["F32", "BF16", "F4"])
def test_on_a_gpu_pieces_are_copied_to_the_device_to_the_bytes_of_the_tensor_whole(
        fmt: str) -> None:
    """On an accelerator the helpers read whole device tensors: pieces are copied onto
    the device window by window, to the values (and merged bytes) of the tensor joined."""
    torch_backend = pytest.importorskip("gradientmail.backends.torch_backend")
    be = torch_backend.TorchBackend("cuda")
    parted = [parted_as(fmt, t, rows) for t, rows in zip(values(3), CUTS, strict=True)]
    whole = [t.joined() if isinstance(t, RowPieces) else t for t in parted]
    a = [be.load(t) for t in whole]
    b = [be.load(t) for t in parted]
    assert all(isinstance(v, torch_backend.TorchValue) and v.tensor.is_cuda for v in b)
    assert [v.to_bytes("F32") for v in b] == [v.to_bytes("F32") for v in a]
    assert be.gram(b) == be.gram(a)
    coeffs = [0.5, 0.25, -1.0]
    assert be.lincomb(b, coeffs).to_bytes("F32") == be.lincomb(a, coeffs).to_bytes("F32")


@pytest.mark.parametrize("fmt", ["F32", "F4"])
def test_the_torch_backend_merges_pieces_without_a_tensor_per_contribution(
        fmt: str) -> None:
    """Measured with tests/workers/alloc_meter.py (torch storages and tracemalloc): a
    merge of pieces costs the merge of the same tensors whole plus a window or two, where
    joining them (what `load` did before) costs a tensor per contribution of pieces."""
    torch_backend = pytest.importorskip("gradientmail.backends.torch_backend")
    from workers.alloc_meter import AllocationMeter

    be = torch_backend.TorchBackend()
    parted = [parted_as(fmt, t, rows) for t, rows in zip(values(3), CUTS, strict=True)]
    whole = [t.joined() if isinstance(t, RowPieces) else t for t in parted]
    tensor = 4 * SHAPE[0] * SHAPE[1]

    def merge(deltas: Callable[[], Sequence[DeltaTensor]]) -> int:
        with AllocationMeter() as meter:
            values_ = [be.load(d) for d in deltas()]
            be.gram(values_)
            be.lincomb(values_, [0.5, 0.25, -1.0])
        return meter.peak

    merge(lambda: whole)  # the pool and the meter's own first allocations
    base, windowed = merge(lambda: whole), merge(lambda: parted)
    joined = merge(lambda: [t.joined() if isinstance(t, RowPieces) else t for t in parted])
    print(f"torch {fmt}: tensor {tensor}, merge of whole deltas {base}, "
          f"pieces {windowed - base:+}, joined {joined - base:+}")
    # One CPU_CHUNK window (4 MiB in F32) alive at a time, and its decoding's temporaries.
    assert windowed - base <= 4 * torch_backend.CPU_CHUNK + (1 << 19), (windowed, base)
    pieced = sum(isinstance(t, RowPieces) for t in parted)
    assert joined - base >= pieced * tensor - (1 << 18), (joined, base)


#: A tensor of odd rows (999 elements): part starts fall at odd elements and inside F4's
#: 32-element blocks, and the merge's windows start inside a part's blocks.
QSHAPE = (1200, 999)
#: Uneven parts: 333 and 867 rows; 1, 0, 699, 499 and 1 rows; whole.
QCUTS = [[0, 333, 1200], [0, 1, 1, 700, 1199, 1200], [0, 1200]]


def quantized_parts(t: TensorBytes, rows: Sequence[int], fmt: str) -> list[Any]:
    """`t` mailed in parts cut at `rows`, each part's rows quantized on their own."""
    return [(f"part-{k}", quantize("w", rows_of(t, a, b).tensor, fmt), {"w": (a, b)})
            for k, (a, b) in enumerate(itertools.pairwise(rows))]


def dequantized_whole(parts: Sequence[Any], fmt: str) -> TensorBytes:
    """What the closer merged before: each part dequantized whole, the rows joined."""
    rows = [dequantize(entries, "w", fmt).to_numpy().reshape(-1) for _, entries, _ in parts]
    return TensorBytes("F32", QSHAPE, np.concatenate(rows).tobytes())


def read_by_closer(parts: Sequence[Any], fmt: str) -> DeltaTensor:
    """What the closer merges now: `pieces_of`, then the screening."""
    schema = Schema((ParameterSpec("w", "F32", QSHAPE),))
    screened = screen_delta(pieces_of(parts, schema, ["w"], fmt), ["w"], fmt)
    assert isinstance(screened, dict)
    return screened["w"]


def close_q(merge: Any, deltas: Sequence[DeltaTensor]) -> list[bytes]:
    cfg = DiLoCo(4, 1, in_flight=1, merge=merge)
    schema = Schema((ParameterSpec("w", "F32", QSHAPE),))
    theta = TensorBytes.from_numpy(np.ones(QSHAPE, np.float32))
    res = cfg.aggregator(NumpyBackend(threads=2)).close_round(
        cfg.initial_state(0, {"w": theta}), contributions(deltas), schema)
    assert res.step is not None
    return [res.step["w"].data, res.state.theta["w"].data, res.state.momentum["w"].data,
            repr(res.mean_cosine).encode()]


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F4"])
def test_a_window_of_a_quantized_tensor_is_those_elements_dequantized(fmt: str) -> None:
    t = values(1, shape=(37, 29))[0]  # 1,073 elements: 34 F4 blocks, the last short
    entries = quantize("w", t, fmt)
    whole = dequantize(entries, "w", fmt).to_numpy().reshape(-1)
    q = dequantizing(entries, "w", fmt)
    assert q.numel == whole.size and q.nbytes < whole.nbytes // 3
    for a, b in [(0, 0), (0, 1073), (1, 2), (31, 33), (33, 97), (64, 96), (1000, 1073),
                 (517, 518)]:
        assert q.read(a, b).tobytes() == whole[a:b].tobytes(), (a, b)
    out = np.full(10, np.nan, np.float32)
    assert q.read(95, 105, out=out) is out and out.tobytes() == whole[95:105].tobytes()
    with pytest.raises(ConfigError, match="window \\[5, 1074\\) is not within 1073"):
        q.read(5, 1074)


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F4"])
def test_dequantizing_refuses_what_dequantize_refuses_in_its_words(fmt: str) -> None:
    entries = quantize("w", values(1, shape=(64, 3))[0], fmt)
    codes, scale = bytearray(entries["w"].data), bytearray(entries["w.scale"].data)
    if fmt == "F8_E4M3":
        codes[150] = 0x7F  # NaN
    else:
        codes[75] = 0x77  # elements 150 and 151: 6 ...
        scale[150 // 32] = 0xFE  # ... times 2^127, past float32's range
    bad = {"w": TensorBytes(fmt, (64, 3), bytes(codes)),
           "w.scale": TensorBytes(entries["w.scale"].dtype, entries["w.scale"].shape,
                                  bytes(scale))}
    words = ["decode to NaN or past float32's range", "'w.scale' is missing"]
    for broken, said in zip((bad, {"w": entries["w"]}), words, strict=True):
        with pytest.raises(CorruptPayload, match=said) as whole:
            dequantize(broken, "w", fmt, key="part-1")
        with pytest.raises(CorruptPayload) as windowed:
            dequantizing(broken, "w", fmt, key="part-1")
        assert str(windowed.value) == str(whole.value)
    # So a closer drops a part contribution for the reason it gave when it dequantized.
    good = quantize("w", values(2, shape=(64, 3))[1], fmt)
    parts = [("part-0", good, {"w": (0, 64)}), ("part-1", bad, {"w": (64, 128)})]
    with pytest.raises(CorruptPayload, match=f"^part-1: tensor 'w': {fmt} codes decode"):
        pieces_of(parts, Schema((ParameterSpec("w", "F32", (128, 3)),)), ["w"], fmt)


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F4"])
def test_quantized_parts_merge_to_the_bytes_of_dequantizing_each_part_whole(
        fmt: str) -> None:
    """Cut unevenly, part starts inside F4 blocks and at odd elements: the closer's
    windowed reading merges, in both merges, to the bytes of the old path (each part
    dequantized whole, the rows joined), and so does a whole quantized payload."""
    whole = values(3, shape=QSHAPE)
    assert QSHAPE[0] * QSHAPE[1] > BLOCK  # two Gram blocks, many windows per part
    parts = [quantized_parts(t, rows, fmt) for t, rows in zip(whole, QCUTS, strict=True)]
    before = [dequantized_whole(p, fmt) for p in parts]
    now = [read_by_closer(p, fmt) for p in parts]
    assert all(isinstance(d, RowPieces) for d in now)
    assert [len(d.pieces) for d in now if isinstance(d, RowPieces)] == [2, 4, 1]
    payload = screen_delta(quantize("w", whole[2], fmt), ["w"], fmt)  # one learner, whole
    assert isinstance(payload, dict)
    for merge in (WeightedMean(), Rda(direct_pattern=None)):
        expected = close_q(merge, before)
        assert close_q(merge, now) == expected
        assert close_q(merge, [*now[:2], payload["w"]]) == expected
    assert delta_norms(contributions(now)) == delta_norms(contributions(before))
    be = NumpyBackend()
    assert [be.load(d).to_bytes("F32") for d in now] == before


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F4"])
@pytest.mark.parametrize("merge", [WeightedMean(), Rda(direct_pattern=None)])
def test_merging_quantized_parts_costs_windows_not_a_tensor(fmt: str, merge: Any) -> None:
    """Reading, screening and merging three quantized contributions of parts costs the
    merge of the same deltas already whole in F32 plus a few windows; the old path (each
    part dequantized whole) held an F32 tensor per contribution."""
    whole = values(3, shape=QSHAPE)
    parts = [quantized_parts(t, rows, fmt) for t, rows in zip(whole, QCUTS, strict=True)]
    before = [dequantized_whole(p, fmt) for p in parts]
    tensor = 4 * QSHAPE[0] * QSHAPE[1]
    close_q(merge, before)  # warm the backend's pool and threads alike for both
    # Read and screened alone: every value decoded and checked, a window at a time.
    read = peak(lambda: [read_by_closer(p, fmt) for p in parts])
    base = peak(lambda: close_q(merge, before))
    windowed = peak(lambda: close_q(merge, [read_by_closer(p, fmt) for p in parts]))
    old = peak(lambda: close_q(merge, [dequantized_whole(p, fmt) for p in parts]))
    print(f"{fmt} {type(merge).__name__}: tensor {tensor}, read {read}, merge of F32 "
          f"deltas {base}, windowed {windowed - base:+}, dequantized whole {old - base:+}")
    assert read < 1 << 19, read  # a 64 Ki window in F32 (256 KiB) and its temporaries
    assert windowed - base < tensor // 8, (windowed, base, tensor)
    assert old - base > 3 * tensor - tensor // 8, (old, base, tensor)
