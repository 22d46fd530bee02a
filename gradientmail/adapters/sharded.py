"""ShardedAdapter: a sharded module's parameters seen shard by shard, under the full schema.

FSDP2 (`torch.distributed.fsdp.fully_shard`) turns each parameter into a DTensor whose
local tensor holds a range of rows (dim 0, split as `torch.chunk` splits it, so the last
ranks may hold fewer rows or none). The wire must not depend on that: the adapter's
`schema` is the full logical one (global shapes, the names an unsharded module has), and
what each rank reads and writes is named by row ranges of those full tensors.

Two ranges per parameter and rank:
- `local_rows`: the rows this rank *holds* (its shard). Snapshots, loads, `apply` and
  `rebase` work on these, on the shard's own device.
- `owned_rows`: the rows this rank *mails* (`read`, `delta`). Ranks that hold the same rows
  (a `Replicate` mesh dimension, as in HSDP, or a plain parameter every rank holds) split
  them by `torch.chunk` over their replica index, so the owned rows of all ranks tile
  every tensor exactly once and upload bandwidth scales with the ranks.

No rank ever builds a full parameter: a full `TensorBytes` handed to `apply`, `rebase` or
`load` is sliced as a view, and every buffer the adapter allocates is the size of the
rank's rows of one tensor (the snapshot and the delta it returns are the rank's shard of
the fragment). FSDP1 (`FullyShardedDataParallel`) is refused: its flat parameters split
tensors at arbitrary element offsets, not rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradientmail.adapters.base import check_fits
from gradientmail.adapters.torch import _TO_NAME, _view
from gradientmail.errors import ConfigError, SchemaMismatch
from gradientmail.wire.serialization import ParameterSpec, Schema
from gradientmail.wire.sharded_ranges import Rows
from gradientmail.wire.tensor_bytes import TensorBytes, nbytes_of

__all__ = ["Layout", "ShardedAdapter", "chunk_rows", "layout_of", "refuse_fsdp1"]

#: Placements a `Layout` understands: "S0" (Shard(0)) and "R" (Replicate).
SHARD0, REPLICATE = "S0", "R"


def chunk_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [start, stop) of part `index` when `rows` rows are split into `parts` as
    `torch.chunk` (and DTensor's `Shard`) split them: ⌈rows/parts⌉ each, the last
    parts short or empty."""
    if parts < 1 or not 0 <= index < parts:
        raise ConfigError(f"part {index} of {parts}: need 0 <= index < parts")
    size = math.ceil(rows / parts) if rows else 0
    start = min(index * size, rows)
    return start, min(start + size, rows)


@dataclass(frozen=True)
class Layout:
    """Where one parameter's rows are on one rank: held [held_start, held_stop) and owned
    (mailed) [owned_start, owned_stop), a sub-range of the held rows."""

    held_start: int
    held_stop: int
    owned_start: int
    owned_stop: int

    @property
    def held(self) -> tuple[int, int]:
        return self.held_start, self.held_stop

    @property
    def owned(self) -> tuple[int, int]:
        return self.owned_start, self.owned_stop


def layout_of(
    rows: int, placements: Sequence[str], mesh_shape: Sequence[int], coordinate: Sequence[int]
) -> Layout:
    """The layout of a tensor of `rows` rows placed over a device mesh, on the rank at
    `coordinate`: each "S0" mesh dimension narrows the held rows to its chunk (in mesh
    order, as DTensor does); the replicas along "R" dimensions then split the held rows
    among themselves for mailing, by their index in row-major order."""
    if not len(placements) == len(mesh_shape) == len(coordinate):
        raise ConfigError(
            f"placements {list(placements)}, mesh shape {list(mesh_shape)} and coordinate "
            f"{list(coordinate)} must have one entry per mesh dimension"
        )
    start, stop = 0, rows
    replicas, replica = 1, 0
    for kind, size, index in zip(placements, mesh_shape, coordinate, strict=True):
        if kind == SHARD0:
            a, b = chunk_rows(stop - start, size, index)
            start, stop = start + a, start + b
        elif kind == REPLICATE:
            replicas, replica = replicas * size, replica * size + index
        else:
            raise ConfigError(f"placement {kind!r} is not {SHARD0!r} or {REPLICATE!r}")
    a, b = chunk_rows(stop - start, replicas, replica)
    return Layout(start, stop, start + a, start + b)


