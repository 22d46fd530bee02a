"""LocalMailbox beyond the contract: crashes, orphaned temp files, disk limits, escapes."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gradientmail.errors import ConfigError, LocalProtocolError, MailboxError
from gradientmail.mailbox import LocalMailbox
from gradientmail.mailbox.local import _HOST, TEMP_PREFIX

MiB = 1024 * 1024
_REPO = str(Path(__file__).resolve().parents[1])


def _temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(f"{TEMP_PREFIX}*"))


def _child(code: str, tmp_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": _REPO}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), str(tmp_path / "mb")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_constructor_does_no_io(tmp_path: Path) -> None:
    root = tmp_path / "deep" / "mb"
    mailbox = LocalMailbox(root)
    assert not root.exists()
    assert mailbox.url == f"file://{root}"
    assert asyncio.run(mailbox.list()) == []
    assert root.is_dir()


@pytest.mark.slow
def test_writer_killed_mid_put_leaves_no_partial_object(tmp_path: Path) -> None:
    """SIGKILL a process that keeps overwriting an 8 MiB object, frozen while a temp file
    exists: the key holds a complete object (or none), and the next open removes the
    orphaned temp file."""
    child = _child(
        """
        import asyncio, sys
        from gradientmail.mailbox import LocalMailbox

        async def main():
            mailbox = LocalMailbox(sys.argv[1])
            i = 0
            while True:
                await mailbox.put("theta/0/big.safetensors", bytes([i % 251]) * (8 << 20))
                i += 1

        asyncio.run(main())
        """,
        tmp_path,
    )
    root = tmp_path / "mb"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the writer never wrote a temp file"
            if _temp_files(root):
                child.send_signal(signal.SIGSTOP)
                if _temp_files(root):
                    break  # frozen with a temp file on disk
                child.send_signal(signal.SIGCONT)
            time.sleep(0.001)
        orphans = _temp_files(root)
        child.kill()
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert len(orphans) == 1 and orphans[0].parent == root / "theta" / "0"
    assert orphans[0].name.startswith(f"{TEMP_PREFIX}{_HOST}-{child.pid}-")

    mailbox = LocalMailbox(root)
    assert asyncio.run(mailbox.list()) in ([], ["theta/0/big.safetensors"])
    assert _temp_files(root) == []
    data = asyncio.run(mailbox.get("theta/0/big.safetensors"))
    if data is not None:
        assert len(data) == 8 * MiB and data == data[:1] * len(data)


@pytest.mark.slow
def test_temp_files_hidden_and_cleaned_by_rule(tmp_path: Path) -> None:
    root = tmp_path / "mb"
    (root / "rounds").mkdir(parents=True)
    live = os.getppid()  # a pid that surely runs
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    names = {
        "live": f"{TEMP_PREFIX}{_HOST}-{live}-aaaa",
        "dead": f"{TEMP_PREFIX}{_HOST}-{dead_pid}-bbbb",
        "old": f"{TEMP_PREFIX}{_HOST}-{live}-cccc",
        "other_host": f"{TEMP_PREFIX}ffffffff-{dead_pid}-dddd",
        "foreign": ".DS_Store",
    }
    for name in names.values():
        (root / "rounds" / name).write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    os.utime(root / "rounds" / names["old"], (two_hours_ago, two_hours_ago))
    (root / "rounds" / "00000000.json").write_bytes(b"{}")

    mailbox = LocalMailbox(root)
    assert asyncio.run(mailbox.list()) == ["rounds/00000000.json"]
    left = sorted(p.name for p in (root / "rounds").iterdir())
    # a live writer's temp file, another host's (its pid means nothing here) and foreign
    # hidden files stay; the dead writer's and the old one go
    assert left == sorted(["00000000.json", names["live"], names["other_host"], ".DS_Store"])
    # Aged by hand: a file's mtime comes from the filesystem's coarser clock and may read
    # later than time.time() just after it was written (a max_age of 1 ms then kept it).
    a_minute_ago = time.time() - 60
    for name in (names["live"], names["other_host"]):
        os.utime(root / "rounds" / name, (a_minute_ago, a_minute_ago))
    assert asyncio.run(mailbox.clean_temp_files(max_age=30)) == 2
    assert sorted(p.name for p in (root / "rounds").iterdir()) == [".DS_Store", "00000000.json"]


@pytest.mark.slow
def test_failed_write_leaves_old_object_and_no_temp_file(tmp_path: Path) -> None:
    """A put that the OS refuses midway (file size limit: EFBIG, as ENOSPC would) raises
    MailboxError naming the key and path, and leaves the old object untouched."""
    child = _child(
        """
        import asyncio, resource, signal, sys
        from gradientmail.errors import MailboxError
        from gradientmail.mailbox import LocalMailbox

        async def main():
            mailbox = LocalMailbox(sys.argv[1])
            await mailbox.put("payloads/3/a.safetensors", b"old object")
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
            for call, key in (
                (mailbox.put, "payloads/3/a.safetensors"),
                (mailbox.put, "payloads/3/b.safetensors"),
                (mailbox.create, "payloads/3/c.safetensors"),
            ):
                try:
                    await call(key, b"x" * (2 << 20))
                except MailboxError as exc:
                    print(exc, "| cause:", type(exc.__cause__).__name__)
                else:
                    print("no error")

        asyncio.run(main())
        """,
        tmp_path,
    )
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    root = tmp_path / "mb"
    calls = [("put", "a"), ("put", "b"), ("create", "c")]
    for line, (op, name) in zip(out.splitlines(), calls, strict=True):
        key = f"payloads/3/{name}.safetensors"
        assert line == (
            f"{op} of key {key!r} in file://{root} failed at {root}/{key}: File too large "
            "(errno 27); the file exceeds the size limit of this process or filesystem"
            " | cause: OSError"
        )
    mailbox = LocalMailbox(root)
    assert asyncio.run(mailbox.list()) == ["payloads/3/a.safetensors"]
    assert asyncio.run(mailbox.get("payloads/3/a.safetensors")) == b"old object"
    assert _temp_files(root) == []


def test_symlink_escape_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"do not read")
    root = tmp_path / "mb"
    root.mkdir()
    (root / "evil").symlink_to(outside)
    mailbox = LocalMailbox(root)
    with pytest.raises(MailboxError) as info:
        asyncio.run(mailbox.get("evil/secret"))
    assert str(info.value) == (
        f"key 'evil/secret' in file://{root} resolves to {outside}/secret, outside the "
        f"mailbox root {root} (through a symlink); remove the symlink"
    )
    with pytest.raises(MailboxError, match="outside the mailbox root"):
        asyncio.run(mailbox.put("evil/new", b"x"))
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]


def test_object_and_directory_conflict(tmp_path: Path) -> None:
    mailbox = LocalMailbox(tmp_path / "mb")

    async def body() -> None:
        await mailbox.put("a", b"object")
        with pytest.raises(MailboxError) as info:
            await mailbox.put("a/b", b"x")
        assert str(info.value) == (
            f"cannot write key 'a/b' in {mailbox.url}: 'a' is an object, so it cannot also "
            "be a directory; a LocalMailbox cannot hold both 'a' and keys under 'a/'"
        )
        await mailbox.put("d/e", b"x")
        for call in (mailbox.put, mailbox.create):
            with pytest.raises(MailboxError) as info:
                await call("d", b"x")
            assert str(info.value) == (
                f"cannot write key 'd' in {mailbox.url}: keys exist under 'd/', so it is a "
                "directory; a LocalMailbox cannot hold both 'd' and keys under it"
            )
        assert await mailbox.get("d") is None
        assert await mailbox.get("a/b") is None
        await mailbox.delete("d")
        assert await mailbox.list() == ["a", "d/e"]

    asyncio.run(body())


def test_delete_prunes_empty_directories_while_writers_run(tmp_path: Path) -> None:
    """Deletes remove directories they empty; a writer into the same directory retries
    instead of failing, and neither thread ever sees an error."""
    root = tmp_path / "mb"
    mailbox = LocalMailbox(root, fsync=False)
    errors: list[BaseException] = []

    def churn(name: str) -> None:
        async def body() -> None:
            for i in range(150):
                key = f"payloads/{i % 3}/{name}"
                await mailbox.put(key, name.encode())
                assert await mailbox.get(key) == name.encode()
                await mailbox.delete(key)

        try:
            asyncio.run(body())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(n,)) for n in ("x", "y", "z")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert asyncio.run(mailbox.list()) == []
    assert list(root.iterdir()) == []


def test_a_directory_made_and_pruned_by_others_meanwhile_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # mkdir says the directory exists (another writer made it), but a delete pruned it
    # before we looked: that is no object in the way; the write retries.
    mailbox = LocalMailbox(tmp_path / "mb", fsync=False)
    asyncio.run(mailbox.put("seed", b""))
    real_mkdir = os.mkdir
    raced: list[str] = []

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).endswith("payloads") and not raced:
            raced.append(str(path))
            raise FileExistsError(errno.EEXIST, "made by another writer", path)
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    asyncio.run(mailbox.put("payloads/0/x", b"x"))
    assert raced and asyncio.run(mailbox.get("payloads/0/x")) == b"x"


def test_options_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"temp_max_age=0 must be > 0 seconds"):
        LocalMailbox(tmp_path, temp_max_age=0)


def test_read_only_creates_nothing_and_removes_nothing(tmp_path: Path) -> None:
    """A read-only mailbox on a missing root reads as empty and leaves the path missing;
    on a real one it leaves even an orphaned temp file where it is."""
    missing = tmp_path / "typo" / "sub" / "dir"
    view = LocalMailbox(missing, read_only=True)
    assert asyncio.run(view.get("manifest.json")) is None
    assert asyncio.run(view.get_range("manifest.json", 0, 4)) is None
    assert asyncio.run(view.list()) == [] and asyncio.run(view.list("rounds/")) == []
    assert not (tmp_path / "typo").exists()
    with pytest.raises(LocalProtocolError, match=r"put of 'manifest.json' refused: "
                       rf"file://{missing} was opened read-only"):
        asyncio.run(view.put("manifest.json", b"{}"))
    with pytest.raises(LocalProtocolError, match="clean of '' refused"):
        asyncio.run(view.clean_temp_files())
    assert not (tmp_path / "typo").exists()

    root = tmp_path / "mb"
    asyncio.run(LocalMailbox(root).put("a/b", b"x"))
    orphan = root / "a" / f"{TEMP_PREFIX}{_HOST}-999999999-000000000000"
    orphan.write_bytes(b"half")
    view = LocalMailbox(root, read_only=True)
    assert asyncio.run(view.list()) == ["a/b"] and asyncio.run(view.get("a/b")) == b"x"
    assert orphan.exists()
