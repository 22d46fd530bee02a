"""One configuration: `LearnerOptions` validation, the recipes' words read everywhere
(earlier spellings with a warning naming the new one), the same defaults through every
entry point, and docs/configuration.md generated from the code."""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from gradientmail import LearnerOptions
from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Rda, WeightedMean
from gradientmail.algorithms.partition import ByBytes, Strided
from gradientmail.algorithms.words import (
    DILOCO_KEYS,
    diloco_from_mapping,
    diloco_to_mapping,
    merge_from_words,
    partition_from_words,
)
from gradientmail.app import reference
from gradientmail.app.cli import build_parser
from gradientmail.errors import ConfigError
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import MemoryMailbox
from gradientmail.traffic import S3_STANDARD, Prices
from gradientmail_accelerate import DiLoCoPlugin
from gradientmail_accelerate.plugin import _DILOCO_KINDS, _OPTION_KINDS, algorithm_from_mapping
from gradientmail_lightning import DiLoCoCallback
from gradientmail_lightning.cli import diloco_callback

ROOT = Path(__file__).resolve().parents[1]

# -- LearnerOptions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(sync=1), "sync=1 must be true or false"),
        (dict(hold_own="yes"), "hold_own='yes' must be true or false"),
        (dict(poll_interval=0), "poll_interval=0 must be a finite number of seconds > 0"),
        (dict(lease_every=math.inf), "lease_every=inf must be a finite number of seconds > 0"),
        (dict(lease_timeout=True), "lease_timeout=True must be a finite number of seconds > 0"),
        (dict(lease_every=60, lease_timeout=60), "lease_timeout=60.0 must exceed "
         "lease_every=60.0, or every learner looks dead between two beats; use about twice "
         "lease_every"),
        (dict(compression="gzip"), "compression='gzip' is not a codec; use 'off' or 'zstd'"),
        (dict(compression=False), "compression=False is not a codec; use 'off' or 'zstd' "
         '(YAML reads a bare off as false: write compression: "off")'),
        (dict(prefix=3), "prefix=3 must be a string"),
        (dict(keep_versions=0), "keep_versions=0 must be an int >= 1 (2 lets readers of the "
         "previous version finish)"),
        (dict(prices={"egress_per_gb": 0}), "prices={'egress_per_gb': 0} must be a "
         "gradientmail.traffic.Prices, e.g. Prices(egress_per_gb=0.0) for learners in the "
         "bucket's region"),
        (dict(wait_for_learners=-1), "wait_for_learners=-1 must be an int >= 0 (0 starts at "
         "once) or None (those a barrier needs: quorum_size when overlap_steps=0, as in "
         "standard DiLoCo)"),
        (dict(wait_timeout=0), "wait_timeout=0 must be a finite number of seconds > 0"),
    ],
)
def test_learner_options_refuse_bad_values_naming_value_rule_and_fix(
        kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        LearnerOptions(**kwargs)
    assert str(info.value) == message


def test_learner_options_are_frozen_and_read_from_a_mapping() -> None:
    o = LearnerOptions(poll_interval=2)
    assert o.poll_interval == 2.0 and isinstance(o.poll_interval, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.sync = False  # type: ignore[misc]
    got = LearnerOptions.from_mapping({"poll_interval": 0.5, "prices": {"egress_per_gb": 0}})
    assert got == LearnerOptions(poll_interval=0.5, prices=Prices(egress_per_gb=0.0))
    assert LearnerOptions.from_mapping(got.to_mapping()) == got
    assert LearnerOptions.from_mapping({"prices": None}).prices == S3_STANDARD
    with pytest.raises(ConfigError) as info:
        LearnerOptions.from_mapping({"poll_intervall": 1, "sink": 2}, source="run.yaml")
    assert str(info.value) == (
        "run.yaml: unknown learner options poll_intervall, sink; valid: sync, hold_own, "
        "poll_interval, lease_every, lease_timeout, compression, prefix, keep_versions, "
        "prices, wait_for_learners, wait_timeout")
    with pytest.raises(ConfigError, match=r"^run.yaml: poll_interval=-1 must be a finite"):
        LearnerOptions.from_mapping({"poll_interval": -1}, source="run.yaml")
    with pytest.raises(ConfigError, match=r"^run.yaml: prices has unknown keys egress; valid: "):
        LearnerOptions.from_mapping({"prices": {"egress": 0}}, source="run.yaml")


# -- the deprecated spellings -----------------------------------------------------------


def learner(**kw: Any) -> Learner:
    # No I/O before start(): building one is enough to read its options.
    return Learner(TorchAdapter(torch.nn.Linear(2, 2)), DiLoCo(), MemoryMailbox(), "l-0", **kw)


def test_the_learners_old_keyword_arguments_build_the_options_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning) as record:
        old = learner(poll_interval=0.5, sync=False)
    msg = str(record[0].message)
    assert msg == (
        "Learner(poll_interval=, sync=...) is deprecated and will be refused in the next "
        "release; pass options=LearnerOptions(poll_interval=0.5, sync=False)")
    new = learner(options=LearnerOptions(poll_interval=0.5, sync=False))
    assert old.options == new.options == LearnerOptions(sync=False, poll_interval=0.5)
    assert old._mailman.options == old.options  # passed whole to the mailman
    with pytest.raises(ConfigError, match=r"got options= and \['sync'\]"):
        learner(options=LearnerOptions(), sync=False)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['poll'\]"):
        learner(poll=1)


@pytest.mark.parametrize(
    ("old", "new", "shown"),
    [
        (dict(merge={"type": "rda", "direct_pattern": "wte"}),
         dict(merge="rda", direct_pattern="wte"),
         "merge: {type: rda, ...} is deprecated and will be refused in the next release; "
         "write merge: rda and direct_pattern: 'wte' beside it"),
        (dict(merge={"type": "rda"}), dict(merge="rda"), "write merge: rda"),
        (dict(merge="weighted_mean"), dict(merge="mean"),
         "merge: weighted_mean is deprecated and will be refused in the next release; "
         "write merge: mean"),
        (dict(partition="by_bytes"), dict(partition="bytes"), "write partition: bytes"),
        (dict(partition={"type": "by_bytes"}), dict(partition="bytes"),
         "write partition: bytes"),
        (dict(partition={"type": "strided", "block_pattern": r"h\.(\d+)\."}),
         dict(partition="strided", block_pattern=r"h\.(\d+)\."),
         "write partition: strided and block_pattern: "),
    ],
)
def test_old_words_read_as_the_new_with_a_warning_naming_the_new(
        old: dict[str, Any], new: dict[str, Any], shown: str) -> None:
    with pytest.warns(DeprecationWarning) as record:
        got = diloco_from_mapping({"fragments": 2, **old}, source="run.yaml")
    assert shown in str(record[0].message) and str(record[0].message).startswith("run.yaml: ")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert got == diloco_from_mapping({"fragments": 2, **new})


def test_the_words_build_the_objects_and_name_the_valid_ones() -> None:
    assert merge_from_words() == Rda() and merge_from_words("mean") == WeightedMean()
    assert merge_from_words("rda", None) == Rda(None)
    assert partition_from_words() == ByBytes()
    assert partition_from_words("strided", r"layer(\d+)") == Strided(r"layer(\d+)")
    assert merge_from_words(Rda("x")) == Rda("x")  # an object passes as it is
    with pytest.raises(ConfigError, match=r"^merge='median' is not one of rda, mean$"):
        merge_from_words("median")
    with pytest.raises(ConfigError, match=r"^partition=3 is not one of bytes, strided$"):
        partition_from_words(3)
    with pytest.raises(ConfigError, match=r"^partition: block_pattern='x' has 0 capture"):
        partition_from_words("strided", "x")


# -- one default per setting ------------------------------------------------------------


def test_every_entry_point_builds_the_same_configuration_from_nothing() -> None:
    alg, opts = DiLoCo(), LearnerOptions()
    cb = diloco_callback("m")
    assert (cb.algorithm, cb.options) == (alg, opts)
    assert DiLoCoCallback("m", alg).options == opts
    for plugin in (DiLoCoPlugin("m"), DiLoCoPlugin.from_mapping({"mailbox": "m"}),
                   DiLoCoPlugin.from_env({"GRADIENTMAIL_MAILBOX": "m"})):
        assert (plugin.resolved_algorithm, plugin.options) == (alg, opts)
    assert algorithm_from_mapping({}) == diloco_from_mapping({}) == alg
    assert learner().options == opts
    sync = build_parser().parse_args(["sync", "m"])
    assert (sync.poll_interval, sync.lease_timeout, sync.keep) == (
        opts.poll_interval, opts.lease_timeout, opts.keep_versions)
    assert build_parser().parse_args(["sweep", "m"]).keep == opts.keep_versions
    assert build_parser().parse_args(["demo"]).outlier_factor == alg.outlier_factor
    # The recipe default's record is the one it wrote before the defaults were shared.
    assert cb.algorithm.to_json() == DiLoCo(100, 1, 1).to_json()


def test_every_entry_point_builds_the_same_configuration_from_the_same_words(
        tmp_path: Path) -> None:
    section: dict[str, Any] = dict(
        sync_every=40, fragments=4, quorum_size=2, merge="rda", direct_pattern="wte",
        partition="strided", block_pattern=r"h\.(\d+)\.", delta_dtype="F4",
        commit_dtype="BF16", outlier_factor=4.0, keep_rounds=3)
    learner_section: dict[str, Any] = dict(
        poll_interval=0.5, lease_every=10.0, lease_timeout=30.0, compression="zstd",
        keep_versions=3, prices={"egress_per_gb": 0.0}, wait_for_learners=2,
        wait_timeout=60.0, hold_own=False)
    want_alg = DiLoCo(40, 4, quorum_size=2, merge=Rda("wte"), partition=Strided(r"h\.(\d+)\."),
                      delta_dtype="F4", commit_dtype="BF16", outlier_factor=4.0,
                      keep_rounds=3)
    want_opts = LearnerOptions(poll_interval=0.5, lease_every=10.0, lease_timeout=30.0,
                               compression="zstd", keep_versions=3,
                               prices=Prices(egress_per_gb=0.0), wait_for_learners=2,
                               wait_timeout=60.0, hold_own=False)
    cb = diloco_callback("m", **section, **learner_section)
    assert (cb.algorithm, cb.options) == (want_alg, want_opts)
    plugin = DiLoCoPlugin.from_mapping({"mailbox": "m", **learner_section, "diloco": section})
    assert (plugin.algorithm, plugin.options) == (want_alg, want_opts)
    env = {"GRADIENTMAIL_MAILBOX": "m", "GRADIENTMAIL_PRICES": "{egress_per_gb: 0.0}"}
    env.update({f"GRADIENTMAIL_{k.upper()}": str(v)
                for k, v in {**section, **learner_section}.items() if k != "prices"})
    plugin = DiLoCoPlugin.from_env(env)
    assert (plugin.algorithm, plugin.options) == (want_alg, want_opts)
    assert diloco_from_mapping(diloco_to_mapping(want_alg)) == want_alg


def test_every_setting_has_a_spelling_at_every_entry_point() -> None:
    recipe = set(inspect.signature(diloco_callback).parameters)
    assert set(DILOCO_KEYS) <= recipe and set(LearnerOptions.names()) <= recipe
    assert tuple(_DILOCO_KINDS) == DILOCO_KEYS
    assert tuple(_OPTION_KINDS) == LearnerOptions.names()
    # The recipe's defaults are the dataclasses' own (a None in_flight/rebase resolves
    # in DiLoCo; merge and partition are their default words).
    params = inspect.signature(diloco_callback).parameters
    for f in dataclasses.fields(DiLoCo):
        if f.name not in ("merge", "partition"):
            assert params[f.name].default == f.default, f.name
    assert (params["merge"].default, params["partition"].default) == ("rda", "bytes")
    assert params["direct_pattern"].default == Rda().direct_pattern
    assert params["block_pattern"].default == Strided().block_pattern
    for f in dataclasses.fields(LearnerOptions):
        default = params[f.name].default
        assert (S3_STANDARD if default is None and f.name == "prices" else default) == \
            f.default, f.name


# -- the reference ------------------------------------------------------------------------


def test_every_setting_has_one_line_of_meaning() -> None:
    for cls in (DiLoCo, LearnerOptions):
        for f in dataclasses.fields(cls):
            doc = f.metadata.get("doc")
            assert isinstance(doc, str) and doc and "\n" not in doc, f"{cls.__name__}.{f.name}"


def test_the_configuration_reference_is_the_codes() -> None:
    page = ROOT / reference.DEFAULT_PATH
    text = reference.render()
    for name in (*DILOCO_KEYS, *LearnerOptions.names()):
        assert f"| `{name}` |" in text, name
    assert page.is_file() and page.read_text() == text, (
        f"{reference.DEFAULT_PATH} differs from the code; regenerate it with: "
        "PYTHONPATH=$PWD python -m gradientmail.app.reference"
    )


def test_the_reference_command_checks_and_writes(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "configuration.md"
    assert reference.main([str(out), "--check"]) == 1
    assert "regenerate it with: PYTHONPATH=$PWD python -m gradientmail.app.reference" in \
        capsys.readouterr().err
    assert reference.main([str(out)]) == 0
    assert reference.main([str(out), "--check"]) == 0
