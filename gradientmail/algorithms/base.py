"""The algorithm interfaces and the values a round is made of.

An `Algorithm` is a frozen configuration that tells a learner and a syncer everything
they need: the round schedule, how the model splits into fragments (`plan`), the quorum,
the transfer formats, and an `Aggregator` that closes rounds. An aggregator is pure:
`close_round(state, contributions, schema)` maps a fragment's `FragmentState` and the
round's `Contribution`s to a `RoundResult`, and equal inputs give equal bytes, whatever
order the contributions arrive in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from gradientmail.algorithms.schedule import RoundSchedule
from gradientmail.backends.base import Backend
from gradientmail.errors import ConfigError, RemoteProtocolError
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.serialization import Schema
from gradientmail.wire.sharded_pieces import DeltaTensor
from gradientmail.wire.tensor_bytes import STORAGE_DTYPES, TensorBytes

if TYPE_CHECKING:
    from gradientmail.wire.records import Participant

__all__ = [
    "MASTER_PREFIX",
    "MOMENTUM_PREFIX",
    "Aggregator",
    "Algorithm",
    "Contribution",
    "FragmentState",
    "RoundResult",
]

MOMENTUM_PREFIX = "momentum/"
MASTER_PREFIX = "master/"


def _count(where: str, name: str, v: object, low: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(f"{where}: {name}={v!r} must be an int >= {low}")


@dataclasses.dataclass(frozen=True, eq=False)
class Contribution:
    """One learner's part in a round: its counters and its delta.

    `delta` maps each of the fragment's tensor names to anchor − θ as a float tensor
    (F32, or F16/BF16), whole or in the `RowPieces` of a contribution made of parts;
    quantized deltas are read by the caller as F32 (`RowPieces` of `Quantized` pieces,
    decoded by the merge a window at a time, or dequantized). `steps` and `tokens` count what it
    trained on this fragment since it last aligned; `final` marks a flush on close.
    """

    learner: str
    local_step: int
    steps: int
    tokens: int
    final: bool
    delta: Mapping[str, DeltaTensor]

    def __post_init__(self) -> None:
        if not isinstance(self.learner, str) or not self.learner:
            raise ConfigError(f"learner={self.learner!r} must be a non-empty string")
        where = f"contribution of {self.learner!r}"
        _count(where, "local_step", self.local_step, 0)
        _count(where, "steps", self.steps, 1)
        _count(where, "tokens", self.tokens, 0)
        if not isinstance(self.final, bool):
            raise ConfigError(f"{where}: final={self.final!r} must be a bool")
        if not isinstance(self.delta, Mapping):
            raise ConfigError(f"{where}: delta must map tensor names to TensorBytes")


def _check_tensors(
    what: str, tensors: Mapping[str, TensorBytes], names: Sequence[str],
    shapes: Mapping[str, tuple[int, ...]], dtypes: tuple[str, ...],
) -> list[str]:
    problems = []
    missing = [n for n in names if n not in tensors]
    extra = sorted(n for n in tensors if n not in shapes)
    if missing:
        problems.append(f"{what} lacks {missing}")
    if extra:
        problems.append(f"{what} has extra {extra}")
    for n in names:
        t = tensors.get(n)
        if t is None:
            continue
        if not isinstance(t, TensorBytes):
            problems.append(f"{what} {n!r} is a {type(t).__name__}, not TensorBytes")
        elif t.shape != shapes[n] or t.dtype not in dtypes:
            problems.append(
                f"{what} {n!r} is {t.dtype}{list(t.shape)}, expected "
                f"{'/'.join(dtypes)}{list(shapes[n])}"
            )
    return problems


@dataclasses.dataclass(frozen=True, eq=False)
class FragmentState:
    """A fragment at one version: what a closer needs to go on from it.

    `theta` holds the published parameters in their schema dtypes; `momentum` the fp32
    outer momentum; `master` the fp32 master copy, kept apart from theta when the schema
    dtype is not F32 or commits carry a quantized update (None: theta is the master).
    """

    fragment: int
    version: int
    theta: Mapping[str, TensorBytes]
    master: Mapping[str, TensorBytes] | None
    momentum: Mapping[str, TensorBytes]

    def __post_init__(self) -> None:
        _count("FragmentState", "fragment", self.fragment, 0)
        _count("FragmentState", "version", self.version, 0)
        problems = self.problems()
        if problems:
            raise ConfigError(f"fragment {self.fragment} v{self.version}: " + "; ".join(problems))

    @property
    def names(self) -> tuple[str, ...]:
        """The fragment's tensor names, in theta's order."""
        return tuple(self.theta)

    def problems(self) -> list[str]:
        """What is inconsistent between theta, master and momentum (empty when sound)."""
        if not isinstance(self.theta, Mapping) or not self.theta:
            return ["theta must map at least one tensor name to TensorBytes"]
        bad = [n for n, t in self.theta.items() if not isinstance(t, TensorBytes)]
        if bad:
            return [f"theta {bad} are not TensorBytes"]
        names = list(self.theta)
        shapes = {n: t.shape for n, t in self.theta.items()}
        out = [
            f"theta {n!r} has dtype {t.dtype}; a schema holds {'/'.join(STORAGE_DTYPES)}"
            for n, t in self.theta.items()
            if t.dtype not in STORAGE_DTYPES
        ]
        out += _check_tensors("momentum", self.momentum, names, shapes, ("F32",))
        if self.master is not None:
            out += _check_tensors("master", self.master, names, shapes, ("F32",))
        return out

    @classmethod
    def initial(
        cls, fragment: int, theta: Mapping[str, TensorBytes], *, keep_master: bool
    ) -> FragmentState:
        """Version 0 from Θ⁰: zero momentum, and an exact fp32 master if `keep_master`."""
        from gradientmail.backends.numpy_backend import NumpyBackend

        theta = dict(theta)
        momentum = {
            n: TensorBytes("F32", t.shape, bytes(4 * t.numel)) for n, t in theta.items()
        }
        master = None
        if keep_master:
            backend = NumpyBackend()
            master = {n: backend.load(t).to_bytes("F32") for n, t in theta.items()}
        return cls(fragment, 0, theta, master, momentum)

    def outer(self) -> dict[str, TensorBytes]:
        """The outer payload: ``momentum/<name>`` and, when kept, ``master/<name>``."""
        out = {MOMENTUM_PREFIX + n: t for n, t in self.momentum.items()}
        if self.master is not None:
            out.update({MASTER_PREFIX + n: t for n, t in self.master.items()})
        return out

    @classmethod
    def from_payloads(
        cls,
        fragment: int,
        version: int,
        theta: Mapping[str, TensorBytes],
        outer: Mapping[str, TensorBytes],
        *,
        key: str = "outer",
    ) -> FragmentState:
        """Rebuild a state from its theta and outer payloads (inverse of `outer()`).

        `RemoteProtocolError` naming `key` and every missing, extra or mis-shaped entry.
        """
        momentum: dict[str, TensorBytes] = {}
        master: dict[str, TensorBytes] = {}
        stray = []
        for k, t in outer.items():
            if k.startswith(MOMENTUM_PREFIX):
                momentum[k[len(MOMENTUM_PREFIX) :]] = t
            elif k.startswith(MASTER_PREFIX):
                master[k[len(MASTER_PREFIX) :]] = t
            else:
                stray.append(k)
        problems = [f"entries {sorted(stray)} are neither momentum/ nor master/"] if stray else []
        try:
            state = cls(fragment, version, dict(theta), master or None, momentum)
        except ConfigError as exc:
            problems.append(str(exc))
        if problems:
            raise RemoteProtocolError(f"{key}: " + "; ".join(problems))
        return state


@dataclasses.dataclass(frozen=True, eq=False)
class RoundResult:
    """What closing a round produced.

    `state` is the fragment at its new version; `update`, when commits carry one, holds
    the quantized Θ_new − Θ_old entries (``<name>`` and ``<name>.scale``) from which
    `state.theta` is rebuilt exactly; `participants` are the merged contributions in
    learner order; `mean_cosine` the mean pairwise cosine of their deltas (None for one).
    With a replicated outer step, `step` holds the merged Δ's entries in `step_format`,
    which every party applies by `rule` ("nesterov" or "average") to reach `state`.
    """

    state: FragmentState
    update: dict[str, TensorBytes] | None
    participants: tuple[Participant, ...]
    mean_cosine: float | None
    all_final: bool
    step: dict[str, TensorBytes] | None = None
    step_format: str | None = None
    rule: str = "nesterov"


@runtime_checkable
class Aggregator(Protocol):
    """Closes rounds of one algorithm over one backend. Pure: no I/O, no clock."""

    def close_round(
        self, state: FragmentState, contributions: Sequence[Contribution], schema: Schema,
        cohort: int | None = None,
    ) -> RoundResult:
        """Merge `contributions` into fragment `state`; equal inputs give equal bytes.
        `cohort`: how many learners train the fragment (None: unknown)."""
        ...


@runtime_checkable
class Algorithm(Protocol):
    """What a learner and a syncer need from an algorithm's configuration."""

    @property
    def schedule(self) -> RoundSchedule:
        """The round schedule for the configured number of fragments."""
        ...

    @property
    def quorum_size(self) -> int: ...

    @property
    def mixing(self) -> float: ...

    @property
    def rebase(self) -> bool | None:
        """Whether a learner rebases its post-snapshot progress onto a commit (None
        before a configuration resolves it; see `DiLoCo`)."""
        ...

    @property
    def overlap_steps(self) -> int | None: ...

    @property
    def delta_dtype(self) -> str | None: ...

    @property
    def delta_density(self) -> float | None: ...

    @property
    def feedback_decay(self) -> float | None: ...

    @property
    def feedback_momentum(self) -> float | None: ...

    @property
    def commit_dtype(self) -> str | None: ...

    @property
    def flush_on_close(self) -> bool: ...

    @property
    def global_batch_size(self) -> int | None: ...

    @property
    def checkpoint_every(self) -> int:
        """Versions of a fragment between uploads of its whole state (1: every commit)."""
        ...

    @property
    def replicated(self) -> bool:
        """Whether commits carry the merged Δ and every party takes the outer step."""
        ...

    @property
    def keep_rounds(self) -> int | None:
        """Rounds whose inputs (contributions, and the state before them) the sweep keeps
        so that `gradientmail verify` can re-derive them (None: sweep them)."""
        ...

    def checkpoint_at(self, version: int) -> bool:
        """Whether the commit of `version` uploads theta and the outer state."""
        ...

    def apply_step(
        self, state: FragmentState, step: Mapping[str, TensorBytes], fmt: str, rule: str,
        backend: Backend | None = None,
    ) -> FragmentState:
        """The fragment one version on after a replicated commit's step."""
        ...

    def schedule_for(self, fragments: int) -> RoundSchedule:
        """The schedule over a plan of `fragments` fragments (a plan may have fewer
        fragments than configured when the model has few tensors)."""
        ...

    def plan(self, schema: Schema) -> tuple[tuple[str, ...], ...]:
        """The tensor names of each fragment; a pure function of the schema."""
        ...

    def with_direct_names(self, names: Collection[str]) -> Algorithm:
        """This configuration for a model whose adapter names `names` as embedding
        parameters (`Adapter.direct_names`); the learner calls it before joining."""
        ...

    def aggregator(self, backend: Backend | None = None) -> Aggregator: ...

    def initial_state(self, fragment: int, theta: Mapping[str, TensorBytes]) -> FragmentState:
        """Version 0 of a fragment from its Θ⁰."""
        ...

    def grace_window(
        self, estimates: Estimates, schedule: RoundSchedule, round_: int,
        poll_interval: float = 1.0,
    ) -> float:
        """Seconds after round `round_`'s first contribution that a closer waits for the
        learners it expects."""
        ...

    def to_json(self) -> dict[str, Any]: ...
