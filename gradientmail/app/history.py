"""The run's history from its round records: what `gradientmail log` and `plot` show.

Contributions are swept once their round commits, so everything here is read from the
round records alone, which are kept: each merged contribution's loss, step time and
payload size are copied into its `Participant`, and the closer stamps `committed_at`
(Unix seconds on its own wall clock; machines share no clock, so times from different
closers are only as consistent as their clocks). `history_rows` and `plot_series` are
pure functions of the records; `read_history` is the I/O and `plot_history` draws with
matplotlib (the `plot` extra), imported only when called.
"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import io
import json
import os
from collections.abc import Sequence
from typing import Any

from gradientmail.errors import MissingExtra
from gradientmail.run.protocol import Exchange
from gradientmail.wire.records import Dropped, RoundRecord

__all__ = [
    "COLUMNS",
    "HistoryRow",
    "PlotSeries",
    "format_csv",
    "format_json",
    "format_table",
    "history_rows",
    "plot_history",
    "plot_series",
    "read_history",
]

#: The columns of a history row, in order: `--csv`'s header and `--json`'s keys.
COLUMNS = ("round", "fragment", "version", "closer", "participants", "dropped", "tokens",
           "mean_cosine", "mean_loss", "bytes_in", "bytes_out", "seconds", "committed_at")

#: Round records read at once (GETs in flight) by `read_history`.
_READ_AHEAD = 32


@dataclasses.dataclass(frozen=True)
class HistoryRow:
    """One committed round as `gradientmail log` prints it.

    `tokens` sums the participants'; `mean_loss` is their reported losses' mean weighted
    by steps (the mean over every step they reported for; None when none reported one);
    `bytes_in` sums the merged contributions' uploaded payloads (a held one, merged from
    its closer's memory, counts 0; None when a record predates `payload_size`), and
    `bytes_out` the payloads the closer wrote (theta, outer state, update, step);
    `seconds` runs from the first contribution the closer saw to the commit, on its
    clock (None in records without `arrival`); `committed_at` is Unix seconds.
    """

    round: int
    fragment: int
    version: int
    closer: str
    participants: tuple[str, ...]
    dropped: tuple[Dropped, ...]
    tokens: int
    mean_cosine: float | None
    mean_loss: float | None
    bytes_in: int | None
    bytes_out: int
    seconds: float | None
    committed_at: float | None

    def to_json(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in COLUMNS}
        out["participants"] = list(self.participants)
        out["dropped"] = [d.to_json() for d in self.dropped]
        return out


def _mean_loss(rec: RoundRecord) -> float | None:
    reported = [(p.loss, p.steps) for p in rec.participants if p.loss is not None]
    steps = sum(s for _, s in reported)
    if steps:
        return sum(loss * s for loss, s in reported) / steps
    # Contributions of zero steps (a final flush with nothing new): a plain mean.
    return sum(loss for loss, _ in reported) / len(reported) if reported else None


def _bytes_in(rec: RoundRecord) -> int | None:
    total = 0
    for p in rec.participants:
        if p.held:
            continue
        if p.payload_size is None:
            return None
        total += p.payload_size
    return total


def history_rows(records: Sequence[RoundRecord]) -> list[HistoryRow]:
    """One row per round record, in the records' order."""
    return [
        HistoryRow(
            round=rec.round, fragment=rec.fragment, version=rec.version, closer=rec.closer,
            participants=tuple(p.learner for p in rec.participants), dropped=rec.dropped,
            tokens=sum(p.tokens for p in rec.participants), mean_cosine=rec.mean_cosine,
            mean_loss=_mean_loss(rec), bytes_in=_bytes_in(rec),
            bytes_out=sum(ref.size for ref in rec.payload_refs()),
            seconds=None if rec.arrival is None else rec.arrival.latency,
            committed_at=rec.committed_at,
        )
        for rec in records
    ]


