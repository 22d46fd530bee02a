"""The torch backend: F32 Values as torch tensors, for a syncer on a GPU learner.

This module imports torch; `gradientmail.backends` imports it only when a `TorchBackend`
is built, so a numpy-only syncer never loads torch.

Every elementwise operation is one float32 kernel (no `alpha=` adds or `addcmul`, which
may fuse a multiply and an add into one rounding), and scalars are rounded to float32
before they reach a kernel, so on CPU the bytes equal the numpy backend's. Reductions sum
exact float64 products; only the summation order differs from numpy.

A contribution made of parts (or a quantized one) loads as a `RowPieces`. On the CPU it
becomes a `TorchRows`, which the fused helpers read a `CPU_CHUNK` window at a time where
its pieces lie, as the numpy backend's `NumpyRows`; on an accelerator, whose helpers run
unchunked, it is copied onto the device window by window, never joined on the host.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, overload

import torch

from gradientmail.backends.numpy_backend import f32
from gradientmail.backends.pool import DEFAULT_POOL_BYTES, BufferPool
from gradientmail.errors import ConfigError
from gradientmail.wire.sharded_pieces import FlatRows, RowPieces
from gradientmail.wire.tensor_bytes import STORAGE_DTYPES, TensorBytes

__all__ = ["TorchBackend", "TorchRows", "TorchValue"]

#: Elements per chunk of the fused helpers on CPU: far larger than numpy's, because each
#: torch call costs microseconds of dispatch and, on several threads, a barrier (on a busy
#: machine a barrier can wait for a descheduled thread). On an accelerator the helpers run
#: unchunked.
CPU_CHUNK = 1 << 20

_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

# torch.frombuffer warns (once per process) that `bytes` are not writable. Values never
# write to a loaded tensor, so spend that one warning here, silenced, at import.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(bytearray(4), dtype=torch.float32)
    torch.frombuffer(bytes(4), dtype=torch.float32)


class TorchValue:
    """An F32 tensor held by torch on some device. Operations return new Values."""

    __slots__ = ("_owned", "_t")

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.dtype != torch.float32:
            raise ConfigError(f"TorchValue holds float32 tensors, not {tensor.dtype}")
        self._t = tensor
        # Whether the tensor is this Value's alone (a result of the backend, or a view of
        # bytes nobody writes): to_bytes then shares its host memory instead of copying.
        self._owned = False

    @classmethod
    def _of(cls, tensor: torch.Tensor) -> TorchValue:
        """A Value owning `tensor`, which nothing else writes."""
        value = cls(tensor)
        value._owned = True
        return value

    @property
    def tensor(self) -> torch.Tensor:
        """The underlying float32 tensor (may share read-only memory; do not modify)."""
        return self._t

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self._t.shape)

    def _other(self, other: object) -> torch.Tensor:
        if isinstance(other, TorchRows):
            other = other.joined()
        if not isinstance(other, TorchValue):
            raise ConfigError(
                f"cannot combine a torch Value with {type(other).__name__}; "
                "load both tensors with the same backend"
            )
        if other._t.shape != self._t.shape:
            raise ConfigError(f"shape {other.shape} does not match {self.shape}")
        return other._t

    def __add__(self, other: Any) -> TorchValue:
        return TorchValue._of(torch.add(self._t, self._other(other)))

    def __sub__(self, other: Any) -> TorchValue:
        return TorchValue._of(torch.sub(self._t, self._other(other)))

    def __mul__(self, k: float) -> TorchValue:
        return TorchValue._of(torch.mul(self._t, f32(k)))

    __rmul__ = __mul__

    def dot(self, other: Any) -> float:
        return float(_gram(_tensors([self, other]))[0, 1])

    def norm(self) -> float:
        return math.sqrt(float(_gram([self._t.reshape(-1)])[0, 0]))

    def isfinite(self) -> bool:
        return _all_finite(self._t)

    def to_bytes(self, dtype: str) -> TensorBytes:
        """The Value in `dtype` as host bytes. F32 on the CPU shares the Value's memory
        when the Value owns it; everything else is converted or copied to the host once,
        into memory the TensorBytes then holds without a further copy."""
        if dtype not in STORAGE_DTYPES:
            raise ConfigError(
                f"to_bytes: dtype {dtype!r} is not one of {', '.join(STORAGE_DTYPES)}"
            )
        t = self._t.reshape(-1)
        if dtype == "BF16":
            bits = t.to(torch.bfloat16).view(torch.int16)
            # torch's vectorised conversion turns NaN into 0xFFFF, its scalar one into
            # 0x7FC0; pin 0x7FC0 so both backends write the same bytes.
            bits = torch.where(torch.isnan(t), torch.tensor(0x7FC0, dtype=torch.int16), bits)
            data = bits.cpu().numpy()
        elif dtype == "F16":
            bits = t.to(torch.float16).view(torch.int16)
            # As numpy writes it; CUDA's conversion writes 0x7FFF.
            bits = torch.where(torch.isnan(t), torch.tensor(0x7E00, dtype=torch.int16), bits)
            data = bits.cpu().numpy()
        elif t.device.type != "cpu" or self._owned:
            data = t.cpu().numpy()  # a fresh host copy, or memory no one writes
        else:
            data = t.numpy().copy()
        data.flags.writeable = False
        return TensorBytes(dtype, self.shape, data)

    def __repr__(self) -> str:
        return f"TorchValue(shape={self.shape}, device={self._t.device})"


class _Flat:
    """The flat float32 elements of a `RowPieces` as CPU tensors, a slice at a time."""

    __slots__ = ("_rows", "device")

    def __init__(self, rows: RowPieces) -> None:
        self._rows = FlatRows(rows)
        self.device = torch.device("cpu")

    def numel(self) -> int:
        return self._rows.size

    def __getitem__(self, window: slice) -> torch.Tensor:
        with warnings.catch_warnings():  # a view of read-only bytes, never written
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self._rows[window])


class TorchRows:
    """A Value over a `RowPieces` on the CPU (a contribution made of parts, or a quantized
    one). The fused helpers and `dot`, `norm`, `isfinite` read it a `CPU_CHUNK` window at
    a time, where it lies: the windows, the Gram's float64 sums and every output byte are
    those of the same tensor loaded whole. The other operations join it first (a copy)."""

    __slots__ = ("_flat", "_tensor")

    def __init__(self, tensor: RowPieces) -> None:
        self._tensor = tensor
        self._flat = _Flat(tensor)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._tensor.shape

    def joined(self) -> TorchValue:
        """The Value as one tensor (a copy of every piece)."""
        out = torch.empty(self._flat.numel(), dtype=torch.float32)
        _fill(out, self._tensor)
        return TorchValue._of(out.reshape(self.shape))

    def __add__(self, other: Any) -> TorchValue:
        return self.joined().__add__(other)

    def __sub__(self, other: Any) -> TorchValue:
        return self.joined().__sub__(other)

    def __mul__(self, k: float) -> TorchValue:
        return self.joined() * k

    __rmul__ = __mul__

    def dot(self, other: Any) -> float:
        return float(_gram(_tensors([self, other]))[0, 1])

    def norm(self) -> float:
        return math.sqrt(float(_gram([self._flat])[0, 0]))

    def isfinite(self) -> bool:
        return _all_finite(self._flat)

    def to_bytes(self, dtype: str) -> TensorBytes:
        return self.joined().to_bytes(dtype)

    def __repr__(self) -> str:
        return f"TorchRows(shape={self.shape})"


#: What the helpers read: a flat float32 tensor, or the pieces of one on the CPU.
_Flats = torch.Tensor | _Flat


def _flat_of(v: object) -> _Flats:
    if isinstance(v, TorchRows):
        return v._flat
    if isinstance(v, TorchValue):
        return v._t.reshape(-1)
    raise ConfigError(
        f"cannot combine a torch Value with {type(v).__name__}; "
        "load both tensors with the same backend"
    )


def _tensors(values: Sequence[Any]) -> list[_Flats]:
    if not values:
        raise ConfigError("need at least one Value")
    first = values[0]
    if not isinstance(first, TorchValue | TorchRows):
        raise ConfigError(f"the torch backend cannot use a {type(first).__name__}")
    out = [_flat_of(first)]
    for v in values[1:]:
        out.append(_flat_of(v))
        if v.shape != first.shape:
            raise ConfigError(f"shape {v.shape} does not match {first.shape}")
    return out


def _fill(out: torch.Tensor, rows: RowPieces) -> None:
    """Writes the elements of `rows` into flat float32 `out` (on any device), one
    `CPU_CHUNK` window at a time: the host holds a window, never the whole tensor."""
    flat = _Flat(rows)
    for s in range(0, flat.numel(), CPU_CHUNK):
        out[s : s + CPU_CHUNK].copy_(flat[s : s + CPU_CHUNK])


def _all_finite(t: _Flats) -> bool:
    if t.numel() == 0:
        return True
    if isinstance(t, _Flat):
        return all(_all_finite(t[s : s + CPU_CHUNK]) for s in range(0, t.numel(), CPU_CHUNK))
    # One reduction pass and no boolean tensor of the input's size: NaN propagates through
    # min and max, and an infinity is the min or the max.
    lo, hi = torch.aminmax(t.reshape(-1))
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def _chunk(t: _Flats) -> int:
    return CPU_CHUNK if t.device.type == "cpu" else max(t.numel(), 1)


def _gram(flats: Sequence[_Flats]) -> torch.Tensor:
    m, size = len(flats), flats[0].numel()
    step = _chunk(flats[0])
    g = torch.zeros((m, m), dtype=torch.float64, device=flats[0].device)
    buf = torch.empty((m, min(step, size)), dtype=torch.float64, device=flats[0].device)
    for s in range(0, size, step):
        n = min(step, size - s)
        block = buf[:, :n]
        for i, t in enumerate(flats):
            block[i].copy_(t[s : s + n])
        g += block @ block.T
    return g.cpu()


def _lincomb_chunk(
    flats: list[_Flats], ks: list[float], s: int, n: int, out: torch.Tensor,
    tmp: torch.Tensor,
) -> None:
    torch.mul(flats[0][s : s + n], ks[0], out=out)
    for t, k in zip(flats[1:], ks[1:], strict=True):
        torch.mul(t[s : s + n], k, out=tmp)
        torch.add(out, tmp, out=out)


class TorchBackend:
    """Values as torch float32 tensors on `device` (default: CPU)."""

    name = "torch"

    def __init__(
        self, device: str | torch.device | None = None, pool_bytes: int = DEFAULT_POOL_BYTES
    ) -> None:
        self.device = torch.device("cpu" if device is None else device)
        # On the CPU, large outputs reuse memory of dropped states (see `BufferPool`).
        self.buffers = BufferPool(pool_bytes if self.device.type == "cpu" else 0)

    def _empty(self, like: _Flats) -> torch.Tensor:
        if like.device.type != "cpu":
            assert isinstance(like, torch.Tensor)  # pieces are read on the CPU only
            return torch.empty_like(like)
        return torch.from_numpy(self.buffers.empty(like.numel()))

    @overload
    def load(self, tensor: TensorBytes) -> TorchValue: ...

    @overload
    def load(self, tensor: RowPieces) -> TorchValue | TorchRows: ...

    @overload
    def load(self, tensor: TensorBytes | RowPieces) -> TorchValue | TorchRows: ...

    def load(self, tensor: TensorBytes | RowPieces) -> TorchValue | TorchRows:
        """A Value from F32, F16 or BF16 bytes (exactly widened to float32; F32 bytes on
        the CPU are viewed in place, read-only by the Value contract). From `RowPieces`:
        on the CPU a `TorchRows` reading them where they lie (nothing copied); on an
        accelerator, whose helpers read whole tensors, one device tensor filled a window
        at a time from the pieces (never joined on the host)."""
        if isinstance(tensor, RowPieces):
            if self.device.type == "cpu":
                return TorchRows(tensor)
            out = torch.empty(tensor.numel, dtype=torch.float32, device=self.device)
            _fill(out, tensor)
            return TorchValue._of(out.reshape(tensor.shape))
        dt = _TORCH_DTYPES.get(tensor.dtype)
        if dt is None:
            raise ConfigError(
                f"cannot load a {tensor.dtype} tensor as a Value; dequantize it to F32 first"
            )
        # frombuffer refuses an empty buffer.
        t = torch.frombuffer(tensor.buffer, dtype=dt) if tensor.nbytes else torch.empty(0, dtype=dt)
        t = t.to(self.device).to(torch.float32)
        return TorchValue._of(t.reshape(tensor.shape))

    def zeros(self, shape: tuple[int, ...]) -> TorchValue:
        return TorchValue._of(torch.zeros(shape, dtype=torch.float32, device=self.device))

    def all_finite(self, value: Any) -> bool:
        """`value.isfinite()`."""
        (t,) = _tensors([value])
        return _all_finite(t)

    def gram(self, values: Sequence[Any]) -> list[list[float]]:
        """G[i][j] = values[i].dot(values[j]) (float64 sums of exact products)."""
        g = _gram(_tensors(values))
        return [[float(x) for x in row] for row in g.tolist()]

    def lincomb(self, values: Sequence[Any], coeffs: Sequence[float]) -> TorchValue:
        """c₀·v₀ + c₁·v₁ + … left to right in float32; the bytes of the Value chain."""
        flats = _tensors(values)
        ks = _coeffs(coeffs, len(flats))
        out = self._empty(flats[0])
        step = _chunk(out)
        tmp = torch.empty(min(step, out.numel()), dtype=torch.float32, device=out.device)
        for s in range(0, out.numel(), step):
            n = min(step, out.numel() - s)
            _lincomb_chunk(flats, ks, s, n, out[s : s + n], tmp[:n])
        return TorchValue._of(out.reshape(values[0].shape))

    def outer_step(
        self,
        theta: Any,
        momentum: Any,
        values: Sequence[Any],
        coeffs: Sequence[float],
        lr: float,
        beta: float,
    ) -> tuple[TorchValue, TorchValue]:
        """Nesterov on Δ = lincomb(values, coeffs): m ← β·m + Δ; Θ ← Θ − η·(Δ + β·m)."""
        flats = _tensors(values)
        th, mo = _tensors([theta, momentum])
        if th.numel() != flats[0].numel():
            raise ConfigError(f"theta shape {theta.shape} does not match {values[0].shape}")
        ks = _coeffs(coeffs, len(flats))
        b, eta = f32(beta), f32(lr)
        th_out, mo_out = self._empty(th), self._empty(mo)
        step = _chunk(th)
        d = torch.empty(min(step, th.numel()), dtype=torch.float32, device=th.device)
        tmp = torch.empty_like(d)
        for s in range(0, th.numel(), step):
            n = min(step, th.numel() - s)
            dd, tt, mm = d[:n], tmp[:n], mo_out[s : s + n]
            _lincomb_chunk(flats, ks, s, n, dd, tt)
            torch.mul(mo[s : s + n], b, out=mm)
            torch.add(mm, dd, out=mm)
            torch.mul(mm, b, out=tt)
            torch.add(dd, tt, out=tt)
            torch.mul(tt, eta, out=tt)
            torch.sub(th[s : s + n], tt, out=th_out[s : s + n])
        shape = tuple(theta.shape)
        return TorchValue._of(th_out.reshape(shape)), TorchValue._of(mo_out.reshape(shape))


def _coeffs(coeffs: Sequence[float], m: int) -> list[float]:
    if len(coeffs) != m:
        raise ConfigError(f"{len(coeffs)} coefficients for {m} values")
    return [f32(c) for c in coeffs]

