"""Transfer formats by torch kernels on a tensor's own device (`quantize_tensor`).

The bytes are those of `gradientmail.wire.quantization`'s numpy path, which the tests
check on the CPU: the same scale choice (from the absmax's float32 bits), the same
scaled values (a multiplication by a power of two), F8_E4M3 by torch's float8 cast
(round to nearest even, as ml_dtypes'), F4 through the numpy path's table of codes,
BF16 by torch's bfloat16 cast. On a GPU the whole tensor is one batch of kernels and
only the codes and scales cross to the host; on the CPU the kernels run a chunk at a
time. Importing this module imports torch: `quantization` imports it only for
``backend="torch"``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np
import numpy.typing as npt
import torch

from gradientmail.errors import ConfigError
from gradientmail.wire.quantization import (
    BLOCK,
    F4_CODES,
    check_format,
    non_finite_error,
    overflow_error,
    scale_name,
)
from gradientmail.wire.serialization import TensorBytes, handed_over

__all__ = ["quantize_bytes", "quantize_tensor", "quantize_tensors"]

_F32_MAX = float(np.finfo(np.float32).max)
# Elements per op on the CPU: ATen's grain size, below which an op runs in the calling
# thread. The learner quantizes on its communication thread while training runs torch on
# the others; multi-threaded ops there meet at OpenMP barriers that stall whenever the
# cores are oversubscribed (measured 10x to 100x slowdowns on a busy 2-core machine).
_CPU_CHUNK = 1 << 15
_SOURCE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_TABLES: dict[torch.device, torch.Tensor] = {}


def quantize_bytes(name: str, tensor: TensorBytes, fmt: str) -> dict[str, TensorBytes]:
    """`quantize_tensor` of a host `TensorBytes` (F32, F16 or BF16), viewed without a copy."""
    raw = np.frombuffer(tensor.buffer, np.uint8)
    with warnings.catch_warnings():  # read-only input: no kernel writes through the view
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(raw)
    return quantize_tensor(name, flat.view(_SOURCE[tensor.dtype]).reshape(tensor.shape), fmt)


def quantize_tensor(name: str, tensor: torch.Tensor, fmt: str) -> dict[str, TensorBytes]:
    """The entries `quantization.quantize` gives for `tensor` (float32, float16 or
    bfloat16, on any device), computed on its device: only the codes and scales are
    copied to the host. The same errors (`NonFiniteError` naming the tensor)."""
    return _launch(name, tensor, fmt)()


def quantize_tensors(tensors: Mapping[str, torch.Tensor], fmt: str) -> dict[str, TensorBytes]:
    """`quantize_tensor` of each of `tensors`, every kernel launched before any result is
    read: on a GPU the host waits for the device once, then copies the codes, instead
    of once per tensor. Errors as `quantize_tensor`'s, for the first bad tensor in order."""
    finish = [_launch(name, t, fmt) for name, t in tensors.items()]
    out: dict[str, TensorBytes] = {}
    for done in finish:
        out.update(done())
    return out


_Finish = Callable[[], dict[str, TensorBytes]]


@torch.no_grad()
def _launch(name: str, tensor: torch.Tensor, fmt: str) -> _Finish:
    """Launch `tensor`'s kernels; the returned function waits for them, checks, and copies."""
    check_format(fmt)
    if tensor.dtype not in _SOURCE.values():
        raise ConfigError(
            f"tensor {name!r}: can only quantize float32, float16 or bfloat16, not {tensor.dtype}"
        )
    shape = tuple(int(d) for d in tensor.shape)
    x = tensor.detach().reshape(-1)
    step = _CPU_CHUNK if x.device.type == "cpu" else max(x.numel(), 1)
    if fmt == "F4":
        return _launch_f4(name, shape, x, step)
    if fmt == "F8_E4M3":
        return _launch_f8(name, shape, x, step)
    amax = _absmax(x, step)
    codes = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)

    def finish() -> dict[str, TensorBytes]:
        a = float(amax)
        if not math.isfinite(a):
            raise _non_finite(name, x, fmt)
        if not math.isfinite(float(np.array(a, np.float32).astype(ml_dtypes.bfloat16))):
            raise overflow_error(name, fmt)
        return {name: TensorBytes("BF16", shape, _host(codes, copy=codes is x))}

    return finish


def _host(t: torch.Tensor, *, copy: bool = False) -> npt.NDArray[np.uint8]:
    """`t`'s bytes as a read-only host array; copied when `t` may be someone else's."""
    if not t.numel():  # an empty tensor's stride may be 0, which `view` refuses
        return handed_over(np.empty(0, np.uint8))
    out = t.reshape(-1).view(torch.uint8).cpu()
    arr: npt.NDArray[np.uint8] = out.numpy()
    if copy and out.data_ptr() == t.data_ptr():
        arr = arr.copy()
    return handed_over(arr)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def _absmax(x: torch.Tensor, step: int) -> torch.Tensor:
    """max |x| as a float32 0-d tensor on x's device (NaN or infinity if any), 0 when empty."""
    parts = [_f32(x[i : i + step]).abs().amax() for i in range(0, x.numel(), step)]
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).amax()


