"""`gradientmail demo` end to end, with tiny settings and a small local corpus."""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

import pytest

from gradientmail.app.cli import main
from gradientmail.app.demo import run_demo
from gradientmail.app.demo_runs import DemoConfig
from gradientmail.errors import ConfigError


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.slow
def test_demo_runs_standard_and_decoupled_dilocos_on_one_budget(corpus: Path,
                                                                 tmp_path: Path) -> None:
    out = io.StringIO()
    cfg = DemoConfig(learners=2, steps=8, slow=2.0, data=str(corpus), sync_every=4,
                     vocab=512, batch=4, block=32, mailbox=str(tmp_path / "box"))
    summary = run_demo(cfg, out=out)
    runs = summary["runs"]
    assert list(runs) == ["standard", "decoupled"]
    standard, decoupled = runs["standard"], runs["decoupled"]
    # Standard: every learner its 8 steps, every learner in every round (H=4).
    assert standard["steps_per_learner"] == [8, 8]
    assert standard["rounds_committed"] == 2
    assert standard["tokens_trained"] == 2 * 8 * 4 * 32
    # Decoupled: the same budget in all, however the learners shared it.
    assert sum(decoupled["steps_per_learner"]) == 16
    assert decoupled["tokens_trained"] == standard["tokens_trained"]
    assert decoupled["rounds_committed"] >= 1
    for r in runs.values():
        loss = r["eval_loss"]
        assert math.isfinite(loss) and 0 < loss < math.log(512) + 1
        assert r["perplexity"] == pytest.approx(math.exp(loss))
        assert r["bytes_sent_per_learner"] > 0
        assert r["curve"] and r["curve"][-1][0] == pytest.approx(r["seconds"])
    assert summary["target_loss"] == standard["eval_loss"]
    assert standard["seconds_to_target"] == pytest.approx(standard["seconds"])
    text = out.getvalue()
    assert "standard DiLoCo (a barrier each round)" in text
    assert "Decoupled DiLoCo (quorum 1, 2 fragments)" in text
    assert "learner-1 steps 2x slower in both" in text
    # the runs it leaves behind are real ones: status reads them
    for system in ("standard", "decoupled"):
        assert main(["status", str(tmp_path / "box" / system), "--json"]) == 0


@pytest.mark.slow
def test_demo_command_prints_json(corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--learners", "1", "--steps", "2", "--slow", "1", "--data",
                 str(corpus), "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["learners"] == 1 and summary["steps"] == 2 and summary["slow"] == 1.0
    assert set(summary["runs"]) == {"standard", "decoupled"}
    assert [r["steps_per_learner"] for r in summary["runs"].values()] == [[2], [2]]
    assert os.path.isdir(summary["mailbox"])


def test_demo_refuses_a_mailbox_in_use(tmp_path: Path) -> None:
    box = tmp_path / "box"
    box.mkdir()
    (box / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match="is not empty; the demo starts new runs"):
        run_demo(DemoConfig(mailbox=str(box)))
    with pytest.raises(ConfigError, match="--learners 0: need 1 to 64 learners"):
        DemoConfig(learners=0)
    with pytest.raises(ConfigError, match=r"--slow 0.5: need a factor from 1 \(none\) to 100"):
        DemoConfig(slow=0.5)
    with pytest.raises(ConfigError, match=r"systems=\['fast'\]: pick from"):
        DemoConfig(systems=("fast",))
