"""A learner's meter (`Learner.traffic`, `TrafficMeasured`): what it counts is what the
learner wrote and read, checked against the records it left in the store."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from test_learner_runtime import FAST, Recorder, all_records, in_threads, make_model
from test_learner_runtime import train_step as sgd_step

from gradientmail import events as ev
from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.app.record_traffic import follow_bytes
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import Mailbox, MemoryMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.traffic import GIB, Prices, RequestCounts


class Inventory(Mailbox):
    """Passes every call on and notes (operation, key, bytes) of each."""

    def __init__(self, inner: Mailbox) -> None:
        self.inner = inner
        self.url = inner.url
        self.calls: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()

    def _note(self, op: str, key: str, n: int = 0) -> None:
        with self._lock:
            self.calls.append((op, key, n))

    async def get(self, key: str) -> bytes | None:
        data = await self.inner.get(key)
        self._note("get", key, 0 if data is None else len(data))
        return data

    async def put(self, key: str, data: bytes) -> None:
        self._note("put", key, len(data))
        await self.inner.put(key, data)

    async def create(self, key: str, data: bytes) -> bool:
        self._note("create", key, len(data))
        return await self.inner.create(key, data)

    async def list(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        self._note("list", prefix)
        return await self.inner.list(prefix, start_after)

    async def delete(self, key: str) -> None:
        self._note("delete", key)
        await self.inner.delete(key)


def test_the_meter_counts_what_the_learner_wrote_and_read() -> None:
    """Standard DiLoCo, two learners: "me" does not close rounds (sync=False), so what it
    writes is its lease, the conditional-write probe and its contributions, each kept in
    the store (`keep_rounds`); "other" closes every round."""
    store = MemoryMailbox()
    seen = Inventory(store)
    alg = DiLoCo.standard(4, 2, keep_rounds=100)
    mine, theirs = Recorder(), Recorder()
    models = [make_model(seed=0), make_model(seed=1)]
    me = Learner(
        TorchAdapter(models[0]),
        alg,
        seen,
        "me",
        on_event=mine,
        options=LearnerOptions(**FAST, sync=False),
    )
    other = Learner(
        TorchAdapter(models[1]),
        alg,
        store,
        "other",
        on_event=theirs,
        options=LearnerOptions(**FAST, keep_versions=1000, prices=Prices(egress_per_gb=0.0)),
    )
    assert me.traffic.counts == RequestCounts() and me.traffic.usd_per_hour is None
    other.start()  # the creator: "me" only joins
    me.start()
    ready = threading.Barrier(2)

    def train(learner: Learner, model: torch.nn.Module, seed: int) -> None:
        ready.wait(timeout=30)
        learner.wait_for_learners(2, timeout=30)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(14):
            sgd_step(model, opt, seed + step)
            learner.step(4)
        learner.close()

    in_threads(lambda: train(me, models[0], 0), lambda: train(other, models[1], 100))
    traffic = me.traffic
    c = traffic.counts

    # The meter saw every call the learner made, as the store below it did.
    ops = [op for op, _, _ in seen.calls]
    assert (c.get, c.create, c.put - c.create, c.list, c.delete) == (
        ops.count("get"), ops.count("create"), ops.count("put"), ops.count("list"),
        ops.count("delete"))
    assert c.bytes_down == sum(n for op, _, n in seen.calls if op == "get")
    assert min(c.get, c.create, c.put - c.create, c.list, c.delete) > 0

    # Bytes up: its contributions' payloads at the sizes their records (read back from the
    # store) name, the records themselves, the 16-byte probes; its leases are empty.
    records = all_records(store)
    assert len(records) >= 3 and all(len(r.participants) == 2 for r in records)

    async def mine_stored() -> tuple[int, int]:
        ex = Exchange(store)
        payloads = recorded = 0
        for rec in records:
            snap = await ex.contribution(rec.round, "me")
            assert snap is not None
            payloads += snap.payload.size
            raw = await store.get(f"snapshots/{rec.round:010d}/me.json")
            assert raw is not None
            recorded += len(raw)
        return payloads, recorded

    payloads, recorded = asyncio.run(mine_stored())
    written = {key.split("/")[0] for op, key, _ in seen.calls if op in ("put", "create")}
    assert written == {"selftest", "leases", "payloads", "snapshots"}
    assert c.bytes_up == payloads + recorded + 2 * 16
    assert payloads == sum(n for op, key, n in seen.calls
                           if op == "create" and key.startswith("payloads/"))

    # Bytes down: the commit payloads of every round it followed, among everything else.
    fetched = {key: n for op, key, n in seen.calls if op == "get"}
    for rec in records:
        follow = rec.step.payload if rec.step is not None else rec.theta
        assert follow is not None and fetched[follow.key] == follow_bytes(rec) > 0
    assert c.bytes_down > sum(follow_bytes(rec) for rec in records)

    # Priced at the defaults (S3 Standard, us-east-1), over its time on its clock.
    assert traffic.usd == pytest.approx(
        ((c.put + c.list) * 0.005 + c.get * 0.0004) / 1000 + c.bytes_down * 0.09 / GIB)
    assert traffic.seconds > 0
    assert traffic.usd_per_hour == pytest.approx(traffic.usd * 3600 / traffic.seconds)
    assert me.traffic == traffic  # closed: the span stops at close()

    # Its events: one per commit it applied, one on close, the last equal to the property.
    reports = mine.of(ev.TrafficMeasured)
    applied = [e.round for e in mine.of(ev.FragmentAligned)]
    assert [e.round for e in reports] == [*applied, me.rounds_seen]
    assert reports[-1].traffic == traffic
    counts = [e.traffic.counts.requests for e in reports]
    assert counts == sorted(counts)  # cumulative
    assert other.traffic.usd_egress == 0.0 and other.traffic.usd > 0  # its own prices

    # RoundClosed.bytes: every payload the closer wrote, at the stored objects' sizes.
    closed = {e.round: e.bytes for e in theirs.of(ev.RoundClosed)}
    assert sorted(closed) == [rec.round for rec in records]

    async def stored_size(key: str) -> int:
        data = await store.get(key)
        assert data is not None, key
        return len(data)

    for rec in records:
        sizes = [asyncio.run(stored_size(r.key)) for r in rec.payload_refs()]
        assert closed[rec.round] == sum(sizes) == sum(r.size for r in rec.payload_refs())


def test_prices_must_be_prices() -> None:
    from gradientmail.errors import ConfigError

    with pytest.raises(ConfigError, match=r"prices=0\.09 must be a gradientmail\.traffic\."
                                          r"Prices"):
        Learner(
            TorchAdapter(make_model()),
            DiLoCo.standard(4, 1),
            MemoryMailbox(),
            "x",
            options=LearnerOptions(prices=0.09),
        )  # type: ignore[arg-type]