def refuse_fsdp1(module: torch.nn.Module) -> None:
    """`ConfigError` when `module` is, or contains, an FSDP1 `FullyShardedDataParallel`."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch built without distributed has no FSDP1 either
        return
    for name, sub in module.named_modules():
        if isinstance(sub, FullyShardedDataParallel):
            where = f"module {name!r}" if name else "the module"
            raise ConfigError(
                f"{where} is wrapped in FSDP1 (FullyShardedDataParallel, Lightning's "
                "FSDPStrategy): its flat parameters split tensors at arbitrary element "
                "offsets, which gradientmail cannot sync shard by shard. Shard with FSDP2 "
                "instead: torch.distributed.fsdp.fully_shard (Lightning's "
                "ModelParallelStrategy, Accelerate's fsdp_version: 2)"
            )


def _placements_of(name: str, p: torch.Tensor) -> tuple[list[str], list[int], list[int]]:
    from torch.distributed.tensor import Replicate, Shard

    mesh = p.device_mesh  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ConfigError(f"parameter {name!r}: this rank is not in its device mesh")
    kinds = []
    for placement in p.placements:  # type: ignore[attr-defined]
        # Exact types: _StridedShard (FSDP2 over tensor parallelism) subclasses Shard but
        # interleaves rows, so its rows are no range.
        if type(placement) is Shard and placement.dim == 0:
            kinds.append(SHARD0)
        elif type(placement) is Replicate:
            kinds.append(REPLICATE)
        else:
            raise ConfigError(
                f"parameter {name!r} is placed {placement} on its mesh; gradientmail syncs "
                "DTensors sharded along dim 0 (FSDP2's Shard(0)) or replicated. Tensor or "
                "sequence parallelism across a learner's ranks is not supported yet"
            )
    return kinds, list(mesh.shape), list(coordinate)


def _group_rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _rows(shape: Sequence[int]) -> int:
    return shape[0] if len(shape) else 1


def _narrow(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of `t` as a view (a 0-d tensor is its own single row)."""
    return t.narrow(0, start, stop - start) if t.dim() else t


def _host_bytes(fresh: torch.Tensor, dtype: str) -> TensorBytes:
    """`fresh` (a new tensor nobody else holds) as TensorBytes, moved to the host but
    not copied when it is already there."""
    t = fresh.to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy()
    raw.flags.writeable = False
    return TensorBytes(dtype, tuple(t.shape), raw)


