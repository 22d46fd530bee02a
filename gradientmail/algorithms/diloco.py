"""DiLoCo, Streaming DiLoCo and Decoupled DiLoCo as one configuration and one aggregator.

`DiLoCo(...)` is the frozen, validated configuration every party of a run shares (its
JSON goes into the manifest); `DiLoCoAggregator` closes a round: it merges each tensor's
deltas with token weights (`WeightedMean` or `Rda`), takes a Nesterov outer step on the
fp32 master, keeps fp32 momentum, and publishes theta in the schema dtype, optionally as a
quantized update. The pure pieces (`plan`, `weight`, `weighted_mean`, `rda`, `nesterov`,
`mean_cosine`, `grace_window`, `outliers`) are importable from here.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from fractions import Fraction
from typing import Any

from gradientmail.algorithms.base import Contribution, FragmentState, RoundResult
from gradientmail.algorithms.merge import (
    Merge,
    Rda,
    WeightedMean,
    mean_cosine,
    merge_from_json,
    normalized_weights,
    rda_coefficients,
    weight,
)
from gradientmail.algorithms.outer import apply_step, merged_step, step_format
from gradientmail.algorithms.partition import (
    ByBytes,
    Partition,
    Strided,
    partition_from_json,
    plan,
)
from gradientmail.algorithms.rounds import cohort_share, grace_window, light, span_scales
from gradientmail.algorithms.schedule import RoundSchedule
from gradientmail.backends.base import Backend, Value
from gradientmail.backends.numpy_backend import NumpyBackend
from gradientmail.errors import ConfigError, NonFiniteError, RemoteProtocolError, SchemaMismatch
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.records import Participant
from gradientmail.wire.serialization import Schema, validate
from gradientmail.wire.sharded_pieces import RowPieces
from gradientmail.wire.sparse import SPARSE_FORMATS, check_decay, check_density
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = [
    "FORMAT_VERSION",
    "DiLoCo",
    "DiLoCoAggregator",
]

#: The version of DiLoCo's JSON record; bumped when its fields change.
FORMAT_VERSION = 1
_FORMATS = ("BF16", "F8_E4M3", "F4")
_RULE = "need 1 <= in_flight <= fragments <= sync_every"
# Frozen, so one shared instance is safe as a dataclass default.
_DEFAULT_MERGE: Merge = Rda(direct_pattern="embed")
_DEFAULT_PARTITION: Partition = ByBytes()


def _setting(default: Any, doc: str) -> Any:
    """A field's default and its one line of meaning (the configuration reference)."""
    return dataclasses.field(default=default, metadata={"doc": doc})


def _int(name: str, v: object, low: int, *, optional: bool = False) -> None:
    if optional and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        kind = "an int or None" if optional else "an int"
        raise ConfigError(f"{name}={v!r} must be {kind}")
    if v < low:
        raise ConfigError(f"{name}={v} is below {low}; need {name} >= {low}")


