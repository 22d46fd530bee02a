"""The run's key layout and the pure decisions over keys and records: which claim counts,
which contributions a round may use, what a sweep deletes.

Kept apart from `gradientmail.run.protocol`, whose `Exchange` carries these out on a mailbox,
so they are read and tested without any I/O.
The whole layout is in `gradientmail.run.protocol`'s docstring. Two keys are fixed: the
manifest, and `rollcall.json`, the roll call (`gradientmail.run.rollcall`): one object for the
run, overwritten by each call and its verdict, read by every learner every few polls.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

from gradientmail.errors import ConfigError, LocalProtocolError
from gradientmail.wire.records import RoundRecord, SnapshotRecord

__all__ = [
    "ARTIFACT_KINDS",
    "CALL_KEY",
    "MANIFEST_KEY",
    "ROUND_AREAS",
    "ROUND_LIMIT",
    "Contributions",
    "Rejected",
    "artifact_key",
    "attempts_in",
    "audit_floor",
    "check_number",
    "current_attempt",
    "delta_keys_problem",
    "init_key",
    "init_part_key",
    "part_key",
    "plan_sweep",
    "round_dir",
    "round_key",
    "screen_snapshot",
]

MANIFEST_KEY = "manifest.json"
CALL_KEY = "rollcall.json"
#: Round numbers are below this (ten digits in keys).
ROUND_LIMIT = 10**10
#: The areas of a commit's payloads, one directory each.
ARTIFACT_KINDS = ("theta", "outer", "updates", "steps")
#: The areas that hold a directory per round.
ROUND_AREAS = ("payloads/", "parts/", "snapshots/", "claims/round/")
_NUMBERED = re.compile(r"(\d{10})")
_ATTEMPT = re.compile(r"\d{6}")
_ARTIFACT = re.compile(r"(theta|outer|updates|steps)/(\d+)/(\d{10})-(\d{6})(\..+)")


def check_number(what: str, value: int, limit: int) -> int:
    """`value`, checked to be an integer in [0, `limit`) before it goes into a key."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise LocalProtocolError(f"{what}={value!r} must be an integer in [0, {limit})")
    return value


def round_key(round_: int) -> str:
    """`rounds/<round>.json`, the commit record of `round_`."""
    return f"rounds/{check_number('round', round_, ROUND_LIMIT):010d}.json"


def round_dir(area: str, round_: int) -> str:
    """`<area><round>/`, the directory of `round_` in a per-round area."""
    return f"{area}{check_number('round', round_, ROUND_LIMIT):010d}/"


def artifact_key(kind: str, fragment: int, version: int, attempt: int, ext: str) -> str:
    """`<kind>/<fragment>/<version>-<attempt><ext>` for kind theta, outer, updates or
    steps."""
    if kind not in ARTIFACT_KINDS:
        raise LocalProtocolError(f"artifact kind {kind!r} must be one of {ARTIFACT_KINDS}")
    check_number("fragment", fragment, 10**6)
    return (f"{kind}/{fragment}/{check_number('version', version, ROUND_LIMIT):010d}"
            f"-{check_number('attempt', attempt, 10**6):06d}{ext}")


def part_key(round_: int, learner: str, k: int, n: int) -> str:
    """`parts/<round>/<learner>/<k>-of-<n>` (the codec's extension follows): part k
    (0 <= k < n, the rank) of a contribution its learner's n ranks mail one each. A
    folder of its own, apart from `payloads/`: a learner id may hold a '.', so a key
    derived from another learner's payload key could collide with it."""
    if not 0 <= k < n:
        raise LocalProtocolError(f"part {k} of {n}: need 0 <= k < n")
    return f"{round_dir('parts/', round_)}{learner}/{k}-of-{n}"


def init_key(attempt: int, fragment: int) -> str:
    """`init/<attempt>/<fragment>` (the codec's extension follows): Θ⁰ of `fragment`, as
    creation `attempt` uploaded it. Never swept: every version-0 reader needs it."""
    return (f"init/{check_number('attempt', attempt, 10**6):06d}/"
            f"{check_number('fragment', fragment, 10**6)}")