class ShardedAdapter:
    """Exposes `module`'s named parameters, DTensors (FSDP2) or plain tensors, shard by
    shard. Build one on every rank, after `fully_shard`.

    `schema` is the full logical schema, equal to `TorchAdapter`'s on the unsharded
    module. `group_size` / `group_rank` split plain (non-DTensor) parameters, which every
    rank holds whole, for mailing; they default to the default process group (one rank
    without one).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        names: Iterable[str] | None = None,
        direct_modules: tuple[type[torch.nn.Module], ...] = (torch.nn.Embedding,
                                                              torch.nn.EmbeddingBag),
        *,
        group_size: int | None = None,
        group_rank: int | None = None,
    ) -> None:
        refuse_fsdp1(module)
        from torch.distributed.tensor import DTensor

        params = dict(module.named_parameters())
        chosen = list(params) if names is None else list(names)
        unknown = [n for n in chosen if n not in params]
        if unknown:
            raise ConfigError(f"parameters {unknown} are not in the module")
        default_size, default_rank = _group_rank()
        size = default_size if group_size is None else group_size
        rank = default_rank if group_rank is None else group_rank
        specs, layouts = [], {}
        for name in chosen:
            p = params[name]
            if p.dtype not in _TO_NAME:
                raise ConfigError(
                    f"parameter {name!r} has dtype {p.dtype}; gradientmail syncs float32, "
                    "float16 and bfloat16 parameters (pass names= to leave it out)"
                )
            shape = tuple(p.shape)  # a DTensor's shape is the global one
            if isinstance(p, DTensor):
                layout = layout_of(_rows(shape), *_placements_of(name, p))
                local = p.to_local()
            else:
                layout = layout_of(_rows(shape), [REPLICATE], [size], [rank])
                local = p
            want = (layout.held_stop - layout.held_start, *shape[1:]) if shape else ()
            if tuple(local.shape) != want:
                raise ConfigError(
                    f"parameter {name!r} {list(shape)}: this rank holds shape "
                    f"{list(local.shape)}, but its placements give rows {list(layout.held)}"
                    f" of shape {list(want)}; the sharding is not a chunk of rows (FSDP1's "
                    "flat parameters are not: shard with torch.distributed.fsdp.fully_shard)"
                )
            specs.append(ParameterSpec(name, _TO_NAME[p.dtype], shape))
            layouts[name] = layout
        self.module = module
        self.schema = Schema(tuple(specs))
        self._layouts: dict[str, Layout] = layouts
        self._params: dict[str, torch.nn.Parameter] = {n: params[n] for n in chosen}
        owned = {id(p) for m in module.modules() if isinstance(m, direct_modules)
                 for p in m.parameters(recurse=False)}
        self.direct_names = frozenset(n for n in chosen if id(params[n]) in owned)

    # -- where the rows are ---------------------------------------------------------------

    def local_rows(self, name: str) -> tuple[int, int]:
        """Rows [start, stop) of parameter `name` this rank holds (its shard)."""
        return self._layouts[name].held

    def owned_rows(self, name: str) -> tuple[int, int]:
        """Rows [start, stop) of parameter `name` this rank mails; the owned rows of all
        ranks tile the tensor exactly once."""
        return self._layouts[name].owned

    def local(self, name: str) -> torch.Tensor:
        """The shard of parameter `name` (detached; writing it writes the parameter)."""
        # Asked for every time: FSDP2 may give a DTensor a new local tensor (at lazy init,
        # after `to_empty` or a `load_state_dict(assign=True)`), so none is kept.
        p = self._params[name]
        with torch.no_grad():
            local = p.to_local() if hasattr(p, "to_local") else p
        return local.detach()

    def part_schema(self, names: Sequence[str] | None = None, *, held: bool = False) -> Schema:
        """The shapes of this rank's owned (or, with `held`, held) rows of `names`."""
        specs = []
        for name in self.schema.names if names is None else names:
            spec = self.schema[name]
            a, b = self.local_rows(name) if held else self.owned_rows(name)
            shape = (b - a, *spec.shape[1:]) if spec.shape else ()
            specs.append(ParameterSpec(name, spec.dtype, shape))
        return Schema(tuple(specs))

    def local_nbytes(self, names: Sequence[str] | None = None, *, dtype: str | None = None) -> int:
        """Bytes of this rank's held rows of `names`, in `dtype` (default: storage)."""
        specs = self.part_schema(names, held=True).params
        return sum(nbytes_of(dtype or spec.dtype, spec.shape) for spec in specs)

    # -- the Adapter operations, shard by shard --------------------------------------------

    @torch.no_grad()
    def snapshot(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Clones of this rank's held rows of `names`, on their device."""
        return {n: self.local(n).clone() for n in names}

    def read(self, names: Sequence[str] | None = None) -> dict[str, Rows]:
        """This rank's owned rows of `names` (all by default), in their storage dtypes. A
        0-d parameter comes from its one owner only."""
        out = {}
        for name in self.schema.names if names is None else names:
            h0 = self.local_rows(name)[0]
            o0, o1 = self.owned_rows(name)
            if o0 == o1 and not self.schema[name].shape:
                continue  # a 0-d tensor has no empty slice: its one owner sends it
            rows = _narrow(self.local(name), o0 - h0, o1 - h0).clone()
            out[name] = Rows(o0, o1, _host_bytes(rows, self.schema[name].dtype))
        return out

    @torch.no_grad()
    def load(self, values: Mapping[str, TensorBytes | Rows]) -> dict[str, torch.Tensor]:
        """This rank's held rows of `values` (full tensors, or row slices covering them)
        as new tensors on the shard's device, in the parameter's dtype."""
        self._check_fits(values, "load")
        out = {}
        for name, value in values.items():
            local = self.local(name)
            out[name] = self._held_view(name, value).to(
                device=local.device, dtype=local.dtype, copy=True
            )
        return out

    @torch.no_grad()
    def delta(
        self, anchor: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor]
    ) -> dict[str, Rows]:
        """anchor − snapshot over this rank's owned rows, in float32 on the device, as
        host bytes. `anchor` and `snapshot` hold held rows (`load`, `snapshot`); a 0-d
        parameter comes from its one owner only."""
        out = {}
        for name in snapshot:
            h0 = self.local_rows(name)[0]
            o0, o1 = self.owned_rows(name)
            if o0 == o1 and not self.schema[name].shape:
                continue  # as in `read`
            diff = _narrow(anchor[name], o0 - h0, o1 - h0).to(torch.float32, copy=True)
            diff.sub_(_narrow(snapshot[name], o0 - h0, o1 - h0))
            out[name] = Rows(o0, o1, _host_bytes(diff, "F32"))
        return out

    def mailed(self, names: Sequence[str]) -> dict[str, tuple[int, int]]:
        """The owned rows of `names` that `delta` returns (a 0-d parameter only on its
        one owner)."""
        out = {}
        for name in names:
            o0, o1 = self.owned_rows(name)
            if o0 == o1 and not self.schema[name].shape:
                continue  # as in `read`
            out[name] = (o0, o1)
        return out

    @torch.no_grad()
    def delta_tensors(self, anchor: Mapping[str, torch.Tensor],
                      snapshot: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`delta` as float32 tensors on the shard's device (the names of `mailed`, each
        shaped as the owned rows): new tensors the caller owns and may write (a sharded
        learner's error feedback works on them there, `learner.feedback`)."""
        out = {}
        for name, (o0, o1) in self.mailed(list(snapshot)).items():
            h0 = self.local_rows(name)[0]
            diff = _narrow(anchor[name], o0 - h0, o1 - h0).to(torch.float32, copy=True)
            out[name] = diff.sub_(_narrow(snapshot[name], o0 - h0, o1 - h0))
        return out

    def owned_offset(self, name: str) -> int:
        """The flat element of the full tensor `name` where this rank's owned rows start."""
        return self.owned_rows(name)[0] * math.prod(self.schema[name].shape[1:])

    @torch.no_grad()
    def delta_into(self, anchor: Mapping[str, torch.Tensor],
                   snapshot: Mapping[str, torch.Tensor], slots: Mapping[str, Any]) -> None:
        """`delta`, written into `slots` (name -> a writable host buffer of the owned rows
        in F32, one per name of `mailed`) instead of new buffers: the same bytes, and on
        the host no buffer beyond the slots (on another device, one tensor's rows)."""
        for name, slot in slots.items():
            h0 = self.local_rows(name)[0]
            o0, o1 = self.owned_rows(name)
            a = _narrow(anchor[name], o0 - h0, o1 - h0)
            s = _narrow(snapshot[name], o0 - h0, o1 - h0)
            if a.numel() == 0:
                continue
            out = torch.frombuffer(slot, dtype=torch.float32).reshape(a.shape)
            if a.device.type == "cpu":
                out.copy_(a)  # a.to(float32) in place: then the same subtraction
                out.sub_(s)
            else:
                out.copy_(a.to(torch.float32, copy=True).sub_(s))

    @torch.no_grad()
    def apply(self, values: Mapping[str, Any], mixing: float = 0.0) -> None:
        """Write `values` into this rank's shards in place: each a loaded tensor (`load`),
        a full `TensorBytes`, or `Rows` covering the held rows. With `mixing` α the
        shard becomes α·θ_local + (1−α)·value, in float32."""
        self._check_fits(values, "apply")
        for name, value in values.items():
            local = self.local(name)
            src = self._held_view(name, value).to(local.device)
            if mixing:
                mixed = src.to(torch.float32, copy=True).mul_(1.0 - mixing)
                mixed.add_(local, alpha=mixing)
                local.copy_(mixed)
                del mixed  # before the next tensor's buffer: one buffer at a time
            else:
                local.copy_(src)

    @torch.no_grad()
    def rebase(self, values: Mapping[str, Any], base: Mapping[str, Any]) -> None:
        """θ ← value + (θ − base) on this rank's shards, in float32 on their device.
        `values` and `base` take the forms `apply` takes."""
        self._check_fits(values, "rebase")
        missing = [n for n in values if n not in base]
        if missing:
            raise SchemaMismatch(f"cannot rebase: no base for {missing}")
        self._check_fits(base, "rebase")
        for name, value in values.items():
            local = self.local(name)
            moved = local.to(torch.float32, copy=True)
            moved.sub_(self._held_view(name, base[name]).to(local.device))
            moved.add_(self._held_view(name, value).to(local.device))
            local.copy_(moved)
            del moved  # before the next tensor's buffer: one buffer at a time

    # -- plumbing ---------------------------------------------------------------------------

    def _held_view(self, name: str, value: Any) -> torch.Tensor:
        """The held rows of `value` without copying: a view of a full TensorBytes or of
        covering Rows (CPU memory), or a loaded tensor as is."""
        h0, h1 = self.local_rows(name)
        if isinstance(value, Rows):
            return _narrow(_view(value.tensor), h0 - value.start, h1 - value.start)
        if isinstance(value, TensorBytes):
            return _narrow(_view(value), h0, h1)
        return value  # type: ignore[no-any-return]

    def _check_fits(self, values: Mapping[str, Any], what: str) -> None:
        check_fits(values, what, self._layouts, self._misfit)

    def _misfit(self, name: str, value: Any) -> str | None:
        full = self.schema[name].shape
        h0, h1 = self._layouts[name].held
        if isinstance(value, Rows):
            shape, rows = value.tensor.shape, (value.start, value.stop)
            want = (value.stop - value.start, *full[1:]) if full else ()
            if tuple(shape) != want or not (rows[0] <= h0 and h1 <= rows[1]):
                return (f"{name!r} rows {list(rows)} of shape {list(shape)} do not cover this "
                        f"rank's rows {[h0, h1]} of {list(full)}")
            return None
        want = full if isinstance(value, TensorBytes) else tuple(self.local(name).shape)
        if tuple(value.shape) != want:
            kind = "a full tensor" if isinstance(value, TensorBytes) else "this rank's shard"
            return f"{name!r} has shape {list(value.shape)}; {kind} has {list(want)}"
        return None

