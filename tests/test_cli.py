"""The `gradientmail` command on real runs in a local directory.

A finished run is made once by two learners in threads (as in test_learner_oracle.py) and
copied for each test; `status`, `export` and `sweep` run in-process through `main(argv)`;
`sync` runs as a subprocess and is stopped with a signal.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_learner_runtime import in_threads
from test_syncer import Run, algorithm

from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.app.cli import main
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import LocalMailbox
from gradientmail.run.keyspace import round_key
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import state_at
from gradientmail.wire.serialization import unpack

H, FRAGMENTS, STEPS, LEARNERS = 4, 2, 12, 2
REPO = Path(__file__).resolve().parent.parent


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def train(url: str) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """Two learners, standard DiLoCo over two fragments; their final state dicts and the
    last round each saw. Each fragment reaches version 3, with a checkpoint at 2."""
    alg = DiLoCo(H, FRAGMENTS, in_flight=1, overlap_steps=0, quorum_size=LEARNERS,
                 merge=WeightedMean(), flush_on_close=False,  # a round every H/P steps
                 checkpoint_every=2)
    finals: list[dict[str, torch.Tensor]] = [{} for _ in range(LEARNERS)]
    seen = [-1] * LEARNERS
    ready = threading.Barrier(LEARNERS)

    def work(w: int) -> None:
        model = make_model()
        learner = Learner(
            TorchAdapter(model),
            alg,
            url,
            f"learner-{w}",
            options=LearnerOptions(poll_interval=0.01, lease_every=5.0, lease_timeout=30.0),
        )
        learner.start()
        ready.wait(timeout=60)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(1000 * w + step)
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
            learner.step(5)
        learner.close()
        seen[w] = learner.rounds_seen
        finals[w] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    in_threads(*(functools.partial(work, w) for w in range(LEARNERS)))
    return finals, seen


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, list[int]]:
    directory = tmp_path_factory.mktemp("cli") / "run"
    finals, seen = train(str(directory))
    return directory, finals, seen


@pytest.fixture
def finished(trained: tuple[Path, Any, list[int]], tmp_path: Path) -> Path:
    """A private copy of the finished run (tests may sweep or beat in it)."""
    copy = tmp_path / "run"
    shutil.copytree(trained[0], copy)
    return copy


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- status ------------------------------------------------------------------------------


def test_status_json_describes_the_finished_run(
    finished: Path, trained: tuple[Path, Any, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    asyncio.run(Exchange(LocalMailbox(str(finished))).beat("watcher"))
    asyncio.run(Exchange(LocalMailbox(str(finished))).beat("sync-1", "closers"))
    rc, out, err = cli(capsys, "status", str(finished), "--json")
    assert (rc, err) == (0, "")
    status = json.loads(out)
    rounds = trained[2][0] + 1
    assert trained[2] == [rounds - 1] * LEARNERS
    assert rounds == STEPS * FRAGMENTS // H  # a round every H/P steps
    assert status["rounds_committed"] == rounds
    assert [(f["fragment"], f["version"]) for f in status["fragments"]] == [
        (p, rounds // FRAGMENTS) for p in range(FRAGMENTS)]
    assert [f["round"] for f in status["fragments"]] == [rounds - 2, rounds - 1]
    # A replicated outer step: the newest commits carry their step; theta and the outer
    # state travel only at checkpoint versions.
    assert all(f["step_bytes"] > 0 for f in status["fragments"])
    assert all((f["theta_bytes"] is None) == (f["outer_bytes"] is None) for f in
               status["fragments"])
    assert status["live_learners"] == ["watcher"]  # the learners released theirs on close
    assert status["standalone_closers"] == ["sync-1"]  # no learner: not in live_learners
    assert set(status["estimates"]) == {"step", "quorum", "sync"}
    assert status["estimates"]["sync"] is not None
    assert status["last_round"]["participants"] == ["learner-0", "learner-1"]
    assert status["open_round"] == {"round": rounds, "fragment": rounds % FRAGMENTS,
                                    "contributions": [], "claims": []}
    assert status["tensors"] == 4 and status["parameters"] == 6 * 8 + 8 + 8 * 2 + 2
    assert status["algorithm"]["quorum_size"] == LEARNERS
    # Traffic, from the round records alone: each payload's size as the records name it.
    records = asyncio.run(Exchange(LocalMailbox(str(finished))).rounds_after(-1))
    traffic = status["traffic"]
    assert (traffic["rounds"], traffic["first_round"], traffic["last_round"]) == (
        rounds, 0, rounds - 1)
    assert traffic["learners"] == 1  # one lease: the watcher's
    per = traffic["per_round"]
    uploaded = [p for rec in records for p in rec.participants if not p.held]
    assert per["uploads"] == len(uploaded) / rounds > 0
    assert per["contribution_bytes"] == sum(p.payload_size or 0 for p in uploaded) / rounds
    assert per["commit_bytes"] == sum(ref.size for rec in records
                                      for ref in rec.payload_refs()) / rounds
    # every commit carries its replicated step: what a following learner downloads
    assert per["follow_bytes"] == sum(rec.step.payload.size for rec in records
                                      if rec.step is not None) / rounds > 0
    assert per["puts"] == pytest.approx(sum(2 * sum(not p.held for p in rec.participants) + 2
                                            + len(rec.payload_refs()) for rec in records)
                                        / rounds)
    stamps = [rec.committed_at for rec in records]
    assert None not in stamps
    if stamps[-1] > stamps[0]:  # stamped in milliseconds: a fast run may share one
        assert traffic["rounds_per_hour"] == pytest.approx(
            (rounds - 1) * 3600 / (stamps[-1] - stamps[0]))
        assert set(traffic["per_learner_hour"]) == {"bytes_up", "bytes_down", "puts", "gets",
                                                    "usd"}
    assert traffic["prices"] == {"put_per_1000": 0.005, "get_per_1000": 0.0004,
                                 "egress_per_gb": 0.09}


def test_status_prints_a_readable_table(
    finished: Path, trained: tuple[Path, Any, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = cli(capsys, "status", str(finished))
    assert rc == 0
    rounds = trained[2][0] + 1
    lines = out.splitlines()
    assert lines[0] == f"run         {finished} (created by {json_creator(finished)})"
    assert f"rounds      {rounds} committed" in lines
    assert "learners    0 holding a lease" in lines
    assert "closers     0 standalone holding a lease (the learners close the rounds)" in lines
    # Of 2 contributions a round, the one that completes the set may be merged from its
    # closer's memory (held), never uploaded.
    [traffic] = [line for line in lines if line.startswith("traffic")]
    assert re.match(rf"traffic     rounds 0-{rounds - 1}, per round: [12]\.\d contributions "
                    r"up \(\d+ B\), commit \d+ B up, \d+ B down per learner, \d+\.\d PUTs$",
                    traffic), traffic
    assert lines[-3].split() == ["fragment", "version", "round", "tensors", "theta", "outer",
                                 "update", "step"]
    plan = json.loads((finished / "manifest.json").read_bytes())["plan"]
    assert [len(names) for names in plan] == [1, 3]  # 0.weight; the rest by bytes
    assert lines[-2].split()[:4] == ["0", str(rounds // 2), str(rounds - 2), "1"]
    assert lines[-1].split()[:4] == ["1", str(rounds // 2), str(rounds - 1), "3"]
    assert lines[-1].split()[-3] == "-"  # no quantized update
    assert lines[-1].split()[-1] != "-"  # the replicated step


def test_status_of_a_run_with_no_round_yet(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "run"
    r = Run(LocalMailbox(str(directory)), algorithm(fragments=2, quorum_size=1))
    manifest = asyncio.run(r.create())
    asyncio.run(r.contribute(0, "a"))
    rc, out, _ = cli(capsys, "status", str(directory), "--json")
    assert rc == 0
    status = json.loads(out)
    assert (status["rounds_committed"], status["last_round"]) == (0, None)
    assert [(f["fragment"], f["version"], f["round"], f["theta_bytes"])
            for f in status["fragments"]] == [(p, 0, None, ref.size)
                                              for p, ref in enumerate(manifest.init)]
    assert status["estimates"] == {"step": None, "quorum": None, "sync": None}
    assert status["traffic"] is None  # no record to read it from
    assert status["open_round"] == {"round": 0, "fragment": 0, "contributions": ["a"],
                                    "claims": []}
    rc, out, _ = cli(capsys, "status", str(directory))
    assert rc == 0
    assert "open round  0 (fragment 0): contributions a; claims none" in out.splitlines()
    assert "estimates   step -, quorum -, sync -" in out.splitlines()
    assert out.splitlines()[-1].split()[:3] == ["1", "0", "init"]


def json_creator(directory: Path) -> str:
    manifest = json.loads((directory / "manifest.json").read_bytes())
    return str(manifest["creator"])


# -- export ------------------------------------------------------------------------------


def test_export_loads_into_the_model_and_equals_the_learners(
    finished: Path, trained: tuple[Path, Any, list[int]], capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    out_file = tmp_path / "model.safetensors"
    rc, out, err = cli(capsys, "export", str(finished), str(out_file))
    assert (rc, err) == (0, "")
    assert out.startswith(f"wrote {out_file}: 4 tensors")
    model = make_model()
    model.load_state_dict(load_file(str(out_file)))  # strict: every parameter, nothing else
    for final in trained[1]:
        for name, value in model.state_dict().items():
            assert torch.equal(value, final[name]), name
    assert not torch.equal(model.state_dict()["0.weight"], make_model().state_dict()["0.weight"])
    _, metadata = unpack_meta(out_file)
    assert metadata["gradientmail.round"] == str(trained[2][0])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".gradientmail-export")]


def unpack_meta(path: Path) -> tuple[Any, dict[str, str]]:
    from gradientmail.wire.serialization import unpack_with_metadata

    return unpack_with_metadata(path.read_bytes())


def test_export_takes_init_for_a_fragment_never_committed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "run"
    r = Run(LocalMailbox(str(directory)), algorithm(fragments=2, quorum_size=1))

    async def setup() -> tuple[Any, Any]:
        manifest = await r.create()
        await r.contribute(0, "a")
        assert await r.syncer().poll(live=frozenset({"a"}))
        rec = await r.ex.read_round(0)
        assert rec is not None
        state = await state_at(r.ex, 0, rec)
        return dict(state.theta), await r.ex.store.fetch_tensors(manifest.init[1])

    committed, init = asyncio.run(setup())
    out_file = tmp_path / "out.safetensors"
    rc, _, _ = cli(capsys, "export", str(directory), str(out_file))
    assert rc == 0
    got = unpack(out_file.read_bytes())
    assert got == {"w": committed["w"], "b": init["b"]}
    assert r.plan == (("w",), ("b",))


def test_export_to_a_missing_directory_is_one_error_line(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "no" / "such" / "dir" / "m.safetensors"
    rc, out, err = cli(capsys, "export", str(finished), str(target))
    assert (rc, out) == (1, "")
    assert err.startswith(f"gradientmail: error: cannot write {str(target)!r}: ")
    assert err.count("\n") == 1


# -- sweep -------------------------------------------------------------------------------


def test_sweep_keeps_the_newest_checkpoint_and_the_steps_after_it(
    finished: Path, trained: tuple[Path, Any, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    rounds = trained[2][0] + 1
    assert rounds // 2 == 3  # each fragment at version 3, its checkpoint at version 2

    def files(kind: str, p: int) -> list[str]:
        return sorted(f.name for f in (finished / kind / str(p)).iterdir())

    for p in range(FRAGMENTS):
        # The learners' syncers swept version 1: the checkpoint at 2 makes it unneeded.
        assert files("theta", p) == files("outer", p) == ["0000000002-000000.safetensors"]
        assert files("steps", p) == ["0000000002-000000.safetensors",
                                     "0000000003-000000.safetensors"]
    rc, out, _ = cli(capsys, "sweep", str(finished), "--keep", "1")
    assert rc == 0
    # Nothing more to sweep: a reader replays the step of version 3 from the checkpoint.
    assert out == (f"swept 0 keys from {finished} (kept the newest 1 versions of each "
                   "fragment, its newest checkpoint and the steps since)\n")
    assert files("steps", 0)[-1] == "0000000003-000000.safetensors"
    # The model is whole after sweeping.
    rc, _, _ = cli(capsys, "export", str(finished), str(finished.parent / "m.safetensors"))
    assert rc == 0


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["status", "export", "sweep"])
def test_a_missing_run_names_the_url(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [command, str(tmp_path / "empty")]
    if command == "export":
        argv.append(str(tmp_path / "m.safetensors"))
    rc, out, err = cli(capsys, *argv)
    assert (rc, out) == (1, "")
    assert err == (f"gradientmail: error: no run found in {str(tmp_path / 'empty')!r}: it "
                   "holds no manifest.json. Check the URL (and --endpoint-url or "
                   "AWS_ENDPOINT_URL for S3); a run is created by its first learner\n")
    assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.parametrize("command", ["status", "log", "plot", "verify", "export", "sweep"])
def test_a_mistyped_nested_path_is_reported_and_not_created(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Commands that find no run leave the path as they found it: missing."""
    url = str(tmp_path / "typo" / "sub" / "dir")
    argv = [command, url]
    if command in ("plot", "export"):
        argv.append(str(tmp_path / "out"))
    rc, out, err = cli(capsys, *argv)
    assert (rc, out) == (1, "")
    assert err.startswith(f"gradientmail: error: no run found in {url!r}: it holds no "
                          "manifest.json.")
    assert not (tmp_path / "typo").exists() and not (tmp_path / "out").exists()


