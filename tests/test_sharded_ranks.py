"""A learner whose ranks each mail their own rows (`ShardedRanks` under `RankSync`), with
ranks as threads (`ThreadRanks` for both the default and the side group): a 2-rank
learner that splits its upload, next to a plain learner, is standard DiLoCo's oracle; its
rounds are made of parts, one per rank, and its ranks end on the same parameters.

The same with real processes, FSDP2 and gloo: tests/test_sharded_oracle.py.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import threading
from typing import Any

import pytest
import torch
from test_learner_oracle import INNER_LR, ROUNDS, H, oracle
from test_learner_runtime import in_threads
from workers.toy import inner_step, make_model

from gradientmail.adapters import TorchAdapter
from gradientmail.adapters.sharded import ShardedAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.integration import RankSync, ThreadRanks
from gradientmail.integration.sharded import ShardedRanks
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import MemoryMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import state_at
from gradientmail.wire.sharded_ranges import rows_of

RANKS = 2
TIMEOUT = 120.0


def standard(**kw: Any) -> DiLoCo:
    return DiLoCo(sync_every=H, fragments=1, in_flight=1, overlap_steps=0,
                  merge=WeightedMean(), quorum_size=2, **kw)


def learner(adapter: Any, url: str, name: str, compression: str = "off",
            **kw: Any) -> Learner:
    return Learner(
        adapter,
        standard(**kw),
        url,
        name,
        options=LearnerOptions(
            poll_interval=0.01,
            lease_every=5.0,
            lease_timeout=30.0,
            compression=compression,
        ),
    )


def start_rank(k: int, model: torch.nn.Module, default: Any, side: Any, url: str,
               **alg: Any) -> tuple[RankSync, ShardedRanks]:
    """Rank `k` of the two-rank learner "ranked" on `url` (thread ranks `default` and
    `side`), started."""
    adapter = ShardedAdapter(model, group_size=RANKS, group_rank=k)
    sharded_ranks = ShardedRanks(adapter, default[k], side[k], k, url, timeout=TIMEOUT)
    sync = RankSync(default[k], model, sharded_ranks=sharded_ranks)
    sync.start(lambda: learner(sharded_ranks.learner_adapter(), url, "ranked", **alg))
    return sync, sharded_ranks


def train_ranked(sync: RankSync, model: torch.nn.Module, ready: threading.Barrier) -> None:
    """A rank of the two-rank learner, started: once the plain learner is in, `ROUNDS`
    rounds on worker 0's data (both ranks train alike, 5 tokens a step each), closed."""
    ready.wait(timeout=TIMEOUT)
    sync.wait_for_learners(2, timeout=TIMEOUT)
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    for step in range(ROUNDS * H):
        inner_step(model, opt, 0, step)
        sync.step(5)
    sync.close()


def train_plain(one: Learner, model: torch.nn.Module,
                ready: threading.Barrier) -> list[torch.Tensor]:
    """The plain learner beside the two ranks, started: `ROUNDS` rounds on worker 1's data
    (10 tokens a step: as many as the two ranks together), closed; its parameters."""
    ready.wait(timeout=TIMEOUT)
    one.wait_for_learners(2, timeout=TIMEOUT)
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    for step in range(ROUNDS * H):
        inner_step(model, opt, 1, step)
        one.step(10)
    one.close()
    return [p.detach().clone() for p in model.parameters()]