def init_part_key(attempt: int, fragment: int, k: int, n: int) -> str:
    """`init/<attempt>/<fragment>/<k>-of-<n>` (the codec's extension follows): part k (the
    rank) of Θ⁰ of `fragment` a creator's n ranks upload one each. Beside the whole
    payload's key, never equal to it (`0/...` is not `0.safetensors`), and under `init/`,
    which no sweep lists."""
    if not 0 <= k < n:
        raise LocalProtocolError(f"part {k} of {n}: need 0 <= k < n")
    return f"{init_key(attempt, fragment)}/{k}-of-{n}"


def delta_keys_problem(record: SnapshotRecord, round_: int, learner: str,
                       extensions: Iterable[str]) -> tuple[str, str] | None:
    """Whether `record`, read at `learner`'s key of `round_`, names payloads it may own:
    None when it does, else what it names and what its key says it must. Its payload must
    be `payloads/<round>/<learner><ext>`, its parts `part_key(round_, learner, k, n)` +
    ext for k = 0..n−1 in order, n = `len(parts)` (`extensions`: of the codecs known)."""
    exts = tuple(extensions)
    if record.payload is not None:
        stem = f"{round_dir('payloads/', round_)}{learner}"
        wanted = sorted(stem + ext for ext in exts)
        if record.payload.key in wanted:
            return None
        return f"payload {record.payload.key!r}", f"payload one of {wanted}"
    n = len(record.parts)
    for k, ref in enumerate(record.parts):
        stem = part_key(round_, learner, k, n)
        if not any(ref.key == stem + ext for ext in exts):
            return f"part {k} {ref.key!r}", f"part {k} {stem!r} and a codec's extension"
    return None


def current_attempt(attempts: Iterable[int]) -> int | None:
    """The claim that counts: the highest attempt (a takeover claims attempt + 1)."""
    return max(attempts, default=None)


def attempts_in(keys: Iterable[str], prefix: str) -> list[int]:
    """The claim attempts among `keys` listed under `prefix`, ascending."""
    out = []
    for key in keys:
        rest = key[len(prefix):]
        if key.startswith(prefix) and _ATTEMPT.fullmatch(rest):
            out.append(int(rest))
    return sorted(out)


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A contribution record that could not be used: its key, its learner (when the key
    names a valid one) and why."""

    key: str
    learner: str | None
    reason: str


@dataclasses.dataclass(frozen=True)
class Contributions:
    """A round's contributions: the well-formed records (by learner id) and the rejected."""

    records: tuple[SnapshotRecord, ...]
    rejected: tuple[Rejected, ...]


def screen_snapshot(
    snapshot: SnapshotRecord, *, fragment: int, version: int, schema_digest: str
) -> str | None:
    """Why a round that trains `fragment` at `version`, for the schema of `schema_digest`,
    cannot use `snapshot`, or None when it can (its payload is still to be checked).

    The one screening rule, in the order the reasons are reported: another fragment,
    another schema digest, a stale base version, no steps trained. The reasons go into
    records' `dropped` entries as written here.
    """
    if snapshot.fragment != fragment:
        return f"fragment {snapshot.fragment}, the round trains fragment {fragment}"
    if snapshot.schema_digest != schema_digest:
        return (f"another schema digest {snapshot.schema_digest[:12]}, the run's is "
                f"{schema_digest[:12]}")
    if snapshot.base_version != version:
        return (f"stale: base version {snapshot.base_version}, the fragment is at version "
                f"{version}")
    if snapshot.steps < 1:
        return "no steps trained"
    return None