def _non_finite(name: str, x: torch.Tensor, fmt: str) -> Exception:
    bad = ~torch.isfinite(x)
    return non_finite_error(name, int(bad.sum()), int(torch.nonzero(bad)[0, 0]), fmt)


def _launch_f8(name: str, shape: tuple[int, ...], x: torch.Tensor, step: int) -> _Finish:
    # The smallest k with amax <= 448 · 2^k, from the bits as `_launch_f4` finds F4's:
    # absmax = 1.f · 2^(b − 127) against 448 = 1.75 · 2^8. On the device, so that no
    # kernel waits for the host.
    amax = _absmax(x, step)
    bits = amax.view(torch.int32)
    k = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    k = torch.where(bits == 0, 0, k.clamp(-126, 127))
    # A finite absmax has k <= 120 (448 · 2^120 > 2^128), so 2^-k is a normal float;
    # the clamp only keeps a NaN's factor a number until the check refuses it.
    inv = ((127 - k.clamp(max=126)) << 23).view(torch.float32)
    out = torch.empty(x.numel(), dtype=torch.float8_e4m3fn, device=x.device)
    for i in range(0, x.numel(), step):
        out[i : i + step] = _f32(x[i : i + step]) * inv

    def finish() -> dict[str, TensorBytes]:
        a = float(amax)
        if not math.isfinite(a):
            raise _non_finite(name, x, "F8_E4M3")
        e = int(k)
        top = float(np.array(a * math.ldexp(1.0, -e), np.float32).astype(ml_dtypes.float8_e4m3fn))
        if math.ldexp(top, e) > _F32_MAX:
            raise overflow_error(name, "F8_E4M3")
        scale = TensorBytes("F32", (), np.float32(math.ldexp(1.0, e)).tobytes())
        return {name: TensorBytes("F8_E4M3", shape, _host(out)), scale_name(name): scale}

    return finish


def _codes_table(device: torch.device) -> torch.Tensor:
    table = _TABLES.get(device)
    if table is None:
        table = _TABLES[device] = torch.from_numpy(F4_CODES.copy()).to(device)
    return table


def _launch_f4(name: str, shape: tuple[int, ...], x: torch.Tensor, step: int) -> _Finish:
    n = x.numel()
    step = -(-step // BLOCK) * BLOCK
    table = _codes_table(x.device)
    packed = torch.empty(-(-n // BLOCK) * BLOCK // 2, dtype=torch.uint8, device=x.device)
    e8 = torch.empty(-(-n // BLOCK), dtype=torch.uint8, device=x.device)
    amaxes, finite = [], []
    for i in range(0, n, step):
        part = _f32(x[i : i + step])
        if part.numel() % BLOCK:
            part = torch.nn.functional.pad(part, (0, -part.numel() % BLOCK))
        blocks = part.view(-1, BLOCK)
        amax = blocks.abs().amax(dim=1)
        finite.append(torch.isfinite(amax).all())
        amaxes.append(amax)
        # As `quantization._f4_exponents`: absmax = 1.f · 2^(b − 127) against 6 = 1.5 · 2^2.
        bits = amax.view(torch.int32)
        k = (bits >> 23) - 129 + ((bits & 0x7FFFFF) > 0x400000).to(torch.int32)
        k = torch.where(bits == 0, 0, k.clamp(-127, 126))
        e8[i // BLOCK : i // BLOCK + k.numel()] = (k + 127).to(torch.uint8)
        inv = ((127 - k) << 23).view(torch.float32)
        y = (blocks * inv[:, None]).view(torch.int32)
        # Round to odd at 16 bits (`quantization._round_to_odd_16`), then the table.
        idx = ((y | ((y & 0xFFFF) + 0xFFFF)) >> 16) & 0xFFFF
        codes = table[idx.reshape(-1)]
        packed[i // 2 : i // 2 + codes.numel() // 2] = codes[0::2] | (codes[1::2] << 4)

    def finish() -> dict[str, TensorBytes]:
        if finite and not bool(torch.stack(finite).all()):
            raise _non_finite(name, x, "F4")
        e8_host = _host(e8)
        k_host = e8_host.astype(np.int32) - 127
        big = k_host >= 126  # only these can round past float32's maximum when decoded
        if big.any():
            where = torch.from_numpy(np.flatnonzero(big)).to(x.device)
            amax_big = torch.cat(amaxes)[where].cpu().numpy()
            inv_big = np.ldexp(np.ones(amax_big.size, np.float32), -k_host[big])
            top = (amax_big * inv_big.astype(np.float32)).astype(ml_dtypes.float4_e2m1fn)
            if (np.ldexp(top.astype(np.float64), k_host[big]) > _F32_MAX).any():
                raise overflow_error(name, "F4")
        codes_host = _host(packed[: (n + 1) // 2])
        scale = TensorBytes("F8_E8M0", (e8_host.size,), e8_host)
        return {name: TensorBytes("F4", shape, codes_host), scale_name(name): scale}

    return finish
