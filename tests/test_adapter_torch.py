"""TorchAdapter: schema from the module, in-place apply, byte-exact conversions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradientmail.adapters import TorchAdapter
from gradientmail.adapters.torch import from_torch, to_torch
from gradientmail.errors import ConfigError, SchemaMismatch
from gradientmail.serialization import ParameterSpec, TensorBytes


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))


def test_schema_from_named_parameters() -> None:
    m = model()
    m[1].to(torch.bfloat16)
    a = TorchAdapter(m)
    assert a.schema.params == (
        ParameterSpec("0.weight", "F32", (4, 3)),
        ParameterSpec("0.bias", "F32", (4,)),
        ParameterSpec("1.weight", "BF16", (4,)),
        ParameterSpec("1.bias", "BF16", (4,)),
    )


def test_apply_writes_in_place_and_keeps_parameter_objects() -> None:
    m = model()
    a = TorchAdapter(m)
    before = a.parameter("0.weight")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    new = np.arange(12, dtype=np.float32).reshape(4, 3)
    a.apply({"0.weight": TensorBytes.from_numpy(new)})
    assert a.parameter("0.weight") is before
    assert opt.param_groups[0]["params"][0] is before
    assert np.array_equal(before.detach().numpy(), new)
    assert a.read(["0.weight"])["0.weight"] == TensorBytes.from_numpy(new)


def test_apply_with_mixing() -> None:
    m = model()
    a = TorchAdapter(m)
    local = a.parameter("0.bias").detach().clone()
    commit = torch.ones(4)
    a.apply({"0.bias": commit}, mixing=0.25)
    assert torch.allclose(a.parameter("0.bias"), 0.25 * local + 0.75 * commit)


def test_snapshot_is_a_detached_copy() -> None:
    m = model()
    a = TorchAdapter(m)
    snap = a.snapshot(["0.bias"])
    with torch.no_grad():
        a.parameter("0.bias").add_(1.0)
    assert not torch.equal(snap["0.bias"], a.parameter("0.bias"))
    assert not snap["0.bias"].requires_grad


def test_bytes_roundtrip_is_exact_for_every_storage_dtype() -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 7)
    for dtype in ("F32", "F16", "BF16"):
        tb = from_torch(x, dtype)
        back = to_torch(tb)
        assert from_torch(back) == tb
    bf = from_torch(x, "BF16")
    ref = x.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    assert bf.data == ref
    assert to_torch(TensorBytes("F32", (0, 3), b"")).shape == (0, 3)


def test_errors_name_the_parameter() -> None:
    m = model()
    with pytest.raises(ConfigError, match=r"parameters \['nope'\] are not in the module"):
        TorchAdapter(m, names=["nope"])
    a = TorchAdapter(m)
    with pytest.raises(SchemaMismatch, match=r"'0.bias' has shape \[3\], the model \[4\]"):
        a.apply({"0.bias": torch.zeros(3)})
    with pytest.raises(SchemaMismatch, match="'x' is not a synced parameter"):
        a.apply({"x": torch.zeros(3)})
    with pytest.raises(ConfigError, match=r"torch dtype torch\.int64"):
        from_torch(torch.zeros(2, dtype=torch.int64))


def test_rebase_moves_the_local_progress_onto_the_commit_in_place() -> None:
    m = model()
    m[1].to(torch.bfloat16)
    a = TorchAdapter(m)
    names = ["0.weight", "1.bias"]
    base = a.snapshot(names)
    with torch.no_grad():
        a.parameter("0.weight").add_(0.5)
        a.parameter("1.bias").sub_(0.25)
    local = a.snapshot(names)
    objects = [a.parameter(n) for n in names]
    commit = {"0.weight": torch.full((4, 3), 2.0),
              "1.bias": TensorBytes.from_numpy(np.full(4, -1.0, np.float32))}
    a.rebase({"0.weight": commit["0.weight"], "1.bias": to_torch(commit["1.bias"])
              .to(torch.bfloat16)}, base)
    assert [a.parameter(n) for n in names] == objects
    want_w = commit["0.weight"] + (local["0.weight"] - base["0.weight"])
    assert torch.equal(a.parameter("0.weight"), want_w)
    want_b = (-1.0 + (local["1.bias"].float() - base["1.bias"].float())).to(torch.bfloat16)
    assert a.parameter("1.bias").dtype == torch.bfloat16
    assert torch.equal(a.parameter("1.bias"), want_b)
    # Host bytes are accepted as the commit, like apply's
    a.rebase({"1.bias": commit["1.bias"]}, {"1.bias": a.snapshot(["1.bias"])["1.bias"]})
    assert torch.equal(a.parameter("1.bias"), torch.full((4,), -1.0, dtype=torch.bfloat16))


def test_rebase_with_nothing_trained_since_the_base_is_the_commit() -> None:
    a = TorchAdapter(model())
    base = a.snapshot(["0.weight"])
    commit = torch.randn(4, 3)
    a.rebase({"0.weight": commit}, base)
    assert torch.equal(a.parameter("0.weight").detach(), commit)


def test_rebase_errors_name_the_parameter() -> None:
    a = TorchAdapter(model())
    with pytest.raises(SchemaMismatch, match=r"cannot rebase: '0.bias' has shape \[3\]"):
        a.rebase({"0.bias": torch.zeros(3)}, {"0.bias": torch.zeros(3)})
    with pytest.raises(SchemaMismatch, match=r"cannot rebase: no base for \['0.bias'\]"):
        a.rebase({"0.bias": torch.zeros(4)}, {})
