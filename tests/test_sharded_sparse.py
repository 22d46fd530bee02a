"""Sparse deltas from a sharded learner: each rank sparsifies its own rows with its own
error feedback, and the closer densifies each part at its rows and merges them as it
merges an unsharded learner's sparse delta (docs/design/sharded.md, "Sparse deltas").

Wire: parts encoded rank by rank read back (`pieces_of`) as the per-part dense rows;
where every part starts on a chunk boundary they are an unsharded learner's entries and
dense delta byte for byte, and SIGN1 selects the unsharded elements wherever the parts
start; hostile parts are refused. Feedback: the ranks' states join into an unsharded
learner's layout and split back. Learner (ranks as threads): a 2-rank learner mailing
sparse parts and a plain learner (TOPK_F8; TOPK_Q2; SIGN1 with feedback momentum) equal
a sparse oracle with error feedback per rank's rows, and the residuals they keep are the
oracle's.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import secrets
import threading
from typing import Any

import numpy as np
import pytest
import torch
from test_learner_oracle import INNER_LR, ROUNDS, H
from test_learner_runtime import in_threads
from test_sharded_ranks import RANKS, TIMEOUT, learner, start_rank, train_plain, train_ranked
from workers.toy import inner_step, make_model

from gradientmail.adapters import TorchAdapter
from gradientmail.adapters.sharded import ShardedAdapter, chunk_rows
from gradientmail.errors import CorruptPayload, GradientmailError, SchemaMismatch
from gradientmail.integration import ThreadRanks
from gradientmail.integration.sharded import ShardedRanks
from gradientmail.learner.feedback import Residuals, join_states, split_state
from gradientmail.learner.sharded import Sparse
from gradientmail.mailbox import MemoryMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.wire.compression import decode
from gradientmail.wire.serialization import ParameterSpec, Schema
from gradientmail.wire.sharded_parts import assemble
from gradientmail.wire.signs import shifted_seed
from gradientmail.wire.sparse import (
    CHUNK,
    chunk_counts,
    chunk_k,
    densify,
    sparse_nbytes,
    sparsify,
    sparsify_sent,
)
from gradientmail.wire.tensor_bytes import TensorBytes

FORMATS = ("TOPK_F8", "TOPK_Q2", "SIGN1")
DENSITY = {"TOPK_F8": 1 / 64, "TOPK_Q2": 1 / 64, "SIGN1": 0.3}


def delta_of(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def encoded_parts(x: np.ndarray, cuts: list[int], fmt: str, round_: int = 7
                  ) -> tuple[list[Any], list[Residuals]]:
    """The parts a learner whose ranks hold rows [cuts[i], cuts[i+1]) of tensor "w" sends,
    each encoded by its own `Residuals` (as each rank does), and those residuals."""
    cols = x.shape[1]
    parts, kept = [], []
    for k, (a, b) in enumerate(itertools.pairwise(cuts)):
        mine = Residuals("ranked")
        rows = x[a:b].reshape(-1)
        entries = mine.encode(round_, 0, {"w": TensorBytes("F32", (b - a, cols), rows.tobytes())},
                              DENSITY[fmt], fmt=fmt, offsets={"w": a * cols})
        parts.append((f"parts/{round_}/ranked/{k}-of-{len(cuts) - 1}", entries, {"w": (a, b)}))
        kept.append(mine)
    return parts, kept


def whole(x: np.ndarray, fmt: str, round_: int = 7) -> tuple[dict[str, TensorBytes], Residuals]:
    mine = Residuals("plain")
    entries = mine.encode(round_, 0, {"w": TensorBytes("F32", x.shape, x.tobytes())},
                          DENSITY[fmt], fmt=fmt)
    return entries, mine


def schema_of(x: np.ndarray) -> Schema:
    return Schema((ParameterSpec("w", "F32", x.shape),))


@pytest.mark.parametrize("fmt", FORMATS)
def test_parts_on_chunk_boundaries_are_the_unsharded_delta_byte_for_byte(fmt: str) -> None:
    # 8 rows of 1,024: each rank's 4 rows are exactly one chunk of the whole tensor.
    x = delta_of(8, 1024)
    parts, kept = encoded_parts(x, [0, 4, 8], fmt)
    entries, mine = whole(x, fmt)
    merged = assemble(parts, schema_of(x), ["w"], fmt)["w"]
    want = densify(entries, "w", x.shape, fmt)
    assert merged.dtype == "F32" and merged.shape == x.shape
    assert bytes(merged.buffer) == bytes(want.buffer)
    # The parts' entries are the whole payload's, cut at the chunk boundary (SIGN1's
    # seed aside: each part carries its shifted seed).
    for suffix in ("", ".scale") + ((".index", ".count") if fmt != "SIGN1" else ()):
        if fmt != "TOPK_F8" and suffix in ("", ".index"):
            continue  # bit-packed across values: a part's padding sits between them
        joined = b"".join(bytes(p[1]["w" + suffix].buffer) for p in parts)
        assert joined == bytes(entries["w" + suffix].buffer), suffix
    # Each rank's residual is its rows of the unsharded residual.
    full = np.concatenate([np.asarray(k.residual(0)["w"]) for k in kept])
    np.testing.assert_array_equal(full, np.asarray(mine.residual(0)["w"]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_parts_off_chunk_boundaries_are_each_part_sparsified_on_its_own(fmt: str) -> None:
    # 7 rows of 1,000, cut after row 4 (element 4,000: inside chunk 0) and an empty part.
    x = delta_of(7, 1000, seed=1)
    cuts = [0, 4, 4, 7]
    parts, kept = encoded_parts(x, cuts, fmt)
    merged = assemble(parts, schema_of(x), ["w"], fmt)["w"].to_numpy()
    for (_, entries, rows), mine, (a, b) in zip(parts, kept, itertools.pairwise(cuts),
                                                strict=True):
        assert rows == {"w": (a, b)}
        dense = densify(entries, "w", (b - a, 1000), fmt).to_numpy()
        np.testing.assert_array_equal(merged[a:b], dense)
        # What a rank sent plus what it kept is its rows of the delta.
        np.testing.assert_allclose(dense.reshape(-1) + np.asarray(mine.residual(0)["w"]),
                                   x[a:b].reshape(-1), rtol=1e-6, atol=1e-7)
        data = sum(t.nbytes for t in entries.values())
        assert data == sparse_nbytes((b - a) * 1000, DENSITY[fmt], fmt,
                                     seed=int(entries["w.select"].to_numpy()[0])
                                     if fmt == "SIGN1" else 0)
    entries, _ = whole(x, fmt)
    want = densify(entries, "w", x.shape, fmt).to_numpy()
    if fmt == "SIGN1":
        # The shifted seeds select the whole tensor's elements; only the magnitudes of
        # the chunk the cut splits differ.
        np.testing.assert_array_equal(merged != 0, want != 0)
        np.testing.assert_array_equal(np.sign(merged), np.sign(want))
    else:
        # Each part keeps its own top k of chunks counted from its first element (4,000
        # and 3,000 elements: one chunk each), not the whole's (4,096 and 2,904).
        k = chunk_k(DENSITY[fmt])
        assert np.count_nonzero(merged) == sum(int(chunk_counts(n, k).sum())
                                               for n in (4000, 3000))
        assert not np.array_equal(merged != 0, want != 0)


def test_the_part_offsets_shift_sign1_seeds_exactly() -> None:
    from gradientmail.wire.signs import select_hash, shifted_seed

    for seed, offset in ((0, 0), (7, 4000), (2**32 - 1, 123_456_789), (99, 2**33 + 5)):
        np.testing.assert_array_equal(select_hash(shifted_seed(seed, offset), 0, 5000),
                                      select_hash(seed, offset, offset + 5000))


def test_hostile_sparse_parts_are_refused_naming_the_part() -> None:
    x = delta_of(7, 1000, seed=2)
    schema = schema_of(x)
    parts, _ = encoded_parts(x, [0, 4, 7], "TOPK_F8")
    key, entries, rows = parts[1]

    def with_(**changed: TensorBytes) -> list[Any]:
        e = dict(entries)
        e.update({k.replace("_", "."): v for k, v in changed.items()})
        return [parts[0], (key, e, rows)]

    count = entries["w.count"].to_numpy().copy()
    count[0] += 1  # a count that lies: the values do not add up
    with pytest.raises(CorruptPayload, match=f"^{key}: tensor 'w': counts add up to"):
        assemble(with_(w_count=TensorBytes("U16", count.shape, count.tobytes())), schema,
                 ["w"], "TOPK_F8")
    index = entries["w.index"].to_numpy().copy()
    index[1] = index[0]  # a duplicate offset
    with pytest.raises(CorruptPayload, match="repeats the one before it"):
        assemble(with_(w_index=TensorBytes("U16", index.shape, index.tobytes())), schema,
                 ["w"], "TOPK_F8")
    index = entries["w.index"].to_numpy().copy()
    index[-1] = 3 * 1000  # past the part's 3,000 elements (the whole tensor has 7,000)
    with pytest.raises(CorruptPayload, match="has offset 3000 in chunk 0 of 3000 elements"):
        assemble(with_(w_index=TensorBytes("U16", index.shape, index.tobytes())), schema,
                 ["w"], "TOPK_F8")
    missing = {k: v for k, v in entries.items() if k != "w.scale"}
    with pytest.raises(SchemaMismatch, match=r"its TOPK_F8 entries do not match its rows: "
                                             r"missing \['w.scale'\], extra \[\]"):
        assemble([parts[0], (key, missing, rows)], schema, ["w"], "TOPK_F8")
    with pytest.raises(SchemaMismatch, match=r"parts do not tile .w.: rows 4..7 are in no part"):
        assemble([parts[0]], schema, ["w"], "TOPK_F8")


@pytest.mark.parametrize("momentum", [0.0, 0.8])
def test_the_ranks_feedback_joins_into_the_unsharded_layout_and_splits_back(
        momentum: float) -> None:
    # Two rounds: round 3 settled, round 5 in flight (its state before kept).
    x1, x2 = delta_of(8, 1024, seed=3), delta_of(8, 1024, seed=4)
    ranks = [Residuals("ranked") for _ in range(2)]
    one = Residuals("ranked")
    for r, x in ((3, x1), (5, x2)):
        for k, mine in enumerate(ranks):
            mine.encode(r, 0, {"w": TensorBytes("F32", (4, 1024), x[4 * k:4 * k + 4].tobytes())},
                        1 / 64, momentum=momentum)
        one.encode(r, 0, {"w": TensorBytes("F32", x.shape, x.tobytes())}, 1 / 64,
                   momentum=momentum)
        if r == 3:
            for mine in (*ranks, one):
                mine.recorded(3, ("ranked",))
    spans = [{"w": (0, 4096)}, {"w": (4096, 8192)}]
    full = join_states([(s, m.state_dict()) for s, m in zip(spans, ranks, strict=True)],
                       {"w": 8192})
    want = one.state_dict()
    assert set(full["in_flight"]) == set(want["in_flight"]) == {5}
    for got, exp in ((full["residuals"][0], want["residuals"][0]),
                     (full["in_flight"][5]["after"], want["in_flight"][5]["after"]),
                     (full["in_flight"][5]["before"], want["in_flight"][5]["before"])):
        assert set(got) == set(exp) == ({"w", "momentum/w"} if momentum else {"w"})
        for n in got:
            np.testing.assert_array_equal(got[n], np.asarray(exp[n]))
    # The residual and its round's `after` stay one array, so a restored learner's
    # failure of round 5 restores `before` exactly.
    assert full["residuals"][0]["w"] is full["in_flight"][5]["after"]["w"]
    for k, s in enumerate(spans):
        a, b = s["w"]
        mine = split_state(full, {"w": (a, b)}, lambda _, v: torch.from_numpy(v.copy()))
        back = Residuals("ranked")
        back.load_state_dict(mine, {"w": b - a}, lambda _, v: v)
        back.failed(5)
        ranks[k].failed(5)
        np.testing.assert_array_equal(np.asarray(back.residual(0)["w"]),
                                      np.asarray(ranks[k].residual(0)["w"]))


# -- a 2-rank learner mailing sparse parts, ranks as threads ----------------------------

SPARSE = {"delta_dtype": "TOPK_F8", "delta_density": 2 / CHUNK}


def sparse_oracle(learners: tuple[tuple[str, int, int], ...] = (("ranked", 0, RANKS),
                                                                 ("plain", 1, 1)),
                  density: float = SPARSE["delta_density"], fmt: str = "TOPK_F8",
                  momentum: float = 0.0) -> tuple[
        list[torch.Tensor], dict[str, dict[str, np.ndarray]], dict[str, dict[str, np.ndarray]]]:
    """Standard DiLoCo of `learners` (name, worker, ranks), each tensor's rows split over
    a learner's ranks as `torch.chunk` splits them (FSDP2's shards, and `ShardedAdapter`'s
    split of a whole model's upload), each rank's rows sparsified on their own in `fmt`
    at `density` with error feedback (and with `momentum` μ, each rank's momentum of its
    rows: m ← μ·m + delta, sending delta + μ·m, the outer step then plain SGD), merged by
    their mean: the parameters, each learner's residuals at the end and what it sent in
    the last round (full tensors)."""
    glob = make_model()
    params = list(glob.parameters())
    names = [n for n, _ in glob.named_parameters()]
    outer = torch.optim.SGD(params, lr=0.7, momentum=0.0 if momentum else 0.9,
                            nesterov=not momentum)
    residual = {who: {n: np.zeros(p.numel(), np.float32) for n, p in zip(names, params,
                                                                        strict=True)}
                for who, _, _ in learners}
    kept_m = {who: {n: np.zeros(p.numel(), np.float32) for n, p in zip(names, params,
                                                                      strict=True)}
              for who, _, _ in learners}
    last: dict[str, dict[str, np.ndarray]] = {}
    for rnd in range(ROUNDS):
        sent: list[list[np.ndarray]] = []
        for who, w, ranks in learners:
            local = make_model()
            local.load_state_dict(glob.state_dict())
            opt = torch.optim.SGD(local.parameters(), lr=INNER_LR)
            for k in range(H):
                inner_step(local, opt, w, rnd * H + k)
            dense = []
            for n, g, p in zip(names, params, local.parameters(), strict=True):
                delta = (g.detach() - p.detach()).reshape(-1).numpy()
                rows, width = (g.shape[0], g.numel() // g.shape[0])
                out = np.zeros_like(delta)
                for a, b in (chunk_rows(rows, ranks, k) for k in range(ranks)):
                    at = slice(a * width, b * width)
                    x = delta[at].copy()
                    if momentum:
                        kept_m[who][n][at] = momentum * kept_m[who][n][at] + x
                        x = x + momentum * kept_m[who][n][at]
                    x += residual[who][n][at]
                    if fmt == "TOPK_F8":
                        _, pos, values = sparsify_sent(
                            n, TensorBytes("F32", (x.size,), x.tobytes()), density)
                        part = np.zeros_like(x)
                        part[pos] = values
                    else:
                        entries = sparsify(n, TensorBytes("F32", (x.size,), x.tobytes()),
                                           density, fmt, seed=shifted_seed(rnd, a * width))
                        part = densify(entries, n, (x.size,), fmt).to_numpy()
                    out[at] = part
                    residual[who][n][at] = x - part
                dense.append(out)
            sent.append(dense)
            last[who] = dict(zip(names, dense, strict=True))
        for i, p in enumerate(params):
            p.grad = torch.from_numpy(sum(d[i] for d in sent) / len(sent)).reshape(p.shape)
        outer.step()
    return [p.detach().clone() for p in params], residual, last


@pytest.mark.parametrize("alg", [
    SPARSE,
    {"delta_dtype": "TOPK_Q2", "delta_density": 3 / CHUNK},
    {"delta_dtype": "SIGN1", "delta_density": 0.5, "feedback_momentum": 0.8,
     "outer_momentum": 0.0},
], ids=["TOPK_F8", "TOPK_Q2", "SIGN1-momentum"])
def test_a_two_rank_learner_mailing_sparse_parts_equals_the_sparse_oracle(
        alg: dict[str, Any]) -> None:
    url = f"memory://sharded-sparse-{secrets.token_hex(4)}"
    default = ThreadRanks.group(RANKS, timeout=TIMEOUT)
    side = ThreadRanks.group(RANKS, timeout=TIMEOUT)
    models = [make_model() for _ in range(RANKS + 1)]
    results: dict[str, list[torch.Tensor]] = {}
    feedback: dict[str, Any] = {}
    ready = threading.Barrier(RANKS + 1)

    def rank(k: int) -> None:
        model = models[k]
        sync, sharded_ranks = start_rank(k, model, default, side, url, **alg)
        train_ranked(sync, model, ready)
        results[f"rank{k}"] = [p.detach().clone() for p in model.parameters()]
        if k == 0:
            assert sync.learner is not None
            # Gathered from both ranks before they stopped serving (`finish`).
            feedback["ranked"] = sync.learner.state_dict()["error_feedback"]
        feedback[f"rank{k}"] = sharded_ranks._feedback

    def plain() -> None:
        model = models[RANKS]
        one = learner(TorchAdapter(model), url, "plain", **alg)
        one.start()
        results["plain"] = train_plain(one, model, ready)
        feedback["plain"] = one.state_dict()["error_feedback"]

    in_threads(*(functools.partial(rank, k) for k in range(RANKS)), plain, timeout=240)
    want, residual, _ = sparse_oracle(density=alg["delta_density"], fmt=alg["delta_dtype"],
                                      momentum=alg.get("feedback_momentum", 0.0))
    for who, got in results.items():
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6, msg=who)
    names = [n for n, _ in make_model().named_parameters()]
    for who in ("ranked", "plain"):
        state = feedback[who]
        assert state["in_flight"] == {}, who
        for n in names:
            np.testing.assert_allclose(np.asarray(state["residuals"][0][n]).reshape(-1),
                                       residual[who][n], rtol=0, atol=1e-6, err_msg=who)
    # Each rank kept its own rows only: rank 1 the second half of every tensor's rows.
    mine = feedback["rank1"].residual(0)
    for n, p in make_model().named_parameters():
        a, b = chunk_rows(p.shape[0], RANKS, 1)
        width = p.numel() // p.shape[0]
        np.testing.assert_allclose(np.asarray(mine[n]), residual["ranked"][n][a * width:b * width],
                                   rtol=0, atol=1e-6)


def test_a_checkpoint_state_goes_to_each_rank_as_its_rows_and_settles_there() -> None:
    """`RankResiduals` (rank 0's view): a full state loaded hands each rank its rows; the
    rounds in flight are every rank's; a failure rank 0 learns is applied by every rank
    before the next side command; gathered again, the state is the loaded one settled."""
    url = f"memory://sharded-feedback-{secrets.token_hex(4)}"
    default = ThreadRanks.group(RANKS, timeout=TIMEOUT)
    side = ThreadRanks.group(RANKS, timeout=TIMEOUT)
    models = [make_model() for _ in range(RANKS)]
    sizes = {n: p.numel() for n, p in models[0].named_parameters()}
    one = Residuals("ranked")  # an unsharded learner's state: round 5 in flight
    for r, seed in ((3, 5), (5, 6)):
        one.encode(r, 0, {n: TensorBytes("F32", (k,), delta_of(1, k, seed).tobytes())
                          for n, k in sizes.items()}, 1 / 64)
    one.recorded(3, ("ranked",))
    state = one.state_dict()
    got: dict[str, Any] = {}
    built = [ShardedRanks(ShardedAdapter(models[k], group_size=RANKS, group_rank=k), default[k],
                          side[k], k, url, timeout=TIMEOUT) for k in range(RANKS)]

    def rank0() -> None:
        view = built[0].feedback("ranked")
        view.load_state_dict(state, sizes, lambda _, v: v)
        view.check_fragments(((*sizes,),))
        got["in_flight"] = view.in_flight()
        got["loaded"] = view.state_dict()
        view.failed(5)
        assert view.in_flight() == {}  # settled in the queue, not yet on the ranks
        got["failed"] = view.state_dict()
        built[0].finish()
        got["final"] = view.state_dict()  # kept from before the ranks stopped

    def rank1() -> None:
        built[1].begin()
        built[1].finish()

    in_threads(rank0, rank1, timeout=120)
    assert got["in_flight"] == {5: 0}
    for n in sizes:
        np.testing.assert_array_equal(got["loaded"]["residuals"][0][n].numpy(),
                                      np.asarray(state["residuals"][0][n]))
        np.testing.assert_array_equal(got["loaded"]["in_flight"][5]["before"][n].numpy(),
                                      np.asarray(state["in_flight"][5]["before"][n]))
    one.failed(5)
    assert got["failed"]["in_flight"] == {} and got["final"]["in_flight"] == {}
    for n in sizes:
        for which in ("failed", "final"):
            np.testing.assert_array_equal(got[which]["residuals"][0][n].numpy(),
                                          np.asarray(one.residual(0)[n]))
    # Each rank holds its own rows, on its device: rank 1 the second half of each tensor.
    for n, p in models[1].named_parameters():
        a, b = chunk_rows(p.shape[0], RANKS, 1)
        width = p.numel() // p.shape[0]
        kept = built[1]._feedback
        assert kept is not None
        np.testing.assert_array_equal(kept.residual(0)[n].numpy(),
                                      np.asarray(one.residual(0)[n])[a * width:b * width])


class FailsOnce(ShardedRanks):
    """A rank whose part of round 1 is encoded and then fails to upload, once (what a PUT
    that keeps failing does): its residual moved, the contribution never landed."""

    failures = 0

    async def _upload_sparse(self, ex: Any, round_: int, *args: Any) -> Any:
        ref = await super()._upload_sparse(ex, round_, *args)
        if round_ == 1 and not FailsOnce.failures:
            FailsOnce.failures += 1
            raise OSError("the part's upload failed")
        return ref


def test_a_failed_sparse_upload_is_settled_on_every_rank() -> None:
    """Round 1's upload fails on rank 1 after both ranks encoded their rows; rank 0 learns
    it (`failed`, as its poster does), and the same steps go out with round 2: every rank
    takes round 1's share back before it encodes round 2, so round 2's parts and the
    residuals gathered after are those of ranks that never sent round 1."""
    name = f"sharded-sparse-fail-{secrets.token_hex(4)}"
    default = ThreadRanks.group(RANKS, timeout=TIMEOUT)
    side = ThreadRanks.group(RANKS, timeout=TIMEOUT)
    models = [make_model() for _ in range(RANKS)]
    shapes = {n: tuple(p.shape) for n, p in models[0].named_parameters()}
    rng = np.random.default_rng(7)
    anchor = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    snaps = [{n: a - 0.1 * rng.standard_normal(a.shape).astype(np.float32)
              for n, a in anchor.items()} for _ in range(2)]
    built = [(FailsOnce if k == 1 else ShardedRanks)(
        ShardedAdapter(models[k], group_size=RANKS, group_rank=k), default[k], side[k], k,
        f"memory://{name}", timeout=TIMEOUT) for k in range(RANKS)]
    FailsOnce.failures = 0
    sparse = Sparse(0, 2 / CHUNK, 1.0, 0.0)
    got: dict[str, Any] = {}

    def rank0() -> None:
        ranks = built[0]
        view = ranks.feedback("ranked")
        ex = Exchange(MemoryMailbox(name))

        def tb(values: dict[str, np.ndarray]) -> dict[str, TensorBytes]:
            return {n: TensorBytes.from_numpy(v) for n, v in values.items()}

        a = ranks.load_full(tb(anchor))
        handles = [ranks.load_full(tb(v)) for v in snaps]

        async def rounds() -> None:
            await ranks.upload(ex, 0, "ranked", a, handles[0], "TOPK_F8", sparse)
            view.recorded(0, ("ranked",))
            with pytest.raises(GradientmailError, match="rank 1: OSError: the part's upload"):
                await ranks.upload(ex, 1, "ranked", a, handles[1], "TOPK_F8", sparse)
            view.failed(1)
            got["refs"] = await ranks.upload(ex, 2, "ranked", a, handles[1], "TOPK_F8",
                                             sparse)
            got["parts"] = [await ex.store.fetch_payload(ref, 1 << 20) for ref in got["refs"]]
            view.recorded(2, ("ranked",))

        asyncio.run(rounds())
        got["state"] = view.state_dict()
        ranks.finish()

    def rank1() -> None:
        built[1].begin()
        built[1].finish()

    try:
        in_threads(rank0, rank1, timeout=120)
    finally:
        MemoryMailbox.forget(name)
    assert FailsOnce.failures == 1
    # What each rank would hold had nothing failed: its rows, encoded round by round.
    state = got["state"]
    assert state["in_flight"] == {}
    for k in range(RANKS):
        mine = Residuals("ranked")
        rows = {n: chunk_rows(s[0], RANKS, k) for n, s in shapes.items()}
        for r, snap in zip((0, 2), snaps, strict=True):
            delta = {n: torch.from_numpy((anchor[n] - snap[n])[a:b].copy())
                     for n, (a, b) in rows.items()}
            entries = mine.encode(r, 0, delta, sparse.density)
            mine.recorded(r, ("ranked",))
        blob = got["parts"][k]
        assert blob is not None
        sent = decode(blob, "off")
        assert {n: bytes(t.buffer) for n, t in sent.items()} == \
            {n: bytes(t.buffer) for n, t in entries.items()}
        for n, (a, b) in rows.items():
            width = int(np.prod(shapes[n][1:]))
            np.testing.assert_array_equal(
                state["residuals"][0][n].numpy()[a * width:b * width],
                np.asarray(mine.residual(0)[n]))
