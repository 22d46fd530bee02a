"""TOPK_F8 and its error feedback on a device: one fragment of GPT-2 (124M), F32 on the
device, to its entries on the host.

Rows: `sparse_torch.sparsify_tensor` over the fragment's tensors, and a learner's whole
error-feedback step (`Residuals.encode` on device tensors: delta + residual, the
encoding, the residual left on the device; the delta cloned first, as
`TorchAdapter.delta_tensors` makes a new one), each beside a plain device-to-host copy of
the same payload bytes into pinned memory (the floor), and whether the entries are byte
for byte numpy's (`sparse.sparsify`; the same `Residuals` steps on host bytes). Needs no
zstandard (the GPU machine has none). Prints a markdown table.

    python benchmarks/sparse_device.py --device cuda --fragments 4
    python benchmarks/sparse_device.py --device cpu --quick     # the plumbing, seconds
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from device_timing import best_ms, device_fragment, pinned_copy  # benchmarks/

from gradientmail.learner.feedback import Residuals
from gradientmail.wire.sparse import DEFAULT_DENSITY, sparse_nbytes, sparsify
from gradientmail.wire.sparse_torch import sparsify_tensor
from gradientmail.wire.tensor_bytes import TensorBytes

GOAL_MS = 10.0  # issue 29: a 124M model's fragment encoded in <= 10 ms on a GPU


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--density", type=float, default=DEFAULT_DENSITY)
    parser.add_argument("--quick", action="store_true", help="a few tensors")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device here; nothing measured")
        return

    fragment = device_fragment(device, args.quick, args.fragments)
    numel = sum(t.numel() for t in fragment.values())
    density = args.density

    def timed(fn: Callable[[], Any]) -> float:
        return best_ms(fn, args.reps, device)

    def encode() -> dict[str, TensorBytes]:
        out: dict[str, TensorBytes] = {}
        for n, t in fragment.items():
            out |= sparsify_tensor(n, t, density)[0]
        return out

    host = {n: TensorBytes.from_numpy(t.cpu().numpy()) for n, t in fragment.items()}
    want: dict[str, TensorBytes] = {}
    for n, h in host.items():
        want |= sparsify(n, h, density)
    on_device, on_host = Residuals("bench"), Residuals("bench")
    on_device.encode(0, 0, {n: t.clone() for n, t in fragment.items()}, density)
    on_host.encode(0, 0, host, density)
    for res in (on_device, on_host):
        res.recorded(0, ("bench",))

    def feedback() -> dict[str, TensorBytes]:
        out = on_device.encode(1, 0, {n: t.clone() for n, t in fragment.items()}, density)
        on_device.failed(1)  # back to round 0's residual: each repetition does the same
        return out

    same_feedback = feedback() == on_host.encode(1, 0, host, density)
    kept = on_device.residual(0)
    assert all(v.device.type == device.type for v in kept.values())
    nbytes = sum(sparse_nbytes(t.numel(), density) for t in fragment.values())
    staged = torch.empty(nbytes, dtype=torch.uint8, device=device)

    copy_ms = timed(lambda: pinned_copy(staged))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}: fragment 0 of {args.fragments} of GPT-2 "
          f"(124M{', a few tensors' if args.quick else ''}), {numel / 1e6:.1f}M parameters "
          f"in {len(fragment)} tensors, density {density:g} ({nbytes / 1e6:.2f} MB of "
          f"payload), best of {args.reps} after a warm-up; copy = the payload's bytes "
          "device to host alone.\n")
    print("| path | ms | copy ms | GB/s of F32 | bytes = numpy's | goal |")
    print("|---|---:|---:|---:|---|---|")
    for path, fn, same in (("sparsify_tensor", encode, encode() == want),
                           ("Residuals.encode (+ clone)", feedback, same_feedback)):
        ms = timed(fn)
        verdict = ("met" if ms <= GOAL_MS else "MISSED") if device.type == "cuda" else "-"
        print(f"| {path} | {ms:.2f} | {copy_ms:.2f} | {4 * numel / ms / 1e6:.1f} | "
              f"{'yes' if same else 'NO'} | <= {GOAL_MS:.0f} ms: {verdict} |")
    if not same_feedback or encode() != want:
        raise SystemExit("the device's bytes differ from numpy's")


if __name__ == "__main__":
    main()
