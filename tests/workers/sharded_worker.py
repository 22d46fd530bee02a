"""One rank of an FSDP2 (`fully_shard`) model driven through `ShardedAdapter`.

    torchrun --nproc_per_node N tests/workers/sharded_worker.py OUT KIND

KIND is "toy" (an Embedding, Linear layers with odd row counts, a bf16 head) or "gpt2"
(a tiny GPT-2 with a 2001-token vocabulary and a tied LM head). Each rank shards the model,
runs one forward and backward (so FSDP2's lazy initialisation has happened), then runs a
fixed script of adapter calls on values every process can regenerate (`values`), and
writes OUT/rank<R>.safetensors (what each call returned or left in the shards) and
OUT/rank<R>.json (row ranges, measured allocation peaks, and whether the gathered full
parameters equal what was applied). tests/test_sharded_adapter.py replays the same script
on the unsharded model with TorchAdapter and compares.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from gradientmail.adapters.torch import from_torch
from gradientmail.wire.serialization import Schema
from gradientmail.wire.tensor_bytes import TensorBytes

MIXING = 0.25


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(4099, 64)  # 1 MiB: copies of it would show
        self.fc = torch.nn.Linear(64, 11)
        self.norm = torch.nn.LayerNorm(11)
        self.head = torch.nn.Linear(11, 3).to(torch.bfloat16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.fc(self.emb(ids))))
        out: torch.Tensor = self.head(h.to(torch.bfloat16)).float()
        return out


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "toy":
        return Toy()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=2001, n_positions=9, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def shard(model: torch.nn.Module, kind: str) -> None:
    from torch.distributed.fsdp import fully_shard

    groups = [model.emb, model.fc, model.head] if kind == "toy" else list(model.transformer.h)
    for module in groups:
        fully_shard(module)
    fully_shard(model)


def loss(model: torch.nn.Module, kind: str) -> torch.Tensor:
    ids = torch.arange(8).reshape(1, 8) * 5
    if kind == "toy":
        return model(ids).square().mean()
    out: torch.Tensor = model(input_ids=ids, labels=ids).loss
    return out


def values(schema: Schema, seed: int) -> dict[str, TensorBytes]:
    """Full tensors for every parameter of `schema`, the same in every process."""
    out = {}
    for i, spec in enumerate(schema.params):
        g = torch.Generator().manual_seed(1000 * seed + i)
        t = torch.randn(spec.shape, generator=g)
        out[spec.name] = from_torch(t, spec.dtype)
    return out


def main(out_dir: str, kind: str) -> None:
    import torch.distributed as dist

    from gradientmail.adapters.sharded import ShardedAdapter
    from gradientmail.wire.serialization import pack
    from gradientmail.wire.sharded_ranges import rows_of
    from workers.alloc_meter import AllocationMeter

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(kind)
    shard(model, kind)
    adapter = ShardedAdapter(model)
    names = list(adapter.schema.names)
    loss(model, kind).backward()  # FSDP2's lazy init, an all-gather and a reduce-scatter
    model.zero_grad(set_to_none=True)

    peaks: dict[str, list[int]] = {}

    def measured(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with AllocationMeter():  # warm-up: tracemalloc's first start counts imports
            pass
        with AllocationMeter() as meter:
            result = fn(*args, **kwargs)
        peaks[what] = [meter.torch_peak, meter.python_peak]
        return result

    saved: dict[str, TensorBytes] = {}

    def keep_shards(step: str) -> None:
        for n in names:
            saved[f"{step}/{n}"] = from_torch(adapter.local(n))

    with torch.no_grad():  # "training": add values(1) to the parameters
        for n, t in adapter.load(values(adapter.schema, 1)).items():
            adapter.local(n).add_(t)
    for n, rows in adapter.read().items():
        saved[f"read/{n}"] = rows.tensor
    snap = measured("snapshot", adapter.snapshot, names)
    anchor = adapter.load(values(adapter.schema, 2))
    delta = measured("delta", adapter.delta, anchor, snap)
    for n, rows in delta.items():
        saved[f"delta/{n}"] = rows.tensor
    with torch.no_grad():  # more training: values(3)
        for n, t in adapter.load(values(adapter.schema, 3)).items():
            adapter.local(n).add_(t)
    measured("rebase", adapter.rebase, values(adapter.schema, 4), snap)
    keep_shards("rebased")
    held = {n: rows_of(v, *adapter.local_rows(n)) for n, v in values(adapter.schema, 5).items()}
    measured("apply_mixed", adapter.apply, held, mixing=MIXING)
    keep_shards("mixed")
    final = values(adapter.schema, 6)
    measured("apply", adapter.apply, final)
    keep_shards("applied")
    gathered = all(
        bool(torch.equal(p.full_tensor(), torch.frombuffer(bytearray(final[n].data),
                                                           dtype=p.dtype).reshape(p.shape)))
        for n, p in model.named_parameters()
    )
    loss(model, kind).backward()  # the model still trains after the adapter wrote it

    out = Path(out_dir)
    (out / f"rank{rank}.safetensors").write_bytes(pack(saved))
    report = {
        "rank": rank,
        "world": dist.get_world_size(),
        "schema": adapter.schema.to_json(),
        "direct": sorted(adapter.direct_names),
        "local_rows": {n: list(adapter.local_rows(n)) for n in names},
        "owned_rows": {n: list(adapter.owned_rows(n)) for n in names},
        "shard_f32_bytes": adapter.local_nbytes(dtype="F32"),
        "largest_f32_bytes": max(4 * math.prod(s.shape) for s in adapter.schema.params),
        "peaks": peaks,
        "gathered_equal": gathered,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1], sys.argv[2])
    from workers.ending import leave  # FSDP2's own gloo collectives: see ending.py

    leave()