def test_bad_urls_and_options_are_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = cli(capsys, "status", str(tmp_path), "--endpoint-url", "http://127.0.0.1:1")
    assert rc == 1
    assert err.startswith("gradientmail: error: option(s) ['endpoint_url'] are not accepted "
                          "by LocalMailbox")
    rc, _, err = cli(capsys, "status", "ftp://host/x")
    assert rc == 1 and "unsupported scheme 'ftp'" in err
    rc, _, err = cli(capsys, "sync", str(tmp_path), "--closer-id", "no spaces")
    assert rc == 1 and err.startswith("gradientmail: error: learner id 'no spaces' is invalid")
    with pytest.raises(SystemExit) as exc:
        main(["sweep", str(tmp_path), "--keep", "0"])
    assert exc.value.code == 2
    assert "--keep: 0 must be >= 1" in capsys.readouterr().err


# -- sync --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sync_closes_a_published_round_and_stops_cleanly(
    sig: signal.Signals, tmp_path: Path
) -> None:
    directory = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradientmail.app.cli", "sync", str(directory),
         "--poll-interval", "0.05", "--closer-id", "cli-sync"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # the run does not exist yet
        assert first == f"gradientmail sync: no run in {directory} yet; waiting for its " \
                        "first learner\n"
        r = Run(LocalMailbox(str(directory)), algorithm(fragments=2, quorum_size=1))

        async def publish() -> None:
            await r.create()  # after the syncer started: it waits for the run
            await r.contribute(0, "a")

        asyncio.run(publish())
        record = directory / round_key(0)
        deadline = time.monotonic() + 60
        while not record.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert record.exists(), "the syncer wrote no record"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out == (f"gradientmail sync: stopped by {sig.name} after closing 1 round of "
                   f"{directory} as 'cli-sync'\n")
    assert "RoundClosed(closer='cli-sync', round=0" in err
    rec = json.loads(record.read_bytes())
    assert rec["closer"] == "cli-sync"
    assert [p["learner"] for p in rec["participants"]] == ["a"]
    assert rec["theta"] is None  # a replicated step: version 1 is no checkpoint
    step = np.frombuffer(unpack((directory / rec["step"]["payload"]["key"]).read_bytes())["w"]
                         .data, np.float32)
    assert step.shape == (6,) and np.abs(step).max() > 0


