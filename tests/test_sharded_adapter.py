"""ShardedAdapter: FSDP2 shards under the full schema, against TorchAdapter on the unsharded
model, in real processes (torchrun, gloo on CPU), with the memory each call allocates.

The row arithmetic and the single-process paths are tested by direct calls; the rest by
tests/workers/sharded_worker.py, which runs a fixed script of adapter calls on every rank
and writes what they returned. `replay` runs the same script on the unsharded model with
TorchAdapter; every rank's output must be exactly its rows of that.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from workers.sharded_worker import MIXING, build, values

from gradientmail.adapters import ShardedAdapter, TorchAdapter
from gradientmail.adapters.sharded import Layout, chunk_rows, layout_of
from gradientmail.adapters.torch import to_torch
from gradientmail.errors import ConfigError, SchemaMismatch
from gradientmail.wire.serialization import Schema, unpack
from gradientmail.wire.sharded_ranges import Rows, rows_of
from gradientmail.wire.tensor_bytes import TensorBytes

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "sharded_worker.py"

# -- the row arithmetic ---------------------------------------------------------------------


def test_chunk_rows_splits_as_torch_chunk() -> None:
    for rows in range(0, 12):
        for parts in range(1, 6):
            got = [chunk_rows(rows, parts, i) for i in range(parts)]
            pieces = torch.arange(rows).chunk(parts) if rows else ()
            want = [(int(p[0]), int(p[-1]) + 1) for p in pieces if len(p)]
            assert [r for r in got if r[0] < r[1]] == want
            assert got[0][0] == 0 and got[-1][1] == rows  # they tile [0, rows)
            assert all(a[1] == b[0] for a, b in itertools.pairwise(got))
    assert [chunk_rows(1, 3, i) for i in range(3)] == [(0, 1), (1, 1), (1, 1)]
    with pytest.raises(ConfigError, match="part 3 of 3: need 0 <= index < parts"):
        chunk_rows(5, 3, 3)


def test_layout_of_fsdp_hsdp_and_replicated() -> None:
    # FSDP2 on 3 ranks, 7 rows: held = owned = torch.chunk's piece.
    assert [layout_of(7, ["S0"], [3], [i]) for i in range(3)] == [
        Layout(0, 3, 0, 3), Layout(3, 6, 3, 6), Layout(6, 7, 6, 7)
    ]
    # HSDP: 2 replicas × 2 shards. Each replica holds its shard's rows; the two replicas
    # of a shard mail half of them each.
    got = {(r, s): layout_of(9, ["R", "S0"], [2, 2], [r, s]) for r in range(2) for s in range(2)}
    assert got[0, 0] == Layout(0, 5, 0, 3) and got[1, 0] == Layout(0, 5, 3, 5)
    assert got[0, 1] == Layout(5, 9, 5, 7) and got[1, 1] == Layout(5, 9, 7, 9)
    # A plain parameter every one of 4 ranks holds: each mails a chunk.
    assert [layout_of(5, ["R"], [4], [i]).owned for i in range(4)] == [
        (0, 2), (2, 4), (4, 5), (5, 5)
    ]
    with pytest.raises(ConfigError, match="placement 'S1' is not 'S0' or 'R'"):
        layout_of(5, ["S1"], [2], [0])


# -- one process, plain parameters ------------------------------------------------------------


def small() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Embedding(7, 3), torch.nn.Linear(3, 5))


def test_without_sharding_it_is_the_torch_adapter() -> None:
    model, twin = small(), small()
    adapter, torch_adapter = ShardedAdapter(model), TorchAdapter(twin)
    assert adapter.schema == torch_adapter.schema
    assert adapter.direct_names == torch_adapter.direct_names == {"0.weight"}
    names = list(adapter.schema.names)
    assert {n: r.tensor for n, r in adapter.read().items()} == torch_adapter.read()
    anchor = values(adapter.schema, 2)
    delta = adapter.delta(adapter.load(anchor), adapter.snapshot(names))
    want = torch_adapter.delta(torch_adapter.load(anchor), torch_adapter.snapshot(names))
    assert {n: r.tensor for n, r in delta.items()} == want
    assert all((r.start, r.stop) == (0, adapter.schema[n].shape[0]) for n, r in delta.items())


def test_plain_parameters_are_mailed_in_chunks_by_rank() -> None:
    model = small()
    full = TorchAdapter(model).read()
    parts = [ShardedAdapter(model, group_size=3, group_rank=r) for r in range(3)]
    assert [p.owned_rows("0.weight") for p in parts] == [(0, 3), (3, 6), (6, 7)]
    assert [p.local_rows("0.weight") for p in parts] == [(0, 7)] * 3
    for p in parts:
        for name, rows in p.read().items():
            assert rows == rows_of(full[name], rows.start, rows.stop)
    assert parts[2].part_schema() == Schema.from_tensors(
        {n: rows_of(t, *parts[2].owned_rows(n)).tensor for n, t in full.items()}
    )


def test_apply_and_rebase_take_full_tensors_rows_and_loaded_values() -> None:
    model = small()
    adapter = ShardedAdapter(model)
    v = values(adapter.schema, 4)
    adapter.apply({"1.bias": rows_of(v["1.bias"], 0, 5)})
    assert torch.equal(model[1].bias, to_torch(v["1.bias"]))
    base = adapter.snapshot(["1.weight"])
    adapter.apply(adapter.load({"1.weight": v["1.weight"]}))
    adapter.rebase({"1.weight": v["1.weight"]}, base)  # θ − base + v = v − base + v
    want = 2 * to_torch(v["1.weight"]) - base["1.weight"]
    assert torch.equal(model[1].weight, want)


def test_values_that_do_not_fit_are_refused_by_name() -> None:
    adapter = ShardedAdapter(small(), group_size=2, group_rank=1)
    v = values(adapter.schema, 4)
    with pytest.raises(SchemaMismatch) as info:
        adapter.apply({
            "0.weight": rows_of(v["0.weight"], 1, 5),
            "1.bias": TensorBytes("F32", (4,), bytes(16)),
            "nope": v["1.bias"],
        })
    assert str(info.value) == (
        "cannot apply: '0.weight' rows [1, 5] of shape [4, 3] do not cover this rank's rows "
        "[0, 7] of [7, 3]; '1.bias' has shape [4]; a full tensor has [5]; 'nope' is not a "
        "synced parameter"
    )
    with pytest.raises(SchemaMismatch, match=r"cannot rebase: no base for \['1.bias'\]"):
        adapter.rebase({"1.bias": v["1.bias"]}, {})
    with pytest.raises(ConfigError, match="its first dimension must be 2"):
        Rows(0, 2, v["1.bias"])


def test_fsdp1_is_refused_naming_fsdp2() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    store = tempfile.mktemp(prefix="gm-fsdp1-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        wrapped = FullyShardedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(4, 3)), device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        with pytest.raises(ConfigError) as info:
            ShardedAdapter(wrapped)
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.unlink(store)
    assert str(info.value) == (
        "the module is wrapped in FSDP1 (FullyShardedDataParallel, Lightning's FSDPStrategy): "
        "its flat parameters split tensors at arbitrary element offsets, which gradientmail "
        "cannot sync shard by shard. Shard with FSDP2 instead: "
        "torch.distributed.fsdp.fully_shard (Lightning's ModelParallelStrategy, Accelerate's "
        "fsdp_version: 2)"
    )


# -- FSDP2 in real processes ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(kind: str, ranks: int, out: Path) -> list[dict[str, Any]]:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert exe is not None, "torchrun is not installed next to this Python"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    cmd = [exe, "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(WORKER), str(out), kind]
    # Generous: two loaded cores, a transformers import per rank.
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, timeout=480)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def replay(kind: str) -> dict[str, dict[str, TensorBytes]]:
    """The worker's script on the unsharded model, through TorchAdapter."""
    model = build(kind)
    adapter = TorchAdapter(model)
    schema, names = adapter.schema, list(adapter.schema.names)
    out: dict[str, dict[str, TensorBytes]] = {}

    def train(seed: int) -> None:
        with torch.no_grad():
            for n, t in adapter.load(values(schema, seed)).items():
                adapter.parameter(n).add_(t)

    train(1)
    out["read"] = adapter.read()
    snap = adapter.snapshot(names)
    out["delta"] = adapter.delta(adapter.load(values(schema, 2)), snap)
    train(3)
    adapter.rebase(values(schema, 4), snap)
    out["rebased"] = adapter.read()
    adapter.apply(values(schema, 5), mixing=MIXING)
    out["mixed"] = adapter.read()
    adapter.apply(values(schema, 6))
    out["applied"] = adapter.read()
    return out


