"""`gradientmail demo --link RATE`: the learners behind shaped links.

In-process: the rates, the message that names what a machine lacks and the fix, the
configuration and the command line, the worker's spec and budget counter, the table.
End to end (slow): two learners behind 20 Mbit/s links, the three runs, and nothing of
the links left afterwards; skipped with the reason where this process may not make
network namespaces (not root, no CAP_NET_ADMIN) or moto is not installed. No timing is
asserted.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gradientmail.app import links
from gradientmail.app.cli import build_parser, demo_config, main
from gradientmail.app.demo import _table, run_demo
from gradientmail.app.demo_link import job_from_spec, job_spec, take_from_file
from gradientmail.app.demo_runs import LINK_SYSTEMS, SYSTEMS, DemoConfig, _Job
from gradientmail.app.links import Links, parse_rate, requirements_error
from gradientmail.errors import ConfigError


def test_rates_read_as_bits_per_second() -> None:
    assert parse_rate("20mbit") == 20e6
    assert parse_rate(" 100MBit ") == 100e6
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("512kbit") == 512e3
    assert parse_rate("2.5mbit") == 2.5e6
    assert parse_rate("none") is None
    for bad in ("20mb", "fast", "", "0mbit", "-1gbit"):
        with pytest.raises(ConfigError, match=r"use e\.g\. 20mbit, 100mbit, 1gbit or none"):
            parse_rate(bad)


def test_the_message_names_what_is_missing_and_the_fix() -> None:
    assert requirements_error(tools=[], refused=None, moto=None) is None
    not_root = requirements_error(
        tools=[], moto=None,
        refused="ip netns add gmp1-probe: mount --make-shared /run/netns failed: "
        "Operation not permitted")
    assert not_root == (
        "root or CAP_NET_ADMIN to make network namespaces, veth pairs and tbf qdiscs (ip "
        "netns add gmp1-probe: mount --make-shared /run/netns failed: Operation not "
        "permitted); run as root")
    no_moto = requirements_error(tools=[], refused=None, moto="No module named 'moto'")
    assert no_moto == ("moto's S3 server for the bucket (No module named 'moto'): pip "
                       "install -e '.[dev]'")
    both = requirements_error(tools=["ip", "tc"], refused="whatever", moto="no moto")
    # Without the tools the probe says nothing worth adding.
    assert both == ("iproute2's ip and tc (not found; e.g. apt-get install iproute2); and "
                    "moto's S3 server for the bucket (no moto): pip install -e '.[dev]'")


def test_the_demo_refuses_before_starting_anything(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(links, "check_requirements", lambda: requirements_error(
        tools=[], refused="ip netns add x: Operation not permitted", moto=None))
    with pytest.raises(ConfigError, match=r"^--link 20mbit needs root or CAP_NET_ADMIN .*"
                       r"Operation not permitted\); run as root; or run without --link$"):
        run_demo(DemoConfig(link="20mbit"))
    assert main(["demo", "--link", "20mbit"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gradientmail: error: --link 20mbit needs root or CAP_NET_ADMIN")
    assert err.rstrip().endswith("run as root; or run without --link")


def test_link_configuration() -> None:
    assert DemoConfig().systems == SYSTEMS and DemoConfig().link is None
    behind = DemoConfig(link="20mbit")
    assert behind.systems == LINK_SYSTEMS == ("standard", "standard-closer", "decoupled")
    assert DemoConfig(link="none", systems=("decoupled",)).systems == ("decoupled",)
    with pytest.raises(ConfigError, match="link rate 'fast'"):
        DemoConfig(link="fast")
    with pytest.raises(ConfigError, match=r"--mailbox /tmp/x with --link 20mbit: .*leave "
                       "--mailbox out"):
        DemoConfig(link="20mbit", mailbox="/tmp/x")
    with pytest.raises(ConfigError, match=r"systems=\['standard-closer'\]: pick from "
                       r"\['standard', 'decoupled'\] \(standard-closer needs a link\)"):
        DemoConfig(systems=("standard-closer",))


def test_the_command_line_passes_the_link() -> None:
    args = build_parser().parse_args(["demo", "--link", "20mbit", "--learners", "2"])
    cfg = demo_config(args)
    assert (cfg.link, cfg.learners, cfg.systems) == ("20mbit", 2, LINK_SYSTEMS)
    assert (cfg.slow, cfg.steps) == (1.0, 128)  # every learner alike unless asked
    asked = demo_config(build_parser().parse_args(["demo", "--link", "1gbit", "--slow",
                                                   "3", "--steps", "40"]))
    assert (asked.link, asked.slow, asked.steps) == ("1gbit", 3.0, 40)
    plain = demo_config(build_parser().parse_args(["demo"]))
    assert plain == DemoConfig()  # the demo without --link is as it was
    assert main(["demo", "--link", "20mb"]) == 1


def test_a_job_travels_to_its_worker_through_a_spec(tmp_path: Path) -> None:
    cfg = DemoConfig(learners=3, steps=7, link="100mbit", diloco=(("outlier_factor", 2.5),))
    job = _Job("standard-closer", "learner-2", 2, cfg, str(tmp_path),
               "s3://gradientmail-demo/standard-closer", "http://10.1.0.1:5000")
    spec = json.loads(json.dumps(job_spec(job, tmp_path / "budget")))
    again, budget = job_from_spec(spec)
    assert again == job and budget == tmp_path / "budget"
    assert again.slow  # the last of three learners, at the default slow=2


def test_the_budget_file_hands_out_each_step_once(tmp_path: Path) -> None:
    path = tmp_path / "budget"
    path.write_bytes(bytes(8))
    taken = [0] * 4

    def take(k: int) -> None:
        while take_from_file(path, 500):
            taken[k] += 1

    threads = [threading.Thread(target=take, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(taken) == 500
    assert not take_from_file(path, 500)
    assert int.from_bytes(path.read_bytes(), "little") == 500


def test_the_table_gains_the_link_and_the_bytes_through_each() -> None:
    def row(label: str, seconds: float, reach: float | None) -> dict[str, object]:
        return {"label": label, "eval_loss": 4.5, "seconds": seconds,
                "seconds_to_target": reach, "steps_per_learner": [20, 20],
                "rounds_committed": 5, "bytes_sent_per_learner": 12.5e6,
                "tokens_trained": 10240, "link_bytes_per_learner": [31.2e6, 18.04e6],
                "curve": [(5.0, 5.1), (seconds, 4.5)],
                "closers": {"sync-next-to-bucket": 5}}

    summary = {"learners": 2, "steps": 20, "slow": 1.0, "link": "20mbit", "seconds": 100.0,
               "target_loss": 4.5, "runs": {
                   "standard": row("standard DiLoCo, closed by a learner", 60.0, 60.0),
                   "decoupled": row("Decoupled DiLoCo (quorum 1, 2 fragments)", 30.0, 24.0),
               }}
    text = _table(summary)
    header, _rule, first, second = text.splitlines()[:4]
    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.split(" | ")]

    assert cells(header)[-2:] == ["link", "MB through each link"]
    assert cells(first)[-2:] == cells(second)[-2:] == ["20mbit", "31.2/18.0"]
    assert "Every learner in its own network namespace behind a 20mbit link" in text
    assert ("Decoupled DiLoCo (quorum 1, 2 fragments): reached the target after 24s (the "
            "first run, which set it: 60s; 2.50x).") in text
    assert "rounds closed by sync-next-to-bucket 5." in text
    assert "behind an unshaped link;" in _table(dict(summary, link="none"))
    # the demo without links keeps its table
    plain = dict(summary)
    del plain["link"]
    assert "link" not in _table(plain).splitlines()[0]


def test_links_name_everything_after_this_process() -> None:
    made = Links(2)
    tag = f"gm{os.getpid() % 10**7}"
    assert made.ns == [f"{tag}-ns0", f"{tag}-ns1"]
    assert made.root_dev == [f"{tag}r0", f"{tag}r1"]
    assert all(len(dev) <= 15 for dev in made.root_dev + made.ns_dev)  # IFNAMSIZ
    made.octet = 123
    assert (made.host(1), made.addr(1)) == ("10.123.1.1", "10.123.1.2")


# -- end to end --------------------------------------------------------------------------



@pytest.mark.slow
@pytest.mark.timeout(420)  # about a minute on an idle 2-core machine
def test_demo_behind_20mbit_links(corpus: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    missing = links.check_requirements()
    if missing is not None:
        pytest.skip(f"gradientmail demo --link needs {missing}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = io.StringIO()
    cfg = DemoConfig(learners=2, steps=8, slow=1.0, data=str(corpus), sync_every=4,
                     vocab=512, batch=4, block=32, link="20mbit")
    summary = run_demo(cfg, out=out)
    runs = summary["runs"]
    assert list(runs) == list(LINK_SYSTEMS)
    for system in ("standard", "standard-closer"):
        # every learner its 8 steps, both in every round (H = 4)
        assert runs[system]["steps_per_learner"] == [8, 8]
        assert runs[system]["rounds_committed"] == 2
        assert sum(runs[system]["closers"].values()) == 2
    assert sum(runs["decoupled"]["steps_per_learner"]) == 16
    assert runs["decoupled"]["rounds_committed"] >= 1
    # The runs beside a standalone closer: it closes their rounds (a learner's closer only
    # after a backup's head start, which these few steps never give it).
    for system in ("standard-closer", "decoupled"):
        assert runs[system]["closers"] == {"sync-next-to-bucket": runs[system][
            "rounds_committed"]}, (system, runs[system]["closers"])
    for system, r in runs.items():
        assert math.isfinite(r["eval_loss"]), system
        assert 1 <= sum(r["closers"].values()) <= r["rounds_committed"]
        assert len(r["link_bytes_per_learner"]) == 2
        for through, (up, down) in zip(r["link_bytes_per_learner"], r["link_up_down"],
                                       strict=True):
            # every learner joined the run through its link, and sent its deltas up it
            assert through == up + down and down > 0, (system, r["link_up_down"])
        assert max(up for up, _ in r["link_up_down"]) >= r["bytes_sent_per_learner"] > 0
    text = out.getvalue()
    assert text.count("| 20mbit |") == 3
    for system in LINK_SYSTEMS:
        assert runs[system]["label"] in text
    assert summary["link"] == "20mbit" and summary["leftovers"] == []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert Links(2).ns[0] not in names


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_terminated_demo_removes_its_links(corpus: Path, tmp_path: Path) -> None:
    missing = links.check_requirements()
    if missing is not None:
        pytest.skip(f"gradientmail demo --link needs {missing}")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradientmail.app.cli", "demo", "--link", "20mbit",
         "--learners", "2", "--steps", "400", "--data", str(corpus)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tag = f"gm{proc.pid % 10**7}"
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:  # until its learners are training behind the links
        seen.append(line)
        if line.lstrip().startswith("standard: steps"):
            break
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{tag}-ns1" in names, "".join(seen)
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    assert proc.wait(60) == 130, "".join(seen) + rest
    assert "gradientmail: interrupted" in rest
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    devices = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert tag not in names + devices