def _float(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ConfigError(f"{name}={v!r} must be a finite number")
    return float(v)


@dataclasses.dataclass(frozen=True)
class DiLoCo:
    """The DiLoCo family as one frozen configuration (see DESIGN §5).

    H = `sync_every` local steps between syncs of each fragment; P = `fragments` (Streaming
    DiLoCo: synced in turn; with `stagger=False`, a barrier's P rounds go out at the same
    step and pipeline, as in `RoundSchedule`); τ = `in_flight` rounds a learner may have
    unmerged; `overlap_steps` bounds how far it trains past its own publish (0: DiLoCo's
    barrier, None: never waits); α = `mixing`; `quorum_size` contributions close a round
    (Decoupled DiLoCo); η = `outer_lr` and β = `outer_momentum` of the Nesterov outer step;
    `merge` and `partition`; `global_batch_size` split over live learners; `delta_dtype`
    (None: the model's own precision — BF16 deltas from a fragment held in BF16, else F32;
    "F32" forces full precision; "TOPK_F8" and "TOPK_Q2", the sparse formats of
    `wire.sparse`, keep `delta_density` (None: 1/32) of every chunk of 4096 elements,
    "SIGN1" (`wire.signs`) the signs of a seeded random `delta_density` (None: 1) of the
    elements, and each learner keeps what it did not send as error feedback,
    `learner.feedback`, its residual scaled by `feedback_decay` each round, None: 1; with
    `feedback_momentum` μ each learner keeps the Nesterov momentum of its own deltas and
    compresses the Nesterov step, and the outer step is plain SGD, outer_momentum=0) and
    `commit_dtype` (None: full theta) transfer formats; `delta_density` and the feedback
    settings are written to the JSON only when set. With error feedback the outer momentum
    belongs with the learners (measured in benchmarks/RESULTS.md, "Sparse and 1-bit
    deltas"): `DiLoCo.standard(H, M, delta_dtype="SIGN1", feedback_momentum=0.8,
    outer_momentum=0.0)` for 1 bit an element, or a top-k format with `outer_lr=1.0,
    outer_momentum=0.0`; `feedback_decay` unset. `flush_on_close` (the default) publishes
    what a closing learner trained since its last contribution as final contributions, so a
    run that ends commits every step it trained; `outlier_factor` k drops a contribution
    whose delta norm exceeds k × the round's median (None: off; see `outliers`). Its JSON
    omits `outlier_factor` when None, so runs created before the field existed keep their
    records.

    `rebase` is how a learner aligns a fragment with a commit. Rebasing sets
    θ ← Θ_new + (θ − base), where base is its own snapshot of that round when it took part
    (its progress up to the snapshot is inside Θ_new) and otherwise the commit it last
    aligned with; the steps and tokens Θ_new did not count stay counted and go out in the
    fragment's next contribution. Nothing trained is thrown away. Without it the commit
    overwrites the fragment, keeping α = `mixing` of it. None (the default) rebases when
    `mixing` is 0 and mixes otherwise; rebase=True with mixing > 0 is refused. Behind a
    barrier (overlap_steps=0) nothing is trained past the snapshot, and rebasing is
    overwriting. The JSON writes `rebase` only where it departs from that default choice,
    so default records, and runs created before the field existed, are unchanged.

    `checkpoint_every` K is how the outer state travels. With K > 1 (the default, 20) the
    outer step is replicated: a commit carries the merged Δ (`RoundResult.step`) and every
    party — learners, closers, standalone syncers — takes the outer step itself with
    `apply_step`, byte for byte the same; the fragment's theta and fp32 outer state are
    uploaded only at versions that are multiples of K, as checkpoints for joiners and
    readers that fell behind. K = 1 uploads theta and the outer state with every commit
    (runs created before replication read as K = 1: their JSON has no such field).

    Every field has a default, the same at every entry point (Python, recipes, the
    Accelerate YAML; docs/configuration.md): `DiLoCo()` is Decoupled DiLoCo with H = 100,
    one fragment, quorum 1 and no barrier. One fragment because it is valid for every H
    (P <= H) and every model, and streaming is a choice that depends on the model's size
    and the link (the recipes set P = 2-8); `in_flight=None` resolves to min(2,
    fragments), so `DiLoCo(H, fragments=P)` keeps the τ = 2 it always had for P >= 2,
    and its record.

    `cohort_share` (on; off in `standard` and `local_sgd`, whose rounds hold every
    learner): a round short of its fragment's learners steps by its share of them
    (`rounds.cohort_share`), so each learner's progress weighs 1/M whichever round it
    lands in. The JSON writes it only when on: older runs read as off.

    `keep_rounds` K makes the run auditable while it trains: the sweep keeps the
    contributions (records and payloads) of the newest K rounds and the outer state before
    them, so `gradientmail verify` can re-derive those commits, and its learners upload
    every contribution (none merged from memory unseen). None (the default) sweeps them.
    """

    sync_every: int = _setting(100, "H: local steps between two syncs of each fragment")
    fragments: int = _setting(
        1, "P: fragments the model is cut into, synced in turn (Streaming DiLoCo when > 1)")
    in_flight: int | None = _setting(
        None, "τ: rounds a learner may have published and not yet merged; "
        "None: min(2, fragments), all of them with stagger false")
    overlap_steps: int | None = _setting(
        None, "steps a learner trains past its own publish before waiting for the commit; "
        "0: DiLoCo's barrier, None: never waits")
    mixing: float = _setting(0.0, "α: the share of local progress kept when a commit lands")
    quorum_size: int = _setting(
        1, "contributions that close a round (Decoupled DiLoCo; standard: the learners)")
    outer_lr: float = _setting(0.7, "η: the learning rate of the Nesterov outer step")
    outer_momentum: float = _setting(0.9, "β: the momentum of the Nesterov outer step")
    # Merge, Partition and Prices values are frozen: one shared default is safe.
    merge: Merge = _setting(  # noqa: RUF009
        _DEFAULT_MERGE, "how a round's deltas merge: rda (RDA; tensors matching "
        "direct_pattern, and rounds of two deltas, by weighted mean) or mean (the "
        "token-weighted mean)")
    partition: Partition = _setting(  # noqa: RUF009
        _DEFAULT_PARTITION, "how tensors are dealt into fragments: bytes (balanced by size) "
        "or strided (blocks numbered by block_pattern dealt round-robin)")
    global_batch_size: int | None = _setting(
        None, "a batch size split over the live learners; None: each keeps its own")
    delta_dtype: str | None = _setting(
        None, "the format of contributions: F32, BF16, F8_E4M3, F4; with error feedback "
        "TOPK_F8 or TOPK_Q2 (the top delta_density of every 4096 elements in 8 or 2 bits) "
        "or SIGN1 (1-bit signs of a random delta_density of them); None: the model's "
        "precision")
    commit_dtype: str | None = _setting(
        None, "the format of commits: BF16, F8_E4M3, F4; None: full theta")
    flush_on_close: bool = _setting(
        True, "a closing learner publishes what it trained since its last contribution")
    outlier_factor: float | None = _setting(
        None, "drop a contribution whose delta norm exceeds k x the round's median; "
        "None: off")
    rebase: bool | None = _setting(
        None, "align a fragment with a commit by rebasing local progress onto it; "
        "None: when mixing is 0")
    checkpoint_every: int = _setting(
        20, "K: theta and the outer state are uploaded every K versions; "
        "between them commits carry the merged step")
    keep_rounds: int | None = _setting(
        None, "keep the newest K rounds' contributions so verify can re-derive them; "
        "None: swept after each commit")
    delta_density: float | None = _setting(
        None, "the share of each chunk a sparse delta carries, in (0, 1]; "
        "None: 1/32 (SIGN1: 1)")
    feedback_decay: float | None = _setting(
        None, "β of a sparse delta's error feedback: the residual is scaled by it before "
        "the next delta is added, in (0, 1]; None: 1 (kept whole)")
    feedback_momentum: float | None = _setting(
        None, "μ of the Nesterov momentum each learner keeps on its own deltas before "
        "compressing them (sparse delta_dtype, outer_momentum 0), in (0, 1); None: off")
    cohort_share: bool = _setting(
        True, "a round short of its fragment's learners steps by the share of them it "
        "holds, so each learner's progress weighs alike whichever round it lands in")
    stagger: bool = _setting(
        True, "fragments sync in turn, spread over H steps; False (behind a barrier): "
        "all at the same step, one round after another, so one fragment's upload "
        "overlaps the merge and download of the one before")

    def __post_init__(self) -> None:
        _int("sync_every", self.sync_every, 1)
        _int("fragments", self.fragments, 1)
        if self.in_flight is None:
            # Two rounds in flight where there are two fragments to stream, else one; a
            # pipelined barrier has all of a sync's rounds in flight.
            tau = min(2, self.fragments) if self.stagger else self.fragments
            object.__setattr__(self, "in_flight", tau)
        _int("in_flight", self.in_flight, 1)
        h, p, tau = self.sync_every, self.fragments, self._in_flight
        if tau > p:
            hint = " (standard DiLoCo: fragments=1, in_flight=1)" if p == 1 else ""
            raise ConfigError(f"in_flight={tau} exceeds fragments={p}; {_RULE}{hint}")
        if p > h:
            raise ConfigError(f"fragments={p} exceeds sync_every={h}; {_RULE}")
        if self.overlap_steps is not None:
            _int("overlap_steps", self.overlap_steps, 0, optional=True)
        for flag in ("flush_on_close", "cohort_share", "stagger"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag}={getattr(self, flag)!r} must be a bool")
        if not self.stagger and (tau != p or self.overlap_steps != 0):
            raise ConfigError(
                f"stagger=False with in_flight={tau}, overlap_steps={self.overlap_steps}: a "
                f"pipelined barrier has its {p} rounds in flight at once; need in_flight={p} "
                f"and overlap_steps=0, as DiLoCo.standard(H, M, fragments={p}, stagger=False) sets"
            )
        mixing = _float("mixing", self.mixing)
        if not 0.0 <= mixing < 1.0:
            raise ConfigError(f"mixing={self.mixing!r} is out of range; need 0 <= mixing < 1")
        _int("quorum_size", self.quorum_size, 1)
        lr = _float("outer_lr", self.outer_lr)
        if lr <= 0:
            raise ConfigError(f"outer_lr={self.outer_lr!r} must be > 0")
        beta = _float("outer_momentum", self.outer_momentum)
        if not 0.0 <= beta < 1.0:
            raise ConfigError(
                f"outer_momentum={self.outer_momentum!r} is out of range; "
                "need 0 <= outer_momentum < 1"
            )
        if not isinstance(self.merge, WeightedMean | Rda):
            raise ConfigError(f"merge={self.merge!r} must be WeightedMean() or Rda(...)")
        if not isinstance(self.partition, ByBytes | Strided):
            raise ConfigError(f"partition={self.partition!r} must be ByBytes() or Strided(...)")
        _int("global_batch_size", self.global_batch_size, 1, optional=True)
        for name in ("delta_dtype", "commit_dtype"):
            v = getattr(self, name)
            # Deltas may be forced to F32 (their default is the model's own precision).
            allowed = ("F32", *_FORMATS, *SPARSE_FORMATS) if name == "delta_dtype" \
                else _FORMATS
            if v is not None and v not in allowed:
                raise ConfigError(
                    f"{name}={v!r} is not a transfer format; use None, "
                    + ", ".join(repr(f) for f in allowed)
                )
        if self.outlier_factor is not None:
            k = _float("outlier_factor", self.outlier_factor)
            if not k > 1.0:
                raise ConfigError(
                    f"outlier_factor={self.outlier_factor!r} must be None (off) or a number > 1: "
                    "a contribution is dropped when its delta norm exceeds outlier_factor "
                    "x the round's median, e.g. 5.0"
                )
            object.__setattr__(self, "outlier_factor", k)
        _int("checkpoint_every", self.checkpoint_every, 1)
        _int("keep_rounds", self.keep_rounds, 1, optional=True)
        if self.delta_density is not None:
            if self.delta_dtype not in SPARSE_FORMATS:
                raise ConfigError(
                    f"delta_density={self.delta_density!r} is set but delta_dtype="
                    f"{self.delta_dtype!r} is dense; use a sparse delta_dtype "
                    f"({', '.join(repr(f) for f in SPARSE_FORMATS)}) or leave delta_density "
                    "None")
            object.__setattr__(self, "delta_density", check_density(self.delta_density))
        if self.feedback_decay is not None:
            if self.delta_dtype not in SPARSE_FORMATS:
                raise ConfigError(
                    f"feedback_decay={self.feedback_decay!r} is set but delta_dtype="
                    f"{self.delta_dtype!r} keeps no error feedback; use a sparse delta_dtype "
                    f"({', '.join(repr(f) for f in SPARSE_FORMATS)}) or leave feedback_decay "
                    "None")
            object.__setattr__(self, "feedback_decay", check_decay(self.feedback_decay))
        if self.feedback_momentum is not None:
            mu = _float("feedback_momentum", self.feedback_momentum)
            if not 0 < mu < 1:
                raise ConfigError(f"feedback_momentum={self.feedback_momentum!r} must be in "
                                  "(0, 1), e.g. 0.9, or None (off)")
            if self.delta_dtype not in SPARSE_FORMATS:
                raise ConfigError(
                    f"feedback_momentum={mu!r} is set but delta_dtype={self.delta_dtype!r} "
                    "keeps no error feedback; use a sparse delta_dtype "
                    f"({', '.join(repr(f) for f in SPARSE_FORMATS)}) or leave "
                    "feedback_momentum None")
            if beta != 0:
                raise ConfigError(
                    f"feedback_momentum={mu!r} and outer_momentum={self.outer_momentum!r}: the "
                    "learners keep the momentum, so the outer step must not keep another; "
                    "set outer_momentum=0")
            object.__setattr__(self, "feedback_momentum", mu)
        if self.rebase is not None and not isinstance(self.rebase, bool):
            raise ConfigError(f"rebase={self.rebase!r} must be True, False or None (automatic)")
        if self.rebase and mixing > 0:
            raise ConfigError(
                f"rebase=True and mixing={self.mixing!r} exclude each other: rebasing keeps "
                "all of the local progress, mixing keeps α of it; use mixing=0 to rebase, "
                "or rebase=False (or None) to mix"
            )
        # None resolves here, so DiLoCo() == DiLoCo(rebase=True) and the learner reads a bool.
        rebase = _default_rebase(mixing) if self.rebase is None else self.rebase
        object.__setattr__(self, "rebase", rebase)
        # Store floats as floats, so the JSON of mixing=0 and mixing=0.0 is the same record.
        object.__setattr__(self, "mixing", mixing)
        object.__setattr__(self, "outer_lr", lr)
        object.__setattr__(self, "outer_momentum", beta)

    @classmethod
    def standard(cls, sync_every: int, learners: int, **overrides: Any) -> DiLoCo:
        """Standard DiLoCo: one fragment, a barrier every H steps, quorum = all learners,
        the weighted mean."""
        kw: dict[str, Any] = dict(
            fragments=1, in_flight=1, overlap_steps=0, quorum_size=learners, merge=WeightedMean(),
            cohort_share=False,
        )
        kw.update(overrides)
        if not kw.get("stagger", True) and "in_flight" not in overrides:
            kw["in_flight"] = kw["fragments"]  # a pipelined barrier: every round in flight
        return cls(sync_every, **kw)

    @classmethod
    def local_sgd(cls, sync_every: int, **overrides: Any) -> DiLoCo:
        """Local SGD: parameter averaging (η = 1, β = 0, the weighted mean) every H steps."""
        kw: dict[str, Any] = dict(
            fragments=1, in_flight=1, overlap_steps=0, outer_lr=1.0, outer_momentum=0.0,
            merge=WeightedMean(), cohort_share=False,
        )
        kw.update(overrides)
        return cls(sync_every, **kw)

    @property
    def _in_flight(self) -> int:
        # Resolved from None in __post_init__: always an int once built.
        assert self.in_flight is not None
        return self.in_flight

    @property
    def schedule(self) -> RoundSchedule:
        return RoundSchedule(self.sync_every, self.fragments, self._in_flight,
                             self.overlap_steps, self.stagger)

    def schedule_for(self, fragments: int) -> RoundSchedule:
        """The schedule over a plan of `fragments` (≤ the configured number)."""
        _int("fragments", fragments, 1)
        if fragments > self.fragments:
            raise ConfigError(f"a plan of {fragments} fragments exceeds fragments={self.fragments}")
        return RoundSchedule(self.sync_every, fragments, min(self._in_flight, fragments),
                             self.overlap_steps, self.stagger)

    def plan(self, schema: Schema) -> tuple[tuple[str, ...], ...]:
        return plan(schema, self.fragments, self.partition)

    def with_direct_names(self, names: Collection[str]) -> DiLoCo:
        """This configuration for a model whose adapter names `names` as embedding
        parameters (merged by weighted mean under RDA): an `Rda` merge that leaves
        `direct_names` to the model gets them; any other configuration is returned as is."""
        m = self.merge
        if not isinstance(m, Rda) or m.direct_names is not None:
            return self
        return dataclasses.replace(self, merge=dataclasses.replace(m, direct_names=tuple(names)))

    @property
    def replicated(self) -> bool:
        """Whether commits carry the merged Δ and every party takes the outer step."""
        return self.checkpoint_every > 1

    def keeps_master(self, dtypes: Sequence[str]) -> bool:
        """Whether a fragment of `dtypes` keeps an fp32 master apart from its theta.
        (A replicated outer step publishes no quantized theta: theta is the master, cast.)"""
        quantized = self.commit_dtype is not None and not self.replicated
        return quantized or any(d != "F32" for d in dtypes)

    def checkpoint_at(self, version: int) -> bool:
        """Whether the commit of `version` uploads theta and the outer state."""
        return version % self.checkpoint_every == 0

    def apply_step(
        self, state: FragmentState, step: Mapping[str, TensorBytes], fmt: str, rule: str,
        backend: Backend | None = None,
    ) -> FragmentState:
        """`outer.apply_step` under this configuration."""
        keep = self.keeps_master([state.theta[n].dtype for n in state.names])
        return apply_step(state, step, fmt, rule, lr=self.outer_lr,
                          momentum=self.outer_momentum, keep_master=keep, backend=backend)

    def initial_state(self, fragment: int, theta: Mapping[str, TensorBytes]) -> FragmentState:
        keep = self.keeps_master([t.dtype for t in theta.values()])
        return FragmentState.initial(fragment, theta, keep_master=keep)

    def aggregator(self, backend: Backend | None = None) -> DiLoCoAggregator:
        return DiLoCoAggregator(self, NumpyBackend() if backend is None else backend)

    def grace_window(
        self, estimates: Estimates, schedule: RoundSchedule, round_: int,
        poll_interval: float = 1.0,
    ) -> float:
        return grace_window(estimates, schedule, round_, poll_interval)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; `from_json(to_json())` gives an equal configuration."""
        out: dict[str, Any] = {"type": "diloco", "version": FORMAT_VERSION}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _OMITTED_WHEN_NONE and v is None:
                continue
            if f.name == "rebase" and v == _default_rebase(self.mixing):
                continue
            if f.name == "checkpoint_every" and v == 1:
                continue
            if (f.name == "cohort_share" and not v) or (f.name == "stagger" and v):
                continue
            out[f.name] = v.to_json() if f.name in ("merge", "partition") else v
        return out

    @classmethod
    def from_json(cls, obj: Any) -> DiLoCo:
        """Strict inverse of `to_json`; `RemoteProtocolError` naming the offending field."""
        if not isinstance(obj, dict):
            raise RemoteProtocolError(f"algorithm record {obj!r:.100} must be a JSON object")
        fields = [f.name for f in dataclasses.fields(cls)]
        want = {"type", "version", *fields}
        missing = sorted(want - set(obj) - _OMITTED_WHEN_NONE
                         - {"checkpoint_every", "cohort_share", "stagger"})
        extra = sorted(set(obj) - want)
        if missing or extra:
            raise RemoteProtocolError(
                f"algorithm record: missing fields {missing}, unknown fields {extra}"
            )
        if obj["type"] != "diloco":
            raise RemoteProtocolError(f"algorithm record: type={obj['type']!r:.60} is not 'diloco'")
        if obj["version"] != FORMAT_VERSION or isinstance(obj["version"], bool):
            raise RemoteProtocolError(
                f"algorithm record: version={obj['version']!r:.60} is not {FORMAT_VERSION}; "
                "the run was created by another gradientmail version"
            )
        kw: dict[str, Any] = {}
        for name in fields:
            if name not in obj:
                continue  # omitted when None
            v = obj[name]
            if name == "merge":
                kw[name] = merge_from_json(v, "merge")
            elif name == "partition":
                kw[name] = partition_from_json(v, "partition")
            else:
                kw[name] = _json_field(name, v)
        if "rebase" in kw and kw["rebase"] == _default_rebase(kw.get("mixing")):
            # One record per configuration: the default choice is written by leaving it out.
            raise RemoteProtocolError(
                f"algorithm record: rebase={kw['rebase']!r} is what mixing="
                f"{kw.get('mixing')!r} implies, and is recorded by omission"
            )
        for name, implied in (("checkpoint_every", 1), ("cohort_share", False),
                              ("stagger", True)):
            if name in kw and kw[name] == implied:  # what the absence means is not written
                raise RemoteProtocolError(f"algorithm record: {name}={str(implied).lower()} "
                                          "is recorded by omission")
        # Runs created before replication carry no checkpoint_every (every commit held the
        # whole state), and those before cohort shares stepped every round in full.
        kw.setdefault("checkpoint_every", 1)
        kw.setdefault("cohort_share", False)
        kw.setdefault("stagger", True)  # runs before it staggered their fragments
        try:
            return cls(**kw)
        except ConfigError as exc:
            raise RemoteProtocolError(f"algorithm record: {exc}") from None


_JSON_KINDS = {
    "sync_every": "int", "fragments": "int", "in_flight": "int", "overlap_steps": "int?",
    "mixing": "number", "quorum_size": "int", "outer_lr": "number", "outer_momentum": "number",
    "global_batch_size": "int?", "delta_dtype": "str?", "commit_dtype": "str?",
    "flush_on_close": "bool", "outlier_factor": "number", "rebase": "bool",
    "checkpoint_every": "int", "keep_rounds": "int", "delta_density": "number",
    "feedback_decay": "number", "feedback_momentum": "number", "cohort_share": "bool",
    "stagger": "bool",
}
# Fields added after format version 1 was pinned are written only where they depart from
# what their absence means (None; `rebase`: `_default_rebase`; `checkpoint_every`: 1;
# `cohort_share`: off; `stagger`: on), so older records stay valid and unchanged.
_OMITTED_WHEN_NONE = frozenset({"outlier_factor", "rebase", "keep_rounds", "delta_density",
                                "feedback_decay", "feedback_momentum"})
_JSON_WORDS = {"int": "an integer", "number": "a number", "str": "a string", "bool": "a bool"}


def _default_rebase(mixing: Any) -> bool:
    """What rebase=None resolves to: rebase unless the configuration mixes."""
    return bool(mixing == 0)


def _json_field(name: str, v: Any) -> Any:
    kind = _JSON_KINDS[name]
    if v is None and kind.endswith("?"):
        return v
    base = kind.rstrip("?")
    not_bool = not isinstance(v, bool)
    ok = {
        "int": not_bool and isinstance(v, int),
        "number": not_bool and isinstance(v, int | float),
        "str": isinstance(v, str),
        "bool": isinstance(v, bool),
    }[base]
    if not ok:
        null = " or null" if kind.endswith("?") else ""
        raise RemoteProtocolError(
            f"algorithm record: {name}={v!r:.60} is not {_JSON_WORDS[base]}{null}"
        )
    return v


class DiLoCoAggregator:
    """Closes DiLoCo rounds over a backend's Value arithmetic; pure and deterministic."""

    def __init__(self, config: DiLoCo, backend: Backend) -> None:
        self.config = config
        self.backend = backend

    def close_round(
        self, state: FragmentState, contributions: Sequence[Contribution], schema: Schema,
        cohort: int | None = None,
    ) -> RoundResult:
        """Merge `contributions` into `state` and take the outer step.

        Contributions are ordered by learner id first, so the bytes do not depend on the
        order they arrived in. Each tensor's deltas are merged with the normalized
        weights tokens²/steps (`Rda`, or the weighted mean for `direct_pattern` tensors
        and for `WeightedMean`); Nesterov moves the fp32 master and the fp32 momentum. A
        round made only of final contributions, or a light one (`light`: under half a
        sync period of progress), moves the master by their weighted mean Δ alone
        (Θ ← Θ − Δ, whatever the merge) and keeps the momentum. With `cohort_share`, the
        merged delta is scaled by `rounds.cohort_share` of `cohort` learners (None: not at
        all). With `commit_dtype`, the update is the quantized Θ_new − Θ_old and the published theta
        is `rebuild_theta(Θ_old, update)`; the rounding stays in the master and is
        corrected next round.

        Raises `SchemaMismatch` (a delta or theta that does not fit the schema),
        `NonFiniteError` (a non-finite delta, naming its learners; or an outer step that
        overflows) and `ConfigError` (no contributions, a learner twice).
        """
        cfg, be = self.config, self.backend
        names = state.names
        validate(schema, state.theta, names)
        contribs = _ordered(contributions)
        _check_deltas(contribs, names, schema)
        exact = [Fraction(c.tokens * c.tokens, c.steps) for c in contribs]
        shares = normalized_weights(exact)
        spans = span_scales([c.steps for c in contribs], cfg.sync_every)
        participants = tuple(
            Participant(c.learner, c.local_step, c.steps, c.tokens, weight(c.tokens, c.steps))
            for c in contribs
        )
        all_final = all(c.final for c in contribs)
        averaged = all_final or light(shares, [c.steps for c in contribs], cfg.sync_every)
        share = (1.0 if cohort is None or not cfg.cohort_share
                 else cohort_share([c.steps for c in contribs], cfg.sync_every, cohort))
        dtypes = [state.theta[n].dtype for n in names]
        fmt = step_format(cfg.commit_dtype, dtypes) if cfg.replicated else "F32"
        m = len(contribs)
        frag_gram = [[0.0] * m for _ in range(m)]
        step: dict[str, TensorBytes] = {}
        for name in names:
            deltas = [be.load(c.delta[name]) for c in contribs]
            # One delta needs no Gram matrix (its coefficient is 1, there is no cosine):
            # a finiteness pass in float32 costs a fraction of a float64 product.
            gram = be.gram(deltas) if m > 1 else [
                [0.0 if be.all_finite(deltas[0]) else math.nan]]
            bad = [c.learner for i, c in enumerate(contribs) if not math.isfinite(gram[i][i])]
            if bad:
                raise NonFiniteError(
                    f"the delta of {name!r} from learners {bad} holds NaN or infinity; "
                    "leave those contributions out of the round"
                )
            for i in range(m):
                for j in range(m):
                    frag_gram[i][j] += gram[i][j]
            coeffs = self._coefficients(name, gram, shares, spans, averaged)
            if share != 1.0:  # a full round keeps its bytes
                coeffs = [k * share for k in coeffs]
            merged = be.lincomb(deltas, coeffs).to_bytes("F32")
            step.update(merged_step(name, merged, fmt))
        # One outer step for both ways of publishing it: what every party of a replicated
        # run applies, and (at F32, byte for byte the same) what a published one uploads.
        rule = "average" if averaged else "nesterov"
        new_state = cfg.apply_step(state, step, fmt, rule, be)
        update: dict[str, TensorBytes] | None = None
        if not cfg.replicated and cfg.commit_dtype is not None:
            assert new_state.master is not None  # kept apart when commits carry an update
            update = {}
            theta = {n: self._publish(n, be.load(new_state.master[n]), state.theta[n], update)
                     for n in names}
            new_state = dataclasses.replace(new_state, theta=theta)
        return RoundResult(
            state=new_state,
            update=update,
            participants=participants,
            mean_cosine=mean_cosine(frag_gram),
            all_final=all_final,
            step=step if cfg.replicated else None,
            step_format=fmt if cfg.replicated else None,
            rule=rule,
        )

    def _coefficients(
        self, name: str, gram: list[list[float]], shares: list[float], spans: list[float],
        averaged: bool = False,
    ) -> list[float]:
        """The coefficient of each raw delta: the merge of the deltas divided by their
        spans (`span_scales`), folded into one number each.

        A round of final contributions only, or a light one (`light`), is the learners'
        progress averaged into the fragment, not an outer step: the weighted mean, never
        RDA's norm. Final flushes carry a few steps each in directions that agree little
        (mean cosine 0.24 at M = 4), and RDA, which keeps the mean norm where the mean
        of such deltas is half as long, moved the fragment ~2x past the average: the
        held-out loss rose from 3.972 to 4.020 in the run's last round, where a quarter
        to a half of that step gave 3.952-3.955 (benchmarks/RESULTS.md, 2026-12-02)."""
        merge = self.config.merge
        if len(shares) == 1:
            return [spans[0]]
        if averaged or isinstance(merge, WeightedMean) or not merge.applies_to(
                name, len(shares)):
            return [p * s for p, s in zip(shares, spans, strict=True)]
        m = len(spans)
        scaled = [[gram[i][j] * spans[i] * spans[j] for j in range(m)] for i in range(m)]
        return [c * s for c, s in zip(rda_coefficients(scaled, shares), spans, strict=True)]

    def _publish(
        self, name: str, new_master: Value, old: TensorBytes, update: dict[str, TensorBytes]
    ) -> TensorBytes:
        fmt = self.config.commit_dtype
        if fmt is None:
            return new_master.to_bytes(old.dtype)
        from gradientmail.wire.quantization import dequantize, quantize

        be = self.backend
        theta_old = be.load(old)
        entries = quantize(name, (new_master - theta_old).to_bytes("F32"), fmt)
        update.update(entries)
        return (theta_old + be.load(dequantize(entries, name, fmt))).to_bytes(old.dtype)


def _ordered(contributions: Sequence[Contribution]) -> list[Contribution]:
    if not contributions:
        raise ConfigError("close_round needs at least one contribution")
    out = sorted(contributions, key=lambda c: c.learner)
    dups = sorted({a.learner for a, b in itertools.pairwise(out) if a.learner == b.learner})
    if dups:
        raise ConfigError(f"learners {dups} contribute more than once to the round; keep one each")
    return out


def _check_deltas(contribs: list[Contribution], names: tuple[str, ...], schema: Schema) -> None:
    problems = []
    for c in contribs:
        missing = [n for n in names if n not in c.delta]
        extra = sorted(n for n in c.delta if n not in names)
        if missing:
            problems.append(f"{c.learner}: missing {missing}")
        if extra:
            problems.append(f"{c.learner}: extra {extra}")
        for n in names:
            t = c.delta.get(n)
            if t is None:
                continue
            known = isinstance(t, TensorBytes | RowPieces)
            if not known or t.dtype not in ("F32", "F16", "BF16"):
                got = t.dtype if known else type(t).__name__
                problems.append(f"{c.learner}: {n!r} is {got}, expected F32 (dequantize first)")
            elif t.shape != schema[n].shape:
                problems.append(
                    f"{c.learner}: {n!r} has shape {list(t.shape)}, the schema says "
                    f"{list(schema[n].shape)}"
                )
    if problems:
        raise SchemaMismatch("deltas do not match the fragment: " + "; ".join(problems))
