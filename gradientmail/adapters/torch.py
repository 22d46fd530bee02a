"""TorchAdapter: a torch module's parameters seen as a Schema and TensorBytes.

The training thread calls `snapshot` (a clone on the parameters' own device: on a GPU it is
queued on the stream, no host sync), `apply` and `rebase` (in-place `copy_` under
`no_grad`, so optimizers, hooks and `torch.compile` keep the same Parameter objects).
Turning a snapshot into bytes (`to_bytes`), the device-to-host copy, is left to the
communication thread.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from gradientmail.adapters.base import check_fits
from gradientmail.errors import ConfigError, SchemaMismatch
from gradientmail.wire.quantization import quantize
from gradientmail.wire.quantization_torch import quantize_tensors
from gradientmail.wire.serialization import ParameterSpec, Schema
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["TorchAdapter", "from_torch", "to_torch"]

# Bytes of F32 differences `delta_quantized` holds on the device between two waits.
_QUANTIZE_BATCH = 64 << 20
_TO_NAME = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_FROM_NAME = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
}


# torch.frombuffer warns (once per process) that a read-only buffer is not writable. The
# views made here are only ever read (copied from), so spend that warning at import.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(bytes(4), dtype=torch.float32)


def _view(tensor: TensorBytes) -> torch.Tensor:
    """A CPU tensor over `tensor`'s memory, no copy. It may be read-only memory shared
    with a payload: only read it (copy from it), never write it or hand it out."""
    try:
        dtype = _FROM_NAME[tensor.dtype]
    except KeyError:
        raise ConfigError(
            f"cannot load a {tensor.dtype} tensor into torch directly; dequantize it first"
        ) from None
    if tensor.numel == 0:  # frombuffer refuses an empty buffer
        return torch.empty(tensor.shape, dtype=dtype)
    return torch.frombuffer(tensor.buffer, dtype=dtype).reshape(tensor.shape)


def to_torch(tensor: TensorBytes, device: torch.device | str | None = None) -> torch.Tensor:
    """A new torch tensor holding `tensor` (F32/F16/BF16/F8_E4M3), on `device`: one copy,
    straight from the TensorBytes' memory to the device."""
    return _view(tensor).to(device=device, copy=True)


def from_torch(tensor: torch.Tensor, dtype: str | None = None) -> TensorBytes:
    """The bytes of `tensor` (cast to `dtype` first, round to nearest even), on the host.

    At most one copy: a conversion or device-to-host transfer makes new memory, which the
    TensorBytes then holds as is; a CPU tensor already in `dtype` is copied once (its
    owner may write it later).
    """
    if dtype is None:
        dtype = _TO_NAME.get(tensor.dtype, "")
        if not dtype:
            raise ConfigError(f"torch dtype {tensor.dtype} is not one of float32/float16/bfloat16")
    target = _FROM_NAME.get(dtype)
    if target is None or dtype == "F8_E4M3":
        raise ConfigError(f"from_torch: dtype {dtype!r} must be F32, F16 or BF16")
    source = tensor.detach()
    t = source.to(device="cpu", dtype=target).contiguous()
    # Reinterpret as bytes: numpy has no bfloat16, so view the storage as uint8.
    raw = t.reshape(-1).view(torch.uint8).numpy()
    if source.numel() and t.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        raw = raw.copy()
    raw.flags.writeable = False
    return TensorBytes(dtype, tuple(t.shape), raw)