async def read_history(ex: Exchange, first: int = 0) -> list[RoundRecord]:
    """The records of rounds `first` to the newest, in order (a few GETs in flight at a
    time: a long run on S3 is read in seconds, not one round-trip per round)."""
    newest = await ex.newest_round()
    out: list[RoundRecord] = []
    for start in range(max(first, 0), newest + 1, _READ_AHEAD):
        stop = min(start + _READ_AHEAD, newest + 1)
        batch = await asyncio.gather(*(ex.read_round(r) for r in range(start, stop)))
        out.extend(rec for rec in batch if rec is not None)
    return out


# -- text, JSON, CSV ---------------------------------------------------------------------


def _dropped_text(dropped: Sequence[Dropped]) -> str:
    return "; ".join(f"{d.learner}: {d.reason}" for d in dropped)


def _cell(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def format_table(rows: Sequence[HistoryRow]) -> str:
    """The readable form: aligned columns, the dropped contributions and why last."""
    header = ("round", "fragment", "version", "closer", "participants", "tokens", "cosine",
              "loss", "bytes in", "bytes out", "seconds", "dropped")
    table = [header]
    for r in rows:
        table.append((
            str(r.round), str(r.fragment), str(r.version), r.closer,
            str(len(r.participants)), str(r.tokens), _cell(r.mean_cosine, 3),
            _cell(r.mean_loss), _cell(r.bytes_in), str(r.bytes_out), _cell(r.seconds, 3),
            _dropped_text(r.dropped) or "-",
        ))
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join([*(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)), row[-1]])
        .rstrip()
        for row in table
    )


def format_json(rows: Sequence[HistoryRow]) -> str:
    """A JSON array of the rows' `to_json()`, one row per line."""
    if not rows:
        return "[]"
    body = ",\n".join(json.dumps(r.to_json(), sort_keys=False, allow_nan=False)
                      for r in rows)
    return f"[\n{body}\n]"