def plan_sweep(
    keys: Iterable[str], latest: Mapping[int, RoundRecord], keep_versions: int = 2,
    checkpoint_every: int = 1, keep_rounds: int | None = None, fragments: int | None = None,
) -> list[str]:
    """The keys to delete once `latest` (each fragment's newest record) is committed.

    Deleted: payloads, snapshots and closer claims of closed rounds (round <= the newest
    committed round), and the theta/outer/update/step payloads of each fragment older than
    what it keeps, or of its newest version but not referenced by its record (a superseded
    closer's upload). A fragment keeps its newest `keep_versions` versions, and with a
    replicated outer step (`checkpoint_every` K > 1) everything from its newest checkpoint
    on (the newest version that is a multiple of K): a reader replays the steps after it.
    With `keep_rounds` R (a run kept auditable; `fragments` is its plan's P, round r
    training fragment r mod P), the contributions of the newest R rounds stay, and so does
    each fragment's state before the oldest of them (`audit_floor`). Never deleted:
    anything the newest records reference, versions not yet committed (a closer may be
    uploading them), fragments with no record in `latest`, and keys of any
    shape this function does not know.
    """
    _check_sweep(keep_versions, checkpoint_every, keep_rounds, fragments)
    if not latest:
        return []
    closed = max(r.round for r in latest.values())
    kept_from = closed + 1 if keep_rounds is None else closed - keep_rounds + 1
    referenced = {ref.key for r in latest.values() for ref in r.payload_refs()}
    doomed = []
    for key in keys:
        area = next((a for a in ROUND_AREAS if key.startswith(a)), None)
        if area is not None:
            m = _NUMBERED.match(key[len(area):])
            if m is not None and key[len(area) + 10:].startswith("/") \
                    and (int(m.group(1)) < kept_from
                         or (area == "claims/round/" and int(m.group(1)) <= closed)):
                doomed.append(key)
            continue
        art = _ARTIFACT.fullmatch(key)
        if art is None or key in referenced or int(art.group(2)) not in latest:
            continue
        newest = latest[int(art.group(2))]
        version = int(art.group(3))
        floor = newest.version - keep_versions
        if checkpoint_every > 1:
            floor = min(floor, newest.version - newest.version % checkpoint_every - 1)
        if keep_rounds is not None:
            assert fragments is not None
            floor = min(floor, audit_floor(newest, kept_from, fragments, checkpoint_every))
        if version <= floor or version == newest.version:
            doomed.append(key)
    return doomed


def _check_sweep(keep_versions: int, checkpoint_every: int, keep_rounds: int | None,
                 fragments: int | None) -> None:
    """`ConfigError` naming the first of `plan_sweep`'s settings that is out of range."""
    if isinstance(keep_versions, bool) or not isinstance(keep_versions, int) \
            or keep_versions < 1:
        raise ConfigError(f"keep_versions={keep_versions!r} must be an integer >= 1")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) \
            or checkpoint_every < 1:
        raise ConfigError(f"checkpoint_every={checkpoint_every!r} must be an integer >= 1")
    if keep_rounds is not None and (isinstance(fragments, bool) or not isinstance(fragments, int)
                                    or fragments < 1):
        raise ConfigError(f"keep_rounds={keep_rounds!r} needs the plan's fragments (an "
                          f"integer >= 1), got fragments={fragments!r}")
    if keep_rounds is not None and (isinstance(keep_rounds, bool)
                                    or not isinstance(keep_rounds, int) or keep_rounds < 1):
        raise ConfigError(f"keep_rounds={keep_rounds!r} must be None or an integer >= 1")


def audit_floor(newest: RoundRecord, kept_from: int, fragments: int,
                checkpoint_every: int) -> int:
    """The newest version of `newest.fragment` a sweep may delete when the rounds from
    `kept_from` on must stay verifiable: below the state before the fragment's oldest
    round in that range — its newest checkpoint at or before that version, the steps
    after it replayed (with K = `checkpoint_every` = 1, that version itself)."""
    r = newest.round
    kept = 0 if r < kept_from else (r - kept_from) // fragments + 1
    before = max(newest.version - kept, 0)
    return before - before % checkpoint_every - 1
