"""LocalMailbox: the Mailbox contract on a local (or shared) directory, the embedded default.

Each key is a file under the root (`rounds/00000001.json` is `<root>/rounds/00000001.json`).
Every write goes to a hidden temporary file in the target's directory, is fsynced, and is
then published in one atomic step: `os.replace` for `put`, `os.link` for `create` (which
fails when the name exists, so exactly one of many concurrent creators wins). A reader
therefore sees the old object, the new one, or nothing; never a partial one. Temporary
files are named `.tmp-<host>-<pid>-<random>`, hidden from `list`, and those left by killed
writers are removed when the mailbox is first used (dead pid on this host, or older than
`temp_max_age` seconds).

Opened with `read_only=True` (what `gradientmail status`, `log`, `verify` and `export`
use), the mailbox leaves the filesystem as it found it: it never creates its root, removes
no temporary file, refuses every write, and reads a missing root as an empty mailbox.

A filesystem cannot hold both a file `a` and a directory `a/`, so unlike S3 a LocalMailbox
cannot hold both the keys `a` and `a/b`; such a write raises `MailboxError` naming both.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import hashlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from gradientmail.errors import ConfigError, LocalProtocolError, MailboxError
from gradientmail.mailbox.base import Mailbox, check_key, check_prefix, check_range

__all__ = ["TEMP_PREFIX", "LocalMailbox"]

TEMP_PREFIX = ".tmp-"
_T = TypeVar("_T")
# Several processes on several hosts may share one directory (NFS): the pid of a temp
# file's writer only means something on the host that wrote it.
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
# A writer whose directory a concurrent delete pruned tries again; under heavy churn (three
# threads putting and deleting in one directory on 2 busy cores) 8 tries were seen to run
# out, so allow many, yielding the CPU between them.
_DIR_RETRIES = 200
_KEY_OPS = frozenset({"get", "get_range", "put", "create", "delete"})
_READ_OPS = frozenset({"get", "get_range", "list"})


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by someone else
    return True


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hint(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "; the filesystem is full (or over quota): free space and retry"
    if exc.errno == errno.EFBIG:
        return "; the file exceeds the size limit of this process or filesystem"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "; check the permissions of the mailbox directory"
    if exc.errno == errno.EROFS:
        return "; the filesystem is read-only"
    return ""


class LocalMailbox(Mailbox):
    """A mailbox in the directory `root` (created on first use, with its parents).

    `fsync=False` skips the fsyncs (faster, still atomic for readers, but a power loss may
    lose recent writes): for throwaway runs only. `read_only=True` creates and removes
    nothing (a missing root reads as empty; `put`, `create`, `delete` and
    `clean_temp_files` raise `LocalProtocolError`). Blocking file I/O runs in worker
    threads.
    """

    metered = False  # requests are system calls

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: bool = True,
        temp_max_age: float = 3600.0,
        read_only: bool = False,
    ) -> None:
        if not temp_max_age > 0:
            raise ConfigError(
                f"temp_max_age={temp_max_age} must be > 0 seconds (how old an orphaned "
                "temporary file must be before it is removed)"
            )
        self.root = os.path.abspath(os.fspath(root))
        self.url = "file://" + self.root
        self._fsync = fsync
        self.read_only = read_only
        self._temp_max_age = temp_max_age
        self._opened = False
        self._real_root = ""
        self._open_lock = threading.Lock()

    # -- the contract -------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        path = self._path(key)
        return await self._io("get", key, path, lambda: self._get(path))

    async def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        path = self._path(key)
        check_range(key, start, stop)
        return await self._io("get_range", key, path, lambda: self._get_range(path, start, stop))

    async def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        data = _frozen(data)
        await self._io("put", key, path, lambda: self._write(key, path, data, replace=True))

    async def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        data = _frozen(data)
        return await self._io(
            "create", key, path, lambda: self._write(key, path, data, replace=False)
        )

    async def list(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        check_prefix(prefix)
        return await self._io("list", prefix, self.root, lambda: self._list(prefix, start_after))

    async def delete(self, key: str) -> None:
        path = self._path(key)
        await self._io("delete", key, path, lambda: self._delete(path))

    async def clean_temp_files(self, max_age: float | None = None) -> int:
        """Remove abandoned temporary files; return how many were removed.

        A temp file is abandoned when its writer's pid is dead (on this host) or it is
        older than `max_age` seconds (default: the mailbox's `temp_max_age`).
        """
        age = self._temp_max_age if max_age is None else max_age
        return await self._io("clean", "", self.root, lambda: self._clean(age))

    # -- plumbing ------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        check_key(key)
        return os.path.join(self.root, *key.split("/"))

    async def _io(self, op: str, key: str, path: str, fn: Callable[[], _T]) -> _T:
        if self.read_only and op not in _READ_OPS:
            raise LocalProtocolError(
                f"{op} of {key!r} refused: {self.url} was opened read-only; open it without "
                "read_only=True to write"
            )

        def run() -> _T:
            self._open()
            if op in _KEY_OPS:
                self._check_inside(key, path)
            return fn()

        try:
            return await asyncio.to_thread(run)
        except MailboxError:
            raise
        except OSError as exc:
            where = f"key {key!r}" if op != "list" else f"prefix {key!r}"
            raise MailboxError(
                f"{op} of {where} in {self.url} failed at {exc.filename or path}: "
                f"{exc.strerror or exc} (errno {exc.errno}){_hint(exc)}"
            ) from exc

    def _open(self) -> None:
        if self._opened:
            return
        with self._open_lock:
            if not self._opened:
                if not self.read_only:
                    os.makedirs(self.root, exist_ok=True)
                # A missing root resolves too (through its existing parents): a read-only
                # mailbox on it finds no key.
                self._real_root = os.path.realpath(self.root)
                if not self.read_only:
                    self._clean(self._temp_max_age)
                self._opened = True

    def _check_inside(self, key: str, path: str) -> None:
        # check_key already rules out '..' and absolute keys; this catches a symlink
        # planted inside the root that points elsewhere.
        real = os.path.realpath(path)
        if real == os.path.join(self._real_root, *key.split("/")):
            return
        if os.path.commonpath([real, self._real_root]) != self._real_root:
            raise MailboxError(
                f"key {key!r} in {self.url} resolves to {real}, outside the mailbox root "
                f"{self._real_root} (through a symlink); remove the symlink"
            )

    def _get(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def _get_range(self, path: str, start: int, stop: int) -> bytes | None:
        # Objects are replaced by rename, never written in place: the open file is one
        # version of the object from its first byte to its last.
        try:
            with open(path, "rb") as f:
                f.seek(start)
                return f.read(stop - start)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def _ensure_dir(self, key: str, path: str) -> None:
        """Create the directory `path` and missing parents, fsyncing each new entry."""
        if os.path.isdir(path):
            return
        parent = os.path.dirname(path)
        if parent != path and len(path) > len(self.root):
            self._ensure_dir(key, parent)
        try:
            os.mkdir(path)
        except FileExistsError:
            if not os.path.isdir(path):
                if not os.path.lexists(path):
                    # Made by another writer, then pruned by a concurrent delete: the
                    # caller retries (_write_temp).
                    raise FileNotFoundError(errno.ENOENT, "directory pruned meanwhile",
                                            path) from None
                other = os.path.relpath(path, self.root).replace(os.sep, "/")
                raise MailboxError(
                    f"cannot write key {key!r} in {self.url}: {other!r} is an object, so it "
                    f"cannot also be a directory; a LocalMailbox cannot hold both {other!r} "
                    f"and keys under {other + '/'!r}"
                ) from None
            return
        if self._fsync:
            _fsync_dir(parent)

    def _write_temp(self, key: str, directory: str, data: bytes) -> str:
        # A concurrent delete may remove an empty directory between our mkdir and open.
        for attempt in range(_DIR_RETRIES):
            name = f"{TEMP_PREFIX}{_HOST}-{os.getpid()}-{secrets.token_hex(6)}"
            tmp = os.path.join(directory, name)
            try:
                self._ensure_dir(key, directory)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                if attempt == _DIR_RETRIES - 1:
                    raise
                time.sleep(0)
                continue
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if self._fsync:
                    os.fsync(fd)
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
            os.close(fd)
            return tmp
        raise AssertionError("unreachable")

    def _write(self, key: str, path: str, data: bytes, *, replace: bool) -> bool:
        directory = os.path.dirname(path)
        if not replace and os.path.lexists(path):
            return self._exists(key, path)  # cheap early answer; os.link below decides
        tmp = self._write_temp(key, directory, data)
        consumed = False
        try:
            if replace:
                try:
                    os.replace(tmp, path)
                except IsADirectoryError:
                    raise self._conflict(key) from None
                consumed = created = True
            else:
                try:
                    os.link(tmp, path)
                    created = True
                except FileExistsError:
                    created = self._exists(key, path)
                except OSError as exc:
                    if exc.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP):
                        raise MailboxError(
                            f"create of key {key!r} in {self.url}: the filesystem refused a "
                            f"hard link ({exc.strerror}); LocalMailbox needs hard links for "
                            "atomic create-if-absent: use a local POSIX filesystem"
                        ) from exc
                    raise
        finally:
            if not consumed:
                os.unlink(tmp)
        if created and self._fsync:
            _fsync_dir(directory)
        return created

    def _exists(self, key: str, path: str) -> bool:
        """create's answer when `path` is taken: False, unless keys live under it."""
        if os.path.isdir(path) and not os.path.islink(path):
            raise self._conflict(key)
        return False

    def _conflict(self, key: str) -> MailboxError:
        return MailboxError(
            f"cannot write key {key!r} in {self.url}: keys exist under {key + '/'!r}, so it "
            f"is a directory; a LocalMailbox cannot hold both {key!r} and keys under it"
        )

    def _delete(self, path: str) -> None:
        try:
            os.unlink(path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return
        directory = os.path.dirname(path)
        if self._fsync:
            with contextlib.suppress(FileNotFoundError):  # pruned by a concurrent delete
                _fsync_dir(directory)
        # Drop directories the delete left empty, so sweeping old rounds leaves no litter.
        # Writers retry when a directory vanishes under them (see _write_temp).
        while len(directory) > len(self.root):
            try:
                os.rmdir(directory)
            except OSError:
                break
            directory = os.path.dirname(directory)

    def _list(self, prefix: str, start_after: str | None) -> builtins.list[str]:
        base = prefix[: prefix.rfind("/") + 1]  # the directory holding every match
        start = os.path.join(self.root, *base.split("/")[:-1]) if base else self.root
        out: builtins.list[str] = []
        _scan(start, base, prefix, start_after, out)
        out.sort()
        return out

    def _clean(self, max_age: float) -> int:
        removed = 0
        # File mtimes are wall-clock times, so age is judged against the wall clock.
        now = time.time()
        for directory, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in files:
                if not name.startswith(TEMP_PREFIX):
                    continue
                path = os.path.join(directory, name)
                try:
                    if self._abandoned(name, now - os.stat(path).st_mtime, max_age):
                        os.unlink(path)
                        removed += 1
                except FileNotFoundError:
                    continue  # its writer finished meanwhile
        return removed

    @staticmethod
    def _abandoned(name: str, age: float, max_age: float) -> bool:
        if age > max_age:
            return True
        parts = name[len(TEMP_PREFIX) :].split("-")
        if len(parts) == 3 and parts[0] == _HOST and parts[1].isdigit():
            pid = int(parts[1])
            return pid != os.getpid() and not _pid_alive(pid)
        return False


def _scan(
    directory: str, keyprefix: str, prefix: str, start_after: str | None, out: list[str]
) -> None:
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if entry.name.startswith("."):
            continue  # temporary files and foreign hidden files are never keys
        key = keyprefix + entry.name
        if entry.is_dir(follow_symlinks=False):
            sub = key + "/"
            if not (sub.startswith(prefix) or prefix.startswith(sub)):
                continue
            # Every key under `sub` sorts before start_after unless sub is its prefix.
            if start_after is not None and sub < start_after[: len(sub)]:
                continue
            _scan(entry.path, sub, prefix, start_after, out)
        elif (
            entry.is_file(follow_symlinks=False)
            and key.startswith(prefix)
            and (start_after is None or key > start_after)
        ):
            out.append(key)


def _frozen(data: bytes) -> bytes:
    """`data` as the write will read it: a read-only view of a buffer, not a copy (a
    sharded learner's part is made in place in a buffer of its own, as large as the
    rank's shard; copying it would double what the rank holds while it uploads)."""
    if isinstance(data, bytes):
        return data
    return memoryview(data).toreadonly()
