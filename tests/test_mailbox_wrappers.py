"""CountingMailbox and FaultyMailbox: the wrappers every later failure test relies on."""

from __future__ import annotations

import asyncio

import pytest

from gradientmail.errors import ConfigError, LocalProtocolError, MailboxError
from gradientmail.mailbox import (
    CountingMailbox,
    FaultPlan,
    FaultyMailbox,
    Mailbox,
    MemoryMailbox,
    RequestCounts,
)
from gradientmail.testing import FakeClock


def test_counting_counts_requests_like_s3(any_mailbox: Mailbox) -> None:
    mailbox = CountingMailbox(any_mailbox)

    async def body() -> None:
        await mailbox.put("a/1", b"12345")
        assert await mailbox.create("a/2", b"123") is True
        assert await mailbox.create("a/2", b"1234567") is False
        assert await mailbox.get("a/1") == b"12345"
        assert await mailbox.get("a/missing") is None
        assert await mailbox.list("a/") == ["a/1", "a/2"]
        assert await mailbox.list("b/") == []
        await mailbox.delete("a/1")

    asyncio.run(body())
    # Both creates are PUTs to S3 (the refused one too), and counted as creates.
    assert mailbox.snapshot() == RequestCounts(
        list=2, get=2, put=3, delete=1, bytes_up=15, bytes_down=5, create=2
    )
    assert mailbox.url == any_mailbox.url


def test_counting_pages_snapshot_reset_and_cost() -> None:
    mailbox = CountingMailbox(MemoryMailbox())

    async def body() -> None:
        for i in range(2500):
            await mailbox.put(f"leases/{i:05d}", b"")
        before = mailbox.snapshot()
        assert len(await mailbox.list("leases/")) == 2500
        assert mailbox.snapshot() - before == RequestCounts(list=3)
        assert len(await mailbox.list("leases/", start_after="leases/01999")) == 500
        assert mailbox.snapshot() - before == RequestCounts(list=4)

    asyncio.run(body())
    counts = mailbox.reset()
    assert counts == RequestCounts(list=4, put=2500)
    assert counts.requests == 2504
    assert counts.cost_usd() == pytest.approx(2504 * 5.0 / 1e6)
    assert RequestCounts(get=1_000_000).cost_usd() == pytest.approx(0.4)
    assert mailbox.snapshot() == RequestCounts()


def test_fail_nth_matching_call_for_times() -> None:
    plan = FaultPlan().fail("put", "payloads/*", nth=2, times=2)
    mailbox = FaultyMailbox(MemoryMailbox(), plan)

    async def body() -> list[str]:
        outcomes = []
        for i in range(5):
            try:
                await mailbox.put(f"payloads/{i}/a", b"x")
                outcomes.append("ok")
            except MailboxError as exc:
                outcomes.append(str(exc))
            await mailbox.put(f"rounds/{i}.json", b"unaffected")
        return outcomes

    assert asyncio.run(body()) == [
        "ok",
        "injected fault: put of 'payloads/1/a' (matching call #2)",
        "injected fault: put of 'payloads/2/a' (matching call #3)",
        "ok",
        "ok",
    ]
    assert asyncio.run(mailbox.list("payloads/")) == [
        "payloads/0/a",
        "payloads/3/a",
        "payloads/4/a",
    ]
    assert len(asyncio.run(mailbox.list("rounds/"))) == 5
    assert [rule.fired for rule in plan.rules] == [2]


def test_fail_after_the_write_landed_and_custom_errors() -> None:
    plan = (
        FaultPlan()
        .fail("create", "claims/*", after=True)
        .fail("get", "rounds/*", times=None, error=TimeoutError)
        .fail("*", "boom", error=ConnectionResetError("peer reset"))
    )
    inner = MemoryMailbox()
    mailbox = FaultyMailbox(inner, plan)

    async def body() -> None:
        with pytest.raises(MailboxError, match=r"injected fault: create of 'claims/0'"):
            await mailbox.create("claims/0", b"landed")
        assert await inner.get("claims/0") == b"landed"  # the answer was lost, not the write
        assert await mailbox.create("claims/0", b"again") is False
        await inner.put("rounds/0.json", b"{}")
        for _ in range(3):
            with pytest.raises(TimeoutError, match=r"get of 'rounds/0.json'"):
                await mailbox.get("rounds/0.json")
        with pytest.raises(ConnectionResetError, match="peer reset"):
            await mailbox.delete("boom")

    asyncio.run(body())


