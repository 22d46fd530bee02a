"""Zero-copy data paths: what is promised to share memory does, and nothing that shares
memory can be written through, so no caller can corrupt a payload or a state."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest
import torch

from gradientmail.adapters import TorchAdapter
from gradientmail.adapters.torch import from_torch, to_torch
from gradientmail.algorithms import Contribution
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.backends import NumpyBackend, TorchBackend
from gradientmail.backends.pool import MIN_POOLED_BYTES, BufferPool
from gradientmail.errors import ConfigError
from gradientmail.wire.compression import decode, encode
from gradientmail.wire.serialization import ParameterSpec, Schema, pack, unpack
from gradientmail.wire.tensor_bytes import TensorBytes

# Large enough that the backends take their outputs from the pool.
BIG = (512, 1024)


def randn(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def payload_array(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, np.uint8)


# -- TensorBytes -------------------------------------------------------------------------


def test_tensorbytes_takes_read_only_buffers_without_copying() -> None:
    raw = randn((3, 4), 0).tobytes()
    view = TensorBytes("F32", (3, 4), memoryview(raw)[:])
    assert view.is_view and np.shares_memory(view.to_numpy(), payload_array(raw))
    frozen = randn((3, 4), 1)
    frozen.flags.writeable = False
    held = TensorBytes("F32", (3, 4), frozen)
    assert np.shares_memory(held.to_numpy(), frozen)
    assert held.data == frozen.tobytes() and isinstance(held.data, bytes)


@pytest.mark.parametrize(
    "writable",
    [bytearray(48), memoryview(bytearray(48)), np.zeros((3, 4), np.float32)],
    ids=["bytearray", "memoryview", "ndarray"],
)
def test_tensorbytes_refuses_writable_buffers(writable: object) -> None:
    with pytest.raises(ConfigError, match="must be bytes"):
        TensorBytes("F32", (3, 4), writable)


def test_views_equal_hash_and_pickle_like_bytes() -> None:
    raw = randn((5,), 2).tobytes()
    a = TensorBytes("F32", (5,), raw)
    b = TensorBytes("F32", (5,), memoryview(raw))
    c = TensorBytes("F32", (5,), memoryview(randn((5,), 3).tobytes()))
    assert a == b and hash(a) == hash(b) and a != c
    assert TensorBytes("F16", (10,), raw) != a  # same bytes, other dtype
    again = pickle.loads(pickle.dumps(b))
    assert again == a and not again.is_view
    assert len({a, b}) == 1


def test_to_numpy_is_a_read_only_view() -> None:
    t = TensorBytes.from_numpy(randn((4,), 4))
    out = t.to_numpy()
    assert not out.flags.writeable
    with pytest.raises(ValueError):
        out[0] = 1.0
    with pytest.raises(ValueError):
        out.flags.writeable = True
    with pytest.raises(TypeError):
        memoryview(t.buffer)[0] = 1  # type: ignore[index]


def test_from_numpy_copies_writable_arrays_and_shares_immutable_ones() -> None:
    a = randn((6,), 5)
    t = TensorBytes.from_numpy(a)
    a[:] = 0.0  # the caller goes on writing its array
    assert t.to_numpy()[0] != 0.0
    again = TensorBytes.from_numpy(t.to_numpy())  # a view of bytes: provably immutable
    assert np.shares_memory(again.to_numpy(), t.to_numpy())


def test_from_numpy_copy_false_hands_the_array_over() -> None:
    a = randn((6,), 6)
    t = TensorBytes.from_numpy(a, copy=False)
    assert np.shares_memory(t.to_numpy(), a)
    with pytest.raises(ValueError):
        a[0] = 1.0  # handed over: the array is read-only now
    with pytest.raises(ConfigError, match="C-contiguous"):
        TensorBytes.from_numpy(randn((4, 4), 7)[:, ::2], copy=False)


# -- payloads ----------------------------------------------------------------------------


def tensors() -> dict[str, TensorBytes]:
    return {
        "w": TensorBytes.from_numpy(randn((8, 8), 8)),
        "b": TensorBytes.from_numpy(randn((8,), 9).astype(np.float16)),
    }


def test_unpack_returns_read_only_views_into_the_one_payload() -> None:
    blob = pack(tensors())
    out = unpack(blob)
    assert out == tensors()
    for t in out.values():
        arr = t.to_numpy()
        assert np.shares_memory(arr, payload_array(blob)) and not arr.flags.writeable


def test_unpack_of_a_writable_blob_copies_it_once() -> None:
    blob = bytearray(pack(tensors()))
    out = unpack(blob)  # type: ignore[arg-type]
    owner = np.frombuffer(blob, np.uint8)
    assert not any(np.shares_memory(t.to_numpy(), owner) for t in out.values())
    del owner
    blob[:] = bytes(len(blob))  # the owner overwrites its buffer afterwards
    assert out == tensors()


def test_decode_off_views_the_payload_and_zstd_owns_its_tensors() -> None:
    pytest.importorskip("zstandard")
    blob = encode(tensors(), "off")
    for t in decode(blob, "off").values():
        assert np.shares_memory(t.to_numpy(), payload_array(blob))
    for t in decode(encode(tensors(), "zstd"), "zstd").values():
        assert not t.to_numpy().flags.writeable


# -- backends ----------------------------------------------------------------------------


def round_inputs(m: int = 2) -> tuple[Schema, DiLoCo, dict[str, TensorBytes], list[Contribution]]:
    schema = Schema((ParameterSpec("w", "F32", BIG),))
    theta = {"w": TensorBytes.from_numpy(randn(BIG, 10))}
    cs = [
        Contribution(f"l{i}", 10, 10, 100 + i, False,
                     {"w": TensorBytes.from_numpy(randn(BIG, 11 + i, 1e-2))})
        for i in range(m)
    ]
    return schema, DiLoCo(sync_every=10, fragments=1, in_flight=1), theta, cs


@pytest.mark.parametrize("make", [NumpyBackend, TorchBackend], ids=["numpy", "torch"])
def test_loaded_f32_and_results_go_to_bytes_without_a_copy(make: type) -> None:
    be = make()
    src = TensorBytes.from_numpy(randn(BIG, 12))
    back = be.load(src).to_bytes("F32")
    assert np.shares_memory(back.to_numpy(), src.to_numpy())
    th, _ = be.outer_step(be.load(src), be.zeros(BIG), [be.load(src)], [1.0], 0.7, 0.9)
    a, b = th.to_bytes("F32").to_numpy(), th.to_bytes("F32").to_numpy()
    assert np.shares_memory(a, b) and not a.flags.writeable
    with pytest.raises(ValueError):
        a[0, 0] = 1.0


def test_numpy_value_of_a_callers_array_is_copied_by_to_bytes() -> None:
    from gradientmail.backends.numpy_backend import NumpyValue

    a = randn((4,), 13)
    t = NumpyValue(a).to_bytes("F32")
    a[:] = 0.0
    assert t.to_numpy()[0] != 0.0


@pytest.mark.parametrize("make", [NumpyBackend, TorchBackend], ids=["numpy", "torch"])
def test_a_dropped_state_is_reused_and_a_held_one_never_is(make: type) -> None:
    schema, cfg, theta, cs = round_inputs()
    agg = cfg.aggregator(make())
    state = cfg.initial_state(0, theta)
    first = agg.close_round(state, cs, schema)
    # Hold only a numpy view of theta (and a torch tensor of the momentum): their memory
    # must never be handed out again while they live.
    held = first.state.theta["w"].to_numpy()
    held_copy = held.copy()
    held_t = torch.frombuffer(first.state.momentum["w"].buffer, dtype=torch.float32)
    held_t_copy = held_t.clone()
    address = held.__array_interface__["data"][0]
    del first
    gc.collect()
    for _ in range(3):
        res = agg.close_round(state, cs, schema)
        out = res.state.theta["w"].to_numpy()
        assert not np.shares_memory(out, held)
        assert np.array_equal(held, held_copy) and torch.equal(held_t, held_t_copy)
        del res, out
    # Once dropped, its memory is taken again (what saves the page faults).
    del held, held_t
    gc.collect()
    again = agg.close_round(state, cs, schema)
    outputs = [again.state.theta["w"], again.state.momentum["w"]]
    if again.step is not None:  # a replicated outer step: the merged Δ is an output too
        outputs.append(again.step["w"])
    addresses = {t.to_numpy().__array_interface__["data"][0] for t in outputs}
    assert address in addresses


def test_pool_limits() -> None:
    pool = BufferPool(limit=4 * MIN_POOLED_BYTES)
    small = pool.empty(16)
    assert pool.nbytes == 0 and small.size == 16
    size = MIN_POOLED_BYTES // 4
    kept = [pool.empty(size) for _ in range(5)]  # the fifth is past the limit: plain
    assert pool.nbytes == 4 * MIN_POOLED_BYTES
    assert all(not np.shares_memory(x, y) for i, x in enumerate(kept) for y in kept[i + 1 :])
    del kept
    reused = pool.empty(size)
    assert pool.nbytes == 4 * MIN_POOLED_BYTES and reused.size == size
    with pytest.raises(ConfigError):
        BufferPool(limit=-1)
    off = BufferPool(limit=0)
    off.empty(size)
    assert off.nbytes == 0


# -- the torch adapter -------------------------------------------------------------------


# Each runs on CPU and, where there is one, on a CUDA device (the `device` fixture); the
# expected values are computed on the host, so a GPU's bytes must equal the CPU's.


def test_from_torch_copies_a_live_tensor_once_and_shares_converted_ones(device: str) -> None:
    p = torch.randn(64, 64).to(device)
    t = from_torch(p)
    p.zero_()  # the parameter trains on
    assert t.to_numpy().any() and not t.to_numpy().flags.writeable
    q = torch.randn(64, 64, dtype=torch.float64)
    u = from_torch(q.to(device), "F32")
    assert np.array_equal(u.to_numpy(), q.to(torch.float32).numpy())


def test_to_torch_and_load_never_alias_the_payload(device: str) -> None:
    blob = pack({"w": TensorBytes.from_numpy(randn((4, 3), 14))})
    w = unpack(blob)["w"]
    out = to_torch(w, device)
    out.zero_()  # a writable tensor of its own
    assert unpack(blob)["w"] == w and w.to_numpy().any()
    m = torch.nn.Linear(3, 4, bias=False).to(device)
    a = TorchAdapter(m)
    loaded = a.load({"weight": w})["weight"]
    assert loaded.device == m.weight.device and from_torch(loaded) == w
    loaded.add_(1.0)
    assert w == unpack(blob)["w"]
    a.apply({"weight": w})
    with torch.no_grad():
        m.weight.mul_(2.0)
    assert w == unpack(blob)["w"]
    assert torch.equal(m.weight.detach().cpu(), torch.from_numpy(w.to_numpy().copy()) * 2.0)


def test_delta_is_host_memory_of_its_own(device: str) -> None:
    m = torch.nn.Linear(3, 4, bias=False).to(device)
    a = TorchAdapter(m)
    anchor = a.snapshot(["weight"])
    with torch.no_grad():
        m.weight.add_(0.5)
    now = a.snapshot(["weight"])
    d = a.delta(anchor, now)["weight"]
    assert np.allclose(d.to_numpy(), -0.5) and not d.to_numpy().flags.writeable
    assert d == from_torch(anchor["weight"].cpu() - now["weight"].cpu())  # the host's bytes


def test_outer_step_knows_whether_theta_is_finite() -> None:
    from gradientmail.backends.numpy_backend import NumpyValue

    be = NumpyBackend()
    big = np.full(BIG, 3e38, np.float32)
    for delta, want in ((randn(BIG, 15), True), (-big, False)):
        th, _ = be.outer_step(be.load(TensorBytes.from_numpy(big)), be.zeros(BIG),
                              [NumpyValue(delta)], [1.0], 0.7, 0.9)
        assert be.all_finite(th) is want and th.isfinite() is want
        assert NumpyValue(th.array).isfinite() is want  # the same answer by a full scan


@pytest.mark.parametrize("m", [2, 3, 8])
def test_gram_of_long_vectors_is_exact_up_to_summation_order_and_symmetric(m: int) -> None:
    import math

    from gradientmail.backends.numpy_backend import NumpyValue

    be = NumpyBackend()
    arrays = [randn((70_001,), 20 + i) for i in range(m)]  # full chunks and a tail
    g = be.gram([NumpyValue(a) for a in arrays])
    wide = [a.astype(np.float64) for a in arrays]
    for i in range(m):
        for j in range(m):
            exact = math.fsum(wide[i] * wide[j])  # float32 products are exact in float64
            assert g[i][j] == g[j][i]
            assert g[i][j] == pytest.approx(exact, rel=1e-12, abs=1e-9)
    if m == 2:  # dot runs the same blocks as a gram of two
        assert NumpyValue(arrays[0]).dot(NumpyValue(arrays[1])) == g[0][1]
