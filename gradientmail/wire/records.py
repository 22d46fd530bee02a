"""The run's records: frozen dataclasses with a strict, canonical JSON form.

Every record object in the mailbox (manifest, claims, contributions, round records) is a
JSON object carrying the format version `"v": 1`. Writing is canonical (sorted keys,
compact separators, UTF-8, no NaN), so equal records are equal bytes and golden records
are byte-stable. Reading is strict: the exact field set, exact JSON types, finite numbers,
a size bound, and the value rules of each record. Anything else is a peer's or the
store's bad data and raises `RemoteProtocolError` naming the key and the field; building a
record with bad values in this process raises `LocalProtocolError`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from gradientmail.errors import (
    GradientmailError,
    LocalProtocolError,
    RemoteProtocolError,
)
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.record_json import (
    CODECS,
    FORMAT_VERSION,
    HINT,
    MAX_MANIFEST_BYTES,
    MAX_RECORD_BYTES,
    Fields,
    build_record,
    canonical_json,
    check_count,
    check_finite,
    check_format,
    check_learner_id,
    check_seconds,
    check_sha256,
    check_text,
    is_number,
    parse_json,
)
from gradientmail.wire.refs import Arrival, PayloadRef, StepRef, UpdateRef
from gradientmail.wire.serialization import Schema

__all__ = [
    "CreationClaim",
    "Dropped",
    "Manifest",
    "Participant",
    "Record",
    "RoundClaim",
    "RoundRecord",
    "SnapshotRecord",
]

class Record:
    """A top-level record: `encode()` to canonical bytes, `decode(data, key)` strictly."""

    MAX_BYTES: ClassVar[int] = MAX_RECORD_BYTES

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_json(cls, obj: Any, key: str) -> Self:
        raise NotImplementedError

    def encode(self) -> bytes:
        data = canonical_json(self.to_json())
        if len(data) > self.MAX_BYTES:
            raise LocalProtocolError(
                f"{type(self).__name__} encodes to {len(data)} bytes; at most {self.MAX_BYTES}"
            )
        return data

    @classmethod
    def decode(cls, data: bytes, key: str) -> Self:
        return cls.from_json(parse_json(data, key, cls.MAX_BYTES), key)


@dataclasses.dataclass(frozen=True)
class CreationClaim(Record):
    """`claims/create/<attempt>`: `learner` bids to create the run (attempt 0 first)."""

    attempt: int
    learner: str

    def __post_init__(self) -> None:
        check_count("attempt", self.attempt)
        check_learner_id(self.learner)

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "learner": self.learner, "v": FORMAT_VERSION}

    @classmethod
    def from_json(cls, obj: Any, key: str) -> Self:
        f = Fields(obj, key, "", ("attempt", "learner", "v"))
        return build_record(cls, key, "", attempt=f.get_int("attempt"),
                            learner=f.get_str("learner"))


@dataclasses.dataclass(frozen=True)
class RoundClaim(Record):
    """`claims/round/<round>/<attempt>`: `closer` bids to close `round`."""

    round: int
    attempt: int
    closer: str

    def __post_init__(self) -> None:
        check_count("round", self.round)
        check_count("attempt", self.attempt)
        check_learner_id(self.closer)

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "closer": self.closer, "round": self.round,
                "v": FORMAT_VERSION}

    @classmethod
    def from_json(cls, obj: Any, key: str) -> Self:
        f = Fields(obj, key, "", ("attempt", "closer", "round", "v"))
        return build_record(cls, key, "", round=f.get_int("round"), attempt=f.get_int("attempt"),
                      closer=f.get_str("closer"))


@dataclasses.dataclass(frozen=True)
class Manifest(Record):
    """`manifest.json`: what the run is. Written once (create-if-absent) by its creator.

    `plan[p]` names the tensors of fragment p and `init[p]` references its Θ⁰; `algorithm`
    is the algorithm's own JSON, carried opaquely (a joiner compares it with its own);
    `codec` is the creator's payload codec (informational: every key's extension names
    its codec); `key_fingerprint` identifies the key of an authenticated run (None: none).

    A creator whose ranks each hold a shard uploads Θ⁰ of a fragment as parts instead
    (`init/<attempt>/<fragment>/<k>-of-<n><ext>`, in k order, each holding the rows of
    `wire.sharded_parts`; docs/design/sharded.md §3): `init[p]` is then None and
    `init_parts[p]` lists them. Each fragment has its payload or its parts, never both.
    `init_parts` is () when no fragment has parts, and is then left out of the JSON, so
    manifests without parts keep their bytes (and an older reader, strict, refuses a
    manifest with parts rather than misread it). `init_refs(p)` is what a reader fetches either way.
    """

    MAX_BYTES: ClassVar[int] = MAX_MANIFEST_BYTES

    schema: Schema
    plan: tuple[tuple[str, ...], ...]
    algorithm: Mapping[str, Any]
    creator: str
    init: tuple[PayloadRef | None, ...]
    codec: str
    key_fingerprint: str | None = None
    init_parts: tuple[tuple[PayloadRef, ...], ...] = ()

    def __post_init__(self) -> None:
        check_learner_id(self.creator)
        if not isinstance(self.algorithm, Mapping):
            raise LocalProtocolError(f"algorithm={self.algorithm!r:.100} must be a JSON object")
        # A private canonical copy, so the frozen record cannot change under us.
        object.__setattr__(self, "algorithm", json.loads(canonical_json(dict(self.algorithm))))
        plan = tuple(tuple(fragment) for fragment in self.plan)
        object.__setattr__(self, "plan", plan)
        object.__setattr__(self, "init", tuple(self.init))
        object.__setattr__(self, "init_parts", tuple(tuple(p) for p in self.init_parts))
        names = [name for fragment in plan for name in fragment]
        if not plan or not all(plan) or sorted(names) != sorted(self.schema.names):
            raise LocalProtocolError(
                f"plan {[list(f) for f in plan]!r:.200} must split the schema's "
                f"{len(self.schema)} tensors into non-empty fragments, each tensor once"
            )
        if len(self.init) != len(plan):
            raise LocalProtocolError(
                f"init has {len(self.init)} payload refs for {len(plan)} fragments; "
                "need one per fragment"
            )
        if self.init_parts and (len(self.init_parts) != len(plan) or not any(self.init_parts)):
            raise LocalProtocolError(
                f"init_parts has {len(self.init_parts)} lists, {sum(map(bool, self.init_parts))}"
                f" of them not empty, for {len(plan)} fragments; need one per fragment (empty "
                "where init has the payload) and some part, or none at all"
            )
        for p, ref in enumerate(self.init):
            parts = self.init_parts[p] if self.init_parts else ()
            if (ref is None) == (not parts):
                raise LocalProtocolError(
                    f"fragment {p}'s Θ⁰ must be one payload (init[{p}]) or parts "
                    f"(init_parts[{p}]), never both and never neither (init[{p}]="
                    f"{ref!r:.80}, {len(parts)} parts)"
                )
            if not all(isinstance(r, PayloadRef) for r in (ref, *parts) if r is not None):
                raise LocalProtocolError(f"init[{p}] and init_parts[{p}] must be PayloadRefs")
        if self.codec not in CODECS:
            raise LocalProtocolError(f"codec={self.codec!r} must be one of {CODECS}")
        if self.key_fingerprint is not None:
            check_sha256("key_fingerprint", self.key_fingerprint)

    def init_refs(self, fragment: int) -> tuple[PayloadRef, ...]:
        """The payloads holding Θ⁰ of `fragment`: the one payload, or its parts in k order."""
        ref = self.init[fragment]
        return (ref,) if ref is not None else self.init_parts[fragment]

    def init_size(self, fragment: int) -> int:
        """Bytes of Θ⁰ of `fragment` as uploaded, every part counted."""
        return sum(ref.size for ref in self.init_refs(fragment))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "algorithm": self.algorithm,
            "codec": self.codec,
            "creator": self.creator,
            "init": [None if ref is None else ref.to_json() for ref in self.init],
            "key_fingerprint": self.key_fingerprint,
            "plan": [list(fragment) for fragment in self.plan],
            "schema": self.schema.to_dict(),
            "v": FORMAT_VERSION,
        }
        if self.init_parts:
            out["init_parts"] = [[ref.to_json() for ref in parts] for parts in self.init_parts]
        return out

    @classmethod
    def from_json(cls, obj: Any, key: str) -> Self:
        parted = ("init_parts",) if isinstance(obj, dict) and "init_parts" in obj else ()
        f = Fields(obj, key, "", ("algorithm", "codec", "creator", "init", "key_fingerprint",
                                   "plan", "schema", "v", *parted))
        plan = []
        for p, fragment in enumerate(f.get_list("plan")):
            if not isinstance(fragment, list):
                f.fail(f"plan[{p}]", "must be an array of tensor names", fragment)
            for i, name in enumerate(fragment):
                if not isinstance(name, str):
                    f.fail(f"plan[{p}][{i}]", "must be a tensor name (a string)", name)
            plan.append(tuple(fragment))
        if not isinstance(f.obj["algorithm"], dict):
            f.fail("algorithm", "must be an object", f.obj["algorithm"])
        try:
            schema = Schema.from_dict(f.obj["schema"])
        except RemoteProtocolError as exc:
            raise RemoteProtocolError(f"record {key!r}: field 'schema': {exc} ({HINT})") from exc
        init_parts: list[tuple[PayloadRef, ...]] = []
        for p, refs in enumerate(f.get_list("init_parts") if parted else []):
            if not isinstance(refs, list):
                f.fail(f"init_parts[{p}]", "must be an array of payload refs", refs)
            init_parts.append(tuple(PayloadRef.from_json(r, key, f"init_parts[{p}][{k}]")
                                    for k, r in enumerate(refs)))
        # A fragment given by parts has no payload: null, allowed only in a manifest
        # with parts (an older one names a payload for every fragment).
        init = tuple(None if r is None and parted else PayloadRef.from_json(r, key, f"init[{p}]")
                     for p, r in enumerate(f.get_list("init")))
        return build_record(
            cls, key, "", schema=schema, plan=tuple(plan), algorithm=f.obj["algorithm"],
            creator=f.get_str("creator"), init=init, codec=f.get_str("codec"),
            key_fingerprint=f.get_str("key_fingerprint", null=True),
            init_parts=tuple(init_parts),
        )


@dataclasses.dataclass(frozen=True)
class SnapshotRecord(Record):
    """`snapshots/<round>/<learner>.json`: one learner's contribution to one round.

    `base_version` is the fragment version the delta was taken against, `local_step` the
    learner's step counter when it snapshotted, `steps`/`tokens` what the delta holds,
    `final` marks a flush on close, `delta_format` the dtype of the delta's tensors (e.g.
    "F32", "BF16", "F8_E4M3", "F4"; quantized ones add `<name>.scale` entries) and
    `payload` the delta itself. `step_seconds` is the learner's step-time EMA (its steps/s
    is the inverse) and `loss` its mean training loss over the steps since it last
    published the fragment, when its training loop reported one (left out of the JSON
    when None, so records without it keep their bytes).

    A learner whose ranks each mail their own rows sends its delta as `parts` instead
    (`parts/<round>/<learner>/<k>-of-<n><ext>`, in k order; docs/design/sharded.md): a record
    holds `payload` or `parts`, never both, and one with parts writes no `payload` field,
    so records without parts keep their bytes (and an older closer, strict, drops a
    record with parts as unreadable rather than misread it).
    """

    learner: str
    round: int
    fragment: int
    base_version: int
    local_step: int
    steps: int
    tokens: int
    final: bool
    schema_digest: str
    delta_format: str
    payload: PayloadRef | None
    step_seconds: float | None = None
    loss: float | None = None
    parts: tuple[PayloadRef, ...] = ()

    def __post_init__(self) -> None:
        check_learner_id(self.learner)
        object.__setattr__(self, "parts", tuple(self.parts))
        if (self.payload is None) == (not self.parts):
            raise LocalProtocolError(
                "a contribution record holds its delta as one payload or as parts, never "
                f"both and never neither (payload={self.payload!r:.80}, "
                f"{len(self.parts)} parts)"
            )
        if not all(isinstance(r, PayloadRef) for r in (self.payload, *self.parts)
                   if r is not None):
            raise LocalProtocolError("payload and parts must be PayloadRefs")
        for name in ("round", "fragment", "base_version", "local_step", "steps", "tokens"):
            check_count(name, getattr(self, name))
        if not isinstance(self.final, bool):
            raise LocalProtocolError(f"final={self.final!r} must be a bool")
        check_sha256("schema_digest", self.schema_digest)
        check_format("delta_format", self.delta_format)
        s = self.step_seconds
        if s is not None:
            if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) \
                    or s < 0:
                raise LocalProtocolError(f"step_seconds={s!r} must be a finite number >= 0")
            object.__setattr__(self, "step_seconds", float(s))
        if self.loss is not None:
            object.__setattr__(self, "loss", check_finite("loss", self.loss))

    def payload_refs(self) -> tuple[PayloadRef, ...]:
        """The payloads holding the delta: the one payload, or the parts in k order."""
        return (self.payload,) if self.payload is not None else self.parts

    @property
    def payload_size(self) -> int:
        """Bytes of the delta as uploaded, every part counted."""
        return sum(ref.size for ref in self.payload_refs())

    @property
    def payload_key(self) -> str:
        """Where the delta lies, for messages: the payload's key, or its parts' folder."""
        if self.payload is not None:
            return self.payload.key
        return self.parts[0].key.rsplit("/", 1)[0] + "/"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "base_version": self.base_version,
            "delta_format": self.delta_format,
            "final": self.final,
            "fragment": self.fragment,
            "learner": self.learner,
            "local_step": self.local_step,
            "round": self.round,
            "schema_digest": self.schema_digest,
            "step_seconds": self.step_seconds,
            "steps": self.steps,
            "tokens": self.tokens,
            "v": FORMAT_VERSION,
        }
        if self.loss is not None:
            out["loss"] = self.loss
        if self.payload is not None:
            out["payload"] = self.payload.to_json()
        else:
            out["parts"] = [ref.to_json() for ref in self.parts]
        return out

    @classmethod
    def from_json(cls, obj: Any, key: str) -> Self:
        optional = ("loss",) if isinstance(obj, dict) and "loss" in obj else ()
        delta = "parts" if isinstance(obj, dict) and "parts" in obj else "payload"
        f = Fields(obj, key, "", ("base_version", "delta_format", "final", "fragment",
                                   "learner", "local_step", delta, "round",
                                   "schema_digest", "step_seconds", "steps", "tokens", "v",
                                   *optional))
        parts = f.get_list("parts") if delta == "parts" else []
        if delta == "parts" and not parts:
            f.fail("parts", "must name at least one part", parts)
        return build_record(
            cls, key, "", learner=f.get_str("learner"), round=f.get_int("round"),
            fragment=f.get_int("fragment"), base_version=f.get_int("base_version"),
            local_step=f.get_int("local_step"), steps=f.get_int("steps"),
            tokens=f.get_int("tokens"),
            final=f.get_bool("final"), schema_digest=f.get_str("schema_digest"),
            delta_format=f.get_str("delta_format"),
            payload=(PayloadRef.from_json(f.obj["payload"], key, "payload")
                     if delta == "payload" else None),
            step_seconds=f.get_opt_float("step_seconds"),
            loss=f.get_float("loss") if optional else None,
            parts=tuple(PayloadRef.from_json(r, key, f"parts[{k}]")
                        for k, r in enumerate(parts)),
        )


@dataclasses.dataclass(frozen=True)
class Participant:
    """A contribution merged into a round: who, at which step, how much, with what weight."""

    learner: str
    local_step: int
    steps: int
    tokens: int
    weight: float
    #: The learner's step-time EMA as its contribution reported it: every party learns
    #: each learner's pace from the records (a closer does not wait for a much slower
    #: one). Left out of the JSON when None, so older records keep their bytes.
    step_seconds: float | None = None
    #: True when the round's closer was this learner and merged its delta from memory:
    #: no payload of it was ever uploaded (a contribution that completes its round's set
    #: costs no upload). Left out of the JSON when False.
    held: bool = False
    #: The learner's mean training loss as its contribution reported it, and the size of
    #: its uploaded payload (None when held): the run's history outlives the swept
    #: contributions. Each left out of the JSON when None.
    loss: float | None = None
    payload_size: int | None = None

    def __post_init__(self) -> None:
        check_learner_id(self.learner)
        if not isinstance(self.held, bool):
            raise LocalProtocolError(f"participant {self.learner!r}: held={self.held!r} "
                                     "must be a bool")
        for name in ("local_step", "steps", "tokens"):
            check_count(name, getattr(self, name))
        object.__setattr__(self, "weight", check_seconds("weight", self.weight))
        if self.step_seconds is not None:
            object.__setattr__(self, "step_seconds",
                               check_seconds("step_seconds", self.step_seconds))
        if self.loss is not None:
            object.__setattr__(self, "loss", check_finite("loss", self.loss))
        if self.payload_size is not None:
            check_count("payload_size", self.payload_size)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"learner": self.learner, "local_step": self.local_step,
                               "steps": self.steps, "tokens": self.tokens,
                               "weight": self.weight}
        if self.step_seconds is not None:
            out["step_seconds"] = self.step_seconds
        if self.held:
            out["held"] = True
        if self.loss is not None:
            out["loss"] = self.loss
        if self.payload_size is not None:
            out["payload_size"] = self.payload_size
        return out

    @classmethod
    def from_json(cls, obj: Any, key: str, path: str) -> Participant:
        optional = tuple(k for k in ("step_seconds", "held", "loss", "payload_size")
                         if isinstance(obj, dict) and k in obj)
        f = Fields(obj, key, path,
                    ("learner", "local_step", "steps", "tokens", "weight", *optional))
        return build_record(cls, key, path, learner=f.get_str("learner"),
                      local_step=f.get_int("local_step"), steps=f.get_int("steps"),
                      tokens=f.get_int("tokens"), weight=float(f.get(
                          "weight", is_number, "must be a number")),
                      step_seconds=(f.get_float("step_seconds")
                                    if "step_seconds" in optional else None),
                      held="held" in optional and f.get(
                          "held", lambda v: v is True, "must be true when present"),
                      loss=f.get_float("loss") if "loss" in optional else None,
                      payload_size=(f.get_int("payload_size")
                                    if "payload_size" in optional else None))


@dataclasses.dataclass(frozen=True)
class Dropped:
    """A contribution the closer left out, and why (e.g. 'stale base version 3')."""

    learner: str
    reason: str

    def __post_init__(self) -> None:
        check_learner_id(self.learner)
        check_text("reason", self.reason)

    def to_json(self) -> dict[str, Any]:
        return {"learner": self.learner, "reason": self.reason}

    @classmethod
    def from_json(cls, obj: Any, key: str, path: str) -> Dropped:
        f = Fields(obj, key, path, ("learner", "reason"))
        return build_record(cls, key, path, learner=f.get_str("learner"),
                      reason=f.get_str("reason"))


@dataclasses.dataclass(frozen=True)
class RoundRecord(Record):
    """`rounds/<round>.json`, the commit: the single source of truth about a round.

    Fragment `fragment` moved to `version` (init is version 0); `theta` holds its new
    parameters, `outer` the outer state any later closer continues from, `update` the
    optional quantized difference. `all_final` marks a round made only of final flushes.
    In a run with a replicated outer step, `step` holds the merged Δ every party applies,
    and `theta` and `outer` are null except at checkpoint versions.
    """

    round: int
    fragment: int
    version: int
    theta: PayloadRef | None
    outer: PayloadRef | None
    update: UpdateRef | None
    participants: tuple[Participant, ...]
    estimates: Estimates
    mean_cosine: float | None
    dropped: tuple[Dropped, ...]
    closer: str
    all_final: bool
    #: How the round waited for its learners (None in records written before it existed,
    #: and left out of the JSON then, so they keep their bytes).
    arrival: Arrival | None = None
    #: The replicated outer step (None in runs that upload the state with every commit,
    #: and left out of the JSON then, so their records keep their bytes).
    step: StepRef | None = None
    #: When the closer committed, in Unix seconds on its own wall clock: for people
    #: reading the run's history (`gradientmail log`/`plot`), never for a decision
    #: (machines share no clock). None in older records, and left out of the JSON then.
    committed_at: float | None = None

    def __post_init__(self) -> None:
        check_count("round", self.round)
        check_count("fragment", self.fragment)
        check_count("version", self.version, low=1)
        if (self.theta is None) != (self.outer is None):
            raise LocalProtocolError("theta and outer are both set (a checkpoint) or both null")
        if self.theta is None and self.step is None:
            raise LocalProtocolError("a commit without theta and outer must carry its step")
        object.__setattr__(self, "participants", tuple(self.participants))
        object.__setattr__(self, "dropped", tuple(self.dropped))
        learners = [p.learner for p in self.participants]
        if len(set(learners)) != len(learners):
            raise LocalProtocolError(f"participants {learners} name a learner twice")
        c = self.mean_cosine
        if c is not None:
            if isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c):
                raise LocalProtocolError(f"mean_cosine={c!r} must be a finite number or None")
            object.__setattr__(self, "mean_cosine", float(c))
        check_learner_id(self.closer)
        if not isinstance(self.all_final, bool):
            raise LocalProtocolError(f"all_final={self.all_final!r} must be a bool")
        if self.committed_at is not None:
            object.__setattr__(self, "committed_at",
                               check_seconds("committed_at", self.committed_at))

    def payload_refs(self) -> tuple[PayloadRef, ...]:
        """Every payload this record references (what sweeping must keep)."""
        refs = [r for r in (self.theta, self.outer) if r is not None]
        if self.update is not None:
            refs.append(self.update.payload)
        if self.step is not None:
            refs.append(self.step.payload)
        return tuple(refs)

    @property
    def checkpoint(self) -> bool:
        """Whether the record carries the fragment's whole state (theta and outer)."""
        return self.theta is not None

    def to_json(self) -> dict[str, Any]:
        out = {
            "all_final": self.all_final,
            "closer": self.closer,
            "dropped": [d.to_json() for d in self.dropped],
            "estimates": self.estimates.to_json(),
            "fragment": self.fragment,
            "mean_cosine": self.mean_cosine,
            "outer": None if self.outer is None else self.outer.to_json(),
            "participants": [p.to_json() for p in self.participants],
            "round": self.round,
            "theta": None if self.theta is None else self.theta.to_json(),
            "update": None if self.update is None else self.update.to_json(),
            "v": FORMAT_VERSION,
            "version": self.version,
        }
        if self.arrival is not None:
            out["arrival"] = self.arrival.to_json()
        if self.step is not None:
            out["step"] = self.step.to_json()
        if self.committed_at is not None:
            out["committed_at"] = self.committed_at
        return out

    @classmethod
    def from_json(cls, obj: Any, key: str) -> Self:
        optional = tuple(k for k in ("arrival", "step", "committed_at")
                         if isinstance(obj, dict) and k in obj)
        f = Fields(obj, key, "", ("all_final", "closer", "dropped", "estimates", "fragment",
                                   "mean_cosine", "outer", "participants", "round", "theta",
                                   "update", "v", "version", *optional))
        try:
            estimates = Estimates.from_json(f.obj["estimates"])
        except GradientmailError as exc:
            raise RemoteProtocolError(
                f"record {key!r}: field 'estimates': {exc} ({HINT})"
            ) from exc
        update, theta, outer, step = (f.obj.get(k)
                                      for k in ("update", "theta", "outer", "step"))
        return build_record(
            cls, key, "", round=f.get_int("round"), fragment=f.get_int("fragment"),
            version=f.get_int("version"),
            theta=None if theta is None else PayloadRef.from_json(theta, key, "theta"),
            outer=None if outer is None else PayloadRef.from_json(outer, key, "outer"),
            step=None if step is None else StepRef.from_json(step, key, "step"),
            update=None if update is None else UpdateRef.from_json(update, key, "update"),
            participants=tuple(Participant.from_json(p, key, f"participants[{i}]")
                               for i, p in enumerate(f.get_list("participants"))),
            estimates=estimates, mean_cosine=f.get_opt_float("mean_cosine"),
            dropped=tuple(Dropped.from_json(d, key, f"dropped[{i}]")
                          for i, d in enumerate(f.get_list("dropped"))),
            closer=f.get_str("closer"), all_final=f.get_bool("all_final"),
            arrival=(Arrival.from_json(f.obj["arrival"], key, "arrival")
                     if "arrival" in optional else None),
            committed_at=(f.get_float("committed_at")
                          if "committed_at" in optional else None),
        )
