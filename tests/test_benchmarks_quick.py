"""The evidence benchmarks run end to end in their `--smoke` mode and write their tables.

benchmarks/convergence.py trains every arm (two learners, a one-layer GPT-2, a dozen
steps) and benchmarks/chaos.py kills learners of a two-learner run; each appends its table
to a results file of the test's own. The numbers of so small a run say nothing about
convergence; the tests check what must hold at any size: every arm trained the same
tokens, the DDP-equivalent's bytes follow its formula, F4 sends fewer bytes than F32, the
chaos run killed learners and lost no commit. benchmarks/vs_torchft.py (skipped without the
`peers` extra) runs gradientmail and torchft side by side: standard DiLoCo and torchft's
DiLoCo follow one trajectory, and torchft's bytes follow their formula.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, tmp_path: Path, *args: str) -> str:
    results = tmp_path / "RESULTS.md"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--results",
         str(results), *args],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return results.read_text()


def rows(text: str) -> dict[str, list[str]]:
    """The table's rows by their first cell (the header and rule excluded)."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and not set(cells[1]) <= set("-:") and cells[0] not in (
                "arm", "run"):
            out[cells[0]] = cells
    return out


def megabytes(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * (1.0 if unit == "MB" else 1e-3)


@pytest.mark.timeout(900)  # many processes: minutes on a loaded 2-core machine
def test_convergence_smoke_writes_every_arm(tmp_path: Path) -> None:
    png = tmp_path / "conv.png"
    text = run("convergence.py", tmp_path, "--plot", str(png))
    assert "## convergence at equal tokens" in text
    assert "Command: `python benchmarks/convergence.py --smoke" in text
    table = rows(text)
    assert len(table) == 7, table
    labels = list(table)
    for want in ("single learner", "DDP-equivalent", "standard DiLoCo (", "Streaming DiLoCo",
                 "Decoupled defaults", "F4 deltas", "Accelerate LocalSGD"):
        assert sum(label.startswith(want) or want in label for label in labels) >= 1, want
    # Equal tokens for every arm: M·S·B·block = 2·12·4·32.
    assert {cells[7] for cells in table.values()} == {"3,072"}
    for cells in table.values():
        loss = float(cells[1])
        assert 0 < loss < 10 and abs(float(cells[2]) - 2.718281828**loss) < 0.01 * float(cells[2])
    ddp = next(c for label, c in table.items() if label.startswith("DDP"))
    assert ddp[3] == "1.000"
    found = re.search(r"([\d,]+) parameters", text)
    assert found is not None
    params = int(found.group(1).replace(",", ""))
    assert abs(megabytes(ddp[4]) - 2 * params * 4 * 12 / 1e6) < 0.01  # 2·params·4 per step
    f32 = next(c for label, c in table.items() if label.startswith("standard DiLoCo ("))
    f4 = next(c for label, c in table.items() if "F4" in label)
    assert megabytes(f4[4]) < megabytes(f32[4]) / 4
    assert int(f32[6]) == 2  # S / H = 12 / 6 rounds, every learner in each
    assert "- DiLoCo <= 1.00x DDP-equivalent loss" in text
    assert "- F4 within +0.5% of F32 loss" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"]({png.name})" in text


@pytest.mark.timeout(900)
def test_convergence_smoke_trains_sparse_arms_with_their_own_settings(tmp_path: Path) -> None:
    text = run("convergence.py", tmp_path, "--arms", "diloco,topk,dtopk", "--sparse-arm",
               "SIGN1@1,lr=0.7,m=0,lm=0.9", "--sparse-arm", "TOPK_Q2@1/64,lr=1,m=0",
               "--plot", str(tmp_path / "p.png"))
    table = rows(text)
    assert len(table) == 5, table
    f32 = table["standard DiLoCo (P=1, quorum M, barrier, mean)"]
    sign1 = table["standard DiLoCo, SIGN1 density 1/1, outer lr 0.7 / momentum 0, learner "
                  "momentum 0.9"]
    q2 = table["Decoupled defaults, TOPK_Q2 density 1/64, outer lr 1 / momentum 0"]
    assert {cells[7] for cells in table.values()} == {"3,072"}
    # 1 bit an element against 32, headers aside (the smoke model's tensors are small).
    assert megabytes(sign1[4]) < megabytes(f32[4]) / 8
    assert int(sign1[6]) == 2 and int(q2[6]) >= 1
    assert "- topk1 within +0.5% of F32 loss at >= 30x fewer bytes" in text
    assert "- dtopk2 within +0.5% of the Decoupled F32 loss" not in text  # no decoupled arm


@pytest.mark.timeout(900)
def test_chaos_smoke_kills_learners_and_loses_no_commit(tmp_path: Path) -> None:
    text = run("chaos.py", tmp_path)
    assert "## goodput under failures (chaos)" in text
    table = rows(text)
    faulty, clean = table["with faults"], table["without faults"]
    assert int(faulty[1].split()[0]) >= 1  # kills
    assert clean[1] == "0 (0)"
    assert faulty[7] == clean[7] == "0"  # commits lost
    assert faulty[3] == clean[3] == "10,240"  # 2 slots × 40 steps × 4×32 tokens
    for cells in (faulty, clean):
        assert int(cells[2]) >= 1  # rounds committed
        assert 0.0 < float(cells[4].rstrip("%")) <= 100.0
    assert "- commits lost: 0 (met)" in text


@pytest.mark.timeout(900)
def test_liveness_smoke_kills_a_learner_and_the_roll_call_lets_its_peer_go_on(
        tmp_path: Path) -> None:
    # --smoke prints its table and appends nothing.
    results = tmp_path / "RESULTS.md"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "liveness.py"), "--smoke", "--results",
         str(results)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not results.exists()
    table = rows(proc.stdout)
    assert set(table) == {"run-0", "run-1"}, table
    # Seconds on a loaded machine are not asserted (the fake-clock tests in
    # tests/test_liveness.py bound them); who was judged gone, and that the run went on, are.
    for cells in table.values():
        assert cells[8] == "learner-1"  # judged gone by the roll call
        assert int(cells[7]) >= 1 and cells[2] != "—"  # called; a round closed without it