# -- S3 ----------------------------------------------------------------------------------


def test_status_and_export_on_s3_with_an_endpoint_option_or_the_environment(
    mailbox_factory: Any, moto_endpoint: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    mailbox = mailbox_factory("s3")
    r = Run(mailbox, algorithm(fragments=2, quorum_size=1))

    async def setup() -> None:
        await r.create()
        await r.contribute(0, "a")
        assert await r.syncer().poll(live=frozenset({"a"}))

    asyncio.run(setup())
    url = mailbox.url
    rc, out, err = cli(capsys, "status", url, "--endpoint-url", moto_endpoint, "--json")
    assert (rc, err) == (0, "")
    status = json.loads(out)
    assert status["rounds_committed"] == 1
    assert [(f["fragment"], f["version"]) for f in status["fragments"]] == [(0, 1), (1, 0)]
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)  # boto3 reads it itself
    rc, out, err = cli(capsys, "export", url, str(tmp_path / "m.safetensors"))
    assert (rc, err) == (0, "")
    assert set(unpack((tmp_path / "m.safetensors").read_bytes())) == {"w", "b"}


def test_demo_takes_the_outlier_factor(capsys: pytest.CaptureFixture[str]) -> None:
    from gradientmail.app.cli import build_parser, demo_config
    from gradientmail.app.demo_runs import _algorithm

    args = build_parser().parse_args(["demo", "--learners", "2", "--outlier-factor", "3.5"])
    for system in ("standard", "decoupled"):
        assert _algorithm(demo_config(args), system).outlier_factor == 3.5
    plain = build_parser().parse_args(["demo", "--slow", "3"])
    assert _algorithm(demo_config(plain), "decoupled").outlier_factor is None
    assert demo_config(plain).slow == 3.0
    assert main(["demo", "--outlier-factor", "0.5"]) == 1
    assert "outlier_factor=0.5 must be None (off) or a number > 1" in capsys.readouterr().err


def test_status_prices_traffic_with_the_prices_given(
    finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = cli(capsys, "status", str(finished), "--json", "--egress-per-gb", "0",
                     "--put-per-1000", "0.01")
    assert rc == 0
    assert json.loads(out)["traffic"]["prices"] == {"put_per_1000": 0.01,
                                                    "get_per_1000": 0.0004,
                                                    "egress_per_gb": 0.0}
    rc, _, err = cli(capsys, "status", str(finished), "--egress-per-gb", "-1")
    assert rc != 0 and "egress_per_gb=-1.0 must be a finite number of dollars >= 0" in err
