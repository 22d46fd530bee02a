"""What `gradientmail verify` found: each round's verdict, the run's report, and its
readable form.

A round is *verified* (re-derived and equal), *failed* (each `Mismatch` names the round,
the fragment, what differs and the tensor), *swept* or *held* (its merge cannot be
re-derived; its `chain` says whether its commit was checked against the chain of steps
instead). The verification itself is `gradientmail.app.verify`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CHECKED",
    "FAILED",
    "HELD",
    "SWEPT",
    "VERIFIED",
    "Mismatch",
    "Report",
    "RoundVerdict",
    "format_report",
]

VERIFIED, FAILED, SWEPT, HELD = "verified", "failed", "swept", "held"
#: A swept or held round's `RoundVerdict.chain`: its commit checked against the chain of
#: steps, or its payloads swept too (nothing of it left to check).
CHECKED = "checked"


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One thing a commit says that its inputs do not give: in round `round` (fragment
    `fragment`), `what` (a payload kind, "participants", "record", ...), the `tensor` when
    one is to blame, and `detail`: what was stored and what was re-derived."""

    round: int
    fragment: int | None
    what: str
    tensor: str | None
    detail: str

    def __str__(self) -> str:
        where = f"round {self.round}" + ("" if self.fragment is None
                                         else f", fragment {self.fragment}")
        tensor = "" if self.tensor is None else f", tensor {self.tensor!r}"
        return f"{where}, {self.what}{tensor}: {self.detail}"

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "fragment": self.fragment, "what": self.what,
                "tensor": self.tensor, "detail": self.detail}


@dataclasses.dataclass(frozen=True)
class RoundVerdict:
    """How round `round` fared: `status` is verified, failed, swept or held; `note` says
    why a round was not verified, or which drops were taken on trust. `chain`, for a
    swept or held round: "checked" (its payloads' digests and the chain of steps to its
    committed theta held) or "swept" (its commit's payloads are gone too); "" otherwise."""

    round: int
    fragment: int | None
    status: str
    mismatches: tuple[Mismatch, ...] = ()
    note: str = ""
    bytes: int = 0
    seconds: float = 0.0
    chain: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "fragment": self.fragment, "status": self.status,
                "mismatches": [m.to_json() for m in self.mismatches], "note": self.note,
                "bytes": self.bytes, "seconds": self.seconds, "chain": self.chain}


@dataclasses.dataclass(frozen=True)
class Report:
    """A verification of the rounds `start`..`stop` (inclusive) of the run at `url`.

    Its JSON counts the rounds by status, and of the swept and held ones (merges not
    re-derived) those whose chain was checked and those nothing of which could be."""

    url: str
    start: int
    stop: int
    sealed: bool
    rounds: tuple[RoundVerdict, ...]

    def count(self, status: str) -> int:
        return sum(1 for v in self.rounds if v.status == status)

    def unmerged(self, chain: str) -> list[int]:
        """The swept and held rounds (merges not re-derived) whose `chain` is `chain`."""
        return [v.round for v in self.rounds if v.status in (SWEPT, HELD) and v.chain == chain]

    @property
    def ok(self) -> bool:
        """Whether no round failed: every re-derived commit matched, and no swept or held
        round's payloads or chain of steps broke (their merges, not re-derived, are no
        failures)."""
        return self.count(FAILED) == 0

    @property
    def first_mismatch(self) -> Mismatch | None:
        return next((m for v in self.rounds for m in v.mismatches), None)

    def to_json(self) -> dict[str, Any]:
        first = self.first_mismatch
        verified = [v for v in self.rounds if v.status == VERIFIED]
        nbytes = sum(v.bytes for v in verified)
        seconds = sum(v.seconds for v in verified)
        return {
            "url": self.url, "ok": self.ok, "start": self.start, "stop": self.stop,
            "seals_checked": self.sealed,
            "rounds_verified": self.count(VERIFIED), "rounds_failed": self.count(FAILED),
            "rounds_swept": self.count(SWEPT), "rounds_held": self.count(HELD),
            "rounds_chain_checked": len(self.unmerged(CHECKED)),
            "rounds_unchecked": len(self.unmerged(SWEPT)),
            "first_mismatch": None if first is None else first.to_json(),
            "bytes_verified": nbytes,
            "mb_per_s": nbytes / 1e6 / seconds if seconds > 0 else None,
            "rounds": [v.to_json() for v in self.rounds],
        }


def format_report(report: Report) -> str:
    """The readable form of a `Report`: the failures, the first mismatch, a summary."""
    lines = []
    for v in report.rounds:
        if v.status == FAILED:
            lines.append(f"round {v.round}: FAILED ({len(v.mismatches)} mismatch"
                         f"{'' if len(v.mismatches) == 1 else 'es'})")
            lines.extend(f"  {m}" for m in v.mismatches)
        elif v.status == HELD:
            lines.append(f"round {v.round}: unverifiable (held): {v.note}")
        elif v.status == VERIFIED and v.note:
            lines.append(f"round {v.round}: verified; {v.note}")
    first = report.first_mismatch
    if first is not None:
        lines.append(f"first mismatch: {first}")
    if report.count(SWEPT) and not report.count(VERIFIED):
        lines.append("nothing left to re-derive: the run sweeps each round's contributions "
                     "once it commits (an auditable run sets DiLoCo's keep_rounds)")
    checked, unchecked = report.unmerged(CHECKED), report.unmerged(SWEPT)
    if checked or unchecked:
        lines.append(f"not re-derived: the merges of {_count(checked + unchecked)} "
                     f"({_spans(sorted(checked + unchecked))}): their contributions are "
                     "swept or were never uploaded")
    if checked:
        lines.append(f"checked instead: {_count(checked)} ({_spans(checked)}): their "
                     "payloads' digests and the chain of steps from the newest checkpoint "
                     "to each committed theta")
    if unchecked:
        lines.append(f"not checked at all: {_count(unchecked)} ({_spans(unchecked)}): "
                     "their commits' payloads are swept too (older than the newest "
                     "checkpoint)")
    seals = ("every record's seal checked" if report.sealed
             else "records unsealed (the run has no run key)")
    span = ("no rounds" if report.stop < report.start
            else f"rounds {report.start}..{report.stop}")
    lines.append(
        f"{'OK' if report.ok else 'FAILED'}: {report.url} {span}: "
        f"{report.count(VERIFIED)} verified, {report.count(FAILED)} failed, "
        f"{report.count(SWEPT)} skipped because swept, {report.count(HELD)} unverifiable "
        f"(held); {seals}"
    )
    return "\n".join(lines)


def _count(rounds: Sequence[int]) -> str:
    return f"{len(rounds)} round{'' if len(rounds) == 1 else 's'}"


def _spans(rounds: Sequence[int]) -> str:
    """Sorted round numbers as ranges: [0, 1, 2, 5] -> "rounds 0..2, 5"."""
    spans: list[list[int]] = []
    for r in rounds:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in spans)
    return ("round " if len(rounds) == 1 else "rounds ") + text
