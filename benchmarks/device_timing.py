"""What the device benchmarks share (benchmarks/codec.py --device, benchmarks/
sparse_device.py): GPT-2 small's tensor shapes, fragment 0 of it drawn on a torch device,
best-of timing with the device synchronized, and a device-to-host copy into pinned
memory (the floor a kernel's payload is compared with). Needs torch only: the GPU
machine has no zstandard.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any


def gpt2_shapes(quick: bool) -> dict[str, tuple[int, ...]]:
    """GPT-2 small: d=768, 12 blocks, vocabulary 50257, context 1024."""
    d = 768
    if quick:
        return {
            "wpe.weight": (1024, d),
            "h.0.ln_1.weight": (d,),
            "h.0.attn.c_attn.weight": (d, 3 * d),
            "h.0.attn.c_attn.bias": (3 * d,),
        }
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (50257, d), "wpe.weight": (1024, d)}
    for i in range(12):
        p = f"h.{i}."
        shapes |= {
            p + "ln_1.weight": (d,),
            p + "ln_1.bias": (d,),
            p + "attn.c_attn.weight": (d, 3 * d),
            p + "attn.c_attn.bias": (3 * d,),
            p + "attn.c_proj.weight": (d, d),
            p + "attn.c_proj.bias": (d,),
            p + "ln_2.weight": (d,),
            p + "ln_2.bias": (d,),
            p + "mlp.c_fc.weight": (d, 4 * d),
            p + "mlp.c_fc.bias": (4 * d,),
            p + "mlp.c_proj.weight": (4 * d, d),
            p + "mlp.c_proj.bias": (d,),
        }
    return shapes | {"ln_f.weight": (d,), "ln_f.bias": (d,)}


def device_fragment(device: Any, quick: bool, fragments: int) -> dict[str, Any]:
    """Fragment 0 of `fragments` of GPT-2 (`gpt2_shapes`), drawn from N(0, 0.02) on torch
    `device` with seed 0: consecutive tensors up to 1/fragments of the model's elements
    (the first tensor whatever its size)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    model = {n: torch.randn(s, device=device, generator=gen) * 0.02
             for n, s in gpt2_shapes(quick).items()}
    total = sum(t.numel() for t in model.values())
    fragment: dict[str, Any] = {}
    for name, t in model.items():
        if fragment and sum(v.numel() for v in fragment.values()) + t.numel() > total / fragments:
            break
        fragment[name] = t
    return fragment


def best_ms(fn: Callable[[], Any], reps: int, device: Any) -> float:
    """The fastest of `reps` runs of `fn` in milliseconds, after a warm-up (kernels
    compiled, tables on the device, allocator primed), `device` synchronized around each."""
    import torch

    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    fn()
    best = math.inf
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def pinned_copy(staged: Any) -> Any:
    """`staged` copied device to host into pinned memory, as the kernels' results are."""
    import torch

    return torch.empty(staged.shape, dtype=staged.dtype, pin_memory=staged.is_cuda).copy_(staged)
