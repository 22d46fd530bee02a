"""The outer step's arithmetic outside the aggregator: what every party of a run with a
replicated outer step computes from a commit's merged Δ (`apply_step`), the format that Δ
travels in, and the theta a learner rebuilds from a quantized update (`rebuild_theta`).

Every function here is pure and deterministic: numpy in float32, one operation at a time,
so a learner, a closer and a standalone syncer reach the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gradientmail.algorithms.base import FragmentState
from gradientmail.backends.base import Backend, Value
from gradientmail.backends.numpy_backend import NumpyBackend
from gradientmail.errors import ConfigError, NonFiniteError, RemoteProtocolError
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = [
    "STEP_RULES",
    "apply_step",
    "check_master",
    "merged_step",
    "rebuild_theta",
    "step_format",
]


def rebuild_theta(
    theta_old: Mapping[str, TensorBytes],
    update: Mapping[str, TensorBytes],
    fmt: str,
    backend: Backend | None = None,
) -> dict[str, TensorBytes]:
    """Θ_new from Θ_old and a commit's quantized update: to_dtype(Θ_old + dequantize(u)),
    in float32, each tensor back in Θ_old's dtype. The closer publishes exactly this."""
    from gradientmail.wire.quantization import dequantize

    be = NumpyBackend() if backend is None else backend
    return {
        n: (be.load(t) + be.load(dequantize(update, n, fmt))).to_bytes(t.dtype)
        for n, t in theta_old.items()
    }


#: How a replicated commit's Δ moves the master: DiLoCo's Nesterov outer step, or the
#: plain average of final or light rounds (Θ ← Θ − Δ, momentum kept).
STEP_RULES = ("nesterov", "average")


def step_format(commit_dtype: str | None, dtypes: Sequence[str]) -> str:
    """The format a replicated commit's Δ travels in: `commit_dtype` when set, else the
    model's own precision (BF16 when every tensor of the fragment is BF16, else F32)."""
    if commit_dtype is not None:
        return commit_dtype
    return "BF16" if dtypes and all(d == "BF16" for d in dtypes) else "F32"


def merged_step(name: str, merged: TensorBytes, fmt: str) -> dict[str, TensorBytes]:
    """The entries that carry tensor `name` of a merged Δ (F32) in format `fmt`."""
    if fmt == "F32":
        return {name: merged}
    from gradientmail.wire.quantization import quantize

    return quantize(name, merged, fmt)


def apply_step(
    state: FragmentState, step: Mapping[str, TensorBytes], fmt: str, rule: str, *,
    lr: float, momentum: float, keep_master: bool, backend: Backend | None = None,
) -> FragmentState:
    """The fragment one version on, after a replicated commit's Δ (`step`, in `fmt`).

    Every party of a run computes exactly these bytes — the closer that merged Δ, each
    learner and any standalone syncer — in float32, one operation at a time, on any
    backend (numpy by default; a backend's elementwise float32 arithmetic is the same):
    `nesterov` is m ← β·m + Δ; Θ ← Θ − η·(Δ + β·m) (η = `lr`, β = `momentum`) on the fp32
    master (theta when the master is not kept apart), `average` is Θ ← Θ − Δ with the
    momentum kept. Theta is the new master cast to its schema dtype; the new master is
    kept apart when `keep_master`.

    Raises `ConfigError` (an unknown rule), `RemoteProtocolError` (entries missing or
    mis-shaped) and `NonFiniteError` (an outer step that overflows float32).
    """
    from gradientmail.wire.quantization import dequantize

    if rule not in STEP_RULES:
        raise ConfigError(f"rule={rule!r} must be one of {STEP_RULES}")
    be = NumpyBackend(threads=1) if backend is None else backend
    theta: dict[str, TensorBytes] = {}
    master: dict[str, TensorBytes] = {}
    moms: dict[str, TensorBytes] = {}
    for name in state.names:
        t = step.get(name)
        if fmt == "F32":
            if not isinstance(t, TensorBytes) or t.dtype != "F32":
                raise RemoteProtocolError(f"the step has no F32 entry {name!r}")
            d = t
        else:
            d = dequantize(step, name, fmt)
        if d.shape != state.theta[name].shape:
            raise RemoteProtocolError(
                f"the step's {name!r} has shape {list(d.shape)}, the fragment holds "
                f"{list(state.theta[name].shape)}"
            )
        delta = be.load(d)
        base = be.load((state.master or state.theta)[name])
        if rule == "average":
            new_master = base - delta
            moms[name] = state.momentum[name]
        else:
            new_master, new_mom = be.outer_step(
                base, be.load(state.momentum[name]), [delta], [1.0], lr, momentum)
            moms[name] = new_mom.to_bytes("F32")
        check_master(be, new_master, name, state.fragment)
        theta[name] = new_master.to_bytes(state.theta[name].dtype)
        if keep_master:
            master[name] = new_master.to_bytes("F32")
    return FragmentState(
        state.fragment, state.version + 1, theta, master if keep_master else None, moms
    )


def check_master(be: Backend, new_master: Value, name: str, fragment: int) -> None:
    # The momentum cannot overflow alone: a non-finite m makes Θ non-finite (η > 0).
    if not be.all_finite(new_master):
        raise NonFiniteError(
            f"the outer step overflowed float32 in {name!r} of fragment {fragment}; the "
            "deltas are too large (lower outer_lr or the inner learning rate)"
        )
