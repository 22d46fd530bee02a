"""Codec and quantizer throughput on GPT-2 (124M)-shaped tensors drawn N(0, 0.02).

For F32 and BF16 sources it measures encode and decode MB/s (of source bytes) and the
compression ratio (source bytes / payload bytes) of every codec and transfer format,
with plain zstd level 1 on the unshuffled blob measured in the same run as the
baseline, then the quantizers alone (numpy and torch paths). Prints a markdown table and
appends it to benchmarks/RESULTS.md.

    python benchmarks/codec.py            # the full 124M parameters (~1.5 GB peak RSS)
    python benchmarks/codec.py --quick    # a ~2.6M-parameter subset, seconds
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

from gradientmail.wire.compression import decode, encode
from gradientmail.wire.quantization import FORMATS, dequantize, quantize
from gradientmail.wire.serialization import pack
from gradientmail.wire.tensor_bytes import TensorBytes

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
GOALS = {"speed": 0.75, "ratio_F32": 1.18, "ratio_BF16": 1.45, "quantize_MBps": 1000.0}


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
    src = sum(t.nbytes for t in tensors.values())
    names = list(tensors)
    rows = []
    for fmt in FORMATS:
        for backend in ("numpy", "torch"):

            def q(fmt: str = fmt, backend: str = backend) -> dict[str, TensorBytes]:
                out: dict[str, TensorBytes] = {}
                for name, t in tensors.items():
                    out |= quantize(name, t, fmt, backend=backend)
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
    return rows


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
    lines += [
        "",
        "Quantizers alone, F32 source (MB/s of F32 input; dequantize: of F32 output):",
        "",
        "| format | path | quantize MB/s | (cpu) | dequantize MB/s | (cpu) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in quant:
        lines.append(
            f"| {r['fmt']} | {r['backend']} | {r['q']:.0f} | {r['q_cpu']:.0f} | "
            f"{r['dq']:.0f} | {r['dq_cpu']:.0f} |"
        )
    lines += ["", *goals(codec, quant)]
    return "\n".join(lines)


def goals(codec: list[dict[str, Any]], quant: list[dict[str, Any]]) -> list[str]:
    out = ["Goals (wall-clock; CPU-time ratio in brackets):", ""]
    for dtype in ("F32", "BF16"):
        rows = {r["payload"]: r for r in codec if r["source"] == dtype}
        base = rows["plain zstd -1 (baseline, 1 thread)"]
        ours = rows[f"{dtype} + zstd"]
        speed, speed_cpu = ours["enc"] / base["enc"], ours["enc_cpu"] / base["enc_cpu"]
        dspeed, dspeed_cpu = ours["dec"] / base["dec"], ours["dec_cpu"] / base["dec_cpu"]
        goal = GOALS[f"ratio_{dtype}"]
        out.append(
            f"- {dtype}: shuffle+zstd encodes at {speed:.2f}x plain zstd's speed "
            f"[{speed_cpu:.2f}x] (goal >= {GOALS['speed']}: "
            f"{'met' if speed >= GOALS['speed'] else 'MISSED'}), decodes at {dspeed:.2f}x "
            f"[{dspeed_cpu:.2f}x]; ratio {ours['ratio']:.3f} vs plain {base['ratio']:.3f} "
            f"(goal >= {goal}: {'met' if ours['ratio'] >= goal else 'MISSED'})"
        )
    for fmt in FORMATS:
        best = max(quant_rows := [r for r in quant if r["fmt"] == fmt], key=lambda r: r["q"])
        verdict = "met" if best["q"] >= GOALS["quantize_MBps"] else "MISSED"
        paths = ", ".join(f"{r['backend']} {r['q']:.0f}" for r in quant_rows)
        out.append(f"- {fmt} quantizer: {paths} MB/s (goal >= 1000: {verdict})")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~2.6M-parameter subset")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (best is kept)")
    parser.add_argument("--no-append", action="store_true", help="do not touch RESULTS.md")
    args = parser.parse_args(argv)
    reps = args.reps or (5 if args.quick else 3)
    shapes = gpt2_shapes(args.quick)
    params = sum(int(np.prod(s)) for s in shapes.values())
    load_before = os.getloadavg()[0]
    codec: list[dict[str, Any]] = []
    quant: list[dict[str, Any]] = []
    for dtype in ("F32", "BF16"):
        tensors = draw(shapes, dtype)
        codec += codec_rows(tensors, dtype, reps)
        if dtype == "F32":
            quant = quantizer_rows(tensors, reps)
        del tensors
    body = table(codec, quant, params)
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
