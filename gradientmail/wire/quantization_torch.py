"""Transfer formats by torch kernels on a tensor's own device (`quantize_tensor`).

The bytes are those of `gradientmail.wire.quantization`'s numpy path, which the tests
check on the CPU: the same scale choice (from the absmax's float32 bits), the same
scaled values (a multiplication by a power of two), F8_E4M3 by torch's float8 cast
(round to nearest even, as ml_dtypes'), F4 through the numpy path's table of codes,
BF16 by torch's bfloat16 cast. On a GPU the whole tensor is one batch of kernels and
only the codes and scales cross to the host; on the CPU the kernels run a chunk at a
time. Importing this module imports torch; `quantization` never imports it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import ml_dtypes
import numpy as np
import numpy.typing as npt
import torch

from gradientmail.errors import ConfigError
from gradientmail.wire.quantization import (
    BLOCK,
    F4_CODES,
    check_format,
    check_quantizable,
    non_finite_error,
    overflow_error,
    scale_name,
)
from gradientmail.wire.tensor_bytes import TensorBytes, handed_over

__all__ = ["host_bytes", "quantize_bytes", "quantize_tensor", "quantize_tensors"]

_F32_MAX = float(np.finfo(np.float32).max)
# Elements per op on the CPU: ATen's grain size, below which an op runs in the calling
# thread. The learner quantizes on its communication thread while training runs torch on
# the others; multi-threaded ops there meet at OpenMP barriers that stall whenever the
# cores are oversubscribed (measured 10x to 100x slowdowns on a busy 2-core machine).
_CPU_CHUNK = 1 << 15
_SOURCE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_TABLES: dict[torch.device, torch.Tensor] = {}


def quantize_bytes(name: str, tensor: TensorBytes, fmt: str) -> dict[str, TensorBytes]:
    """`quantize_tensor` of a host `TensorBytes` (F32, F16 or BF16), viewed without a copy:
    the bytes of `quantization.quantize`."""
    check_quantizable(name, tensor, fmt)
    raw = np.frombuffer(tensor.buffer, np.uint8)
    with warnings.catch_warnings():  # read-only input: no kernel writes through the view
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(raw)
    return quantize_tensor(name, flat.view(_SOURCE[tensor.dtype]).reshape(tensor.shape), fmt)


def quantize_tensor(name: str, tensor: torch.Tensor, fmt: str) -> dict[str, TensorBytes]:
    """The entries `quantization.quantize` gives for `tensor` (float32, float16 or
    bfloat16, on any device), computed on its device: only the codes and scales are
    copied to the host. The same errors (`NonFiniteError` naming the tensor)."""
    return quantize_tensors({name: tensor}, fmt)


def quantize_tensors(tensors: Mapping[str, torch.Tensor], fmt: str) -> dict[str, TensorBytes]:
    """`quantize_tensor` of each of `tensors`, in their order. The tensors of one device
    are one batch: every kernel writes into one buffer of codes and one of scales, and
    the host waits once and copies each buffer once (the entries are views of those
    copies), instead of waiting and copying per tensor. Errors as `quantize_tensor`'s,
    for the first bad tensor in order."""
    check_format(fmt)
    out: dict[str, TensorBytes] = {}
    run: list[tuple[str, torch.Tensor]] = []
    for name, tensor in tensors.items():
        if tensor.dtype not in _SOURCE.values():
            raise ConfigError(f"tensor {name!r}: can only quantize float32, float16 or "
                              f"bfloat16, not {tensor.dtype}")
        if run and tensor.device != run[0][1].device:
            out |= _batch(run, fmt)
            run = []
        run.append((name, tensor))
    return out | _batch(run, fmt) if run else out


def _code_bytes(fmt: str, numel: int) -> int:
    """Bytes of codes a tensor takes in the batch buffer (F4: whole blocks)."""
    return {"BF16": 2 * numel, "F8_E4M3": numel}.get(fmt, -(-numel // BLOCK) * BLOCK // 2)


@torch.no_grad()
def _batch(items: list[tuple[str, torch.Tensor]], fmt: str) -> dict[str, TensorBytes]:
    device = items[0][1].device
    # On the CPU, ops of at most _CPU_CHUNK elements; on a GPU, one op per tensor.
    step = _CPU_CHUNK if device.type == "cpu" else 0
    flat = [t.detach().reshape(-1) for _, t in items]
    ends = np.cumsum([_code_bytes(fmt, x.numel()) for x in flat]).tolist()
    codes = torch.empty(ends[-1], dtype=torch.uint8, device=device)
    nblocks = np.cumsum([-(-x.numel() // BLOCK) for x in flat]).tolist()
    scales = torch.empty(nblocks[-1] if fmt == "F4" else 0, dtype=torch.uint8, device=device)
    # Per tensor: its absmax (F4: the largest block absmax), NaN or infinite if any value
    # is, and F8's exponent k; 0 for an empty tensor.
    amax = torch.zeros(len(items), dtype=torch.float32, device=device)
    k = torch.zeros(len(items), dtype=torch.int32, device=device)
    block_amax = []
    for i, x in enumerate(flat):
        start = ends[i - 1] if i else 0
        out = codes[start : ends[i]]
        if fmt == "F4":
            first = nblocks[i - 1] if i else 0
            block_amax.append(_f4(x, out, scales[first : nblocks[i]], amax[i], step))
        elif fmt == "F8_E4M3":
            _f8(x, out.view(torch.float8_e4m3fn), amax[i], k[i], step)
        elif x.numel():
            amax[i] = _absmax(x, step or x.numel())
            out.view(torch.bfloat16).copy_(x)
    codes_h, scales_h = _host(codes), _host(scales)  # the host waits here, once
    amax_h, k_h = amax.cpu().numpy(), k.cpu().numpy()
    entries: dict[str, TensorBytes] = {}
    for i, (name, _) in enumerate(items):
        if not math.isfinite(float(amax_h[i])):
            raise _non_finite(name, flat[i], fmt)
        start, shape = (ends[i - 1] if i else 0), tuple(int(d) for d in items[i][1].shape)
        if fmt == "BF16":
            top = np.array(amax_h[i], np.float32).astype(ml_dtypes.bfloat16)
            if not math.isfinite(float(top)):
                raise overflow_error(name, fmt)
            entries[name] = TensorBytes("BF16", shape, codes_h[start : ends[i]])
        elif fmt == "F8_E4M3":
            e = int(k_h[i])
            scaled = np.array(float(amax_h[i]) * math.ldexp(1.0, -e), np.float32)
            if math.ldexp(float(scaled.astype(ml_dtypes.float8_e4m3fn)), e) > _F32_MAX:
                raise overflow_error(name, fmt)
            scale = TensorBytes("F32", (), np.float32(math.ldexp(1.0, e)).tobytes())
            entries[name] = TensorBytes("F8_E4M3", shape, codes_h[start : ends[i]])
            entries[scale_name(name)] = scale
        else:
            first = nblocks[i - 1] if i else 0
            e8 = scales_h[first : nblocks[i]]
            _check_f4_overflow(name, e8, block_amax[i])
            n = flat[i].numel()
            entries[name] = TensorBytes("F4", shape, codes_h[start : start + (n + 1) // 2])
            entries[scale_name(name)] = TensorBytes("F8_E8M0", (e8.size,), e8)
    return entries


def host_bytes(t: torch.Tensor) -> npt.NDArray[np.uint8]:
    """A device buffer of bytes as a read-only host array, the host waiting for it (the
    way every encoder on a device brings its output over: `_host`)."""
    return _host(t)


def _host(t: torch.Tensor) -> npt.NDArray[np.uint8]:
    """A device buffer's bytes as a read-only host array (a CPU one as it is: ours).

    From a CUDA device into pinned memory: the copy runs at the link's speed, about twice
    a copy into pageable memory's. torch's caching host allocator keeps those pages for
    the next round's payload once this one's entries are dropped."""
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t)  # blocking: the host waits for the device here
    else:
        host = t.cpu()
    arr: npt.NDArray[np.uint8] = host.numpy()
    return handed_over(arr)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def _absmax(x: torch.Tensor, step: int) -> torch.Tensor:
    """max |x| as a float32 0-d tensor on x's device (NaN or infinity if any)."""
    parts = [_f32(x[i : i + step]).abs().amax() for i in range(0, x.numel(), step)]
    return parts[0] if len(parts) == 1 else torch.stack(parts).amax()