class TorchAdapter:
    """Exposes `module`'s named parameters (all of them, in module order) to a learner.

    Pass the unwrapped module (`ddp.module`, `accelerator.unwrap_model(model)`), so names
    carry no wrapper prefix and match across learners. `direct_names` are the parameters
    of its `direct_modules` (embeddings by default, whatever their names: GPT-2's `wte`
    and `wpe`), which an RDA merge averages by weight instead of preserving norms.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        names: Iterable[str] | None = None,
        direct_modules: tuple[type[torch.nn.Module], ...] = (torch.nn.Embedding,
                                                              torch.nn.EmbeddingBag),
    ) -> None:
        params = dict(module.named_parameters())
        if names is None:
            chosen = list(params)
        else:
            chosen = list(names)
            unknown = [n for n in chosen if n not in params]
            if unknown:
                raise ConfigError(f"parameters {unknown} are not in the module")
        specs = []
        for name in chosen:
            p = params[name]
            if p.dtype not in _TO_NAME:
                raise ConfigError(
                    f"parameter {name!r} has dtype {p.dtype}; gradientmail syncs float32, "
                    "float16 and bfloat16 parameters (pass names= to leave it out)"
                )
            specs.append(ParameterSpec(name, _TO_NAME[p.dtype], tuple(p.shape)))
        self.module = module
        self._params: dict[str, torch.nn.Parameter] = {n: params[n] for n in chosen}
        self.schema = Schema(tuple(specs))
        # By identity: a tied parameter is named once, after its first owner.
        owned = {id(p) for m in module.modules() if isinstance(m, direct_modules)
                 for p in m.parameters(recurse=False)}
        self.direct_names = frozenset(n for n, p in self._params.items() if id(p) in owned)

    @property
    def device(self) -> torch.device:
        first = next(iter(self._params.values()), None)
        return first.device if first is not None else torch.device("cpu")

    def parameter(self, name: str) -> torch.nn.Parameter:
        return self._params[name]

    @torch.no_grad()
    def snapshot(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Detached clones of the named parameters on their device (cheap, no host sync)."""
        return {n: self._params[n].detach().clone() for n in names}

    def read(self, names: Sequence[str] | None = None) -> dict[str, TensorBytes]:
        """Host bytes of the named parameters (all by default) in their storage dtypes."""
        chosen = self.schema.names if names is None else names
        return {n: from_torch(self._params[n]) for n in chosen}

    def load(self, values: Mapping[str, TensorBytes]) -> dict[str, torch.Tensor]:
        """`values` as tensors on the parameters' device, in their storage dtypes."""
        return {
            n: _view(t).to(
                device=self._params[n].device, dtype=self._params[n].dtype, copy=True
            )
            for n, t in values.items()
        }

    @torch.no_grad()
    def delta(
        self, anchor: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor]
    ) -> dict[str, TensorBytes]:
        """anchor − snapshot per name, computed in float32 on the device, as host bytes."""
        return {
            n: from_torch(anchor[n].to(torch.float32) - snapshot[n].to(torch.float32), "F32")
            for n in snapshot
        }

    @torch.no_grad()
    def delta_tensors(
        self, anchor: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """anchor − snapshot per name, float32 on the parameters' device: new tensors the
        caller owns and may write (the error feedback of sparse deltas works on them
        there, `learner.feedback`, and brings only the payload's bytes to the host)."""
        return {n: anchor[n].to(torch.float32) - snapshot[n].to(torch.float32)
                for n in snapshot}

    def to_device(self, name: str, value: Any) -> torch.Tensor:
        """`value` (a torch tensor or numpy array, e.g. from a checkpoint) as a new flat
        float32 tensor on parameter `name`'s device."""
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        device = self._params[name].device
        return t.detach().reshape(-1).to(device=device, dtype=torch.float32, copy=True)

    @torch.no_grad()
    def delta_quantized(
        self, anchor: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor], fmt: str
    ) -> dict[str, TensorBytes]:
        """`delta` in transfer format `fmt`: the entries `quantization.quantize` gives for
        each name, byte for byte. On a GPU each difference is quantized there and only the
        codes and scales cross to the host; on the CPU numpy quantizes the host bytes."""
        out: dict[str, TensorBytes] = {}
        batch: dict[str, torch.Tensor] = {}
        held = 0
        for n in snapshot:
            diff = anchor[n].to(torch.float32) - snapshot[n].to(torch.float32)
            if diff.device.type == "cpu":  # numpy's quantizers beat torch's on a CPU
                out |= quantize_tensors(batch, fmt) if batch else {}
                batch, held = {}, 0
                out |= quantize(n, from_torch(diff, "F32"), fmt)
                continue
            # Kernels of several tensors are launched before the host waits once for all
            # of them; the batch's differences, up to _QUANTIZE_BATCH bytes, are held
            # on the device meanwhile.
            batch[n] = diff
            held += diff.numel() * 4
            if held >= _QUANTIZE_BATCH:
                out |= quantize_tensors(batch, fmt)
                batch, held = {}, 0
        return out | quantize_tensors(batch, fmt) if batch else out

    @torch.no_grad()
    def apply(self, values: Mapping[str, Any], mixing: float = 0.0) -> None:
        """Write `values` (TensorBytes or torch tensors) into the parameters in place.

        With `mixing` α the parameter becomes α·θ_local + (1−α)·value.
        """
        self._check_fits(values, "apply")
        for name, value in values.items():
            p = self._params[name]
            t = self._on_device(value, p)
            if mixing:
                mixed = t.to(torch.float32, copy=True).mul_(1.0 - mixing)
                mixed.add_(p.detach().to(torch.float32), alpha=mixing)
                p.copy_(mixed)
            else:
                p.copy_(t)

    @torch.no_grad()
    def rebase(self, values: Mapping[str, Any], base: Mapping[str, Any]) -> None:
        """θ ← value + (θ − base) in place, in float32 on the parameters' device, then cast
        to the parameter's dtype: the progress made since `base` kept on top of `values`.
        """
        self._check_fits(values, "rebase")
        missing = [n for n in values if n not in base]
        if missing:
            raise SchemaMismatch(f"cannot rebase: no base for {missing}")
        for name, value in values.items():
            p = self._params[name]
            local = p.detach().to(torch.float32, copy=True)
            local.sub_(self._on_device(base[name], p).to(torch.float32))
            local.add_(self._on_device(value, p).to(torch.float32))
            p.copy_(local)

    def _check_fits(self, values: Mapping[str, Any], what: str) -> None:
        check_fits(values, what, self._params, self._misfit)

    def _misfit(self, name: str, value: Any) -> str | None:
        shape, want = tuple(value.shape), tuple(self._params[name].shape)
        if shape == want:
            return None
        return f"{name!r} has shape {list(shape)}, the model {list(want)}"

    @staticmethod
    def _on_device(value: Any, p: torch.nn.Parameter) -> torch.Tensor:
        # A TensorBytes is read in place (on the CPU; callers only read the result: copy_,
        # or arithmetic into a fresh tensor), so a payload is not copied once more.
        out: torch.Tensor = (_view(value) if isinstance(value, TensorBytes) else value).to(p.device)
        return out