def test_delay_sleeps_on_the_given_clock() -> None:
    clock = FakeClock()
    plan = FaultPlan().delay("get", "rounds/*", 5.0, clock).delay("list", "leases/", 1.5, clock)
    mailbox = FaultyMailbox(MemoryMailbox(), plan)

    async def body() -> None:
        await mailbox.put("rounds/0.json", b"{}")
        assert clock.now() == 0.0
        assert await mailbox.get("rounds/0.json") == b"{}"
        assert await mailbox.get("rounds/1.json") is None
        assert clock.now() == 10.0
        await mailbox.get("theta/x")
        await mailbox.list("leases/")
        await mailbox.list("rounds/")
        assert clock.now() == 11.5

    asyncio.run(body())


def test_corrupt_and_truncate_gets() -> None:
    plan = FaultPlan().corrupt("payloads/*").truncate("theta/*", 3, nth=2, times=1)
    inner = MemoryMailbox()
    mailbox = FaultyMailbox(inner, plan)
    blob = bytes(range(100))

    async def body() -> None:
        for key in ("payloads/a", "theta/a", "other"):
            await inner.put(key, blob)
        await inner.put("payloads/empty", b"")
        corrupted = await mailbox.get("payloads/a")
        assert corrupted is not None and len(corrupted) == len(blob)
        assert [i for i in range(100) if corrupted[i] != blob[i]] == [0, 50, 99]
        assert await mailbox.get("payloads/empty") == b""
        assert await mailbox.get("theta/a") == blob  # the 1st matching get is spared
        assert await mailbox.get("theta/a") == blob[:3]
        assert await mailbox.get("theta/a") == blob
        assert await mailbox.get("other") == blob
        assert await inner.get("payloads/a") == blob  # the stored object is intact

    asyncio.run(body())


def test_drop_create_condition_overwrites(any_mailbox: Mailbox) -> None:
    mailbox = FaultyMailbox(any_mailbox, FaultPlan().drop_create_condition("claims/*"))

    async def body() -> None:
        assert await mailbox.create("claims/0", b"first") is True
        assert await mailbox.create("claims/0", b"second") is True
        assert await mailbox.get("claims/0") == b"second"
        assert await mailbox.create("rounds/0.json", b"a") is True
        assert await mailbox.create("rounds/0.json", b"b") is False

    asyncio.run(body())


def test_plan_rules_validated() -> None:
    with pytest.raises(ConfigError) as info:
        FaultPlan().fail("post")
    assert str(info.value) == ("fault op 'post' is not one of ('get', 'get_range', 'put', "
                               "'create', 'list', 'delete') or '*'")
    with pytest.raises(ConfigError, match=r"fault nth=0 and times=1 must be >= 1"):
        FaultPlan().fail("put", nth=0)


def test_a_ranged_read_is_counted_as_one_get_of_the_range_only() -> None:
    import asyncio

    from gradientmail.mailbox import MemoryMailbox
    from gradientmail.mailbox.wrappers import CountingMailbox

    async def go() -> tuple[bytes | None, int, int]:
        box = CountingMailbox(MemoryMailbox())
        await box.put("k", bytes(range(100)))
        box.reset()
        data = await box.get_range("k", 10, 20)
        c = box.snapshot()
        return data, c.get, c.bytes_down

    assert asyncio.run(go()) == (bytes(range(10, 20)), 1, 10)


