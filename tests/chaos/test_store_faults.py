"""The store itself misbehaves: it ignores conditional writes, or the disk fills up.

A store (or proxy) that drops create-if-absent would elect several closers per round: a
learner refuses it at join. A full disk under a local-directory mailbox makes writes fail
with a clear error (reported as events) and leaves no partial object; once space returns
the run goes on. The disk is made full two ways: RLIMIT_FSIZE on one learner process
(EFBIG; works everywhere) and, where this platform lets the tests mount one, a tiny tmpfs
that the test fills with ballast (ENOSPC, for every learner at once).
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos.harness import (
    LearnerResult,
    ToyAdapter,
    Worker,
    check_ends_on_commits,
    conclude,
    spawn_learner,
    temp_files,
    verify_run,
    wait_until,
)
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.errors import ConditionalWriteUnsupported
from gradientmail.events import Event
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import FaultPlan, FaultyMailbox, LocalMailbox
from gradientmail.run.protocol import Exchange

RUN = ["--sync-every", "4", "--fragments", "2", "--sleep", "0.02", "--poll", "0.01"]
EFBIG_TEXT = ("File too large (errno 27); the file exceeds the size limit of this process "
              "or filesystem")
ENOSPC_TEXT = ("No space left on device (errno 28); the filesystem is full (or over quota): "
               "free space and retry")


def test_a_store_that_ignores_conditional_writes_is_refused_at_join(tmp_path: Path) -> None:
    mailbox = FaultyMailbox(LocalMailbox(tmp_path / "run"), FaultPlan().drop_create_condition())
    seen: list[Event] = []
    learner = Learner(ToyAdapter(), DiLoCo(sync_every=4, fragments=2), mailbox, "hopeful",
                      on_event=seen.append)
    with pytest.raises(ConditionalWriteUnsupported) as info:
        learner.start()
    message = str(info.value)
    assert message.startswith(f"file://{tmp_path / 'run'} does not honour create-if-absent: "
                              "a second create of probe key 'selftest/")
    assert message.endswith("so elections would have several winners; use a store that "
                            "supports conditional writes (AWS S3, Cloudflare R2, MinIO, a "
                            "local directory) and no proxy that strips the If-None-Match "
                            "header")
    learner.close()  # returns at once: nothing was joined
    assert asyncio.run(LocalMailbox(tmp_path / "run").list()) == []  # no manifest, no claim
    assert seen == []


def failures(res: LearnerResult) -> list[dict[str, object]]:
    return res.of_type("PublishFailed") + res.of_type("PollFailed")


@pytest.mark.slow
def test_a_learner_whose_writes_fail_with_efbig_goes_on_once_they_succeed(
    tmp_path: Path,
) -> None:
    """From step 30 to step 70 (or later, until one of its publishes has failed) every
    non-empty file the `full` learner writes fails (its leases are empty files: it stays
    live). The other learner runs the rounds."""
    box = tmp_path / "run"
    steady = spawn_learner(box, "steady", tmp_path / "steady.json", "--worker", "0",
                           "--steps", "140", "--wait-for", "2", *RUN)
    full = spawn_learner(box, "full", tmp_path / "full.json", "--worker", "1",
                         "--steps", "110", "--fsize", "1@30", "--fsize-restore", "70", *RUN)
    try:
        results = [LearnerResult.of(w.finish(timeout=120)) for w in (steady, full)]
    finally:
        for w in (steady, full):
            w.stop()
    assert temp_files(box) == []  # no partial object, no temporary file left behind
    mailbox = LocalMailbox(box)
    figures = verify_run(mailbox)
    for res in results:
        check_ends_on_commits(mailbox, res)
    steady_res, full_res = results
    failed = full_res.of_type("PublishFailed")
    assert failed, "no publish failed while the file size limit was in force"
    for e in failures(full_res):
        assert EFBIG_TEXT in str(e["error"]), e
    # The payload's write fails; or, when the limit fell between the two writes of a
    # publish in flight, the record's.
    assert all(re.search(r"of key '(payloads|snapshots)/\d{10}/full\.", str(e["error"]))
               for e in failed), failed
    last_failed = max(int(str(e["round"])) for e in failed)
    assert any(r > last_failed for r in figures.participants("full"))
    assert any(r > last_failed for r in figures.participants("steady"))
    assert failures(steady_res) == []
    conclude("file size limit (EFBIG) on one learner's writes, lifted later", figures,
             [e for res in results for e in res.events],
           steady_res.step_max, failed_publishes=len(failed),
           failed_polls=len(full_res.of_type("PollFailed")),
           full_rejoined_at=min(r for r in figures.participants("full") if r > last_failed))


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted for the test; skipped where this process may not mount."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = shutil.which("mount")
    if mount is None:
        pytest.skip("no mount command on this platform")
    done = subprocess.run([mount, "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"this platform does not let the tests mount a tmpfs: {done.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(ballast: Path) -> None:
    """Append to `ballast` until the disk is full (deletes elsewhere may free some)."""
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            try:
                os.write(fd, b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return
    finally:
        os.close(fd)


def newest(box: Path) -> int:
    return asyncio.run(Exchange(LocalMailbox(box)).newest_round())


@pytest.mark.slow
def test_a_full_disk_stops_the_rounds_until_space_returns(tiny_disk: Path) -> None:
    box = tiny_disk / "run"
    logs = tiny_disk.parent
    learners: list[Worker] = [
        spawn_learner(box, name, logs / f"{name}.json", "--worker", str(w), "--steps", "200",
                      "--wait-for", "2", "--ready-at", "40", *RUN)
        for w, name in enumerate(("one", "two"))
    ]
    ballast = tiny_disk / "ballast"
    try:
        wait_until(learners[0].ready.exists, 60, "step 40", learners)
        full_from = newest(box)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:  # the sweep frees a little now and then
            fill(ballast)
            time.sleep(0.01)
        full_until = newest(box)
        ballast.unlink()
        results = [LearnerResult.of(w.finish(timeout=120)) for w in learners]
    finally:
        for w in learners:
            w.stop()
    assert temp_files(box) == []
    mailbox = LocalMailbox(box)
    figures = verify_run(mailbox)
    for res in results:
        check_ends_on_commits(mailbox, res)
    failed = [e for res in results for e in failures(res)]
    assert failed, "nothing failed while the disk was full"
    for e in failed:
        assert ENOSPC_TEXT in str(e["error"]), e
    assert figures.rounds - 1 > full_until + 2  # the rounds went on once space returned
    for name in ("one", "two"):
        assert any(r > full_until for r in figures.participants(name)), name
    conclude("disk full (tmpfs, ENOSPC) for 1.5 s, then space returns", figures,
             [e for res in results for e in res.events],
           max(res.step_max for res in results), failed_ops=len(failed),
           rounds_while_full=full_until - full_from,
           rounds_after=figures.rounds - 1 - full_until)