def _non_finite(name: str, x: torch.Tensor, fmt: str) -> Exception:
    bad = ~torch.isfinite(x)
    return non_finite_error(name, int(bad.sum()), int(torch.nonzero(bad)[0, 0]), fmt)


def _f8(x: torch.Tensor, out: torch.Tensor, amax: torch.Tensor, k: torch.Tensor,
        step: int) -> None:
    """F8 codes of `x` into `out`; its absmax into `amax`, its exponent into `k`."""
    n = x.numel()
    if not n:
        return
    step = step or n
    amax.copy_(_absmax(x, step))
    # The smallest k with amax <= 448 · 2^k, from the bits as `_f4` finds F4's:
    # absmax = 1.f · 2^(b − 127) against 448 = 1.75 · 2^8, so k = b − 135, one more
    # when f > 0x600000; on the device, so that no kernel waits for the host.
    bits = amax.view(torch.int32)
    e = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    k.copy_(torch.where(bits == 0, 0, e.clamp(-126, 127)))
    # A finite absmax has k <= 120 (448 · 2^120 > 2^128), so 2^-k is a normal float;
    # the clamp only keeps a NaN's factor a number until the host refuses it.
    inv = ((127 - k.clamp(max=126)) << 23).view(torch.float32)
    for i in range(0, n, step):
        out[i : i + step] = _f32(x[i : i + step]) * inv


