"""Mailbox wrappers: `CountingMailbox`, the library's meter, and `FaultyMailbox`.

`CountingMailbox` counts requests the way S3 bills them (a `list` costs one LIST per page
of 1,000 keys) and the bytes that travel; every `Learner` wraps its mailbox in one
(`Learner.traffic`), and tests and benchmarks use it as they like. `FaultyMailbox` injects
the faults a real store produces, from a small plan:

    plan = (FaultPlan()
            .fail("put", "payloads/*", nth=2)            # the 2nd matching put fails
            .delay("get", "rounds/*", 5.0, clock)        # every matching get waits 5 s
            .corrupt("theta/*")                          # gets return flipped bytes
            .drop_create_condition())                    # create acts like put
    mailbox = FaultyMailbox(MemoryMailbox(), plan)

Patterns are `fnmatch` globs over keys (over the prefix, for `list`); `*` crosses '/'.
A ranged read (`get_range`) is a GET: a rule for "get" faults it as it faults a full read
(so do `corrupt` and `truncate`), and a rule for "get_range" faults ranged reads alone.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import threading

from gradientmail.clock import Clock, MonotonicClock
from gradientmail.errors import ConfigError, MailboxError
from gradientmail.mailbox.base import Mailbox, check_range
from gradientmail.traffic import RequestCounts

__all__ = ["OPS", "CountingMailbox", "FaultPlan", "FaultRule", "FaultyMailbox"]

#: The operations a rule may name ("*" names all of them; "get" names "get_range" too).
OPS = ("get", "get_range", "put", "create", "list", "delete")
_LIST_PAGE = 1000
_FIELDS = tuple(f.name for f in dataclasses.fields(RequestCounts))


class CountingMailbox(Mailbox):
    """Passes every call to `inner` and counts it; `snapshot()` reads, `reset()` zeroes.

    Requests are counted whether they succeed or fail, as a store would bill them; bytes
    up when sent, bytes down when received. Safe from any thread: a learner's training
    thread reads it while the communication thread counts. A count is a few integer
    additions under a lock, nothing next to the request it counts.
    """

    def __init__(self, inner: Mailbox) -> None:
        self.inner = inner
        self.url = inner.url
        self.metered = inner.metered
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_FIELDS, 0)

    def snapshot(self) -> RequestCounts:
        with self._lock:
            return RequestCounts(**self._counts)

    def reset(self) -> RequestCounts:
        """Zero the counts; return what they were."""
        with self._lock:
            counts = RequestCounts(**self._counts)
            self._counts = dict.fromkeys(_FIELDS, 0)
            return counts

    def _add(self, **deltas: int) -> None:
        with self._lock:
            counts = self._counts
            for name, n in deltas.items():
                counts[name] += n

    async def get(self, key: str) -> bytes | None:
        self._add(get=1)
        data = await self.inner.get(key)
        if data is not None:
            self._add(bytes_down=len(data))
        return data

    async def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        # A ranged GET is billed as a GET; only the range travels.
        self._add(get=1)
        data = await self.inner.get_range(key, start, stop)
        if data is not None:
            self._add(bytes_down=len(data))
        return data

    async def put(self, key: str, data: bytes) -> None:
        self._add(put=1, bytes_up=len(data))
        await self.inner.put(key, data)

    async def create(self, key: str, data: bytes) -> bool:
        self._add(put=1, create=1, bytes_up=len(data))
        return await self.inner.create(key, data)

    async def list(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        try:
            keys = await self.inner.list(prefix, start_after)
        except BaseException:
            self._add(list=1)
            raise
        self._add(list=max(1, math.ceil(len(keys) / _LIST_PAGE)))
        return keys

    async def delete(self, key: str) -> None:
        self._add(delete=1)
        await self.inner.delete(key)

    async def close(self) -> None:
        await self.inner.close()


@dataclasses.dataclass
class FaultRule:
    """One fault: which calls it matches, what it does, and how often it has fired.

    A rule matches calls of `op` ("*" for any) whose key matches `pattern`; it fires on
    the `nth` matching call and the `times - 1` matching calls after it (`times=None`:
    every matching call from the nth on). A rule for "get" matches ranged reads too: S3
    bills a ranged GET as a GET, and before `FaultyMailbox` served ranges itself each one
    was a full `get`, which plans written then expect to fault.
    """

    kind: str  # "fail" | "delay" | "corrupt" | "truncate" | "drop_create_condition"
    op: str
    pattern: str
    nth: int = 1
    times: int | None = 1
    error: type[BaseException] | BaseException = MailboxError
    after: bool = False
    seconds: float = 0.0
    clock: Clock | None = None
    length: int = 0
    matched: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.op != "*" and self.op not in OPS:
            raise ConfigError(f"fault op {self.op!r} is not one of {OPS} or '*'")
        if self.nth < 1 or (self.times is not None and self.times < 1):
            raise ConfigError(f"fault nth={self.nth} and times={self.times} must be >= 1")

    def hit(self, op: str, key: str) -> bool:
        """Count a call; True when this rule fires on it. Callers hold the plan's lock."""
        ops = ("*", op, "get") if op == "get_range" else ("*", op)
        if not (self.op in ops and fnmatch.fnmatchcase(key, self.pattern)):
            return False
        self.matched += 1
        if self.matched < self.nth:
            return False
        if self.times is not None and self.matched >= self.nth + self.times:
            return False
        self.fired += 1
        return True