def tiles(ranges: list[list[int]], rows: int) -> bool:
    ordered = sorted(tuple(r) for r in ranges if r[0] < r[1])
    return (ordered[0][0], ordered[-1][1]) == (0, rows) and all(
        a[1] == b[0] for a, b in itertools.pairwise(ordered)
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind, ranks", [("toy", 3), ("gpt2", 2)])
def test_fsdp2_ranks_hold_exactly_their_rows(kind: str, ranks: int, tmp_path: Path) -> None:
    reports = run_ranks(kind, ranks, tmp_path)
    expected = replay(kind)
    schema = TorchAdapter(build(kind)).schema
    for report in reports:
        # The wire does not depend on the sharding: the full schema, the same names.
        assert Schema.from_json(report["schema"]) == schema
        assert report["gathered_equal"] is True
        got = unpack((tmp_path / f"rank{report['rank']}.safetensors").read_bytes())
        for name in schema.names:
            held, owned = report["local_rows"][name], report["owned_rows"][name]
            assert held == owned  # FSDP2 alone: no replicas, each rank mails what it holds
            for step in ("read", "delta"):
                assert got[f"{step}/{name}"] == rows_of(expected[step][name], *owned).tensor
            for step in ("rebased", "mixed", "applied"):
                assert got[f"{step}/{name}"] == rows_of(expected[step][name], *held).tensor
    for name, spec in zip(schema.names, schema.params, strict=True):
        assert tiles([r["owned_rows"][name] for r in reports], spec.shape[0])
    if kind == "toy":  # uneven: 4099 rows over 3 ranks, 3 rows of the bf16 head
        assert [r["local_rows"]["emb.weight"] for r in reports] == [
            [0, 1367], [1367, 2734], [2734, 4099]
        ]
        assert reports[0]["direct"] == ["emb.weight"]
    else:
        assert [r["local_rows"]["transformer.wpe.weight"] for r in reports] == [[0, 5], [5, 9]]
        assert reports[0]["direct"] == ["transformer.wpe.weight", "transformer.wte.weight"]
    check_memory(kind, reports)


def check_memory(kind: str, reports: list[dict[str, Any]]) -> None:
    """What each call allocated: exactly the buffers its contract needs, and in all
    (Python's allocations and the meter's own bookkeeping included) at most the rank's
    shard plus one full tensor, in float32."""
    schema = TorchAdapter(build(kind)).schema
    for report in reports:
        held = {n: tuple(r) for n, r in report["local_rows"].items()}

        def held_bytes(name: str, itemsize: int, held: dict[str, Any] = held) -> int:
            a, b = held[name]
            spec = schema[name]
            return (b - a) * (spec.numel // spec.shape[0]) * itemsize

        sizes = {"F32": 4, "BF16": 2, "F16": 2}
        peaks = report["peaks"]
        storage = sum(held_bytes(n, sizes[schema[n].dtype]) for n in schema.names)
        shard_f32 = sum(held_bytes(n, 4) for n in schema.names)
        one_f32 = max(held_bytes(n, 4) for n in schema.names)
        assert shard_f32 == report["shard_f32_bytes"]
        assert peaks["snapshot"][0] == storage  # the clones, nothing else
        assert peaks["delta"][0] == shard_f32  # the rows it returns, made in place
        assert peaks["rebase"][0] == one_f32  # one float32 buffer at a time
        assert peaks["apply_mixed"][0] == one_f32
        assert peaks["apply"][0] == 0  # full TensorBytes are sliced as views
        bound = report["shard_f32_bytes"] + report["largest_f32_bytes"]
        for what, (torch_peak, python_peak) in peaks.items():
            assert torch_peak + python_peak <= bound, (what, torch_peak, python_peak, bound)


def test_no_host_copies_outside_torch() -> None:
    # numpy and bytes buffers are invisible to torch's dispatch: tracemalloc sees them.
    # With 8 MiB tensors, a copy of any row slice would show as megabytes.
    import tracemalloc

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8191, 256), torch.nn.Linear(256, 1023))
    adapter = ShardedAdapter(model, group_size=2, group_rank=1)
    names = list(adapter.schema.names)
    full = values(adapter.schema, 7)
    snap, anchor = adapter.snapshot(names), adapter.load(full)
    calls = {
        "read": adapter.read,
        "delta": lambda: adapter.delta(anchor, snap),
        "apply": lambda: adapter.apply(full),
        "apply_rows": lambda: adapter.apply({n: rows_of(v, 0, v.shape[0])
                                             for n, v in full.items()}, mixing=0.5),
        "rebase": lambda: adapter.rebase(full, snap),
    }
    for what, call in calls.items():
        tracemalloc.start()
        try:
            result = call()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        del result
        assert peak < 64 * 1024, (what, peak)


class WithScalar(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.tensor(0.5))
        self.proj = torch.nn.Linear(2, 3)


def test_a_scalar_parameter_is_mailed_by_its_one_owner() -> None:
    model = WithScalar()
    owner, other = (ShardedAdapter(model, group_size=2, group_rank=r) for r in range(2))
    assert (owner.owned_rows("temperature"), other.owned_rows("temperature")) == ((0, 1), (1, 1))
    assert owner.read()["temperature"] == Rows(0, 1, TensorBytes("F32", (), b"\x00\x00\x00?"))
    assert "temperature" not in other.read()
    names = list(owner.schema.names)
    anchor = values(owner.schema, 2)
    assert set(owner.delta(owner.load(anchor), owner.snapshot(names))) == set(names)
    assert set(other.delta(other.load(anchor), other.snapshot(names))) == {"proj.weight",
                                                                          "proj.bias"}
    other.apply({"temperature": anchor["temperature"]})
    assert torch.equal(model.temperature.detach(), to_torch(anchor["temperature"]))
