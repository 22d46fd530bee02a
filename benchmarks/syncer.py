"""Seconds to close one round, against the memory-bound floor measured in the same run.

A round of M contributions to one F32 fragment of ~31M parameters (a few large tensors,
one of them an embedding so both the RDA and the weighted-mean paths run) is closed by
`DiLoCoAggregator.close_round` on the numpy backend and on the torch CPU backend, with
the RDA merge (default) or the weighted mean (`--merge mean`, standard DiLoCo's). Two
floors, both numpy on one thread in the same run:

- the floor (issue #4's): reading the same M × fragment bytes once (summing each tensor);
- the traffic floor: streaming the bytes the design cannot avoid: the M deltas once per
  pass the merge needs (RDA tensors two: the Gram matrix, then the merge; weighted-mean
  tensors and a single contribution one), theta and momentum read, theta and momentum
  written.

Prints a markdown table and appends it to benchmarks/RESULTS.md.

    python benchmarks/syncer.py                 # 31M parameters, M in 2, 4, 8, RDA
    python benchmarks/syncer.py --merge mean    # the same with the weighted mean
    python benchmarks/syncer.py --quick         # 1M parameters, seconds
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gradientmail.algorithms import Aggregator, Contribution, FragmentState
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Rda, WeightedMean
from gradientmail.backends import NumpyBackend
from gradientmail.backends.base import Backend
from gradientmail.wire.serialization import ParameterSpec, Schema
from gradientmail.wire.tensor_bytes import TensorBytes

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def shapes(quick: bool, layout: str) -> dict[str, tuple[int, ...]]:
    if layout == "many-medium":
        # 12 tensors of 10.5 MB: below glibc's 32 MB mmap ceiling, so the bytes of one
        # round reuse the heap memory of the last instead of faulting in fresh pages.
        rows = 64 if quick else 1024
        return {("wte.embed" if i == 0 else f"h.{i}.w"): (rows, 2560) for i in range(12)}
    if quick:
        return {"wte.embed.weight": (512, 1024), "h.0.mlp.fc": (256, 1024),
                "h.0.mlp.proj": (1024, 256)}
    # 12.6M + 9.4M + 9.4M = 31.5M parameters, 126 MB in F32.
    return {"wte.embed.weight": (8192, 1536), "h.0.mlp.fc": (1536, 6144),
            "h.0.mlp.proj": (6144, 1536)}


def best_of(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 1M-parameter fragment")
    ap.add_argument("--layout", choices=["few-large", "many-medium"], default="few-large",
                    help="3 tensors of 37-50 MB (default) or 12 tensors of 10.5 MB")
    ap.add_argument("--merge", choices=["rda", "mean"], default="rda",
                    help="Rda() (the default; its embedding by weighted mean) or WeightedMean()")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (best is kept)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch backend")
    ap.add_argument("--device", default=None, help="also time TorchBackend(DEVICE), e.g. cuda")
    ap.add_argument("--numpy-threads", type=int, default=None, help="NumpyBackend(threads=)")
    ap.add_argument("--torch-cpu-chunk", type=int, default=None,
                    help="override gradientmail.backends.torch_backend.CPU_CHUNK")
    ap.add_argument("--no-append", action="store_true", help="do not write RESULTS.md")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the file to append to")
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 3)
    spec = shapes(args.quick, args.layout)
    schema = Schema(tuple(ParameterSpec(n, "F32", s) for n, s in spec.items()))
    numel = sum(int(np.prod(s)) for s in spec.values())
    rng = np.random.default_rng(0)
    theta = {n: TensorBytes.from_numpy(rng.standard_normal(s, dtype=np.float32))
             for n, s in spec.items()}
    merge = Rda() if args.merge == "rda" else WeightedMean()
    cfg = DiLoCo(sync_every=100, fragments=1, in_flight=1, merge=merge)
    numpy_backend = NumpyBackend(threads=args.numpy_threads)
    backends: list[Backend] = [numpy_backend]
    labels = [f"numpy ({numpy_backend.threads} threads)"]
    if not args.no_torch or args.device:
        import torch

        from gradientmail.backends import TorchBackend, torch_backend

        if args.torch_cpu_chunk:
            torch_backend.CPU_CHUNK = args.torch_cpu_chunk
    if not args.no_torch:
        backends.append(TorchBackend())
        labels.append(f"torch cpu ({torch.get_num_threads()} threads, chunk "
                      f"{torch_backend.CPU_CHUNK})")
    if args.device:
        backends.append(TorchBackend(args.device))
        labels.append(f"torch {args.device}")
    rows = []
    ms = (2, 4, 8)
    contributions: list[Contribution] = []
    for m in ms:
        while len(contributions) < m:
            i = len(contributions)
            delta = {n: TensorBytes.from_numpy(rng.standard_normal(s, dtype=np.float32) * 1e-2)
                     for n, s in spec.items()}
            contributions.append(Contribution(f"l{i}", 100, 100, 1000 + i, False, delta))
        cs = contributions[:m]
        arrays = [np.frombuffer(t.data, np.float32) for c in cs for t in c.delta.values()]

        def read_once(arrays: list[np.ndarray] = arrays) -> None:
            for a in arrays:
                a.sum()

        floor, _ = best_of(read_once, reps)
        state = cfg.initial_state(0, theta)
        traffic, moved = traffic_floor(state, cs, merge, reps)
        row = [f"{m}", f"{m * numel * 4 / 1e6:.0f}", f"{floor:.3f}", f"{moved / 1e6:.0f}",
               f"{traffic:.3f}"]
        reference = None
        for be in backends:
            agg = cfg.aggregator(be)
            out = agg.close_round(state, cs, schema)  # warm up, and check the bytes
            if reference is None:
                reference = out.state.theta
            elif out.state.theta != reference:
                sys.exit(f"{be.name} gave other bytes than numpy for M={m}")

            def close(
                agg: Aggregator = agg, state: FragmentState = state, cs: list[Contribution] = cs
            ) -> None:
                agg.close_round(state, cs, schema)

            best, med = best_of(close, reps)
            row += [f"{best:.3f} (median {med:.3f})", f"{best / floor:.2f}x",
                    f"{best / traffic:.2f}x"]
        rows.append(row)
        print(" | ".join(row), file=sys.stderr)
    header = ["M", "MB read", "floor s (numpy sum)", "traffic MB", "traffic floor s"]
    for label in labels:
        header += [f"{label} s", "/ floor", "/ traffic floor"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if not args.no_append:
        command = "python " + " ".join(["benchmarks/syncer.py", *sys.argv[1:]])
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        text = (
            f"\n## syncer: close_round vs the memory-bound floor, {args.merge} ({when})\n\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}"
            f"{_torch_version(args.no_torch and not args.device)}. Command: `{command}`. "
            "Byte-identical results on every backend (checked). One F32 fragment of "
            f"{numel / 1e6:.1f}M parameters in {len(spec)} tensors ({MERGES[args.merge]}); "
            f"best of {reps}. Traffic floor: numpy streaming the deltas once per pass the "
            "merge needs (RDA tensors twice, the others once; close_round itself reads every "
            "delta twice), theta and momentum read, theta and momentum written.\n\n"
            f"{table}\n"
        )
        with open(args.results, "a") as f:
            f.write(text)


MERGES = {
    "rda": "RDA, the embedding by weighted mean",
    "mean": "weighted mean",
}


def traffic_floor(
    state: FragmentState, cs: list[Contribution], merge: Rda | WeightedMean, reps: int
) -> tuple[float, int]:
    """Seconds (best of `reps`) for numpy on one thread to stream the bytes a round cannot
    avoid, and that number of bytes: each delta read once per pass its tensor's merge
    needs, theta and momentum read, theta and momentum written (into memory already
    touched, as the backends' buffer pools reuse it)."""
    passes = {
        n: 2 if len(cs) > 1 and isinstance(merge, Rda) and not merge.is_direct(n) else 1
        for n in state.names
    }
    reads = [np.frombuffer(c.delta[n].buffer, np.float32) for n in state.names for c in cs
             for _ in range(passes[n])]
    reads += [np.frombuffer(group[n].buffer, np.float32) for n in state.names
              for group in (state.theta, state.momentum)]
    writes = [np.ones(state.theta[n].nbytes // 4, np.float32) for n in state.names for _ in "tm"]

    def stream() -> None:
        for a in reads:
            a.sum()
        for w in writes:
            w.fill(1.0)

    best, _ = best_of(stream, reps)
    return best, sum(a.nbytes for a in reads) + sum(w.nbytes for w in writes)


def _torch_version(skip: bool) -> str:
    if skip:
        return ""
    import torch

    return f", torch {torch.__version__}"


if __name__ == "__main__":
    main()