class FaultPlan:
    """A list of `FaultRule`s built by chaining; every builder method returns the plan.

    Operations are the Mailbox's methods. A ranged read is "get_range", and a rule for
    "get" matches it as well as full reads, counting each ranged read as one matching
    call (what a plan written before ranged reads saw, as each was one full `get`): a
    sharded learner's ranged reads of a commit fail under `fail("get", "theta/*")` as
    a whole learner's full reads do. `fail("get_range", ...)` faults ranged reads alone.
    On a ranged read, `corrupt` flips bits in the returned range (its first, middle and
    last bytes), and `truncate` acts on the object: the range is cut at `length` bytes
    from the object's start, as if the object itself were cut there.
    """

    def __init__(self) -> None:
        self.rules: list[FaultRule] = []
        self._lock = threading.Lock()

    def fail(
        self,
        op: str,
        pattern: str = "*",
        *,
        nth: int = 1,
        times: int | None = 1,
        error: type[BaseException] | BaseException = MailboxError,
        after: bool = False,
    ) -> FaultPlan:
        """Raise `error` from matching calls; with `after=True` the call happens first
        (a write that landed but whose answer was lost)."""
        self.rules.append(FaultRule("fail", op, pattern, nth, times, error=error, after=after))
        return self

    def delay(
        self,
        op: str,
        pattern: str,
        seconds: float,
        clock: Clock | None = None,
        *,
        nth: int = 1,
        times: int | None = None,
    ) -> FaultPlan:
        """Sleep `seconds` on `clock` (default: the real one) before matching calls."""
        self.rules.append(FaultRule("delay", op, pattern, nth, times, seconds=seconds, clock=clock))
        return self

    def corrupt(self, pattern: str = "*", *, nth: int = 1, times: int | None = None,
                op: str = "get") -> FaultPlan:
        """Flip bits in the objects matching gets return (an empty object stays empty), or
        in the range a matching ranged read returns; `op="get_range"` corrupts ranged
        reads alone."""
        if op not in ("get", "get_range"):
            raise ConfigError(f"corrupt op={op!r} must be 'get' or 'get_range'")
        self.rules.append(FaultRule("corrupt", op, pattern, nth, times))
        return self

    def truncate(
        self, pattern: str, length: int, *, nth: int = 1, times: int | None = None
    ) -> FaultPlan:
        """Matching gets return only the first `length` bytes (a ranged read: the part of
        its range before byte `length` of the object)."""
        self.rules.append(FaultRule("truncate", "get", pattern, nth, times, length=length))
        return self

    def drop_create_condition(self, pattern: str = "*") -> FaultPlan:
        """create overwrites and returns True, like a proxy that drops If-None-Match."""
        self.rules.append(FaultRule("drop_create_condition", "create", pattern, 1, None))
        return self

    def firing(self, op: str, key: str) -> list[FaultRule]:
        """The rules that fire on this call (each rule counts it)."""
        with self._lock:
            return [rule for rule in self.rules if rule.hit(op, key)]


def _flip(data: bytes) -> bytes:
    if not data:
        return data
    out = bytearray(data)
    for i in {0, len(out) // 2, len(out) - 1}:
        out[i] ^= 0x5A
    return bytes(out)


class FaultyMailbox(Mailbox):
    """Passes calls to `inner`, applying the faults of `plan` to the calls they match."""

    def __init__(self, inner: Mailbox, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self.url = inner.url
        self.metered = inner.metered

    async def _before(self, op: str, key: str, where: str = "") -> list[FaultRule]:
        rules = self.plan.firing(op, key)
        for rule in rules:
            if rule.kind == "delay":
                await (rule.clock or MonotonicClock()).sleep(rule.seconds)
        for rule in rules:
            if rule.kind == "fail" and not rule.after:
                raise _error(rule, op, key, where)
        return rules

    @staticmethod
    def _after(rules: list[FaultRule], op: str, key: str, where: str = "") -> None:
        for rule in rules:
            if rule.kind == "fail" and rule.after:
                raise _error(rule, op, key, where)

    async def get(self, key: str) -> bytes | None:
        rules = await self._before("get", key)
        data = await self.inner.get(key)
        self._after(rules, "get", key)
        if data is not None:
            for rule in rules:
                if rule.kind == "corrupt":
                    data = _flip(data)
                elif rule.kind == "truncate":
                    data = data[: rule.length]
        return data

    async def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        check_range(key, start, stop)  # a misused API is refused before any fault
        where = f" bytes [{start}, {stop})"
        rules = await self._before("get_range", key, where)
        data = await self.inner.get_range(key, start, stop)
        self._after(rules, "get_range", key, where)
        if data is not None:
            for rule in rules:
                if rule.kind == "corrupt":
                    data = _flip(data)
                elif rule.kind == "truncate":
                    data = data[: max(0, rule.length - start)]
        return data

    async def put(self, key: str, data: bytes) -> None:
        rules = await self._before("put", key)
        await self.inner.put(key, data)
        self._after(rules, "put", key)

    async def create(self, key: str, data: bytes) -> bool:
        rules = await self._before("create", key)
        if any(rule.kind == "drop_create_condition" for rule in rules):
            await self.inner.put(key, data)
            created = True
        else:
            created = await self.inner.create(key, data)
        self._after(rules, "create", key)
        return created

    async def list(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        rules = await self._before("list", prefix)
        keys = await self.inner.list(prefix, start_after)
        self._after(rules, "list", prefix)
        return keys

    async def delete(self, key: str) -> None:
        rules = await self._before("delete", key)
        await self.inner.delete(key)
        self._after(rules, "delete", key)

    async def close(self) -> None:
        await self.inner.close()


def _error(rule: FaultRule, op: str, key: str, where: str = "") -> BaseException:
    if isinstance(rule.error, BaseException):
        return rule.error
    return rule.error(f"injected fault: {op} of {key!r}{where} (matching call #{rule.matched})")
