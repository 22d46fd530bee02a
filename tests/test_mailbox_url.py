"""open_mailbox: URLs, paths and instances to mailboxes; the package's public names."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import gradientmail.mailbox
from gradientmail.errors import ConfigError
from gradientmail.mailbox import LocalMailbox, MemoryMailbox, S3Mailbox, open_mailbox


def test_public_names() -> None:
    assert sorted(gradientmail.mailbox.__all__) == [
        "CountingMailbox",
        "FaultPlan",
        "FaultRule",
        "FaultyMailbox",
        "LocalMailbox",
        "Mailbox",
        "MemoryMailbox",
        "RequestCounts",
        "S3Mailbox",
        "check_key",
        "check_prefix",
        "open_mailbox",
        "verify_conditional_writes",
    ]


def test_paths_and_file_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for target in (str(tmp_path / "a"), tmp_path / "a", f"file://{tmp_path}/a"):
        mailbox = open_mailbox(target)
        assert isinstance(mailbox, LocalMailbox)
        assert mailbox.root == str(tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    relative = open_mailbox("runs/r1", fsync=False)
    assert isinstance(relative, LocalMailbox) and relative.root == str(tmp_path / "runs" / "r1")
    assert not os.path.exists(tmp_path / "runs")  # nothing is opened yet
    spaced = open_mailbox(f"file://localhost{tmp_path}/with%20space")
    assert isinstance(spaced, LocalMailbox) and spaced.root == f"{tmp_path}/with space"


def test_s3_urls() -> None:
    mailbox = open_mailbox("s3://my-bucket/runs/r1", endpoint_url="http://127.0.0.1:9")
    assert isinstance(mailbox, S3Mailbox)
    assert (mailbox.bucket, mailbox.prefix, mailbox.url) == (
        "my-bucket",
        "runs/r1/",
        "s3://my-bucket/runs/r1/",
    )
    assert mailbox.endpoint_url == "http://127.0.0.1:9"
    bare = open_mailbox("s3://my-bucket")
    assert isinstance(bare, S3Mailbox) and bare.prefix == "" and bare.url == "s3://my-bucket/"
    with pytest.raises(ConfigError, match=r"names no bucket; use s3://bucket/prefix"):
        open_mailbox("s3:///prefix")


def test_memory_urls() -> None:
    a, b = open_mailbox("memory://shared-x"), open_mailbox("memory://shared-x")
    assert isinstance(a, MemoryMailbox) and a.url == "memory://shared-x"
    asyncio.run(a.put("k", b"v"))
    assert asyncio.run(b.get("k")) == b"v"
    private = open_mailbox("memory://")
    assert asyncio.run(private.get("k")) is None
    MemoryMailbox.forget("shared-x")


def test_instance_passes_through() -> None:
    mailbox = MemoryMailbox()
    assert open_mailbox(mailbox) is mailbox
    with pytest.raises(ConfigError, match=r"options \['fsync'\] given with the ready-made"):
        open_mailbox(mailbox, fsync=False)


def test_bad_urls_and_options() -> None:
    with pytest.raises(ConfigError) as info:
        open_mailbox("gs://bucket/run")
    assert str(info.value) == (
        "mailbox URL 'gs://bucket/run' has the unsupported scheme 'gs'; supported: "
        "file:///dir (or a plain path), s3://bucket/prefix, memory://name"
    )
    with pytest.raises(ConfigError) as info:
        open_mailbox("s3://b-1/x", endpoint="http://x")
    assert str(info.value).startswith(
        "option(s) ['endpoint'] are not accepted by S3Mailbox (for 's3://b-1/x'); accepted: "
        "['addressing_style', 'clock', 'connect_timeout', 'create_attempts', 'endpoint_url',"
    )
    with pytest.raises(ConfigError, match=r"accepted: \['read_only'\]"):
        open_mailbox("memory://x", fsync=True)
    with pytest.raises(ConfigError, match=r"names the host 'server'"):
        open_mailbox("file://server/share")
    with pytest.raises(ConfigError, match=r"has a query or fragment"):
        open_mailbox("s3://b-1/x?endpoint_url=http://y")
    with pytest.raises(ConfigError, match=r"is not a non-empty string"):
        open_mailbox("")