def format_csv(rows: Sequence[HistoryRow]) -> str:
    """CSV with a `COLUMNS` header: participants space-separated, dropped as
    "learner: reason" joined by "; ", an empty cell for None."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for r in rows:
        values = r.to_json()
        values["participants"] = " ".join(r.participants)
        values["dropped"] = _dropped_text(r.dropped)
        writer.writerow(["" if values[c] is None else values[c] for c in COLUMNS])
    return out.getvalue()


# -- plot --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PlotSeries:
    """What `plot_history` draws, computed from the records alone.

    `times[i]` places round i of `rounds` on the x axis: seconds since the first commit
    when every record has `committed_at` (`timed`), else the round number. `losses`
    holds each learner's (x, loss) points, at the commits that merged its contribution;
    `live[i]` counts the learners the round's closer heard from or waited for
    (participants, dropped, and expected but missing).
    """

    timed: bool
    start: float | None
    rounds: tuple[int, ...]
    times: tuple[float, ...]
    losses: dict[str, tuple[tuple[float, float], ...]]
    mean_loss: tuple[float | None, ...]
    bytes_in: tuple[int, ...]
    bytes_out: tuple[int, ...]
    live: tuple[int, ...]
    participants: tuple[int, ...]


def plot_series(records: Sequence[RoundRecord]) -> PlotSeries:
    """The series `plot_history` draws from `records` (in round order)."""
    stamps = [rec.committed_at for rec in records]
    timed = bool(records) and all(t is not None for t in stamps)
    start = min(t for t in stamps if t is not None) if timed else None
    times = tuple((t - start) if timed and t is not None and start is not None
                  else float(rec.round) for rec, t in zip(records, stamps, strict=True))
    losses: dict[str, list[tuple[float, float]]] = {}
    for rec, x in zip(records, times, strict=True):
        for p in rec.participants:
            if p.loss is not None:
                losses.setdefault(p.learner, []).append((x, p.loss))
    rows = history_rows(records)
    return PlotSeries(
        timed=timed, start=start, rounds=tuple(rec.round for rec in records), times=times,
        losses={k: tuple(v) for k, v in sorted(losses.items())},
        mean_loss=tuple(r.mean_loss for r in rows),
        bytes_in=tuple(r.bytes_in or 0 for r in rows),
        bytes_out=tuple(r.bytes_out for r in rows),
        live=tuple(len({p.learner for p in rec.participants}
                       | {d.learner for d in rec.dropped}
                       | set(rec.arrival.missed if rec.arrival is not None else ()))
                   for rec in records),
        participants=tuple(len(rec.participants) for rec in records),
    )


def _time_axis(series: PlotSeries) -> tuple[tuple[float, ...], str]:
    if not series.timed:
        return series.times, "round (some records carry no commit time)"
    span = max(series.times, default=0.0)
    for unit, seconds in (("hours", 3600.0), ("minutes", 60.0)):
        if span >= 3 * seconds:
            return tuple(t / seconds for t in series.times), f"{unit} since the first commit"
    return series.times, "seconds since the first commit"


def plot_history(records: Sequence[RoundRecord], path: str | os.PathLike[str],
                 title: str = "gradientmail run") -> None:
    """Draw the run's history as a PNG at `path`: training loss per learner and the
    committed rounds over wall-clock time, bytes per round, live learners. Needs
    matplotlib (`pip install 'gradientmail[plot]'`); changes no global backend."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise MissingExtra("plot", "gradientmail plot (matplotlib)") from exc
    s = plot_series(records)
    xs, xlabel = _time_axis(s)
    fig = Figure(figsize=(11, 7.5))
    (loss_ax, rounds_ax), (bytes_ax, live_ax) = fig.subplots(2, 2)
    scale = {x: x2 for x, x2 in zip(s.times, xs, strict=True)}
    for learner, points in s.losses.items():
        loss_ax.plot([scale[x] for x, _ in points], [v for _, v in points], marker=".",
                     linewidth=1, label=learner)
    mean = [(x, v) for x, v in zip(xs, s.mean_loss, strict=True) if v is not None]
    if mean:
        loss_ax.plot([x for x, _ in mean], [v for _, v in mean], color="black",
                     linestyle="--", linewidth=1.5, label="round mean")
        loss_ax.legend(fontsize="small", ncol=2)
    else:
        loss_ax.text(0.5, 0.5, "no contribution reported a loss", ha="center",
                     transform=loss_ax.transAxes)
    loss_ax.set(title="training loss per learner", xlabel=xlabel, ylabel="mean loss")
    rounds_ax.step(xs, s.rounds, where="post", color="tab:green")
    rounds_ax.plot(xs, s.rounds, linestyle="none", marker="|", color="tab:green")
    rounds_ax.set(title="committed rounds", xlabel=xlabel, ylabel="round")
    width = 0.4
    positions = range(len(s.rounds))
    bytes_ax.bar([i - width / 2 for i in positions], [b / 2**20 for b in s.bytes_in],
                 width, label="in (contributions)")
    bytes_ax.bar([i + width / 2 for i in positions], [b / 2**20 for b in s.bytes_out],
                 width, label="out (commit)")
    if len(s.rounds) <= 20:
        bytes_ax.set_xticks(list(positions), [str(r) for r in s.rounds])
    bytes_ax.set(title="bytes per round", xlabel="round", ylabel="MiB")
    bytes_ax.legend(fontsize="small")
    live_ax.step(xs, s.live, where="post", label="heard from or awaited")
    live_ax.step(xs, s.participants, where="post", label="merged")
    live_ax.set(title="live learners", xlabel=xlabel, ylabel="learners")
    live_ax.set_ylim(bottom=0, top=max(s.live, default=0) + 1)
    for ax in (rounds_ax, live_ax):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    live_ax.legend(fontsize="small")
    if s.start is not None:
        import datetime

        began = datetime.datetime.fromtimestamp(s.start, datetime.UTC)
        title = f"{title} (first commit {began:%Y-%m-%d %H:%M:%S} UTC)"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100, format="png")