# checkpoint_every=1: every commit carries its theta, which each rank reads by rows; the
# default replicates the outer step, and rank 0 hands each rank its rows of the state.
@pytest.mark.parametrize("alg", [{"checkpoint_every": 1}, {}], ids=["rows", "replicated"])
def test_a_two_rank_learner_mailing_parts_and_a_plain_one_equal_the_oracle(
        alg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"memory://sharded-{secrets.token_hex(4)}"
    # How many earlier snapshots each rank still holds as it takes one: none (standard
    # DiLoCo, one round in flight), so a fragment's snapshot never coexists with the last.
    snapshots: dict[int, set[int]] = {k: set() for k in range(RANKS)}
    overlapping: dict[int, list[int]] = {k: [] for k in range(RANKS)}
    replay = ShardedRanks._replay

    def counted(self: ShardedRanks, kind: str, args: Any, released: Any) -> None:
        if kind == "snapshot":
            live = snapshots[self.rank] & (set(self._store) - set(released))
            overlapping[self.rank].append(len(live))
            snapshots[self.rank].add(args[0])
        replay(self, kind, args, released)

    monkeypatch.setattr(ShardedRanks, "_replay", counted)
    default = ThreadRanks.group(RANKS, timeout=TIMEOUT)
    side = ThreadRanks.group(RANKS, timeout=TIMEOUT)
    # Built one after the other: make_model seeds torch's global generator.
    models = [make_model() for _ in range(RANKS + 1)]
    results: dict[str, list[torch.Tensor]] = {}
    ready = threading.Barrier(RANKS + 1)
    rows: dict[int, Any] = {}

    def rank(k: int) -> None:
        model = models[k]
        sync, sharded_ranks = start_rank(k, model, default, side, url, **alg)
        train_ranked(sync, model, ready)
        assert sync.rounds_seen == ROUNDS - 1
        # The anchor of the one fragment, and a snapshot kept for rebasing at most: every
        # other snapshot and commit was released on every rank.
        assert sharded_ranks.held <= 2, sharded_ranks.held
        results[f"rank{k}"] = [p.detach().clone() for p in model.parameters()]
        adapter = sharded_ranks.adapter
        rows[k] = (sharded_ranks.rows_state(0),
                   {n: adapter.local_rows(n) for n in adapter.schema.names})

    def plain() -> None:
        model = models[RANKS]
        one = learner(TorchAdapter(model), url, "plain", **alg)
        one.start()
        results["plain"] = train_plain(one, model, ready)

    in_threads(*(functools.partial(rank, k) for k in range(RANKS)), plain, timeout=240)
    assert overlapping == {k: [0] * ROUNDS for k in range(RANKS)}, overlapping
    want = oracle()
    for who, got in results.items():
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6, msg=who)
    async def contributions() -> list[Any]:
        ex = Exchange(MemoryMailbox(url.split("//")[1]))
        recs = await ex.rounds_after(-1)
        assert [sorted(p.learner for p in r.participants) for r in recs] == \
            [["plain", "ranked"]] * ROUNDS
        assert all(r.theta is not None for r in recs) == ("checkpoint_every" in alg)
        if "checkpoint_every" not in alg:
            # Each rank replayed the outer step on its own rows: byte for byte the rows
            # of the state the run's closer computed.
            whole = await state_at(ex, 0, recs[-1])
            for k, (mine, held) in rows.items():
                assert mine is not None and mine.version == whole.version, k
                for part, full in ((mine.theta, whole.theta), (mine.momentum, whole.momentum)):
                    for n, t in part.items():
                        want = rows_of(full[n], *held[n]).tensor
                        assert bytes(t.buffer) == bytes(want.buffer), (k, n)
        else:
            assert all(mine is None for mine, _ in rows.values())
        return [await ex.contribution(r, "ranked") for r in range(ROUNDS)]

    for snap in asyncio.run(contributions()):
        assert snap is None or [ref.key.rsplit("/", 1)[1] for ref in snap.parts] == \
            ["0-of-2.safetensors", "1-of-2.safetensors"]