def test_a_ranged_read_is_a_get_to_a_plan_and_get_range_names_it_alone() -> None:
    # "get" faults ranged and full reads alike, each ranged read one matching call (what
    # plans saw when each ranged read was a full get); "get_range" faults ranged reads.
    plan = (FaultPlan()
            .fail("get", "theta/*", nth=2, times=2)
            .fail("get_range", "steps/*", times=None))
    inner = MemoryMailbox()
    mailbox = FaultyMailbox(inner, plan)

    async def body() -> list[str]:
        for key in ("theta/a", "steps/a"):
            await inner.put(key, bytes(range(10)))
        outcomes = []
        calls = [("range", "theta/a"), ("full", "theta/a"), ("range", "theta/a"),
                 ("range", "theta/a"), ("full", "steps/a"), ("range", "steps/a"),
                 ("range", "steps/a")]
        for how, key in calls:
            try:
                got = await (mailbox.get_range(key, 2, 5) if how == "range"
                             else mailbox.get(key))
                outcomes.append(f"{how} {got!r}")
            except MailboxError as exc:
                outcomes.append(str(exc))
        return outcomes

    assert asyncio.run(body()) == [
        "range b'\\x02\\x03\\x04'",
        "injected fault: get of 'theta/a' (matching call #2)",
        "injected fault: get_range of 'theta/a' bytes [2, 5) (matching call #3)",
        "range b'\\x02\\x03\\x04'",
        f"full {bytes(range(10))!r}",
        "injected fault: get_range of 'steps/a' bytes [2, 5) (matching call #1)",
        "injected fault: get_range of 'steps/a' bytes [2, 5) (matching call #2)",
    ]
    assert [(rule.matched, rule.fired) for rule in plan.rules] == [(4, 2), (2, 2)]


def test_a_ranged_read_fails_after_its_read_and_misuse_is_refused_first() -> None:
    plan = FaultPlan().fail("get_range", "k", after=True, error=TimeoutError)
    counting = CountingMailbox(MemoryMailbox())
    mailbox = FaultyMailbox(counting, plan)

    async def body() -> None:
        await mailbox.put("k", b"abcdef")
        counting.reset()
        with pytest.raises(LocalProtocolError, match=r"byte range \[3, 1\) of key 'k'"):
            await mailbox.get_range("k", 3, 1)
        assert plan.rules[0].matched == 0  # a misused call is no store call to fault
        with pytest.raises(TimeoutError, match=r"get_range of 'k' bytes \[1, 4\)"):
            await mailbox.get_range("k", 1, 4)
        assert await mailbox.get_range("k", 1, 4) == b"bcd"

    asyncio.run(body())
    # The failed read happened (its answer was lost): two GETs of 3 bytes each.
    assert (counting.snapshot().get, counting.snapshot().bytes_down) == (2, 6)


def test_corrupt_truncate_and_delay_on_ranged_reads() -> None:
    clock = FakeClock()
    plan = (FaultPlan()
            .corrupt("payloads/*")
            .truncate("theta/*", 30)
            .delay("get_range", "steps/*", 2.0, clock))
    inner = MemoryMailbox()
    mailbox = FaultyMailbox(inner, plan)
    blob = bytes(range(100))

    async def body() -> None:
        for key in ("payloads/a", "theta/a", "steps/a"):
            await inner.put(key, blob)
        # Corrupt flips the first, middle and last bytes of the range returned.
        got = await mailbox.get_range("payloads/a", 10, 20)
        assert got is not None and len(got) == 10
        assert [i for i in range(10) if got[i] != blob[10 + i]] == [0, 5, 9]
        assert await mailbox.get_range("payloads/a", 100, 120) == b""
        # Truncate cuts the object at 30 bytes: a range across the cut ends there, one
        # after it is empty, one before it is whole. As a full get truncated, then sliced.
        assert await mailbox.get_range("theta/a", 20, 40) == blob[20:30]
        assert await mailbox.get_range("theta/a", 40, 50) == b""
        assert await mailbox.get_range("theta/a", 0, 10) == blob[:10]
        full = await mailbox.get("theta/a")
        assert full is not None and full[20:40] == blob[20:30]
        assert await mailbox.get_range("theta/gone", 0, 10) is None
        # Delays a ranged read, not a full one.
        assert await mailbox.get_range("steps/a", 0, 3) == blob[:3]
        assert await mailbox.get("steps/a") == blob
        assert clock.now() == 2.0
        assert await inner.get("payloads/a") == blob  # the stored objects are intact
        assert await inner.get("theta/a") == blob

    asyncio.run(body())
