"""The ``TOPK_F8`` encoder of `gradientmail.wire.sparse` as torch kernels on a tensor's
own device (`sparsify_tensor`).

This module only computes. The format (the chunk size, the exponent rule, the entries'
names and layout, the overflow rule) is `wire.sparse`'s, which assembles the entries
(`sparse_entries`) and checks them (`check_overflow`) from what comes to the host: per
tensor one copy of its codes, offsets, chunk exponents and chunk absmaxes, a little over
3 bytes per value kept. The bytes are `sparse.sparsify`'s, which the tests check on the
CPU (ties, zeros, odd lengths): the top k of each chunk by |value| with ties at the
threshold going to the lowest offsets, found as numpy finds them (the threshold is the
k-th largest |value|, which `topk` gives whatever order it returns its values in; then
every element above it, and the first elements equal to it up to k); the exponent from
the absmax's float32 bits (the rule `quantization_torch` uses for F8); the codes by
torch's float8 cast (round to nearest even, as ml_dtypes'). Importing this module
imports torch; `sparse` never imports it.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from gradientmail.errors import ConfigError
from gradientmail.wire.quantization import non_finite_error
from gradientmail.wire.quantization_torch import host_bytes
from gradientmail.wire.sparse import (
    CHUNK,
    check_overflow,
    chunk_counts,
    chunk_k,
    sparse_entries,
)
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["sparsify_tensor"]

_SOURCE = (torch.float32, torch.float16, torch.bfloat16)
# Chunks (rows of CHUNK) per batch of kernels. On the CPU, 8 rows = 32 Ki elements, ATen's
# grain size: every op runs in the calling thread (the learner encodes on its
# communication thread while training runs torch on the others; see quantization_torch).
# On a GPU, 4096 rows = 16 Mi elements, which bounds the temporaries (about 14 bytes an
# element) while each kernel still fills the device.
_CPU_ROWS = 8
_GPU_ROWS = 4096


@torch.no_grad()
def sparsify_tensor(name: str, x: torch.Tensor, density: float) -> tuple[
        dict[str, TensorBytes], torch.Tensor, torch.Tensor]:
    """`sparse.sparsify_sent` of `x` (float32, float16 or bfloat16, any shape, on any
    device), computed on x's device: the entries (on the host, byte for byte
    `sparse.sparsify`'s), the flat positions kept (int64, ascending) and the float32
    values `densify` gives them, both on x's device. The same errors (`NonFiniteError`
    naming the tensor for NaN, infinity or a code that overflows float32)."""
    if x.dtype not in _SOURCE:
        raise ConfigError(f"tensor {name!r}: can only sparsify float32, float16 or bfloat16, "
                          f"not {x.dtype}")
    k = chunk_k(density)
    flat = x.detach().reshape(-1)
    flat = flat if flat.dtype == torch.float32 else flat.to(torch.float32)
    n = flat.numel()
    full = n // CHUNK
    rows = _CPU_ROWS if flat.device.type == "cpu" else _GPU_ROWS
    pos_parts: list[torch.Tensor] = []
    amax_parts: list[torch.Tensor] = []
    if full:
        block = flat[: full * CHUNK].view(full, CHUNK)
        for r in range(0, full, rows):
            pos, amax = _top(block[r : r + rows], min(k, CHUNK))
            pos_parts.append(pos + r * CHUNK)
            amax_parts.append(amax)
    if n % CHUNK:
        last = flat[full * CHUNK :].view(1, -1)
        pos, amax = _top(last, min(k, last.shape[1]))
        pos_parts.append(pos + full * CHUNK)
        amax_parts.append(amax)
    device = flat.device
    pos = torch.cat(pos_parts) if pos_parts else torch.zeros(0, dtype=torch.int64, device=device)
    amax = (torch.cat(amax_parts) if amax_parts
            else torch.zeros(0, dtype=torch.float32, device=device))
    chunk = pos // CHUNK
    # The smallest k with amax <= 448 · 2^k, from the bits (`quantization_torch._f8`):
    # absmax = 1.f · 2^(b − 127) against 448 = 1.75 · 2^8.
    bits = amax.view(torch.int32)
    e = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    kexp = torch.where(bits == 0, 0, e.clamp(-126, 127))
    # 2^-k and 2^k as float32 bits; a finite absmax has k <= 120, the clamp only keeps a
    # NaN's factor a number until the host refuses it.
    inv = ((127 - kexp.clamp(max=126)) << 23).view(torch.float32)
    scale = ((kexp + 127) << 23).view(torch.float32)
    codes = (flat[pos] * inv[chunk]).to(torch.float8_e4m3fn)
    sent = codes.to(torch.float32) * scale[chunk]
    nnz, m = pos.numel(), amax.numel()
    # One copy to the host: codes (1 byte a value), offsets (2), exponents (1 a chunk:
    # k fits an int8), absmaxes (4 a chunk).
    packed = torch.cat([
        codes.view(torch.uint8),
        (pos - chunk * CHUNK).to(torch.int16).view(torch.uint8),
        kexp.to(torch.int8).view(torch.uint8),
        amax.view(torch.uint8),
    ])
    host = host_bytes(packed)  # the host waits here, once
    amax_h: npt.NDArray[np.float32] = host[3 * nnz + m :].view("<f4")
    if not np.isfinite(amax_h).all():
        bad = ~torch.isfinite(flat)
        raise non_finite_error(name, int(bad.sum()), int(torch.nonzero(bad)[0, 0]), "TOPK_F8")
    kexp_h = host[3 * nnz : 3 * nnz + m].view(np.int8).astype(np.int32)
    check_overflow(name, amax_h, kexp_h)
    entries = sparse_entries(name, host[:nnz], host[nnz : 3 * nnz].view("<u2"),
                             chunk_counts(n, k), kexp_h)
    return entries, pos, sent


def _top(block: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions (row-major, ascending) of the k largest |values| of each row of
    `block`, ties at the threshold going to the lowest indices; and each row's absmax
    (NaN or infinite when a value is). Exactly k a row, whatever the values: a row with
    a NaN yields some k positions (the host refuses the tensor afterwards)."""
    a = block.abs()
    thr = torch.topk(a, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    keep = a > thr
    tied = a == thr
    need = k - keep.sum(dim=1, keepdim=True, dtype=torch.int32)
    keep |= tied & (torch.cumsum(tied, dim=1, dtype=torch.int32) <= need)
    pos = _nonzero(keep.view(-1), a.shape[0] * k)
    return pos, a.amax(dim=1)


def _nonzero(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of `mask`'s first `count` set elements (ascending; padded with the last
    index when fewer are set), without the host sync of a plain `nonzero` where the
    device offers `nonzero_static`."""
    try:
        out = torch.nonzero_static(mask, size=count, fill_value=mask.numel() - 1)
    except (NotImplementedError, RuntimeError):
        out = torch.nonzero(mask)
        if out.shape[0] != count:  # a NaN row: keep the shapes, the host refuses it
            pad = torch.full((count, 1), mask.numel() - 1, dtype=out.dtype, device=out.device)
            pad[: min(count, out.shape[0])] = out[:count]
            out = pad
    return out[:, 0]