@pytest.mark.timeout(900)
def test_vs_torchft_smoke_runs_both_systems_on_the_same_trajectory(tmp_path: Path) -> None:
    pytest.importorskip("torchft", reason="the peers extra: pip install 'gradientmail[peers]'")
    pytest.importorskip("moto.server", reason="the S3 arm runs moto's server")
    # --smoke prints its table and appends nothing.
    results = tmp_path / "RESULTS.md"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vs_torchft.py"), "--smoke", "--results",
         str(results)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not results.exists()
    assert "Command: `python benchmarks/vs_torchft.py --smoke" in proc.stdout
    table = {(c[0], c[1], c[2]): c for c in (
        [x.strip() for x in line.strip().strip("|").split("|")]
        for line in proc.stdout.splitlines() if line.startswith("| "))
        if c[0] in ("gradientmail", "torchft")}
    assert len(table) == 8, table
    tft = table["torchft", "DiLoCo (1 fragment, Manager + gloo)", "gloo allreduce"]
    std = table["gradientmail", "standard DiLoCo (`DiLoCo.standard(H, 2)`)", "local directory"]
    s3 = table["gradientmail", "standard DiLoCo (`DiLoCo.standard(H, 2)`)", "S3 (moto)"]
    # The same model, data, seeds and outer step: standard DiLoCo and torchft's DiLoCo
    # follow one trajectory (up to float32 rounding), on either store.
    for cells in (std, s3):
        assert abs(float(cells[3]) - float(tft[3])) < 0.01, (cells[3], tft[3])
    kills = {k[1]: c for k, c in table.items() if k[1].endswith("+ SIGKILL")}
    assert len(kills) == 3
    for cells in kills.values():
        assert cells[7].endswith(" s"), cells  # the survivor's stall after the kill
    # torchft's bytes follow their formula: params × 4 each way per 2-replica allreduce.
    found = re.search(r"([\d,]+) parameters", proc.stdout)
    assert found is not None
    per_round = f"{int(found.group(1).replace(',', '')) * 4 / 1e6:.2f} MB"
    assert tft[5] == f"{per_round} / {per_round}; {per_round} / {per_round}"
    assert int(std[8]) == 4  # S / H = 24 / 6 rounds, one record each
    for line in ("- sync overhead per round, standard DiLoCo", "- bytes up + down per learner",
                 "- survivor's longest step call after the SIGKILL"):
        assert line in proc.stdout
