"""DiLoCo's configuration, its JSON, the partition plan and the grace window."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.algorithms import Algorithm, Estimates, RoundSchedule, algorithm_from_json
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Rda, WeightedMean
from gradientmail.algorithms.partition import ByBytes, Strided, plan
from gradientmail.algorithms.rounds import grace_window
from gradientmail.errors import ConfigError, RemoteProtocolError
from gradientmail.wire.serialization import ParameterSpec, Schema

# -- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(in_flight=3, fragments=2), "in_flight=3 exceeds fragments=2; "
         "need 1 <= in_flight <= fragments <= sync_every"),
        (dict(fragments=1, in_flight=2), "in_flight=2 exceeds fragments=1; need 1 <= in_flight <= "
         "fragments <= sync_every (standard DiLoCo: fragments=1, in_flight=1)"),
        (dict(fragments=11, in_flight=1), "fragments=11 exceeds sync_every=10; "
         "need 1 <= in_flight <= fragments <= sync_every"),
        (dict(in_flight=0), "in_flight=0 is below 1; need in_flight >= 1"),
        (dict(sync_every=0, fragments=1, in_flight=1), "sync_every=0 is below 1; "
         "need sync_every >= 1"),
        (dict(sync_every=10.0), "sync_every=10.0 must be an int"),
        (dict(fragments=True), "fragments=True must be an int"),
        (dict(overlap_steps=-1), "overlap_steps=-1 is below 0; need overlap_steps >= 0"),
        (dict(mixing=1.0), "mixing=1.0 is out of range; need 0 <= mixing < 1"),
        (dict(mixing=-0.1), "mixing=-0.1 is out of range; need 0 <= mixing < 1"),
        (dict(mixing="0.5"), "mixing='0.5' must be a finite number"),
        (dict(quorum_size=0), "quorum_size=0 is below 1; need quorum_size >= 1"),
        (dict(outer_lr=0.0), "outer_lr=0.0 must be > 0"),
        (dict(outer_lr=float("nan")), "outer_lr=nan must be a finite number"),
        (dict(outer_momentum=1.0), "outer_momentum=1.0 is out of range; "
         "need 0 <= outer_momentum < 1"),
        (dict(global_batch_size=0), "global_batch_size=0 is below 1; "
         "need global_batch_size >= 1"),
        (dict(delta_dtype="F16"), "delta_dtype='F16' is not a transfer format; use None, "
         "'F32', 'BF16', 'F8_E4M3', 'F4'"),
        (dict(commit_dtype="int8"), "commit_dtype='int8' is not a transfer format"),
        (dict(merge="rda"), "merge='rda' must be WeightedMean() or Rda(...)"),
        (dict(partition=None), "partition=None must be ByBytes() or Strided(...)"),
        (dict(flush_on_close=1), "flush_on_close=1 must be a bool"),
        (dict(outlier_factor=1.0), "outlier_factor=1.0 must be None (off) or a number > 1: a "
         "contribution is dropped when its delta norm exceeds outlier_factor x the round's "
         "median, e.g. 5.0"),
        (dict(outlier_factor=0.5), "outlier_factor=0.5 must be None (off) or a number > 1"),
        (dict(outlier_factor="5"), "outlier_factor='5' must be a finite number"),
        (dict(outlier_factor=float("inf")), "outlier_factor=inf must be a finite number"),
        (dict(outlier_factor=True), "outlier_factor=True must be a finite number"),
        (dict(rebase=True, mixing=0.5), "rebase=True and mixing=0.5 exclude each other: "
         "rebasing keeps all of the local progress, mixing keeps α of it; use mixing=0 to "
         "rebase, or rebase=False (or None) to mix"),
        (dict(rebase=1), "rebase=1 must be True, False or None (automatic)"),
    ],
)
def test_rejects_bad_values_naming_value_and_rule(kwargs: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = dict(sync_every=10, fragments=4)
    base.update(kwargs)
    with pytest.raises(ConfigError) as exc:
        DiLoCo(**base)
    assert message in str(exc.value)


def test_strided_pattern_needs_one_capture_group() -> None:
    with pytest.raises(ConfigError) as exc:
        Strided(r"\.\d+\.")
    assert str(exc.value) == (
        r"block_pattern='\\.\\d+\\.' has 0 capture groups; it needs exactly one, around the "
        r"block index, e.g. r'\.(\d+)\.'"
    )
    with pytest.raises(ConfigError, match="has 2 capture groups"):
        Strided(r"(h)\.(\d+)")
    with pytest.raises(ConfigError, match="is not a valid regular expression"):
        Strided("(")


def test_defaults_and_presets() -> None:
    d = DiLoCo(sync_every=100, fragments=4)
    assert (d.in_flight, d.overlap_steps, d.outer_lr, d.outer_momentum) == (2, None, 0.7, 0.9)
    assert d.merge == Rda(direct_pattern="embed") and d.partition == ByBytes()
    assert d.outlier_factor is None  # the outlier guard is off by default
    assert DiLoCo(10, 2, outlier_factor=3).outlier_factor == 3.0
    assert d.schedule == RoundSchedule(100, 4, in_flight=2, overlap_steps=None)
    assert isinstance(d, Algorithm)
    std = DiLoCo.standard(500, learners=8)
    assert (std.fragments, std.in_flight, std.overlap_steps, std.quorum_size) == (1, 1, 0, 8)
    assert std.merge == WeightedMean()
    sgd = DiLoCo.local_sgd(50, quorum_size=2)
    assert (sgd.outer_lr, sgd.outer_momentum, sgd.merge, sgd.quorum_size) == (
        1.0, 0.0, WeightedMean(), 2
    )
    with pytest.raises(dataclasses_frozen()):
        d.fragments = 2  # type: ignore[misc]


def test_every_field_has_a_default_in_flight_follows_fragments() -> None:
    # One default per setting: DiLoCo() is what every entry point builds when given
    # nothing (tests/test_config_entry_points.py): Decoupled DiLoCo, H = 100, one fragment.
    d = DiLoCo()
    assert (d.sync_every, d.fragments, d.in_flight, d.overlap_steps, d.quorum_size) == (
        100, 1, 1, None, 1)
    assert d == DiLoCo(100, 1, 1)
    # in_flight=None resolves to min(2, fragments), so configurations written before it
    # had a default keep their value and their record.
    assert DiLoCo(fragments=4).in_flight == 2 and DiLoCo(fragments=4, in_flight=None) == \
        DiLoCo(fragments=4, in_flight=2)
    assert DiLoCo(fragments=4).to_json() == GOLDEN


def dataclasses_frozen() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_schedule_for_a_shorter_plan() -> None:
    d = DiLoCo(sync_every=12, fragments=4, in_flight=3, overlap_steps=5)
    assert d.schedule_for(2) == RoundSchedule(12, 2, in_flight=2, overlap_steps=5)
    with pytest.raises(ConfigError, match="a plan of 5 fragments exceeds fragments=4"):
        d.schedule_for(5)


# -- JSON ------------------------------------------------------------------------------

GOLDEN = {
    "type": "diloco", "version": 1, "sync_every": 100, "fragments": 4, "in_flight": 2,
    "overlap_steps": None, "mixing": 0.0, "quorum_size": 1, "outer_lr": 0.7,
    "outer_momentum": 0.9, "merge": {"type": "rda", "direct_pattern": "embed", "min_deltas": 3},
    "partition": {"type": "by_bytes"}, "global_batch_size": None, "delta_dtype": None,
    "commit_dtype": None, "flush_on_close": True, "checkpoint_every": 20, "cohort_share": True,
}


def test_json_is_pinned() -> None:
    assert DiLoCo(sync_every=100, fragments=4).to_json() == GOLDEN
    assert json.dumps(GOLDEN)  # JSON-able as is


def test_runs_created_before_cohort_shares_step_every_round_in_full() -> None:
    # Their records have no cohort_share: it reads as False, written by omission; the
    # standard and local SGD presets (rounds of every learner) keep it off.
    before = {k: v for k, v in GOLDEN.items() if k != "cohort_share"}
    old = DiLoCo.from_json(before)
    assert old.cohort_share is False and old == DiLoCo(100, 4, cohort_share=False)
    assert old.to_json() == before and DiLoCo(100, 4).cohort_share is True
    assert not DiLoCo.standard(10, 4).cohort_share and not DiLoCo.local_sgd(10).cohort_share
    assert "cohort_share" not in DiLoCo.standard(10, 4).to_json()
    with pytest.raises(RemoteProtocolError, match="cohort_share=false is recorded by omission"):
        DiLoCo.from_json({**before, "cohort_share": False})
    with pytest.raises(RemoteProtocolError, match="cohort_share=1 is not a bool"):
        DiLoCo.from_json({**before, "cohort_share": 1})
    with pytest.raises(ConfigError, match="cohort_share='yes' must be a bool"):
        DiLoCo(cohort_share="yes")  # type: ignore[arg-type]


def test_a_pipelined_barrier_sends_a_syncs_rounds_at_one_step() -> None:
    # stagger=False: the P rounds of a sync go out at the same step (gap H, then 0s), all
    # in flight at once behind the barrier; written only when off, so older runs (and
    # every staggered one) keep their records.
    d = DiLoCo.standard(12, 4, fragments=3, stagger=False)
    assert (d.in_flight, d.overlap_steps) == (3, 0)
    assert [d.schedule.gap(r) for r in range(7)] == [12, 0, 0, 12, 0, 0, 12]
    assert [d.schedule.spacing(r) for r in range(4)] == [12, 12, 12, 12]
    assert d.schedule_for(2).gap(1) == 0 and d.schedule_for(2).in_flight == 2
    assert d.to_json()["stagger"] is False and DiLoCo.from_json(d.to_json()) == d
    assert "stagger" not in DiLoCo.standard(12, 4, fragments=3).to_json()
    assert [DiLoCo(12, 3).schedule.gap(r) for r in range(3)] == [4, 4, 4]
    assert DiLoCo(12, 3, overlap_steps=0, stagger=False).in_flight == 3
    with pytest.raises(RemoteProtocolError, match="stagger=true is recorded by omission"):
        DiLoCo.from_json({**GOLDEN, "stagger": True})
    with pytest.raises(ConfigError, match=r"stagger=False with in_flight=2, overlap_steps=0: "
                       r".*need in_flight=3 and overlap_steps=0, as DiLoCo.standard\(H, M, "
                       r"fragments=3, stagger=False\) sets"):
        DiLoCo.standard(12, 4, fragments=3, stagger=False, in_flight=2)
    with pytest.raises(ConfigError, match="stagger=False with in_flight=3, overlap_steps=None"):
        DiLoCo(12, 3, stagger=False)
    with pytest.raises(ConfigError, match="stagger='no' must be a bool"):
        DiLoCo(stagger="no")  # type: ignore[arg-type]


def test_runs_created_before_replication_upload_the_state_with_every_commit() -> None:
    # Their records have no checkpoint_every: it reads as 1, which is written by omission.
    before = {k: v for k, v in GOLDEN.items() if k != "checkpoint_every"}
    old = DiLoCo.from_json(before)
    assert old.checkpoint_every == 1 and not old.replicated
    assert old == DiLoCo(100, 4, checkpoint_every=1) and old.to_json() == before
    assert DiLoCo(100, 4).replicated and DiLoCo(100, 4).checkpoint_at(40)
    assert not DiLoCo(100, 4).checkpoint_at(41)
    with pytest.raises(RemoteProtocolError, match="checkpoint_every=1 is recorded by omission"):
        DiLoCo.from_json({**before, "checkpoint_every": 1})
    with pytest.raises(RemoteProtocolError, match="checkpoint_every=0 is below 1"):
        DiLoCo.from_json({**before, "checkpoint_every": 0})
    with pytest.raises(ConfigError, match="checkpoint_every=0 is below 1"):
        DiLoCo(100, 4, checkpoint_every=0)


def test_outlier_factor_is_in_the_json_only_when_set() -> None:
    # Runs created before the field existed keep adopting: None is written by omission.
    assert "outlier_factor" not in DiLoCo(sync_every=100, fragments=4).to_json()
    assert DiLoCo.from_json(GOLDEN).outlier_factor is None
    guarded = DiLoCo(sync_every=100, fragments=4, outlier_factor=5)
    assert guarded.to_json() == {**GOLDEN, "outlier_factor": 5.0}
    assert DiLoCo.from_json({**GOLDEN, "outlier_factor": 5.0}) == guarded
    assert DiLoCo.from_json({**GOLDEN, "outlier_factor": 5}) == guarded


def test_rebase_is_the_default_without_mixing_and_in_the_json_only_when_not() -> None:
    d = DiLoCo(sync_every=100, fragments=4)
    assert d.rebase is True and d == DiLoCo(100, 4, rebase=True)
    assert d.to_json() == GOLDEN  # default records unchanged: rebase written by omission
    mixed = DiLoCo(100, 4, mixing=0.5)
    assert mixed.rebase is False and mixed == DiLoCo(100, 4, mixing=0.5, rebase=False)
    assert "rebase" not in mixed.to_json()
    # Runs created before the field existed adopt as the default choice.
    assert DiLoCo.from_json(GOLDEN) == d
    assert DiLoCo.from_json({**GOLDEN, "mixing": 0.5}) == mixed
    # Overwriting without mixing is the one choice that departs from the default.
    plain = DiLoCo(100, 4, rebase=False)
    assert plain.rebase is False and plain != d
    assert plain.to_json() == {**GOLDEN, "rebase": False}
    assert DiLoCo.from_json({**GOLDEN, "rebase": False}) == plain
    # The standard presets rebase too: behind their barrier it is overwriting.
    assert DiLoCo.standard(10, learners=2).rebase is True


def test_mixing_zero_int_and_float_give_one_record() -> None:
    a, b = DiLoCo(10, 2, mixing=0), DiLoCo(10, 2, mixing=0.0)
    assert json.dumps(a.to_json()) == json.dumps(b.to_json())
    assert isinstance(a.mixing, float)


@st.composite
def configs(draw: st.DrawFn) -> DiLoCo:
    h = draw(st.integers(1, 10_000))
    p = draw(st.integers(1, min(h, 64)))
    tau = draw(st.integers(1, p))
    fmt = st.sampled_from([None, "BF16", "F8_E4M3", "F4"])
    merge = draw(st.one_of(
        st.just(WeightedMean()),
        st.builds(Rda, st.one_of(st.none(), st.text(max_size=8))),
    ))
    partition = draw(st.one_of(
        st.just(ByBytes()),
        st.builds(Strided, st.sampled_from([r"\.(\d+)\.", r"layers_(\d+)", r"h(\d)"])),
    ))
    mixing = draw(st.one_of(st.just(0.0), st.floats(0, 1, exclude_max=True)))
    return DiLoCo(
        sync_every=h, fragments=p, in_flight=tau,
        overlap_steps=draw(st.one_of(st.none(), st.integers(0, 10**6))),
        mixing=mixing,
        quorum_size=draw(st.integers(1, 1000)),
        outer_lr=draw(st.floats(1e-6, 10)),
        outer_momentum=draw(st.floats(0, 1, exclude_max=True)),
        merge=merge, partition=partition,
        global_batch_size=draw(st.one_of(st.none(), st.integers(1, 10**6))),
        delta_dtype=draw(fmt), commit_dtype=draw(fmt),
        flush_on_close=draw(st.booleans()),
        outlier_factor=draw(st.one_of(st.none(), st.floats(1.0, 1e6, exclude_min=True))),
        rebase=draw(st.sampled_from([None, False, True] if mixing == 0 else [None, False])),
    )


@settings(max_examples=150, deadline=None)
@given(configs())
def test_json_round_trip_is_exact(cfg: DiLoCo) -> None:
    text = json.dumps(cfg.to_json(), sort_keys=True)
    again = DiLoCo.from_json(json.loads(text))
    assert again == cfg
    assert json.dumps(again.to_json(), sort_keys=True) == text
    assert algorithm_from_json(json.loads(text)) == cfg


def _with(**changes: Any) -> dict[str, Any]:
    obj = dict(GOLDEN)
    obj.update(changes)
    return obj


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ([], "algorithm record [] must be a JSON object"),
        ({k: v for k, v in GOLDEN.items() if k != "mixing"},
         "algorithm record: missing fields ['mixing'], unknown fields []"),
        (_with(lr=1), "algorithm record: missing fields [], unknown fields ['lr']"),
        (_with(type="adam"), "algorithm record: type='adam' is not 'diloco'"),
        (_with(version=2), "algorithm record: version=2 is not 1; the run was created by "
         "another gradientmail version"),
        (_with(version=True), "algorithm record: version=True is not 1"),
        (_with(sync_every="100"), "algorithm record: sync_every='100' is not an integer"),
        (_with(fragments=4.0), "algorithm record: fragments=4.0 is not an integer"),
        (_with(overlap_steps=1.5), "algorithm record: overlap_steps=1.5 is not an integer "
         "or null"),
        (_with(mixing=None), "algorithm record: mixing=None is not a number"),
        (_with(outer_lr=True), "algorithm record: outer_lr=True is not a number"),
        (_with(commit_dtype=4), "algorithm record: commit_dtype=4 is not a string or null"),
        (_with(flush_on_close=0), "algorithm record: flush_on_close=0 is not a bool"),
        (_with(outlier_factor=None), "algorithm record: outlier_factor=None is not a number"),
        (_with(outlier_factor="5"), "algorithm record: outlier_factor='5' is not a number"),
        (_with(outlier_factor=1), "algorithm record: outlier_factor=1 must be None (off) or "
         "a number > 1"),
        (_with(rebase=None), "algorithm record: rebase=None is not a bool"),
        (_with(rebase=True), "algorithm record: rebase=True is what mixing=0.0 implies, and "
         "is recorded by omission"),
        (_with(mixing=0.5, rebase=False), "algorithm record: rebase=False is what "
         "mixing=0.5 implies"),
        (_with(mixing=0.5, rebase=True), "algorithm record: rebase=True and mixing=0.5 "
         "exclude each other"),
        (_with(in_flight=5), "algorithm record: in_flight=5 exceeds fragments=4; need 1 <= "
         "in_flight <= fragments <= sync_every"),
        (_with(commit_dtype="F16"), "algorithm record: commit_dtype='F16' is not a transfer"),
        (_with(merge={"type": "mean"}), "merge.type='mean' is not a merge; use "
         "'weighted_mean' or 'rda'"),
        (_with(merge={"type": "rda"}), "merge: rda needs exactly 'type' and "
         "'direct_pattern' (and may have 'direct_names' and 'min_deltas'); got ['type']"),
        (_with(merge={"type": "rda", "direct_pattern": 3}),
         "merge.direct_pattern=3 must be a string or null"),
        (_with(merge={"type": "weighted_mean", "x": 1}),
         "merge: weighted_mean takes no options; unexpected keys ['x']"),
        (_with(partition="by_bytes"), "partition='by_bytes' must be an object with a "
         "string 'type'"),
        (_with(partition={"type": "strided", "block_pattern": "x"}),
         "partition.block_pattern: block_pattern='x' has 0 capture groups"),
        (_with(partition={"type": "by_bytes", "block_pattern": "x"}),
         "partition: by_bytes takes no options; unexpected keys ['block_pattern']"),
    ],
)
def test_from_json_rejects_other_shapes(obj: Any, message: str) -> None:
    with pytest.raises(RemoteProtocolError) as exc:
        DiLoCo.from_json(obj)
    assert message in str(exc.value)


def test_algorithm_from_json_rejects_unknown_types() -> None:
    with pytest.raises(RemoteProtocolError, match="has type 'sgd'; known algorithms: 'diloco'"):
        algorithm_from_json({"type": "sgd"})


# -- plan ------------------------------------------------------------------------------


def schema_of(sizes: dict[str, int], dtype: str = "F32") -> Schema:
    return Schema(tuple(ParameterSpec(n, dtype, (k,)) for n, k in sizes.items()))


def gpt_schema(blocks: int) -> Schema:
    sizes = {"wte.weight": 5000, "wpe.weight": 700}
    for b in range(blocks):
        sizes |= {f"h.{b}.attn.weight": 300, f"h.{b}.mlp.weight": 600, f"h.{b}.ln.bias": 10}
    sizes |= {"ln_f.bias": 10, "lm_head.bias": 50}
    return schema_of(sizes)


def test_by_bytes_packs_largest_first_into_the_lightest() -> None:
    s = schema_of({"a": 10, "b": 7, "c": 7, "d": 5, "e": 1})
    # a(40)->0; b(28)->1; c(28)->2; d(20)->1 (1 and 2 tie at 28: lowest); e(4)->2.
    assert plan(s, 3, ByBytes()) == (("a",), ("b", "d"), ("c", "e"))
    assert plan(s, 1, ByBytes()) == (("a", "b", "c", "d", "e"),)
    assert plan(s, 9, ByBytes()) == (("a",), ("b",), ("c",), ("d",), ("e",))
    assert plan(Schema(()), 3, ByBytes()) == ()


def test_ties_are_broken_by_name_not_schema_order() -> None:
    a = plan(schema_of({"y": 4, "x": 4, "z": 4}), 2, ByBytes())
    # x, y, z by name: x -> 0, y -> 1, z -> 0 (a tie: lowest index); schema order inside.
    assert a == (("x", "z"), ("y",))


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(st.text("abcdefgh.", min_size=1, max_size=6), st.integers(0, 10**6),
                    min_size=1, max_size=40),
    st.integers(1, 12),
)
def test_by_bytes_is_a_balanced_deterministic_partition(sizes: dict[str, int], p: int) -> None:
    s = schema_of(sizes)
    out = plan(s, p, ByBytes())
    reordered = plan(schema_of(dict(reversed(list(sizes.items())))), p, ByBytes())
    assert [set(f) for f in out] == [set(f) for f in reordered]
    flat = [n for frag in out for n in frag]
    assert sorted(flat) == sorted(sizes) and len(out) <= min(p, len(sizes))
    loads = [sum(s.nbytes(n) for n in frag) for frag in out]
    if len(out) > 1:
        assert max(loads) - min(loads) <= max(s.nbytes(n) for n in sizes)
    order = {n: i for i, n in enumerate(s.names)}
    assert all(list(f) == sorted(f, key=order.__getitem__) for f in out)


def test_strided_deals_blocks_round_robin_and_packs_the_rest() -> None:
    s = gpt_schema(blocks=6)
    out = plan(s, 3, Strided())
    blocks = [sorted({int(n.split(".")[1]) for n in f if n.startswith("h.")}) for f in out]
    assert blocks == [[0, 3], [1, 4], [2, 5]]
    # The rest, largest first onto the lightest: all three hold 2 × 910 × 4 bytes of
    # blocks, so wte goes to 0, wpe to 1, lm_head to 2, ln_f to 2 (2 is then lightest).
    rest = [[n for n in f if not n.startswith("h.")] for f in out]
    assert rest == [["wte.weight"], ["wpe.weight"], ["ln_f.bias", "lm_head.bias"]]


def test_strided_orders_blocks_by_index_not_by_name() -> None:
    s = schema_of({f"layers.{b}.w": 4 for b in (10, 2, 1)})
    assert plan(s, 2, Strided()) == (("layers.10.w", "layers.1.w"), ("layers.2.w",))


def test_strided_with_more_fragments_than_blocks_packs_the_rest_into_empty_ones() -> None:
    s = gpt_schema(blocks=2)
    out = plan(s, 4, Strided())
    assert len(out) == 4
    assert out[2] == ("wte.weight",)
    assert out[3] == ("wpe.weight", "ln_f.bias", "lm_head.bias")


def test_strided_capture_must_be_digits() -> None:
    s = schema_of({"h.x.w": 4})
    with pytest.raises(ConfigError, match=r"captured 'x' in tensor 'h\.x\.w'"):
        plan(s, 2, Strided(r"h\.(\w)\."))


def test_plan_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="fragments=0 must be an int >= 1"):
        plan(schema_of({"a": 1}), 0, ByBytes())


def test_algorithm_plan_uses_its_partition() -> None:
    s = gpt_schema(blocks=4)
    d = DiLoCo(sync_every=20, fragments=2, partition=Strided())
    assert d.plan(s) == plan(s, 2, Strided())


# -- grace window ----------------------------------------------------------------------


def test_grace_window() -> None:
    s = RoundSchedule(sync_every=40, fragments=4, in_flight=2, overlap_steps=None)  # gap 10
    # a few steps (5) of the run's pace, at least 3 polls, at most one gap
    assert grace_window(Estimates(step=0.5, quorum=2.0, sync=1.0), s, 0) == 3.0
    assert grace_window(Estimates(step=0.5), s, 0, poll_interval=0.2) == 2.5
    assert grace_window(Estimates(step=2.0), s, 0) == 10.0
    assert grace_window(Estimates(step=0.1), s, 0) == 1.0  # the gap: 10 steps of 0.1 s
    assert grace_window(Estimates(step=0.1), s, 0, poll_interval=0.01) == 0.5
    # the quorum and sync estimates play no part (nor does overlap_steps)
    barrier = RoundSchedule(sync_every=40, fragments=4, in_flight=2, overlap_steps=0)
    assert grace_window(Estimates(step=2.0, quorum=50.0, sync=9.0), barrier, 0) == 10.0
    # round 0 has no step estimate yet: the poll floor
    for missing in (Estimates(), Estimates(quorum=1.0, sync=1.0)):
        assert grace_window(missing, s, 0) == 3.0
        assert grace_window(missing, s, 0, poll_interval=0.5) == 1.5
    d = DiLoCo(sync_every=40, fragments=4)
    assert d.grace_window(Estimates(step=2.0), d.schedule, 0, 1.0) == 10.0


def test_direct_names_come_from_the_model_and_are_in_the_json_only_when_there_are_some() -> None:
    d = DiLoCo(sync_every=4, fragments=2)
    # no embeddings: the configuration, and so the run's bytes, unchanged
    assert d.with_direct_names(()).to_json() == d.to_json()
    resolved = d.with_direct_names({"wte.weight", "pos.weight"})
    assert resolved.to_json()["merge"] == {"type": "rda", "direct_pattern": "embed",
                                           "direct_names": ["pos.weight", "wte.weight"],
                                           "min_deltas": 3}
    assert algorithm_from_json(json.loads(json.dumps(resolved.to_json()))) == resolved
    # names the user gave, or another merge, are left alone
    mine = DiLoCo(sync_every=4, fragments=2, merge=Rda(None, ("a",)))
    assert mine.with_direct_names({"b"}) is mine
    mean = DiLoCo(sync_every=4, fragments=2, merge=WeightedMean())
    assert mean.with_direct_names({"b"}) is mean
    for bad in (["b", "a"], [], ["a", "a"], [3]):
        with pytest.raises(RemoteProtocolError, match="direct_names"):
            algorithm_from_json({**resolved.to_json(),
                                 "merge": {"type": "rda", "direct_pattern": None,
                                           "direct_names": bad}})
    with pytest.raises(ConfigError, match="direct_names"):
        Rda(None, "wte")  # type: ignore[arg-type]
