"""Bytes of one learner's delta payload per round, by transfer format, against F32.

    python benchmarks/sparse_bytes.py [--n-layer 2] [--n-embd 128] [--vocab 4096]

Packs one delta of the convergence benchmark's GPT-2 (one fragment: the whole model, as
standard DiLoCo sends it) in F32, BF16, F8_E4M3, F4, and TOPK_F8, TOPK_Q2 and SIGN1 at
several densities, and prints the payload bytes (safetensors headers included, codec off)
and F32's bytes over each. Counts are exact: the sizes do not depend on the values (no
codec), so a random delta stands for a trained one. No timing.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from gradientmail.wire.quantization import quantize
from gradientmail.wire.serialization import pack
from gradientmail.wire.sparse import chunk_k, sparsify
from gradientmail.wire.tensor_bytes import TensorBytes

DENSITIES = (1 / 8, 1 / 16, 1 / 32, 0.02, 0.01, 1 / 256)
SIGN_DENSITIES = (1.0, 1 / 2, 1 / 3, 1 / 4, 1 / 8)


def model_delta(n_layer: int, n_embd: int, vocab: int) -> dict[str, TensorBytes]:
    from gradientmail.integration.textdata import tiny_gpt2

    model = tiny_gpt2(vocab, n_layer=n_layer, n_embd=n_embd, n_head=4, n_positions=64, seed=0)
    rng = np.random.default_rng(0)
    return {n: TensorBytes.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32))
            for n, p in model.named_parameters()}


def sizes(delta: dict[str, TensorBytes]) -> list[tuple[str, int]]:
    out = [("F32", len(pack(delta)))]
    for fmt in ("BF16", "F8_E4M3", "F4"):
        entries: dict[str, Any] = {}
        for n, t in delta.items():
            entries.update(quantize(n, t, fmt))
        out.append((fmt, len(pack(entries))))
    for fmt, densities in (("TOPK_F8", DENSITIES), ("TOPK_Q2", DENSITIES),
                           ("SIGN1", SIGN_DENSITIES)):
        for d in densities:
            entries = {}
            for n, t in delta.items():
                entries.update(sparsify(n, t, d, fmt))
            kept = f"k={chunk_k(d)} of 4096" if fmt != "SIGN1" else "seeded random share"
            out.append((f"{fmt} density {d:.4g} ({kept})", len(pack(entries))))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args(argv)
    delta = model_delta(args.n_layer, args.n_embd, args.vocab)
    n = sum(t.numel for t in delta.values())
    print(f"GPT-2 {args.n_layer}x{args.n_embd}, vocabulary {args.vocab}: {n:,} parameters, "
          f"{len(delta)} tensors\n")
    print("| delta format | payload bytes | F32 / format |")
    print("|---|---:|---:|")
    rows = sizes(delta)
    f32 = rows[0][1]
    for fmt, b in rows:
        print(f"| {fmt} | {b:,} | {f32 / b:.1f}x |")


if __name__ == "__main__":
    main()
