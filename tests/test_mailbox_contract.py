"""The Mailbox contract, run against memory, a local directory and S3 (moto over HTTP)."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.errors import ConditionalWriteUnsupported, LocalProtocolError
from gradientmail.mailbox import (
    FaultPlan,
    FaultyMailbox,
    LocalMailbox,
    Mailbox,
    MemoryMailbox,
    verify_conditional_writes,
)
from gradientmail.mailbox.url import open_mailbox


def test_get_missing_is_none(any_mailbox: Mailbox) -> None:
    assert asyncio.run(any_mailbox.get("nothing/here")) is None


def test_put_overwrites(any_mailbox: Mailbox) -> None:
    async def body() -> None:
        await any_mailbox.put("a/b.json", b"first")
        assert await any_mailbox.get("a/b.json") == b"first"
        await any_mailbox.put("a/b.json", b"second, longer")
        assert await any_mailbox.get("a/b.json") == b"second, longer"
        assert await any_mailbox.list("a/") == ["a/b.json"]

    asyncio.run(body())


def test_create_twice(any_mailbox: Mailbox) -> None:
    async def body() -> None:
        assert await any_mailbox.create("claims/round/3/0", b"learner-a") is True
        assert await any_mailbox.create("claims/round/3/0", b"learner-b") is False
        assert await any_mailbox.get("claims/round/3/0") == b"learner-a"
        await any_mailbox.put("claims/round/3/1", b"x")
        assert await any_mailbox.create("claims/round/3/1", b"y") is False
        assert await any_mailbox.get("claims/round/3/1") == b"x"

    asyncio.run(body())


def test_list_sorted_with_prefix_and_start_after(any_mailbox: Mailbox) -> None:
    keys = [
        "rounds/00000002.json",
        "rounds/00000000.json",
        "rounds/00000001.json",
        "rounds-old/x",
        "round",
        "theta/0/00000001.safetensors",
        "theta/1/00000001.safetensors",
        "manifest.json",
    ]

    async def body() -> None:
        await asyncio.gather(*(any_mailbox.put(k, k.encode()) for k in keys))
        assert await any_mailbox.list() == sorted(keys)
        assert await any_mailbox.list("rounds/") == [
            "rounds/00000000.json",
            "rounds/00000001.json",
            "rounds/00000002.json",
        ]
        assert await any_mailbox.list("round") == sorted(k for k in keys if k.startswith("round"))
        assert await any_mailbox.list("rounds/", start_after="rounds/00000000.json") == [
            "rounds/00000001.json",
            "rounds/00000002.json",
        ]
        assert await any_mailbox.list("rounds/", start_after="rounds/00000002.json") == []
        assert await any_mailbox.list("theta/", start_after="theta/0/zzz") == [
            "theta/1/00000001.safetensors"
        ]
        assert await any_mailbox.list("", start_after="rounds") == [
            "rounds-old/x",
            "rounds/00000000.json",
            "rounds/00000001.json",
            "rounds/00000002.json",
            "theta/0/00000001.safetensors",
            "theta/1/00000001.safetensors",
        ]
        assert await any_mailbox.list("missing/") == []

    asyncio.run(body())


def test_delete_is_idempotent(any_mailbox: Mailbox) -> None:
    async def body() -> None:
        await any_mailbox.put("payloads/3/a.safetensors", b"x")
        await any_mailbox.delete("payloads/3/a.safetensors")
        await any_mailbox.delete("payloads/3/a.safetensors")
        await any_mailbox.delete("never/was")
        assert await any_mailbox.get("payloads/3/a.safetensors") is None
        assert await any_mailbox.list("payloads/") == []
        # the key can be created again after its delete
        assert await any_mailbox.create("payloads/3/a.safetensors", b"y") is True

    asyncio.run(body())


def test_binary_data_and_empty_object(any_mailbox: Mailbox) -> None:
    blob = bytes(range(256)) * 64 + b"\x00\xff\r\n"

    async def body() -> None:
        await any_mailbox.put("bin", blob)
        assert await any_mailbox.create("empty", b"") is True
        await any_mailbox.put("also-empty", b"")
        assert await any_mailbox.get("bin") == blob
        assert await any_mailbox.get("empty") == b""
        assert await any_mailbox.get("also-empty") == b""
        assert await any_mailbox.list() == ["also-empty", "bin", "empty"]
        await any_mailbox.put("view", memoryview(b"from a view"))  # type: ignore[arg-type]
        assert await any_mailbox.get("view") == b"from a view"

    asyncio.run(body())


@pytest.mark.parametrize(
    ("key", "rule"),
    [
        ("../escape", "an empty, '.' or '..' segment or a leading '/'"),
        ("/etc/passwd", "an empty, '.' or '..' segment or a leading '/'"),
        ("a//b", "an empty, '.' or '..' segment or a leading '/'"),
        ("a/./b", "an empty, '.' or '..' segment or a leading '/'"),
        ("nul\x00byte", "character outside"),
        ("back\\slash", "character outside"),
        ("", "empty or not a string"),
        ("a/.tmp-123-abc", "segment starting with '.'"),
        ("x" * 1025, "at most 1024"),
    ],
)
def test_bad_keys_rejected(any_mailbox: Mailbox, key: str, rule: str) -> None:
    async def body() -> None:
        for call in (
            lambda: any_mailbox.get(key),
            lambda: any_mailbox.put(key, b"x"),
            lambda: any_mailbox.create(key, b"x"),
            lambda: any_mailbox.delete(key),
        ):
            with pytest.raises(LocalProtocolError, match="mailbox key") as info:
                await call()
            assert rule in str(info.value)
        with pytest.raises(LocalProtocolError):
            await any_mailbox.list("../")
        assert await any_mailbox.list() == []

    asyncio.run(body())


def test_concurrent_creates_have_one_winner(any_mailbox: Mailbox) -> None:
    """16 tasks race to create one key: exactly one wins and its bytes are stored."""

    async def body() -> None:
        results = await asyncio.gather(
            *(any_mailbox.create("claims/create/0", f"learner-{i}".encode()) for i in range(16))
        )
        assert sorted(results) == [False] * 15 + [True]
        winner = results.index(True)
        assert await any_mailbox.get("claims/create/0") == f"learner-{winner}".encode()

    asyncio.run(body())


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_concurrent_creates_from_threads(
    mailbox_factory: Callable[..., Mailbox], kind: str
) -> None:
    """16 threads, each with its own event loop (as separate learners would), one winner."""
    mailbox: Mailbox = mailbox_factory(kind)
    for round_ in range(5):
        key = f"claims/round/{round_}/0"
        barrier = threading.Barrier(16)
        results: dict[int, bool] = {}

        def race(
            i: int,
            key: str = key,
            barrier: threading.Barrier = barrier,
            out: dict[int, bool] = results,
        ) -> None:
            barrier.wait()
            out[i] = asyncio.run(mailbox.create(key, f"t{i}".encode()))

        threads = [threading.Thread(target=race, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, won in results.items() if won]
        assert len(results) == 16 and len(winners) == 1
        assert asyncio.run(mailbox.get(key)) == f"t{winners[0]}".encode()


@pytest.mark.parametrize("kind", ["memory", "local", "s3"])
def test_list_paginates_beyond_1000_keys(
    mailbox_factory: Callable[..., Mailbox], kind: str
) -> None:
    mailbox: Mailbox = mailbox_factory(kind, **({"fsync": False} if kind == "local" else {}))
    keys = [f"leases/learner-{i:05d}" for i in range(1100)]

    async def body() -> None:
        gate = asyncio.Semaphore(32)

        async def put(k: str) -> None:
            async with gate:
                await mailbox.put(k, b"1")

        await asyncio.gather(*(put(k) for k in reversed(keys)))
        await mailbox.put("other/x", b"")
        assert await mailbox.list("leases/") == keys
        assert await mailbox.list("leases/", start_after=keys[999]) == keys[1000:]
        assert await mailbox.list("leases/", start_after=keys[5]) == keys[6:]

    asyncio.run(body())


def test_selftest_passes(any_mailbox: Mailbox) -> None:
    asyncio.run(verify_conditional_writes(any_mailbox))
    assert asyncio.run(any_mailbox.list()) == []  # the probe is cleaned up


def test_selftest_fails_without_create_condition(any_mailbox: Mailbox) -> None:
    faulty = FaultyMailbox(any_mailbox, FaultPlan().drop_create_condition())
    with pytest.raises(ConditionalWriteUnsupported) as info:
        asyncio.run(verify_conditional_writes(faulty))
    message = str(info.value)
    assert message.startswith(f"{any_mailbox.url} does not honour create-if-absent")
    assert "a second create of probe key 'selftest/" in message
    assert "returned True (it must return False because the key exists)" in message
    assert "If-None-Match" in message
    assert asyncio.run(any_mailbox.list()) == []


_SEGMENT = st.sampled_from(["a", "b", "ab", "a-b", "a.b", "a0", "b_1", "z"])
_KEYS = st.lists(st.lists(_SEGMENT, min_size=1, max_size=3).map("/".join), max_size=12)


def _model_list(keys: set[str], prefix: str, start_after: str | None) -> list[str]:
    return sorted(
        k for k in keys if k.startswith(prefix) and (start_after is None or k > start_after)
    )


@settings(max_examples=60, deadline=None)
@given(
    keys=_KEYS,
    prefix=st.sampled_from(["", "a", "a/", "a-", "ab/", "a/b", "b/"]),
    start_after=st.one_of(st.none(), _SEGMENT, st.lists(_SEGMENT, max_size=3).map("/".join)),
)
def test_list_matches_model(keys: list[str], prefix: str, start_after: str | None) -> None:
    """list(prefix, start_after) agrees with a sorted filter, on memory and a directory."""
    # A directory cannot hold both 'a' and 'a/b'; keep the keys a filesystem can hold.
    kept: set[str] = set()
    for k in keys:
        if not any(o.startswith(k + "/") or k.startswith(o + "/") for o in kept):
            kept.add(k)
    with tempfile.TemporaryDirectory() as tmp:
        mailboxes = [MemoryMailbox(), LocalMailbox(os.path.join(tmp, "mb"), fsync=False)]

        async def body() -> None:
            for mailbox in mailboxes:
                for k in kept:
                    await mailbox.put(k, k.encode())
                expected = _model_list(kept, prefix, start_after or None)
                assert await mailbox.list(prefix, start_after or None) == expected

        asyncio.run(body())


def test_a_read_only_view_reads_and_refuses_every_write(
    any_mailbox: Mailbox, request: pytest.FixtureRequest
) -> None:
    """The same store opened with `read_only=True` (as the read-only commands open it)
    reads what is there and refuses put, create and delete, changing nothing."""
    options = {}
    if any_mailbox.url.startswith("s3://"):
        options["endpoint_url"] = request.getfixturevalue("moto_endpoint")
    view = open_mailbox(any_mailbox.url, read_only=True, **options)

    async def body() -> None:
        await any_mailbox.put("rounds/00000000.json", b"{}")
        assert await view.get("rounds/00000000.json") == b"{}"
        assert await view.get_range("rounds/00000000.json", 0, 1) == b"{"
        assert await view.list() == ["rounds/00000000.json"]
        for op, call in [("put", view.put("x", b"1")), ("create", view.create("x", b"1")),
                         ("delete", view.delete("rounds/00000000.json"))]:
            with pytest.raises(LocalProtocolError, match=(
                    rf"{op} of '(x|rounds/00000000.json)' refused: .* was opened read-only; "
                    "open it without read_only=True to write")):
                await call
        assert await any_mailbox.list() == ["rounds/00000000.json"]
        await view.close()

    asyncio.run(body())
