"""DiLoCoPlugin: built in code, from the YAML file named by GRADIENTMAIL_CONFIG, and from
GRADIENTMAIL_* variables (which override the file); every bad key and value is refused
with a message naming it and the fix."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Rda, WeightedMean
from gradientmail.algorithms.partition import ByBytes, Strided
from gradientmail.algorithms.words import diloco_to_mapping
from gradientmail.errors import ConfigError
from gradientmail.learner.options import LearnerOptions
from gradientmail.traffic import Prices
from gradientmail_accelerate import DEFAULT_ALGORITHM, DiLoCoPlugin
from gradientmail_accelerate.plugin import algorithm_from_mapping

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "diloco.yaml"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "gm.yaml"
    path.write_text(text)
    return str(path)


def test_the_example_yaml_reads_as_documented() -> None:
    plugin = DiLoCoPlugin.from_yaml(EXAMPLE)
    assert plugin == DiLoCoPlugin(
        "runs/accelerate-demo",
        DiLoCo(
            sync_every=20,
            fragments=2,
            in_flight=2,
            overlap_steps=None,
            quorum_size=1,
            outer_lr=0.7,
            outer_momentum=0.9,
            merge=Rda(direct_pattern="embed"),
            partition=ByBytes(),
        ),
        learner_id=None,
        options=LearnerOptions(poll_interval=0.2, compression="off"),
    )


def test_environment_overrides_the_yaml_file() -> None:
    env = {
        "GRADIENTMAIL_CONFIG": str(EXAMPLE),
        "GRADIENTMAIL_MAILBOX": "s3://bucket/run-7",
        "GRADIENTMAIL_LEARNER_ID": "node-3",
        "GRADIENTMAIL_SYNC_EVERY": "8",
        "GRADIENTMAIL_FRAGMENTS": "1",
        "GRADIENTMAIL_IN_FLIGHT": "1",
        "GRADIENTMAIL_OVERLAP_STEPS": "0",
        "GRADIENTMAIL_MIXING": "0.25",
        "GRADIENTMAIL_MERGE": "mean",
        "GRADIENTMAIL_PARTITION": "strided",
        "GRADIENTMAIL_BLOCK_PATTERN": r"h\.(\d+)\.",
        "GRADIENTMAIL_GLOBAL_BATCH_SIZE": "256",
        "GRADIENTMAIL_DELTA_DTYPE": "F4",
        "GRADIENTMAIL_FLUSH_ON_CLOSE": "yes",
        "GRADIENTMAIL_SYNC": "false",
        "GRADIENTMAIL_TOKENS_PER_STEP": "4096",
        "GRADIENTMAIL_COMPRESSION": "zstd",
        "GRADIENTMAIL_LEASE_EVERY": "5",
        "GRADIENTMAIL_LEASE_TIMEOUT": "12.5",
        "GRADIENTMAIL_PREFIX": "runs/a/",
        "GRADIENTMAIL_WAIT_FOR_LEARNERS": "3",
        "GRADIENTMAIL_WAIT_TIMEOUT": "90",
        "GRADIENTMAIL_HOLD_OWN": "false",
        "GRADIENTMAIL_KEEP_VERSIONS": "3",
        "GRADIENTMAIL_PRICES": "{egress_per_gb: 0}",
        "GRADIENTMAIL_RUN_KEY": "the key of run seven, 32 bytes long",
        "HOME": "/root",
    }
    plugin = DiLoCoPlugin.from_env(env)
    assert plugin == DiLoCoPlugin(
        "s3://bucket/run-7",
        DiLoCo(
            sync_every=8,
            fragments=1,
            in_flight=1,
            overlap_steps=0,
            mixing=0.25,
            quorum_size=1,
            merge=WeightedMean(),
            partition=Strided(r"h\.(\d+)\."),
            global_batch_size=256,
            delta_dtype="F4",
            flush_on_close=True,
        ),
        learner_id="node-3",
        tokens_per_step=4096,
        options=LearnerOptions(
            sync=False,
            hold_own=False,
            poll_interval=0.2,  # from the file
            compression="zstd",
            lease_every=5.0,
            lease_timeout=12.5,
            prefix="runs/a/",
            keep_versions=3,
            prices=Prices(egress_per_gb=0.0),
            wait_for_learners=3,
            wait_timeout=90.0,
        ),
        run_key="the key of run seven, 32 bytes long",
    )
    assert "run seven" not in repr(plugin)


def test_environment_alone_and_defaults() -> None:
    plugin = DiLoCoPlugin.from_env({"GRADIENTMAIL_MAILBOX": "/data/run"})
    assert plugin.mailbox == "/data/run" and plugin.algorithm is None
    assert plugin.resolved_algorithm == DEFAULT_ALGORITHM
    assert DiLoCo() == DEFAULT_ALGORITHM and plugin.options == LearnerOptions()
    # Missing diloco fields take DiLoCo's defaults; in_flight follows fragments.
    plugin = DiLoCoPlugin.from_env(
        {"GRADIENTMAIL_MAILBOX": "/data/run", "GRADIENTMAIL_FRAGMENTS": "4"}
    )
    assert plugin.algorithm == DiLoCo(fragments=4, in_flight=2)
    plugin = DiLoCoPlugin.from_env(
        {"GRADIENTMAIL_MAILBOX": "/data/run", "GRADIENTMAIL_SYNC_EVERY": "3"}
    )
    assert plugin.algorithm == DiLoCo(sync_every=3, fragments=1, in_flight=1)
    plugin = DiLoCoPlugin.from_env(
        {"GRADIENTMAIL_MAILBOX": "/data/run", "GRADIENTMAIL_OVERLAP_STEPS": "none"}
    )
    assert plugin.algorithm == dataclasses.replace(DEFAULT_ALGORITHM, overlap_steps=None)


def test_an_empty_file_with_a_mailbox_variable(tmp_path: Path) -> None:
    path = write(tmp_path, "# nothing yet\n")
    plugin = DiLoCoPlugin.from_env({"GRADIENTMAIL_CONFIG": path, "GRADIENTMAIL_MAILBOX": "m"})
    assert plugin == DiLoCoPlugin("m")


def test_merge_and_partition_spellings(tmp_path: Path) -> None:
    cases: list[tuple[str, Any]] = [
        ("merge: rda", Rda()),
        ("merge: rda\n  direct_pattern: wte", Rda("wte")),
        ("merge: rda\n  direct_pattern: null", Rda(None)),
        ("merge: mean", WeightedMean()),
        ("partition: bytes", ByBytes()),
        ("partition: strided", Strided()),
        (r"partition: strided" "\n" r"  block_pattern: 'layers\.(\d+)\.'",
         Strided(r"layers\.(\d+)\."),
        ),
    ]
    for line, want in cases:
        path = write(tmp_path, f"mailbox: m\ndiloco:\n  fragments: 2\n  {line}\n")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the recipes' words draw no warning
            alg = DiLoCoPlugin.from_yaml(path).resolved_algorithm
        assert getattr(alg, line.split(":")[0]) == want, line


def test_the_old_spellings_read_the_same_with_a_warning_naming_the_new(tmp_path: Path) -> None:
    cases: list[tuple[str, str, str]] = [
        ("merge: {type: rda, direct_pattern: wte}", "merge: rda\n  direct_pattern: wte",
         "write merge: rda and direct_pattern: 'wte' beside it"),
        ("merge: {type: rda}", "merge: rda", "write merge: rda"),
        ("merge: weighted_mean", "merge: mean", "write merge: mean"),
        ("merge: {type: weighted_mean}", "merge: mean", "write merge: mean"),
        ("partition: by_bytes", "partition: bytes", "write partition: bytes"),
        (r"partition: {type: strided, block_pattern: 'h\.(\d+)\.'}",
         "partition: strided\n  block_pattern: 'h\\.(\\d+)\\.'",
         "write partition: strided and block_pattern: "),
    ]
    for old, new, hint in cases:
        old_path = write(tmp_path, f"mailbox: m\ndiloco:\n  fragments: 2\n  {old}\n")
        with pytest.warns(DeprecationWarning) as record:
            got = DiLoCoPlugin.from_yaml(old_path)
        msg = str(record[0].message)
        assert msg.startswith(f"{old_path}: diloco.") and "is deprecated" in msg, msg
        assert hint in msg, msg
        new_path = tmp_path / "new.yaml"
        new_path.write_text(f"mailbox: m\ndiloco:\n  fragments: 2\n  {new}\n")
        assert got == DiLoCoPlugin.from_yaml(new_path), old
    # The old flow mappings in a variable, too.
    with pytest.warns(DeprecationWarning, match="write merge: rda and direct_pattern: None"):
        plugin = DiLoCoPlugin.from_env(
            {"GRADIENTMAIL_MAILBOX": "m",
             "GRADIENTMAIL_MERGE": "{type: rda, direct_pattern: null}"})
    assert plugin.resolved_algorithm.merge == Rda(None)


def test_learner_settings_by_name_are_deprecated_and_build_the_options() -> None:
    with pytest.warns(DeprecationWarning, match=r"pass options=LearnerOptions\(poll_interval=0.5"):
        plugin = DiLoCoPlugin("m", poll_interval=0.5)
    assert plugin == DiLoCoPlugin("m", options=LearnerOptions(poll_interval=0.5))
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        DiLoCoPlugin("m", poll_intervall=0.5)


def bad_yaml(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        DiLoCoPlugin.from_yaml(path)
    msg = str(info.value)
    assert msg.startswith(path + ": "), msg
    return msg


def test_unknown_keys_are_named_with_the_valid_ones(tmp_path: Path) -> None:
    msg = bad_yaml(tmp_path, "mailbox: m\nmailbx: n\n")
    assert msg.endswith(
        "unknown key mailbx; valid keys: mailbox, learner_id, tokens_per_step, sync, "
        "hold_own, poll_interval, lease_every, lease_timeout, compression, prefix, "
        "keep_versions, prices, wait_for_learners, wait_timeout, diloco"
    )
    msg = bad_yaml(tmp_path, "mailbox: m\ndiloco:\n  sync_evry: 3\n  outer_lrr: 1\n")
    assert "unknown keys diloco.sync_evry, diloco.outer_lrr; valid keys: sync_every, " in msg
    assert msg.endswith("delta_dtype, commit_dtype, flush_on_close, outlier_factor, rebase, "
                        "checkpoint_every, keep_rounds, delta_density, feedback_decay, "
                        "feedback_momentum, cohort_share, stagger")
    assert "merge, direct_pattern, partition, block_pattern" in msg
    msg = bad_yaml(tmp_path, "mailbox: m\ndiloco:\n  merge: {type: rda, pattern: x}\n")
    assert msg.endswith("diloco.merge: unknown option pattern for rda; its options: direct_pattern")
    msg = bad_yaml(tmp_path, "mailbox: m\ndiloco:\n  merge: {type: weighted_mean, x: 1}\n")
    assert msg.endswith("unknown option x for weighted_mean; its options: none")
    msg = bad_yaml(tmp_path, "mailbox: m\ndiloco:\n  merge: median\n")
    assert msg.endswith("diloco.merge='median' is not one of rda, mean")
    with pytest.warns(DeprecationWarning, match="write merge: rda"):
        msg = bad_yaml(tmp_path, "mailbox: m\ndiloco:\n  merge: {type: rda, direct_pattern: y}"
                       "\n  direct_pattern: x\n")
    assert msg.endswith("diloco.merge: direct_pattern is given twice; write it beside merge")
    msg = bad_yaml(tmp_path, "mailbox: m\ndiloco:\n  partition: [1]\n")
    assert "diloco.partition=[1] is not one of bytes, strided" in msg


def test_bad_values_name_the_key_and_the_rule(tmp_path: Path) -> None:
    msg = bad_yaml(tmp_path, "mailbox: m\ndiloco:\n  sync_every: ten\n")
    assert msg.endswith("diloco.sync_every='ten' must be an integer")
    msg = bad_yaml(tmp_path, "mailbox: m\ndiloco:\n  sync_every: true\n")
    assert msg.endswith("diloco.sync_every=True must be an integer")
    msg = bad_yaml(tmp_path, "mailbox: m\ndiloco:\n  overlap_steps: 1.5\n")
    assert msg.endswith("diloco.overlap_steps=1.5 must be an integer or null")
    msg = bad_yaml(tmp_path, "mailbox: m\ndiloco:\n  fragments: 2\n  in_flight: 3\n")
    assert msg.endswith(
        "diloco.in_flight=3 exceeds fragments=2; need 1 <= in_flight <= fragments <= sync_every"
    )
    msg = bad_yaml(tmp_path, "mailbox: m\ndiloco:\n  mixing: 1.0\n")
    assert msg.endswith("diloco.mixing=1.0 is out of range; need 0 <= mixing < 1")
    msg = bad_yaml(
        tmp_path, "mailbox: m\ndiloco:\n  partition: strided\n  block_pattern: x\n"
    )
    assert "block_pattern='x' has 0 capture groups" in msg
    msg = bad_yaml(tmp_path, "mailbox: m\ncompression: off\n")
    assert msg.endswith(
        "compression=False is not a codec; use 'off' or 'zstd' "
        '(YAML reads a bare off as false: write compression: "off")'
    )
    msg = bad_yaml(tmp_path, "mailbox: m\nsync: 1\n")
    assert msg.endswith("sync=1 must be true or false")
    msg = bad_yaml(tmp_path, "mailbox: m\nlease_every: 60\nlease_timeout: 30\n")
    assert msg.endswith(
        "lease_timeout=30.0 must exceed lease_every=60.0, or every learner looks dead between "
        "two beats; use about twice lease_every"
    )
    msg = bad_yaml(tmp_path, "learner_id: a\n")
    assert "'mailbox' is required" in msg and "GRADIENTMAIL_MAILBOX" in msg
    msg = bad_yaml(tmp_path, "- mailbox\n")
    assert msg.endswith("the config must be a mapping, got list ['mailbox']")
    msg = bad_yaml(tmp_path, "mailbox: m\ndiloco: 3\n")
    assert msg.endswith("diloco must be a mapping, got int 3")
    msg = bad_yaml(tmp_path, "mailbox: [unclosed\n")
    assert "not valid YAML" in msg


def bad_env(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as info:
        DiLoCoPlugin.from_env({"GRADIENTMAIL_MAILBOX": "m", **env})
    return str(info.value)


def test_bad_environment_values_name_the_variable() -> None:
    assert bad_env({"GRADIENTMAIL_SYNC_EVERY": "ten"}) == (
        "GRADIENTMAIL_SYNC_EVERY='ten' is not an integer"
    )
    assert (
        bad_env({"GRADIENTMAIL_OUTER_LR": "fast"}) == "GRADIENTMAIL_OUTER_LR='fast' is not a number"
    )
    assert bad_env({"GRADIENTMAIL_SYNC": "maybe"}) == (
        "GRADIENTMAIL_SYNC='maybe' is not a bool; use one of 1, true, yes, on, 0, false, no, off"
    )
    assert bad_env({"GRADIENTMAIL_MERGE": "median"}) == (
        "GRADIENTMAIL_* variables: diloco.merge='median' is not one of rda, mean"
    )
    assert "GRADIENTMAIL_PARTITION='{type: [' is not a YAML flow mapping" in bad_env(
        {"GRADIENTMAIL_PARTITION": "{type: ["}
    )
    assert bad_env({"GRADIENTMAIL_QUORUM_SIZE": "0"}) == (
        "GRADIENTMAIL_* variables: diloco.quorum_size=0 is below 1; need quorum_size >= 1"
    )
    assert bad_env({"GRADIENTMAIL_POLL_INTERVAL": "nan"}) == (
        "GRADIENTMAIL_* variables: poll_interval=nan must be a finite number of seconds > 0"
    )
    assert bad_env({"GRADIENTMAIL_CONFIG": "/no/such/gm.yaml"}) == (
        "cannot read the gradientmail config '/no/such/gm.yaml': No such file or directory; "
        "point GRADIENTMAIL_CONFIG at an existing YAML file"
    )
    with pytest.raises(ConfigError, match=r"^GRADIENTMAIL_\* variables: 'mailbox' is required"):
        DiLoCoPlugin.from_env({})


def test_an_unknown_variable_draws_a_warning_with_the_valid_names() -> None:
    with pytest.warns(UserWarning) as record:
        plugin = DiLoCoPlugin.from_env({"GRADIENTMAIL_MAILBOX": "m", "GRADIENTMAIL_SYNC_EVRY": "5"})
    assert plugin == DiLoCoPlugin("m")
    msg = str(record[0].message)
    assert msg.startswith(
        "ignoring environment variables ['GRADIENTMAIL_SYNC_EVRY']: no such gradientmail "
        "setting; valid: GRADIENTMAIL_MAILBOX, GRADIENTMAIL_LEARNER_ID, "
    )
    assert "GRADIENTMAIL_SYNC_EVERY" in msg and msg.endswith("(and GRADIENTMAIL_CONFIG)")


def test_plugin_fields_are_validated_in_code() -> None:
    def msg(**kw: Any) -> str:
        with pytest.raises(ConfigError) as info:
            DiLoCoPlugin(**{"mailbox": "m", **kw})
        return str(info.value)

    assert msg(mailbox="") == (
        "mailbox='' must be a Mailbox or a non-empty URL (a directory, file:///dir or "
        "s3://bucket/prefix)"
    )
    assert msg(algorithm={"sync_every": 3}).startswith("algorithm={'sync_every': 3} must be a ")
    assert msg(tokens_per_step=-1) == "tokens_per_step=-1 is negative; need tokens_per_step >= 0"
    assert msg(tokens_per_step=2.5) == (
        "tokens_per_step=2.5 must be an int >= 0, a callable returning one, or None"
    )
    assert msg(options={"poll_interval": 1}) == (
        "options={'poll_interval': 1} must be a gradientmail.LearnerOptions or None")
    assert msg(learner_id=3) == "learner_id=3 must be a string or None"
    assert DiLoCoPlugin("m", tokens_per_step=lambda: 3).tokens_per_step is not None


configs = st.builds(
    lambda h, p, tau, overlap, q, merge, part, fmt, flush, k, outlier: DiLoCo(
        sync_every=h * p,
        fragments=p,
        in_flight=min(tau, p),
        overlap_steps=overlap,
        quorum_size=q,
        merge=merge,
        partition=part,
        delta_dtype=fmt,
        flush_on_close=flush,
        checkpoint_every=k,
        outlier_factor=outlier,
    ),
    st.integers(1, 50),
    st.integers(1, 4),
    st.integers(1, 4),
    st.none() | st.integers(0, 9),
    st.integers(1, 8),
    st.sampled_from([WeightedMean(), Rda(), Rda(None), Rda("wte")]),
    st.sampled_from([ByBytes(), Strided(), Strided(r"layer(\d+)")]),
    st.sampled_from([None, "BF16", "F8_E4M3", "F4"]),
    st.booleans(),
    # 1 is left out of a manifest's JSON (runs from before replication), where a YAML
    # section without the key takes DiLoCo's default: written out, it round-trips.
    st.sampled_from([2, 20, 50]),
    st.none() | st.floats(1.5, 10.0),
)


@settings(max_examples=40, deadline=None)
@given(configs)
def test_a_diloco_section_round_trips_every_configuration(config: DiLoCo) -> None:
    section = diloco_to_mapping(config)
    assert algorithm_from_mapping(section) == config
    # The same through YAML text, as a user would write it.
    import yaml

    text = yaml.safe_dump({"mailbox": "m", "diloco": section})
    assert DiLoCoPlugin.from_mapping(yaml.safe_load(text)).algorithm == config
    assert re.search(r"sync_every: \d+", text)


def test_the_outlier_factor_from_the_file_and_its_variable(tmp_path: Path) -> None:
    path = tmp_path / "diloco.yaml"
    path.write_text("mailbox: runs/x\ndiloco:\n  sync_every: 8\n  outlier_factor: 3\n")
    assert DiLoCoPlugin.from_yaml(path).resolved_algorithm.outlier_factor == 3.0
    env = {"GRADIENTMAIL_CONFIG": str(path)}
    assert DiLoCoPlugin.from_env(env).resolved_algorithm.outlier_factor == 3.0
    env["GRADIENTMAIL_OUTLIER_FACTOR"] = "2.5"
    assert DiLoCoPlugin.from_env(env).resolved_algorithm.outlier_factor == 2.5
    env["GRADIENTMAIL_OUTLIER_FACTOR"] = "none"
    assert DiLoCoPlugin.from_env(env).resolved_algorithm.outlier_factor is None
    env["GRADIENTMAIL_OUTLIER_FACTOR"] = "0.5"
    with pytest.raises(ConfigError, match=r"diloco.outlier_factor=0.5 must be None \(off\)"):
        DiLoCoPlugin.from_env(env)
