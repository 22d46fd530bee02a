"""Codec and quantizer throughput on GPT-2 (124M)-shaped tensors drawn N(0, 0.02).

For F32 and BF16 sources it measures encode and decode MB/s (of source bytes) and the
compression ratio (source bytes / payload bytes) of every codec and transfer format,
with a memory copy of the blob and plain zstd level 1 on the unshuffled blob measured
in the same run as baselines, then the quantizers alone (numpy and torch paths, one
thread). Prints a markdown table and appends it to benchmarks/RESULTS.md.

    python benchmarks/codec.py            # the full 124M parameters (~1.5 GB peak RSS)
    python benchmarks/codec.py --quick    # a ~2.6M-parameter subset, seconds
    python benchmarks/codec.py --device cuda   # the quantizers on a GPU (says so and
                                               # exits 0 where there is none)
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
from functools import partial
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import zstandard
from device_timing import best_ms, device_fragment, gpt2_shapes, pinned_copy  # benchmarks/

from gradientmail.wire.compression import decode, encode
from gradientmail.wire.quantization import FORMATS, dequantize, quantize
from gradientmail.wire.quantization_torch import quantize_bytes
from gradientmail.wire.serialization import pack
from gradientmail.wire.tensor_bytes import TensorBytes

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
GOALS = {"speed": 0.75, "ratio_F32": 1.18, "ratio_BF16": 1.45, "quantize_MBps": 1000.0,
         "gpu_ms": 10.0}


def draw(shapes: dict[str, tuple[int, ...]], dtype: str) -> dict[str, TensorBytes]:
    rng = np.random.default_rng(0)
    out = {}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        out[name] = TensorBytes.from_numpy(x if dtype == "F32" else x.astype(ml_dtypes.bfloat16))
    return out


def best_of(reps: int, fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """Fastest wall-clock and CPU seconds of `reps` runs, and the last result.

    The machine is shared: the minimum is the least disturbed run, and CPU time (this
    process, all threads) shows what the work costs whatever else is running.
    """
    walls, cpus, result = [], [], None
    for _ in range(reps):
        result = None  # free the previous result before the next run allocates its own
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus), result


def quantize_all(tensors: dict[str, TensorBytes], fmt: str | None) -> dict[str, TensorBytes]:
    if fmt is None:
        return dict(tensors)
    out: dict[str, TensorBytes] = {}
    for name, t in tensors.items():
        out |= quantize(name, t, fmt)
    return out


def dequantize_all(entries: dict[str, TensorBytes], names: list[str], fmt: str | None) -> None:
    if fmt is not None:
        for name in names:
            dequantize(entries, name, fmt)


def codec_rows(tensors: dict[str, TensorBytes], dtype: str, reps: int) -> list[dict[str, Any]]:
    src = sum(t.nbytes for t in tensors.values())
    names = list(tensors)
    rows = []
    blob = pack(tensors)
    threads = min(os.cpu_count() or 1, 4)
    copy = best_of(reps, partial(bytearray, blob))
    rows.append(row(dtype, "memory copy of the blob (baseline)", src, len(blob), copy, copy))
    for label, cctx in [
        ("plain zstd -1 (baseline, 1 thread)", zstandard.ZstdCompressor(level=1)),
        (f"plain zstd -1 ({threads} threads)", zstandard.ZstdCompressor(level=1, threads=threads)),
    ]:
        enc = best_of(reps, partial(cctx.compress, blob))
        frame = enc[2]
        dec = best_of(reps, partial(zstandard.ZstdDecompressor().decompress, frame))
        rows.append(row(dtype, label, src, len(frame), enc, dec))
    formats: list[str | None] = [None, *[f for f in FORMATS if not (dtype == "BF16" == f)]]
    for fmt in formats:
        for codec in ("off", "zstd"):

            def encode_all(fmt: str | None = fmt, codec: str = codec) -> bytes:
                return encode(quantize_all(tensors, fmt), codec)

            def decode_all(payload: bytes, fmt: str | None = fmt, codec: str = codec) -> None:
                dequantize_all(decode(payload, codec), names, fmt)

            enc = best_of(reps, encode_all)
            dec = best_of(reps, partial(decode_all, enc[2]))
            rows.append(row(dtype, f"{fmt or dtype} + {codec}", src, len(enc[2]), enc, dec))
    return rows


def row(
    dtype: str,
    label: str,
    src: int,
    out: int,
    enc: tuple[float, float, Any],
    dec: tuple[float, float, Any],
) -> dict[str, Any]:
    return {
        "source": dtype,
        "payload": label,
        "enc": src / enc[0] / 1e6,
        "enc_cpu": src / enc[1] / 1e6,
        "dec": src / dec[0] / 1e6,
        "dec_cpu": src / dec[1] / 1e6,
        "ratio": src / out,
        "mb": out / 1e6,
    }


def quantizer_rows(tensors: dict[str, TensorBytes], reps: int) -> list[dict[str, Any]]:
    """Each quantizer alone, one thread (torch's own pool set to 1 for the torch path),
    with a copy of the same F32 bytes timed in the same run as the baseline."""
    import torch

    src = sum(t.nbytes for t in tensors.values())
    names = list(tensors)
    arrays = [t.to_numpy() for t in tensors.values()]
    _, copy_cpu, _ = best_of(reps, lambda: [a.copy() for a in arrays])
    rows = [{"fmt": "-", "backend": "memory copy (baseline)", "q": 0.0,
             "q_cpu": src / copy_cpu / 1e6, "dq": 0.0, "dq_cpu": src / copy_cpu / 1e6}]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for fmt in FORMATS:
            for backend in ("numpy", "torch"):

                def q(fmt: str = fmt, backend: str = backend) -> dict[str, TensorBytes]:
                    one = quantize_bytes if backend == "torch" else quantize
                    out: dict[str, TensorBytes] = {}
                    for name, t in tensors.items():
                        out |= one(name, t, fmt)
                    return out

                q_wall, q_cpu, entries = best_of(reps, q)
                d_wall, d_cpu, _ = best_of(reps, partial(dequantize_all, entries, names, fmt))
                rows.append(
                    {
                        "fmt": fmt,
                        "backend": backend,
                        "q": src / q_wall / 1e6,
                        "q_cpu": src / q_cpu / 1e6,
                        "dq": src / d_wall / 1e6,
                        "dq_cpu": src / d_cpu / 1e6,
                    }
                )
                del entries
    finally:
        torch.set_num_threads(threads)
    return rows


def sparse_rows(tensors: dict[str, TensorBytes], reps: int) -> list[dict[str, Any]]:
    """The ``TOPK_F8`` encoder at the default density, one thread: numpy's `sparsify` and
    the torch kernels of `sparse_torch` on the CPU, and a learner's error feedback
    (`Residuals.encode`: delta + residual, the encoding, the residual left) on host bytes
    and on CPU torch tensors (which numpy encodes through a view)."""
    import torch

    from gradientmail.learner.feedback import Residuals
    from gradientmail.wire.sparse import DEFAULT_DENSITY, sparsify
    from gradientmail.wire.sparse_torch import sparsify_tensor

    src = sum(t.nbytes for t in tensors.values())
    on_cpu = {n: torch.from_numpy(t.to_numpy().copy()) for n, t in tensors.items()}

    def numpy_path() -> Any:
        return [sparsify(n, t, DEFAULT_DENSITY) for n, t in tensors.items()]

    def torch_path() -> Any:
        return [sparsify_tensor(n, t, DEFAULT_DENSITY) for n, t in on_cpu.items()]

    def feedback(torch_tensors: bool) -> Callable[[], Any]:
        res = Residuals("bench")
        res.encode(0, 0, {n: t.clone() for n, t in on_cpu.items()} if torch_tensors
                   else tensors, DEFAULT_DENSITY)  # a residual to carry in
        res.recorded(0, ("bench",))

        def go() -> Any:
            delta = ({n: t.clone() for n, t in on_cpu.items()} if torch_tensors
                     else tensors)
            out = res.encode(1, 0, delta, DEFAULT_DENSITY)
            res.failed(1)  # back to round 0's residual: every repetition does the same
            return out
        return go

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = []
        for path, fn in (("sparsify, numpy", numpy_path), ("sparsify, torch", torch_path),
                         ("error feedback, host bytes", feedback(False)),
                         ("error feedback, torch tensors", feedback(True))):
            wall, cpu, _ = best_of(reps, fn)
            rows.append({"path": path, "enc": src / wall / 1e6, "enc_cpu": src / cpu / 1e6})
    finally:
        torch.set_num_threads(threads)
    return rows


def sparse_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "TOPK_F8 at the default density (1/32), F32 source, one thread (MB/s of F32 input; "
        "the error-feedback rows include delta + residual and the residual left, and for "
        "torch tensors a clone of the delta):",
        "",
        "| path | encode MB/s | (cpu) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {r['path']} | {r['enc']:.0f} | {r['enc_cpu']:.0f} |" for r in rows]
    return "\n".join(lines)


def table(codec: list[dict[str, Any]], quant: list[dict[str, Any]], params: int) -> str:
    lines = [
        f"GPT-2-shaped tensors, {params / 1e6:.1f}M parameters drawn N(0, 0.02). MB/s are "
        "megabytes of source tensor per second of wall-clock time, and (cpu) per second of "
        "this process's CPU time, all threads; best of the repetitions. Encode = quantize + "
        "shuffle + pack + compress; decode = the reverse, back to F32 for quantized "
        "formats. Ratio = source bytes / payload bytes.",
        "",
        "| source | payload | encode MB/s | (cpu) | decode MB/s | (cpu) | ratio | payload MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in codec:
        lines.append(
            f"| {r['source']} | {r['payload']} | {r['enc']:.0f} | {r['enc_cpu']:.0f} | "
            f"{r['dec']:.0f} | {r['dec_cpu']:.0f} | {r['ratio']:.3f} | {r['mb']:.1f} |"
        )
    copy = quant[0]["q_cpu"]
    lines += [
        "",
        "Quantizers alone, F32 source, one thread (MB/s of F32 input; dequantize: of F32 "
        f"output, which the numpy path always gives); x copy = CPU MB/s / a copy's {copy:.0f}:",
        "",
        "| format | path | quantize MB/s | (cpu) | x copy | dequantize MB/s | (cpu) | x copy |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in quant[1:]:
        lines.append(
            f"| {r['fmt']} | {r['backend']} | {r['q']:.0f} | {r['q_cpu']:.0f} | "
            f"{r['q_cpu'] / copy:.2f} | {r['dq']:.0f} | {r['dq_cpu']:.0f} | "
            f"{r['dq_cpu'] / copy:.2f} |"
        )
    lines += ["", *goals(codec, quant)]
    return "\n".join(lines)


def goals(codec: list[dict[str, Any]], quant: list[dict[str, Any]]) -> list[str]:
    out = ["Goals (per core: CPU-time MB/s; wall-clock ratio in brackets):", ""]
    for dtype in ("F32", "BF16"):
        rows = {r["payload"]: r for r in codec if r["source"] == dtype}
        base = rows["plain zstd -1 (baseline, 1 thread)"]
        ours = rows[f"{dtype} + zstd"]
        enc, enc_wall = ours["enc_cpu"] / base["enc_cpu"], ours["enc"] / base["enc"]
        dec, dec_wall = ours["dec_cpu"] / base["dec_cpu"], ours["dec"] / base["dec"]
        goal = GOALS[f"ratio_{dtype}"]
        out.append(
            f"- {dtype}: shuffle+zstd encodes at {enc:.2f}x plain zstd's speed "
            f"[{enc_wall:.2f}x] and decodes at {dec:.2f}x [{dec_wall:.2f}x] (goal >= "
            f"{GOALS['speed']}: {_verdict(min(enc, dec) >= GOALS['speed'])}); ratio "
            f"{ours['ratio']:.3f} vs plain {base['ratio']:.3f} (goal >= {goal}: "
            f"{_verdict(ours['ratio'] >= goal)})"
        )
    for fmt in FORMATS:
        paths_of = [r for r in quant if r["fmt"] == fmt]
        best_q = max(r["q_cpu"] for r in paths_of)
        best_dq = max(r["dq_cpu"] for r in paths_of)
        paths = ", ".join(f"{r['backend']} {r['q_cpu']:.0f}" for r in paths_of)
        out.append(
            f"- {fmt}: quantize {paths} MB/s per core, dequantize {best_dq:.0f} (goal >= "
            f"{GOALS['quantize_MBps']:.0f} both: "
            f"{_verdict(min(best_q, best_dq) >= GOALS['quantize_MBps'])})"
        )
    return out


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def gpu_rows(reps: int, fragments: int, device: str = "cuda") -> list[dict[str, Any]] | None:
    """The torch kernels on a CUDA device: one fragment of GPT-2 (124M) in F32 on the
    GPU to its entries on the host (`quantize_tensors`, the device-to-host copy of the
    codes included), beside a plain copy of the same payload bytes to the host, and
    whether the entries are byte for byte numpy's. None when there is no CUDA device."""
    try:
        import torch
    except ImportError:
        return None
    if device == "cuda" and not torch.cuda.is_available():
        return None
    from gradientmail.wire.quantization import quantized_nbytes
    from gradientmail.wire.quantization_torch import quantize_tensors

    fragment = device_fragment(device, False, fragments)
    numel = sum(t.numel() for t in fragment.values())

    def timed(fn: Callable[[], Any]) -> float:
        return best_ms(fn, reps, device)

    rows = []
    for fmt in FORMATS:
        nbytes = sum(quantized_nbytes(fmt, t.numel()) for t in fragment.values())
        staged = torch.empty(nbytes, dtype=torch.uint8, device=device)
        ms = timed(partial(quantize_tensors, fragment, fmt))
        copy_ms = timed(partial(pinned_copy, staged))
        same = quantize_tensors(fragment, fmt) == quantize_all(
            {n: TensorBytes.from_numpy(t.cpu().numpy()) for n, t in fragment.items()}, fmt)
        rows.append({"fmt": fmt, "params": numel, "tensors": len(fragment), "ms": ms,
                     "copy_ms": copy_ms, "gbps": 4 * numel / ms / 1e6, "same": same})
    return rows


def gpu_table(rows: list[dict[str, Any]], fragments: int, device: str) -> str:
    lines = [
        f"{device}: fragment 0 of {fragments} of GPT-2 (124M) drawn N(0, 0.02) in F32 on the "
        "GPU, to its entries on the host (`quantization_torch.quantize_tensors`, best of "
        "the repetitions after a warm-up); copy = the same number of payload bytes copied "
        "device to host alone, into pinned memory as the kernels' results are (the floor).",
        "",
        "| format | params | tensors | encode ms | copy ms | GB/s of F32 | bytes = numpy's "
        "| goal |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        verdict = _verdict(r["ms"] <= GOALS["gpu_ms"]) if r["fmt"] != "BF16" else "-"
        lines.append(
            f"| {r['fmt']} | {r['params'] / 1e6:.1f}M | {r['tensors']} | {r['ms']:.2f} | "
            f"{r['copy_ms']:.2f} | {r['gbps']:.0f} | {'yes' if r['same'] else 'NO'} | "
            f"<= {GOALS['gpu_ms']:.0f} ms: {verdict} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~2.6M-parameter subset")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (best is kept)")
    parser.add_argument("--no-append", action="store_true", help="do not touch RESULTS.md")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: time the torch kernels on a GPU instead")
    parser.add_argument("--fragments", type=int, default=1,
                        help="with --device cuda: time fragment 0 of this many (default 1)")
    args = parser.parse_args(argv)
    reps = args.reps or (5 if args.quick else 3)
    if args.device == "cuda":
        rows = gpu_rows(reps, args.fragments)
        if rows is None:
            print("--device cuda: no CUDA device here (torch missing or "
                  "torch.cuda.is_available() is False); nothing measured")
            return
        import torch

        device = torch.cuda.get_device_name()
        body = gpu_table(rows, args.fragments, device)
        command = f"python benchmarks/codec.py --device cuda --fragments {args.fragments}"
        section = (
            f"## codec: {command}\n\n"
            f"{datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}, torch "
            f"{torch.__version__}\n\n{body}\n"
        )
        print(section)
        if not args.no_append:
            with open(RESULTS, "a", encoding="utf-8") as f:
                f.write("\n" + section)
        return
    shapes = gpt2_shapes(args.quick)
    params = sum(int(np.prod(s)) for s in shapes.values())
    load_before = os.getloadavg()[0]
    codec: list[dict[str, Any]] = []
    quant: list[dict[str, Any]] = []
    sparse: list[dict[str, Any]] = []
    for dtype in ("F32", "BF16"):
        tensors = draw(shapes, dtype)
        codec += codec_rows(tensors, dtype, reps)
        if dtype == "F32":
            quant = quantizer_rows(tensors, reps)
            sparse = sparse_rows(tensors, reps)
        del tensors
    body = table(codec, quant, params) + "\n\n" + sparse_table(sparse)
    load = statistics.mean([load_before, os.getloadavg()[0]])
    command = "python benchmarks/codec.py" + (" --quick" if args.quick else "")
    section = (
        f"## codec: {command}\n\n"
        f"{datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}, "
        f"{platform.machine()}, nproc {os.cpu_count()}, load average ~{load:.1f} (shared "
        f"machine), Python {sys.version.split()[0]}, zstandard {zstandard.__version__}\n\n"
        f"{body}\n"
    )
    print(section)
    if not args.no_append:
        text = "\n" + section if RESULTS.exists() else "# Benchmark results\n\n" + section
        with open(RESULTS, "a", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
