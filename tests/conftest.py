"""Shared fixtures.

- `moto_endpoint` (session): a real S3 HTTP endpoint (moto's server on 127.0.0.1, a free
  port), with dummy credentials and region in the environment for the session. Started
  only when a test asks for S3.
- `s3_bucket` (session): a bucket on that endpoint.
- `mailbox_factory`: `mailbox_factory(kind, **options)` returns a fresh, empty mailbox of
  kind "memory", "local" or "s3" (its own store / directory / prefix); all are closed at
  teardown.
- `any_mailbox`: one fresh mailbox per kind, so a test taking it runs three times.
- `no_run_key_from_the_caller` (autouse): unsets `GRADIENTMAIL_RUN_KEY`.
- `device`: "cpu", then "cuda" (marked `cuda`; skipped "needs a CUDA device" where torch
  sees none), so a test taking it checks the same outcomes on a GPU's tensors.
- `corpus`: a few standard-library modules as one local text file (the demo's data).

Tests drive mailboxes with `asyncio.run(...)`; mailboxes hold no event-loop state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gradientmail.mailbox import LocalMailbox, Mailbox, MemoryMailbox, S3Mailbox

MAILBOX_KINDS = ("memory", "local", "s3")
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))
S3_BUCKET = "gradientmail-test"


@pytest.fixture(autouse=True)
def no_run_key_from_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Learner without `run_key` takes `GRADIENTMAIL_RUN_KEY`: one set in the shell
    that runs the tests must not turn their runs into authenticated ones."""
    monkeypatch.delenv("GRADIENTMAIL_RUN_KEY", raising=False)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """URL of a moto S3 server running in a thread of this process."""
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as env:
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }.items():
            env.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            env.delenv(name, raising=False)
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture(scope="session")
def s3_bucket(moto_endpoint: str) -> str:
    import boto3

    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=S3_BUCKET)
    return S3_BUCKET


class MailboxFactory:
    """Makes fresh mailboxes for one test and closes them afterwards."""

    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        self._request = request
        self._tmp_path = tmp_path
        self._made: list[Mailbox] = []
        self._names: list[str] = []

    def __call__(self, kind: str, **options: Any) -> Mailbox:
        name = f"t-{secrets.token_hex(6)}"
        mailbox: Mailbox
        if kind == "memory":
            self._names.append(name)
            mailbox = MemoryMailbox(name)
        elif kind == "local":
            mailbox = LocalMailbox(os.path.join(self._tmp_path, name), **options)
        elif kind == "s3":
            bucket = self._request.getfixturevalue("s3_bucket")
            endpoint = self._request.getfixturevalue("moto_endpoint")
            options.setdefault("endpoint_url", endpoint)
            mailbox = S3Mailbox(bucket, prefix=name, **options)
        else:
            raise ValueError(f"mailbox kind {kind!r} is not one of {MAILBOX_KINDS}")
        self._made.append(mailbox)
        return mailbox

    def close(self) -> None:
        for mailbox in self._made:
            asyncio.run(mailbox.close())
        for name in self._names:
            MemoryMailbox.forget(name)


@pytest.fixture
def mailbox_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MailboxFactory]:
    factory = MailboxFactory(request, tmp_path)
    yield factory
    factory.close()


@pytest.fixture(params=MAILBOX_KINDS)
def any_mailbox(request: pytest.FixtureRequest, mailbox_factory: MailboxFactory) -> Mailbox:
    return mailbox_factory(request.param)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """A torch device name for the test's modules and tensors."""
    if request.param == "cuda":
        # Asked here, not at collection: conftest loads for every test, most need no torch.
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
    return str(request.param)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A few standard-library modules as one text file: real text, small and local (the
    demo's and the recipes' data without a download)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((stdlib / name).read_text() for name in ("textwrap.py", "bisect.py",
                                                               "heapq.py", "shlex.py"))
    path = tmp_path / "corpus.txt"
    path.write_text(text * 3)
    return path