def _codes_table(device: torch.device) -> torch.Tensor:
    table = _TABLES.get(device)
    if table is None:
        table = _TABLES[device] = torch.from_numpy(F4_CODES.copy()).to(device)
    return table


def _f4(x: torch.Tensor, out: torch.Tensor, e8: torch.Tensor, amax: torch.Tensor,
        step: int) -> list[torch.Tensor]:
    """F4 codes of `x` into `out` (whole blocks, the last padded with zeros), the blocks'
    E8M0 scales into `e8`, the largest block absmax into `amax`; returns the blocks'
    absmaxes, a chunk at a time."""
    n = x.numel()
    if not n:
        return []
    step = -(-(step or n) // BLOCK) * BLOCK
    table = _codes_table(x.device)
    block_amax = []
    for i in range(0, n, step):
        part = _f32(x[i : i + step])
        if part.numel() % BLOCK:
            part = torch.nn.functional.pad(part, (0, -part.numel() % BLOCK))
        blocks = part.view(-1, BLOCK)
        bamax = blocks.abs().amax(dim=1)
        block_amax.append(bamax)
        # As `quantization._f4_exponents`: absmax = 1.f · 2^(b − 127) against 6 = 1.5 · 2^2.
        bits = bamax.view(torch.int32)
        k = (bits >> 23) - 129 + ((bits & 0x7FFFFF) > 0x400000).to(torch.int32)
        k = torch.where(bits == 0, 0, k.clamp(-127, 126))
        e8[i // BLOCK : i // BLOCK + k.numel()] = (k + 127).to(torch.uint8)
        inv = ((127 - k) << 23).view(torch.float32)
        y = (blocks * inv[:, None]).view(torch.int32)
        # Round to odd at 16 bits (`quantization._round_to_odd_16`), then the table.
        idx = ((y | ((y & 0xFFFF) + 0xFFFF)) >> 16) & 0xFFFF
        codes = table[idx.reshape(-1)]
        out[i // 2 : i // 2 + codes.numel() // 2] = codes[0::2] | (codes[1::2] << 4)
    amax.copy_(torch.stack([b.amax() for b in block_amax]).amax())
    return block_amax


def _check_f4_overflow(
    name: str, e8: npt.NDArray[np.uint8], block_amax: list[torch.Tensor]
) -> None:
    """`overflow_error` if a block's largest value, rounded to E2M1 and scaled back by
    its 2^k, passes float32's maximum (only k >= 126 can; their absmaxes are fetched)."""
    k = e8.astype(np.int32) - 127
    big = k >= 126
    if not big.any():
        return
    where = torch.from_numpy(np.flatnonzero(big)).to(block_amax[0].device)
    amax = torch.cat(block_amax)[where].cpu().numpy()
    inv = np.ldexp(np.ones(amax.size, np.float32), -k[big]).astype(np.float32)
    top = (amax * inv).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    if (np.ldexp(top, k[big]) > _F32_MAX).any():
        raise overflow_error(name, "F4")
