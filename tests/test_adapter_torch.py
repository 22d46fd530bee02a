"""TorchAdapter: schema from the module, in-place apply, byte-exact conversions.

Tests taking `device` run on CPU and, where there is one, on a CUDA device; their
expected values are computed on the host, so a GPU's result must match the CPU's bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradientmail.adapters import TorchAdapter
from gradientmail.adapters.torch import from_torch, to_torch
from gradientmail.errors import ConfigError, SchemaMismatch
from gradientmail.wire.quantization import FORMATS, quantize
from gradientmail.wire.serialization import ParameterSpec
from gradientmail.wire.tensor_bytes import TensorBytes


def model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)  # built on the host, then moved: the same values on every device
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4)).to(device)


def host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


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


def test_apply_writes_in_place_and_keeps_parameter_objects(device: str) -> None:
    m = model(device)
    a = TorchAdapter(m)
    before = a.parameter("0.weight")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    new = np.arange(12, dtype=np.float32).reshape(4, 3)
    a.apply({"0.weight": TensorBytes.from_numpy(new)})
    assert a.parameter("0.weight") is before
    assert opt.param_groups[0]["params"][0] is before
    assert before.device.type == device
    assert np.array_equal(host(before).numpy(), new)
    assert a.read(["0.weight"])["0.weight"] == TensorBytes.from_numpy(new)


def test_apply_with_mixing(device: str) -> None:
    m = model(device)
    a = TorchAdapter(m)
    local = host(a.parameter("0.bias")).clone()
    commit = torch.ones(4)
    a.apply({"0.bias": commit.to(device)}, mixing=0.25)
    assert torch.allclose(host(a.parameter("0.bias")), 0.25 * local + 0.75 * commit)


def test_snapshot_is_a_detached_copy(device: str) -> None:
    m = model(device)
    a = TorchAdapter(m)
    snap = a.snapshot(["0.bias"])
    with torch.no_grad():
        a.parameter("0.bias").add_(1.0)
    assert snap["0.bias"].device == a.parameter("0.bias").device  # no host round trip
    assert not torch.equal(snap["0.bias"], a.parameter("0.bias"))
    assert not snap["0.bias"].requires_grad


def test_bytes_roundtrip_is_exact_for_every_storage_dtype(device: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 7)
    on = x.to(device)
    for dtype in ("F32", "F16", "BF16"):
        tb = from_torch(on, dtype)
        assert tb == from_torch(x, dtype)  # the device casts to the host's bytes
        back = to_torch(tb, device)
        assert back.device.type == device
        assert from_torch(back) == tb
    bf = from_torch(on, "BF16")
    ref = x.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    assert bf.data == ref
    assert to_torch(TensorBytes("F32", (0, 3), b""), device).shape == (0, 3)


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


def test_rebase_moves_the_local_progress_onto_the_commit_in_place(device: str) -> None:
    m = model(device)
    m[1].to(torch.bfloat16)
    a = TorchAdapter(m)
    names = ["0.weight", "1.bias"]
    base = a.snapshot(names)
    with torch.no_grad():
        a.parameter("0.weight").add_(0.5)
        a.parameter("1.bias").sub_(0.25)
    local = a.snapshot(names)
    objects = [a.parameter(n) for n in names]
    commit_w = torch.full((4, 3), 2.0)
    commit_b = TensorBytes.from_numpy(np.full(4, -1.0, np.float32))
    # A commit on the parameters' device (what `load` returns) and one on the host.
    a.rebase({"0.weight": commit_w.to(device), "1.bias": to_torch(commit_b)
              .to(torch.bfloat16)}, base)
    assert [a.parameter(n) for n in names] == objects
    want_w = commit_w + (host(local["0.weight"]) - host(base["0.weight"]))
    assert torch.equal(host(a.parameter("0.weight")), want_w)
    want_b = (-1.0 + (host(local["1.bias"]).float() - host(base["1.bias"]).float())).to(
        torch.bfloat16)
    assert a.parameter("1.bias").dtype == torch.bfloat16
    assert torch.equal(host(a.parameter("1.bias")), want_b)
    # Host bytes are accepted as the commit, like apply's
    a.rebase({"1.bias": commit_b}, {"1.bias": a.snapshot(["1.bias"])["1.bias"]})
    assert torch.equal(host(a.parameter("1.bias")), torch.full((4,), -1.0, dtype=torch.bfloat16))


def test_rebase_with_nothing_trained_since_the_base_is_the_commit(device: str) -> None:
    a = TorchAdapter(model(device))
    base = a.snapshot(["0.weight"])
    commit = torch.randn(4, 3)
    a.rebase({"0.weight": commit.to(device)}, base)
    assert torch.equal(host(a.parameter("0.weight")), commit)


def test_rebase_errors_name_the_parameter() -> None:
    a = TorchAdapter(model())
    with pytest.raises(SchemaMismatch, match=r"cannot rebase: '0.bias' has shape \[3\]"):
        a.rebase({"0.bias": torch.zeros(3)}, {"0.bias": torch.zeros(3)})
    with pytest.raises(SchemaMismatch, match=r"cannot rebase: no base for \['0.bias'\]"):
        a.rebase({"0.bias": torch.zeros(4)}, {})


def test_embedding_parameters_are_named_by_their_module_type_not_their_name() -> None:
    """GPT-2's token and position tables (`wte`, `wpe`) hold no "embed" in their names:
    the adapter names them from their modules, so RDA averages them by weight (the learner
    puts them in its merge's `direct_names`). A weight tied to an embedding (GPT-2's
    `lm_head`) is one parameter, named once."""
    from gradientmail.algorithms.diloco import DiLoCo
    from gradientmail.algorithms.merge import Rda
    from gradientmail.integration.textdata import tiny_gpt2

    gpt2 = tiny_gpt2(64, n_layer=1, n_embd=16, n_head=2, n_positions=8, seed=0)
    adapter = TorchAdapter(gpt2)
    assert adapter.direct_names == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert not any("embed" in n for n in adapter.direct_names)
    alg = DiLoCo(sync_every=4, fragments=2).with_direct_names(adapter.direct_names)
    assert isinstance(alg.merge, Rda)
    assert [n for n in adapter.schema.names if alg.merge.is_direct(n)] == [
        "transformer.wte.weight", "transformer.wpe.weight"]
    # other module types on request; none at all for a model without embeddings
    lin = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.LayerNorm(3))
    assert TorchAdapter(lin, direct_modules=(torch.nn.LayerNorm,)).direct_names == {
        "1.weight", "1.bias"}
    assert TorchAdapter(model()).direct_names == frozenset()


@pytest.mark.parametrize("fmt", FORMATS)
def test_delta_quantized_is_quantize_of_the_delta(device: str, fmt: str) -> None:
    m = model(device)
    m[1].to(torch.bfloat16)
    a = TorchAdapter(m)
    anchor = a.snapshot(a.schema.names)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.5).add_(0.01)
    snap = a.snapshot(a.schema.names)
    want: dict[str, TensorBytes] = {}
    for name, t in a.delta(anchor, snap).items():
        want |= quantize(name, t, fmt)
    got = a.delta_quantized(anchor, snap, fmt)
    assert got == want
    assert list(got) == list(want)
