"""The run's history: `gradientmail log` and `plot` on a finished demo run, the rows as pure
functions of round records, and the losses, sizes and commit times that reach them."""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import io
import json
import math
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_syncer import SCHEMA, Run, algorithm, delta

from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.schedule import RoundSchedule
from gradientmail.app.cli import main
from gradientmail.app.demo import run_demo
from gradientmail.app.demo_runs import DemoConfig
from gradientmail.app.history import (
    COLUMNS,
    history_rows,
    plot_history,
    plot_series,
    read_history,
)
from gradientmail.errors import MissingExtra
from gradientmail.integration import LossMean, output_loss
from gradientmail.learner import state as ls
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import LocalMailbox, MemoryMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.records import Dropped, Participant, RoundRecord
from gradientmail.wire.refs import Arrival, PayloadRef

PNG = b"\x89PNG\r\n\x1a\n"
TABLE_HEADER = ["round", "fragment", "version", "closer", "participants", "tokens", "cosine",
                "loss", "bytes", "in", "bytes", "out", "seconds", "dropped"]


# -- a finished demo run -----------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """Two demo learners of standard DiLoCo, 8 steps at H=4: two rounds committed in a
    local directory."""
    tmp = tmp_path_factory.mktemp("history")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((stdlib / name).read_text() for name in ("textwrap.py", "bisect.py"))
    corpus = tmp / "corpus.txt"
    corpus.write_text(text * 3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp / "cache"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        cfg = DemoConfig(learners=2, steps=8, data=str(corpus), sync_every=4, vocab=512,
                         batch=4, block=32, mailbox=str(tmp / "box"), systems=("standard",))
        summary = run_demo(cfg, out=io.StringIO())
    yield tmp / "box" / "standard", int(summary["runs"]["standard"]["rounds_committed"])


def records_of(box: Path) -> list[RoundRecord]:
    return list(asyncio.run(Exchange(LocalMailbox(str(box))).rounds_after(-1)))


@pytest.mark.slow
def test_log_prints_one_row_per_round_under_the_golden_columns(
    demo_run: tuple[Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    box, rounds = demo_run
    assert rounds == 2
    assert main(["log", str(box)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == TABLE_HEADER
    assert len(lines) == 1 + rounds
    for r, line in enumerate(lines[1:]):
        cells = line.split()
        assert cells[0] == str(r) and cells[1] == "0" and cells[2] == str(r + 1)
        assert cells[4] == "2" and cells[-1] == "-"  # both learners, nothing dropped


@pytest.mark.slow
def test_log_json_agrees_with_the_records(
    demo_run: tuple[Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    box, rounds = demo_run
    assert main(["log", str(box), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    records = records_of(box)
    assert len(rows) == len(records) == rounds
    stamps = []
    for row, rec in zip(rows, records, strict=True):
        assert list(row) == list(COLUMNS)
        assert (row["round"], row["fragment"], row["version"], row["closer"]) == (
            rec.round, rec.fragment, rec.version, rec.closer)
        assert row["participants"] == ["learner-0", "learner-1"]
        assert row["dropped"] == []
        assert row["tokens"] == sum(p.tokens for p in rec.participants) == 2 * 4 * 4 * 32
        assert row["mean_cosine"] == rec.mean_cosine
        # The demo reports its losses: every participant carries one, and the round's
        # mean is theirs weighted by steps.
        losses = [p.loss for p in rec.participants]
        assert all(loss is not None and 0 < loss < math.log(512) + 1 for loss in losses)
        assert row["mean_loss"] == pytest.approx(
            sum(p.loss * p.steps for p in rec.participants if p.loss is not None)
            / sum(p.steps for p in rec.participants))
        assert row["bytes_out"] == sum(ref.size for ref in rec.payload_refs()) > 0
        uploaded = [p for p in rec.participants if not p.held]
        assert all(p.payload_size is not None and p.payload_size > 0 for p in uploaded)
        assert row["bytes_in"] == sum(p.payload_size or 0 for p in uploaded)
        assert rec.arrival is not None and row["seconds"] == rec.arrival.latency
        assert rec.committed_at is not None and row["committed_at"] == rec.committed_at
        stamps.append(rec.committed_at)
    assert stamps == sorted(stamps)  # one machine's clock: commits in round order
    assert rows[1]["mean_loss"] < rows[0]["mean_loss"] + 0.5  # it trains, roughly


@pytest.mark.slow
def test_log_csv_parses_back_to_the_json_rows(
    demo_run: tuple[Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    box, _ = demo_run
    assert main(["log", str(box), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert main(["log", str(box), "--csv"]) == 0
    reader = csv.DictReader(io.StringIO(capsys.readouterr().out))
    assert reader.fieldnames == list(COLUMNS)
    parsed = list(reader)
    assert len(parsed) == len(rows)
    for got, want in zip(parsed, rows, strict=True):
        assert got["participants"].split() == want["participants"]
        assert got["dropped"] == ""
        for name in ("round", "fragment", "version", "tokens", "bytes_in", "bytes_out"):
            assert int(got[name]) == want[name]
        for name in ("mean_cosine", "mean_loss", "seconds", "committed_at"):
            assert float(got[name]) == want[name]
        assert got["closer"] == want["closer"]


@pytest.mark.slow
def test_log_json_and_csv_exclude_each_other(demo_run: tuple[Path, int]) -> None:
    box, _ = demo_run
    with pytest.raises(SystemExit) as exc:
        main(["log", str(box), "--json", "--csv"])
    assert exc.value.code == 2


@pytest.mark.slow
def test_plot_writes_a_png(demo_run: tuple[Path, int], tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    box, rounds = demo_run
    out = tmp_path / "history.png"
    assert main(["plot", str(box), str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
    assert f"wrote {out}: {rounds} rounds, 2 learners" in capsys.readouterr().out


def test_log_and_plot_of_a_place_without_a_run(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", str(tmp_path)]) == 1
    assert main(["plot", str(tmp_path), str(tmp_path / "x.png")]) == 1
    assert "no run found in" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


# -- rows from records, without a run ---------------------------------------------------


def ref(key: str, size: int) -> PayloadRef:
    return PayloadRef(key, size, "a" * 64)


def record(r: int, participants: tuple[Participant, ...], **kw: Any) -> RoundRecord:
    return RoundRecord(
        r, r % 2, r // 2 + 1, ref(f"theta/{r % 2}/x-{r}", 1000), ref(f"outer/{r % 2}/x-{r}", 2000),
        None, participants, Estimates(None, None, None), None, kw.pop("dropped", ()), "c",
        False, **kw,
    )


def test_rows_weigh_losses_by_steps_and_count_held_payloads_as_zero() -> None:
    rec = record(3, (
        Participant("a", 10, 4, 100, 1.0, loss=2.0, payload_size=500),
        Participant("b", 10, 12, 300, 1.0, loss=4.0, held=True),
        Participant("c", 10, 4, 100, 1.0, payload_size=700),  # reported no loss
    ), arrival=Arrival(1.0, 2.5, "a"), committed_at=1_700_000_000.25,
        dropped=(Dropped("d", "stale base version 0"),))
    (row,) = history_rows([rec])
    assert row.tokens == 500
    assert row.mean_loss == pytest.approx((2.0 * 4 + 4.0 * 12) / 16)
    assert (row.bytes_in, row.bytes_out) == (1200, 3000)
    assert (row.seconds, row.committed_at) == (2.5, 1_700_000_000.25)
    assert row.to_json()["dropped"] == [{"learner": "d", "reason": "stale base version 0"}]
    assert row.participants == ("a", "b", "c")


def test_rows_of_records_written_before_the_history_fields() -> None:
    # An older record: no loss, no payload sizes, no arrival, no commit time.
    rec = record(0, (Participant("a", 4, 4, 64, 1.0), Participant("b", 4, 4, 64, 1.0)))
    data = rec.encode()
    for field in (b'"loss"', b'"payload_size"', b'"committed_at"', b'"arrival"'):
        assert field not in data
    (row,) = history_rows([RoundRecord.decode(data, "rounds/0000000000.json")])
    assert (row.mean_loss, row.bytes_in, row.seconds, row.committed_at) == (
        None, None, None, None)
    assert row.bytes_out == 3000


def test_plot_falls_back_to_rounds_without_commit_times(tmp_path: Path) -> None:
    timed = [record(r, (Participant("a", 4 * r, 4, 64, 1.0, loss=3.0 - r),),
                    committed_at=1000.0 + 10 * r) for r in range(3)]
    s = plot_series(timed)
    assert s.timed and s.start == 1000.0 and s.times == (0.0, 10.0, 20.0)
    assert s.losses == {"a": ((0.0, 3.0), (10.0, 2.0), (20.0, 1.0))}
    assert s.live == (1, 1, 1)
    mixed = [dataclasses.replace(timed[0], committed_at=None), *timed[1:]]
    s = plot_series(mixed)
    assert not s.timed and s.times == (0.0, 1.0, 2.0)
    out = tmp_path / "h.png"
    plot_history(mixed, out)
    assert out.read_bytes().startswith(PNG)
    plot_history([], tmp_path / "empty.png")  # a run with no commit yet still draws
    assert (tmp_path / "empty.png").read_bytes().startswith(PNG)


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MissingExtra, match=r"pip install 'gradientmail\[plot\]'"):
        plot_history([], tmp_path / "x.png")


# -- what reaches the records ------------------------------------------------------------


def test_the_closer_copies_losses_and_sizes_and_stamps_the_commit() -> None:
    async def main_() -> None:
        MemoryMailbox.forget("history")
        r = Run(MemoryMailbox("history"), algorithm(fragments=2, quorum_size=2))
        await r.create()
        a = await r.ex.publish(0, "a", delta(0, "a", r.plan[0]), fragment=0, base_version=0,
                               local_step=4, steps=4, tokens=64, final=False,
                               schema_digest=SCHEMA.digest(), delta_format="F32", loss=2.5)
        b = await r.contribute(0, "b")
        s = r.syncer(wall_clock=lambda: 1_750_000_000.12345)
        assert await s.poll(live=frozenset({"a", "b"}))
        (rec,) = await read_history(r.ex)
        got = {p.learner: (p.loss, p.payload_size, p.held) for p in rec.participants}
        assert got == {"a": (2.5, a.payload.size, False), "b": (None, b.payload.size, False)}
        assert rec.committed_at == 1_750_000_000.123  # milliseconds are plenty
        MemoryMailbox.forget("history")

    asyncio.run(main_())


def test_learner_state_means_the_losses_since_each_fragments_publish() -> None:
    sch = RoundSchedule(sync_every=4, fragments=2, in_flight=1)
    state = ls.initial_state(2)
    assert ls.mean_loss(state, 0) is None
    state = ls.advanced(state, 10)  # no loss reported
    assert ls.mean_loss(state, 0) is None
    for loss in (1.0, 2.0, float("nan"), 3.0):  # a non-finite loss is left out
        state = ls.advanced(state, 10, loss=loss)
    assert ls.mean_loss(state, 0) == ls.mean_loss(state, 1) == 2.0
    state = ls.published(state, 0, sch)  # round 0 trains fragment 0
    assert ls.mean_loss(state, 0) is None and ls.mean_loss(state, 1) == 2.0
    state = ls.advanced(state, 10, loss=6.0)
    assert (ls.mean_loss(state, 0), ls.mean_loss(state, 1)) == (6.0, 3.0)


def test_a_learner_reports_its_mean_loss_into_the_records() -> None:
    mailbox = MemoryMailbox()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    alg = DiLoCo(sync_every=4, fragments=1, in_flight=1, overlap_steps=0)
    learner = Learner(
        TorchAdapter(model),
        alg,
        mailbox,
        "solo",
        options=LearnerOptions(poll_interval=0.005, lease_every=5.0, lease_timeout=30.0),
    )
    learner.start()
    for step in range(8):
        with torch.no_grad():
            model.weight.add_(0.01)
        learner.step(16, loss=torch.tensor(float(step)))
    learner.close()
    records = asyncio.run(Exchange(mailbox).rounds_after(-1))
    assert [[p.loss for p in rec.participants] for rec in records[:2]] == [[1.5], [5.5]]
    assert all(rec.committed_at is not None for rec in records)


def test_integration_loss_mean_takes_the_mean_since_the_last_step() -> None:
    mean = LossMean()
    assert mean.take() is None
    mean.add(torch.tensor(2.0, requires_grad=True))
    mean.add(None)
    mean.add(output_loss({"loss": torch.tensor([4.0])}))
    assert mean.take() == 3.0 and mean.take() is None
    assert output_loss(torch.tensor([1.0, 2.0])) is None  # not a scalar loss
    assert output_loss(None) is None and output_loss(1) == 1.0 and output_loss(True) is None