def test_a_mesh_that_does_not_span_the_learner_is_refused() -> None:
    import os
    import tempfile

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from gradientmail.errors import ConfigError
    from gradientmail.integration.sharded import check_meshes, is_sharded

    store = tempfile.mktemp(prefix="gm-mesh-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        model = make_model()
        assert not is_sharded(model)
        fully_shard(model)  # over the default mesh: this one rank
        assert is_sharded(model)
        check_meshes(model, 1)
        # What a learner of 2 ranks sees when each shards over a mesh of its own (say
        # Lightning's data_parallel dimension of size 1 with 2 tensor-parallel ranks).
        with pytest.raises(ConfigError) as info:
            check_meshes(model, 2)
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.unlink(store)
    assert str(info.value).startswith(
        "parameter '0.weight' is sharded over a device mesh of 1 ranks (shape [1]), but the "
        "learner has 2: shard over all of its ranks"
    )


class Recording(ShardedRanks):
    """A rank's `ShardedRanks` that notes the kind of every side command it serves."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.served: list[str] = []

    def _share(self, cmd: tuple[Any, ...]) -> Any:
        self.served.append(cmd[0])
        return super()._share(cmd)

    async def _serve(self, cmd: tuple[Any, ...], ex: Exchange) -> Any:
        self.served.append(cmd[0])
        return await super()._serve(cmd, ex)


class ReadLog(ShardedAdapter):
    """A `ShardedAdapter` that notes the rows each `read` returned."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.reads: list[dict[str, tuple[int, int]]] = []

    def read(self, names: Any = None) -> dict[str, Any]:
        got = super().read(names)
        self.reads.append({n: (r.start, r.stop) for n, r in got.items()})
        return got


@pytest.mark.parametrize(("alg", "compression"), [
    ({"checkpoint_every": 1}, "off"), ({}, "off"), ({}, "zstd")],
    ids=["rows", "replicated", "replicated-zstd"])
def test_a_two_rank_creator_uploads_theta0_by_parts_and_a_plain_learner_joins_on_it(
        alg: dict[str, Any], compression: str) -> None:
    """The 2-rank learner creates the run: each rank uploads its owned rows of Θ⁰ as its
    part (no rank gathers or joins them: no `read` command is ever served, and every
    rank reads its own rows, a tensor at a time; uncompressed, whatever the learner's
    codec); the manifest names the parts. A plain
    learner built with other parameters joins at version 0 on exactly the creator's;
    the rounds closed from that Θ⁰ equal the oracle, and verify re-derives every one."""
    url = f"memory://sharded-init-{secrets.token_hex(4)}"
    default = ThreadRanks.group(RANKS, timeout=TIMEOUT)
    side = ThreadRanks.group(RANKS, timeout=TIMEOUT)
    models = [make_model() for _ in range(RANKS)] + [make_model(seed=3)]
    theta0 = [p.detach().clone() for p in models[0].parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(theta0, models[RANKS].parameters(),
                                                     strict=True))
    created = threading.Event()
    ready = threading.Barrier(RANKS + 1)
    results: dict[str, list[torch.Tensor]] = {}
    sets: dict[int, Recording] = {}
    joined: list[torch.Tensor] = []
    kw = dict(alg, keep_rounds=100)  # every contribution kept: verify re-derives them

    def rank(k: int) -> None:
        model = models[k]
        adapter = ReadLog(model, group_size=RANKS, group_rank=k)
        sharded_ranks = sets[k] = Recording(adapter, default[k], side[k], k, url, timeout=TIMEOUT,
                                      compression=compression)
        sync = RankSync(default[k], model, sharded_ranks=sharded_ranks)
        sync.start(lambda: learner(sharded_ranks.learner_adapter(), url, "ranked",
                                   compression=compression, **kw))
        created.set()
        train_ranked(sync, model, ready)
        results[f"rank{k}"] = [p.detach().clone() for p in model.parameters()]

    def plain() -> None:
        assert created.wait(timeout=TIMEOUT)
        model = models[RANKS]
        one = learner(TorchAdapter(model), url, "plain", **kw)
        one.start()
        joined.extend(p.detach().clone() for p in model.parameters())
        results["plain"] = train_plain(one, model, ready)

    in_threads(*(functools.partial(rank, k) for k in range(RANKS)), plain, timeout=240)
    for got, want in zip(joined, theta0, strict=True):
        assert torch.equal(got, want)  # the creator's Θ⁰, exactly
    for who, got in results.items():
        for g, w in zip(got, oracle(), strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6, msg=who)
    for k, ranks in sets.items():
        assert "init" in ranks.served and "read" not in ranks.served, (k, ranks.served)
        adapter = ranks.adapter
        assert isinstance(adapter, ReadLog)
        # Its own rows, one tensor per read: no rank ever held more of Θ⁰ than that.
        assert adapter.reads and all(len(r) == 1 for r in adapter.reads)
        assert all(rows == adapter.mailed(list(rows)) for rows in adapter.reads)

    async def check() -> None:
        from gradientmail.app.verify import verify_run
        from gradientmail.wire.compression import decode_with_metadata
        from gradientmail.wire.sharded_parts import rows_in

        box = MemoryMailbox(url.split("//")[1])
        ex = Exchange(box)
        manifest = await ex.read_manifest()
        assert manifest is not None and manifest.creator == "ranked"
        assert manifest.init == (None,) and manifest.codec == compression
        # Uncompressed whatever the learner's codec: its ranks read their rows by ranges.
        assert [ref.key for ref in manifest.init_parts[0]] == [
            "init/000000/0/0-of-2.safetensors", "init/000000/0/1-of-2.safetensors"]
        for k, ref in enumerate(manifest.init_parts[0]):
            blob = await ex.store.fetch_payload(ref)
            assert blob is not None
            _, meta = decode_with_metadata(blob, "off")
            assert rows_in(meta, ref.key) == sets[k].adapter.mailed(manifest.plan[0])
        theta = await ex.fetch_init(manifest, 0)
        assert theta is not None
        names = list(manifest.plan[0])
        for name, want in zip(names, theta0, strict=True):
            assert bytes(theta[name].buffer) == want.numpy().tobytes()
        report = await verify_run(ex, url)
        assert report.ok and [v.status for v in report.rounds] == ["verified"] * ROUNDS

    asyncio.run(check())


class _Counted:
    """A rank's default-group collectives, counting the broadcasts the training channel
    makes."""

    def __init__(self, inner: ThreadRanks) -> None:
        self.inner = inner
        self.ints = 0
        self.objects = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def broadcast_ints(self, values: Any) -> list[int]:
        self.ints += 1
        return self.inner.broadcast_ints(values)

    def broadcast_object(self, obj: Any) -> Any:
        self.objects += 1
        return self.inner.broadcast_object(obj)


def test_an_op_is_one_broadcast_once_its_names_are_known_and_the_control_closes_them() -> None:
    default = [_Counted(r) for r in ThreadRanks.group(RANKS, timeout=TIMEOUT)]
    side = ThreadRanks.group(RANKS, timeout=TIMEOUT)
    models = [make_model() for _ in range(RANKS)]
    names = [n for n, _ in models[0].named_parameters()]
    tail = [7, -1, 3]
    seen: dict[int, Any] = {}

    def rank(k: int) -> None:
        adapter = ShardedAdapter(models[k], group_size=RANKS, group_rank=k)
        sharded_ranks = ShardedRanks(adapter, default[k], side[k], k, "memory://ops",
                                     timeout=TIMEOUT)
        ones = {n: torch.ones_like(adapter.local(n)) for n in names}
        sharded_ranks._keep(100, ones)  # loaded values, as a commit's would be on every rank
        counts = []
        if k == 0:
            for step in range(3):
                sharded_ranks.ops_tail(len(tail))
                if step < 2:
                    sharded_ranks.op("snapshot", 10 + step, names[:2])
                else:
                    sharded_ranks.op("apply", 100, 0.3)
                    for i in range(5):  # more releases than a message holds
                        sharded_ranks._drop(i)
                    sharded_ranks.op("release")
                counts.append((default[k].ints, default[k].objects))
                assert sharded_ranks.end_ops(tail) == tail
        else:
            for _ in range(3):
                assert sharded_ranks.serve_ops([0, 0, 0]) == tail
                counts.append((default[k].ints, default[k].objects))
        seen[k] = counts, {i: sharded_ranks._store.get(i) for i in (10, 11)}

    before = {k: [p.detach().clone() for p in models[k].parameters()] for k in range(RANKS)}
    in_threads(*(functools.partial(rank, k) for k in range(RANKS)), timeout=60)
    # Counted on rank 0 after each step's ops (ints, objects): the first snapshot of a
    # name list sends it (a header and an object), the second only its number (one
    # message); the apply's mixing rides in the ints, exactly; more releases than fit go
    # as an object. Each step's end message (carrying the tail) is one message more.
    assert seen[0][0] == [(1, 1), (3, 1), (6, 2)], seen[0][0]
    assert seen[1][0] == [(2, 1), (4, 1), (7, 2)], seen[1][0]
    for k in range(RANKS):
        snaps = seen[k][1]
        for i in (10, 11):  # both snapshots taken, of the parameters before the apply
            assert list(snaps[i]) == names[:2]
            for n, was in zip(names[:2], before[k], strict=False):
                assert torch.equal(snaps[i][n], was), (k, i, n)
        for p, was in zip(models[k].parameters(), before[k], strict=True):
            torch.testing.assert_close(p.detach(), 0.3 * was + 0.7, rtol=0, atol=1e-6)
