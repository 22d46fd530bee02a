"""benchmarks/cross_site.py's quick mode end to end, where network namespaces are allowed.

Two learners of the one-layer smoke GPT-2 behind veth pairs shaped at 20 Mbit/s, moto's
S3 server in the root namespace, standard DiLoCo and the DDP-equivalent for 60 steps.
What must hold at any speed: a row per system with a finite held-out loss, every link
carried at least the payload its system must have sent through it, and nothing of the
run (namespace, veth) is left afterwards. Skipped, with the script's own reason, where
this process may not create namespaces, veth pairs or tbf qdiscs (not root, no
CAP_NET_ADMIN); no timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(420)  # ~35 s on an idle 2-core machine; minutes when it is loaded
def test_quick_rehearsal_measures_both_systems_and_leaves_nothing(tmp_path: Path) -> None:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs iproute2's `ip` and `tc`")
    pytest.importorskip("moto.server")
    out = tmp_path / "rows.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cross_site.py"), "--quick", "--json",
         str(out), "--plot", str(tmp_path / "curve.png")],
        capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "are refused here" in proc.stdout:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    result = json.loads(out.read_text())
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == {"standard", "ddp"}
    for system, row in rows.items():
        assert "error" not in row, row.get("error")
        assert row["link"] == "20mbit"
        assert row["curve"], system
        assert all(math.isfinite(loss) for _, _, loss in row["curve"])
        assert math.isfinite(row["loss"])
        assert len(row["link_bytes"]) == 2
        for link, payload in zip(row["link_bytes"], row["payload"], strict=True):
            assert link >= payload > 0, (system, row["link_bytes"], row["payload"])
    # DDP took every step and allreduced the gradients of each: the formula's bytes.
    assert rows["ddp"]["steps"] == 60
    assert rows["ddp"]["payload"][0] == 2 * (result["params"] + 1) * 4 * 60
    # Standard DiLoCo committed every round with both learners.
    assert rows["standard"]["records"] == 3
    assert rows["standard"]["curve"][-1][1] == 60
    assert "| gradientmail standard DiLoCo (embedded closers) | 20mbit |" in proc.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "curve.png").stat().st_size > 0
    # Nothing of the run is left: no namespace, no veth carrying its tag.
    tag = result["tag"]
    assert result["leftovers"] == []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not re.search(rf"{tag}(?:-ns|r|n)\d", names + links), (names, links)
