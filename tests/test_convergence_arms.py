"""benchmarks/convergence.py's sparse arms (no training, no processes): `--sparse-arm`
specs become arms with their own DiLoCo settings, `--topk-density` with the run-wide
flags keeps its names, and the goal lines compare each arm with its own F32 arm."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench() -> Any:
    spec = importlib.util.spec_from_file_location("convergence", ROOT / "benchmarks" /
                                                  "convergence.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


def test_sparse_arm_specs_become_arms_with_their_settings() -> None:
    c = bench()
    s = c.Settings(sync_every=10, sparse_specs=(
        c.parse_spec("SIGN1@1,lr=0.7,m=0,lm=0.9"), c.parse_spec("TOPK_Q2@1/24,lr=1,m=0")))
    templates = {a.name: a for a in c.ARMS}
    arms = c.sparse_arms(templates["topk"], s) + c.sparse_arms(templates["dtopk"], s)
    assert [a.name for a in arms] == ["topk1", "topk2", "dtopk1", "dtopk2"]
    assert arms[0].label == ("standard DiLoCo, SIGN1 density 1/1, outer lr 0.7 / momentum 0, "
                             "learner momentum 0.9")
    first, second, decoupled = (c.algorithm(arms[i], s) for i in (0, 1, 3))
    assert (first.delta_dtype, first.delta_density, first.feedback_momentum,
            first.outer_lr, first.outer_momentum, first.quorum_size) == (
        "SIGN1", 1.0, 0.9, 0.7, 0.0, 4)
    assert (second.delta_dtype, second.delta_density, second.outer_lr) == (
        "TOPK_Q2", 1 / 24, 1.0)
    assert (decoupled.fragments, decoupled.quorum_size, decoupled.delta_dtype) == (
        3, 1, "TOPK_Q2")


def test_topk_density_keeps_its_names_and_bad_specs_are_named() -> None:
    c = bench()
    s = c.Settings(topk_densities=(1 / 32, 0.01), feedback_decay=0.95)
    arms = c.sparse_arms(next(a for a in c.ARMS if a.name == "topk"), s)
    assert [a.name for a in arms] == ["topk32", "topk100"]
    assert c.algorithm(arms[1], s).feedback_decay == 0.95
    with pytest.raises(argparse.ArgumentTypeError, match="unknown 'mu'; use lr, m, decay, lm"):
        c.parse_spec("SIGN1@1,mu=0.9")
    with pytest.raises(argparse.ArgumentTypeError, match="'x' is not a density"):
        c.parse_spec("SIGN1@x")


def test_each_sparse_arm_is_held_to_its_own_f32_arm() -> None:
    c = bench()

    def row(arm: str, loss: float, nbytes: float) -> dict[str, Any]:
        return {"arm": arm, "label": arm, "curve": [(1, nbytes, loss)], "wall": 1.0,
                "tokens": 1, "syncs": 1}

    _, goals = c.table([row("diloco", 4.0, 3000.0), row("decoupled", 5.0, 3000.0),
                        row("topk1", 4.01, 100.0), row("dtopk1", 5.2, 50.0)])
    assert goals == [
        "topk1 within +0.5% of F32 loss at >= 30x fewer bytes: +0.25% at 30.0x "
        "fewer (met)",
        "dtopk1 within +0.5% of the Decoupled F32 loss at >= 30x fewer bytes: +4.00% at 60.0x "
        "fewer (NOT met)",
    ]
