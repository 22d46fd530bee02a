"""benchmarks/gpu_convergence.py's reading of its arms (no training, no processes): the
goals are read at the largest token count every arm evaluated, and a truncated run says
so; the GPU default budget is whole rounds of H."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def bench() -> Any:
    spec = importlib.util.spec_from_file_location(
        "gpu_convergence", ROOT / "benchmarks" / "gpu_convergence.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while defined
    spec.loader.exec_module(module)
    return module


def curve(arm: str, losses: list[float], per_point: int) -> list[dict[str, Any]]:
    return [{"arm": arm, "step": i, "tokens": i * per_point, "loss": loss, "train_s": 1.0,
             "sync_s": 0.0, "rounds_seen": i - 1} for i, loss in enumerate(losses)]


def test_the_default_budget_is_whole_rounds() -> None:
    s = bench().Settings()
    assert s.steps == 1200 and s.steps % s.sync_every == 0
    assert s.steps * s.global_batch * s.block <= s.tokens


def test_goals_are_read_where_every_arm_evaluated() -> None:
    gc = bench()
    s = gc.Settings(tokens=3 * 64 * 256 * 30, eval_rounds=1)  # S = 90: points every 30
    per = s.eval_every * s.global_batch * s.block
    arms = ["ddp", "diloco-m1", "diloco-m4"]
    points = {"ddp": curve("ddp", [5.0, 3.0, 2.0, 1.5], per),
              "diloco-m1": curve("diloco-m1", [5.0, 2.9, 1.9, 1.4], per),
              "diloco-m4": curve("diloco-m4", [5.0, 3.2, 2.1], per)}  # out of time
    done = {a: [{"rank": 0, "steps": 30 * (len(points[a]) - 1), "planned": 90, "ended": "x",
                 "train_s": 10.0, "sync_s": 1.0, "published_bytes": 0, "rounds": 1}]
            for a in arms}
    body, csv = gc.tables(s, arms, points, done, dict.fromkeys(arms, 0))
    assert f"diloco-m4 held-out loss ≤ 1.02× DDP-equivalent's at {2 * per:,} tokens (67% " \
           "of the planned" in body
    assert "1.0500× (NOT met)" in body  # 2.1 / 2.0
    assert "diloco-m1 held-out loss ≤ 1.00×" in body and "0.9500× (met)" in body
    assert f"| {3 * per:,} | 1.5000 | 1.4000 | – | 0.9333 | – |" in body
    assert len(csv.splitlines()) == 1 + 4 + 4 + 3
