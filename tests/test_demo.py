"""`gradientmail demo` end to end, with tiny settings and a small local corpus."""

from __future__ import annotations

import io
import json
import math
import os
import sysconfig
from pathlib import Path

import pytest

from gradientmail.app.cli import main
from gradientmail.app.demo import DemoConfig, run_demo
from gradientmail.errors import ConfigError


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A few standard-library modules as one text file: real text, small and local."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((stdlib / name).read_text() for name in ("textwrap.py", "bisect.py",
                                                               "heapq.py", "shlex.py"))
    path = tmp_path / "corpus.txt"
    path.write_text(text * 3)
    return path


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_demo_runs_learners_and_compares_with_one_alone(corpus: Path, tmp_path: Path) -> None:
    out = io.StringIO()
    cfg = DemoConfig(learners=2, steps=12, data=str(corpus), sync_every=4, vocab=512,
                     batch=4, block=32, mailbox=str(tmp_path / "box"))
    summary = run_demo(cfg, out=out)
    assert summary["rounds_committed"] == 3  # every learner in every round, H=4, 12 steps
    assert summary["mailbox"] == str(tmp_path / "box")
    for arm in ("gradientmail", "alone"):
        loss = summary["eval_loss"][arm]
        assert math.isfinite(loss) and 0 < loss < math.log(512) + 1
        assert summary["perplexity"][arm] == pytest.approx(math.exp(loss))
    assert summary["tokens_trained"] == {"gradientmail": 2 * 12 * 4 * 32, "alone": 12 * 4 * 32}
    assert summary["bytes_sent_per_learner"] > 0
    text = out.getvalue()
    assert "gradientmail, 2 learners" in text and "one learner alone" in text
    assert "3 rounds committed" in text
    # the run it leaves behind is a real one: status reads it
    assert main(["status", str(tmp_path / "box"), "--json"]) == 0


def test_demo_command_prints_json(corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--learners", "1", "--steps", "2", "--data", str(corpus), "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["learners"] == 1 and summary["steps"] == 2
    assert set(summary["eval_loss"]) == {"gradientmail", "alone"}
    assert os.path.isdir(summary["mailbox"])


def test_demo_refuses_a_mailbox_in_use(tmp_path: Path) -> None:
    box = tmp_path / "box"
    box.mkdir()
    (box / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match="is not empty; the demo starts a new run"):
        run_demo(DemoConfig(mailbox=str(box)))
    with pytest.raises(ConfigError, match="--learners 0: need 1 to 64 learners"):
        DemoConfig(learners=0)
