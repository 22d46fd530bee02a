r"""`DiLoCoPlugin`: what the Accelerate wrapper needs to run a learner, as one dataclass.

Accelerate refuses custom `kwargs_handlers` and its config YAML rejects unknown keys, so
gradientmail's settings live apart: in a `DiLoCoPlugin` built in code, or read by
`DiLoCoPlugin.from_env()` from the YAML file named by `GRADIENTMAIL_CONFIG` and from
`GRADIENTMAIL_*` variables (a variable overrides the same key of the file). This module is
the one place the wrapper reads the environment.

The YAML file (every key is in docs/configuration.md)::

    mailbox: runs/demo            # a directory, file:///dir, s3://bucket/prefix
    learner_id: node-3            # optional; default <host>-<pid> of rank 0
    poll_interval: 0.5            # and every other LearnerOptions setting: sync,
                                  # hold_own, compression, lease_every, lease_timeout,
                                  # prefix, keep_versions, prices, wait_for_learners,
                                  # wait_timeout; and tokens_per_step
    diloco:                       # the fields of gradientmail.DiLoCo, as a recipe's
      sync_every: 50
      fragments: 2
      merge: rda                  # or mean
      direct_pattern: embed       # rda's: tensors merged by weighted mean
      partition: bytes            # or strided, with block_pattern: '\.(\d+)\.'

Missing settings take `DiLoCo`'s and `LearnerOptions`' own defaults. Each key has a
variable: `GRADIENTMAIL_MAILBOX`, `GRADIENTMAIL_SYNC_EVERY`, `GRADIENTMAIL_MERGE`,
`GRADIENTMAIL_PRICES` (a YAML flow mapping such as `{egress_per_gb: 0}`), ...; `none`
(or an empty value) sets an optional field to None. The spellings of earlier releases
(`merge: {type: rda, direct_pattern: ...}`, `weighted_mean`, `by_bytes`,
`{type: strided, block_pattern: ...}`) still read, with a DeprecationWarning. The run
key of an authenticated run comes from `GRADIENTMAIL_RUN_KEY` only (a secret does not
belong in a config file), as for the `gradientmail` command.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.words import DILOCO_KEYS, diloco_from_mapping
from gradientmail.errors import ConfigError, MissingExtra
from gradientmail.learner.options import LearnerOptions
from gradientmail.mailbox.base import Mailbox
from gradientmail.wire.auth import RUN_KEY_VARIABLE, env_run_key

__all__ = [
    "DEFAULT_ALGORITHM",
    "ENV_PREFIX",
    "RUN_KEY_VARIABLE",
    "DiLoCoPlugin",
    "algorithm_from_mapping",
]

#: The algorithm of a plugin built without one: DiLoCo's defaults, as everywhere.
DEFAULT_ALGORITHM = DiLoCo()
ENV_PREFIX = "GRADIENTMAIL_"
#: Variables of the GRADIENTMAIL_ namespace that belong to other parts of the package.
_OTHER_VARIABLES = frozenset({"CONFIG", "RUN_KEY", "REGOLD"})

# Each setting's kind, shared by the YAML reader (typed values) and the environment
# reader (strings): "int", "int?", "float", "float?", "bool", "bool?", "str", "str?",
# "spec" (a word or an old-style flow mapping), "mapping".
_OWN_KINDS = {
    "mailbox": "str",
    "learner_id": "str?",
    "tokens_per_step": "int?",
}
_OPTION_KINDS = {
    "sync": "bool",
    "hold_own": "bool",
    "poll_interval": "float",
    "lease_every": "float",
    "lease_timeout": "float",
    "compression": "str",
    "prefix": "str",
    "keep_versions": "int",
    "prices": "mapping",
    "wait_for_learners": "int?",
    "wait_timeout": "float",
}
_PLUGIN_KINDS = {**_OWN_KINDS, **_OPTION_KINDS}
_DILOCO_KINDS = {
    "sync_every": "int",
    "fragments": "int",
    "in_flight": "int?",
    "overlap_steps": "int?",
    "mixing": "float",
    "quorum_size": "int",
    "outer_lr": "float",
    "outer_momentum": "float",
    "merge": "spec",
    "direct_pattern": "str?",
    "partition": "spec",
    "block_pattern": "str",
    "global_batch_size": "int?",
    "delta_dtype": "str?",
    "commit_dtype": "str?",
    "flush_on_close": "bool",
    "outlier_factor": "float?",
    "rebase": "bool?",
    "checkpoint_every": "int",
    "keep_rounds": "int?",
    "delta_density": "float?",
    "feedback_decay": "float?",
    "feedback_momentum": "float?",
    "cohort_share": "bool",
    "stagger": "bool",
}
_YAML_KEYS = (*_PLUGIN_KINDS, "diloco")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True, init=False)
class DiLoCoPlugin:
    """The wrapper's settings: where the run lives and how this learner takes part.

    `mailbox` is a Mailbox or a URL; `algorithm` the run's DiLoCo configuration (None:
    `DEFAULT_ALGORITHM`); `learner_id` (None: `<host>-<pid>` of rank 0, or the id a loaded
    checkpoint carries); `tokens_per_step`: tokens one process consumes per optimizer
    step, an int or a callable returning this step's count (None: count with
    `DiLoCo.count(batch)`, or 0, which merges learners as equals); `options` the
    learner's settings (`LearnerOptions`: sync, leases, prices, and the
    `wait_for_learners` learners waited for at `start()`, for up to `wait_timeout`
    seconds); `run_key` (None: `GRADIENTMAIL_RUN_KEY`). The settings by name
    (`poll_interval=0.5`, earlier releases' spelling) still build the options, with a
    DeprecationWarning, for one release.
    """

    mailbox: Mailbox | str
    algorithm: DiLoCo | None
    learner_id: str | None
    tokens_per_step: int | Callable[[], int] | None
    options: LearnerOptions
    run_key: str | bytes | None = dataclasses.field(repr=False)

    def __init__(
        self,
        mailbox: Mailbox | str,
        algorithm: DiLoCo | None = None,
        learner_id: str | None = None,
        tokens_per_step: int | Callable[[], int] | None = None,
        *,
        options: LearnerOptions | None = None,
        run_key: str | bytes | None = None,
        **deprecated: Any,
    ) -> None:
        unknown = sorted(set(deprecated) - set(LearnerOptions.names()))
        if unknown:
            raise TypeError(f"DiLoCoPlugin() got unexpected keyword arguments {unknown}")
        if deprecated:
            if options is not None:
                raise ConfigError(f"DiLoCoPlugin got options= and {sorted(deprecated)}; put "
                                  "them in the LearnerOptions")
            spelled = ", ".join(f"{k}={v!r}" for k, v in deprecated.items())
            warnings.warn(
                f"DiLoCoPlugin({', '.join(f'{k}=' for k in deprecated)}...) is deprecated "
                f"and will be refused in the next release; pass "
                f"options=LearnerOptions({spelled})",
                DeprecationWarning,
                stacklevel=2,
            )
            options = LearnerOptions(**deprecated)
        for name, value in (
            ("mailbox", mailbox), ("algorithm", algorithm), ("learner_id", learner_id),
            ("tokens_per_step", tokens_per_step),
            ("options", options if options is not None else LearnerOptions()),
            ("run_key", run_key),
        ):
            object.__setattr__(self, name, value)
        self._check()

    def _check(self) -> None:
        if not isinstance(self.options, LearnerOptions):
            raise ConfigError(
                f"options={self.options!r} must be a gradientmail.LearnerOptions or None"
            )
        if not isinstance(self.mailbox, Mailbox | str) or not self.mailbox:
            raise ConfigError(
                f"mailbox={self.mailbox!r} must be a Mailbox or a non-empty URL "
                "(a directory, file:///dir or s3://bucket/prefix)"
            )
        if self.algorithm is not None and not isinstance(self.algorithm, DiLoCo):
            raise ConfigError(
                f"algorithm={self.algorithm!r} must be a gradientmail.DiLoCo configuration or None"
            )
        if self.learner_id is not None and not isinstance(self.learner_id, str):
            raise ConfigError(f"learner_id={self.learner_id!r} must be a string or None")
        t = self.tokens_per_step
        if not (t is None or callable(t) or (isinstance(t, int) and not isinstance(t, bool))):
            raise ConfigError(
                f"tokens_per_step={t!r} must be an int >= 0, a callable returning one, or None"
            )
        if isinstance(t, int) and t < 0:
            raise ConfigError(f"tokens_per_step={t} is negative; need tokens_per_step >= 0")
        if self.run_key is not None and not isinstance(self.run_key, str | bytes):
            raise ConfigError(
                f"run_key must be a str, bytes or None, not {type(self.run_key).__name__}"
            )

    @property
    def resolved_algorithm(self) -> DiLoCo:
        """`algorithm`, or `DEFAULT_ALGORITHM` when it is None."""
        return self.algorithm if self.algorithm is not None else DEFAULT_ALGORITHM

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> DiLoCoPlugin:
        """The plugin the YAML file at `path` describes (see the module docstring)."""
        return cls.from_mapping(_read_yaml(Path(path)), source=os.fspath(path))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "config") -> DiLoCoPlugin:
        """The plugin a parsed YAML mapping describes; `source` names it in errors."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: the config must be a mapping, got {_kind(data)}")
        _check_keys(data, _YAML_KEYS, source, "")
        if "mailbox" not in data:
            raise ConfigError(
                f"{source}: 'mailbox' is required (a directory, file:///dir or "
                "s3://bucket/prefix), or set GRADIENTMAIL_MAILBOX"
            )
        typed = {k: _typed(k, v, _PLUGIN_KINDS[k], source)
                 for k, v in data.items() if k != "diloco"}
        kw: dict[str, Any] = {k: v for k, v in typed.items() if k in _OWN_KINDS}
        kw["options"] = LearnerOptions.from_mapping(
            {k: v for k, v in typed.items() if k in _OPTION_KINDS}, source)
        if data.get("diloco") is not None:
            kw["algorithm"] = algorithm_from_mapping(data["diloco"], source)
        plugin: DiLoCoPlugin = _build(cls, kw, source)
        return plugin

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DiLoCoPlugin:
        """The plugin from `GRADIENTMAIL_CONFIG`'s YAML file and `GRADIENTMAIL_*` variables.

        A variable overrides the same key of the file; a `GRADIENTMAIL_*` variable that
        names no setting draws a warning listing the valid ones. `environ` defaults to
        `os.environ`.
        """
        env = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        sources = []
        path = env.get(ENV_PREFIX + "CONFIG")
        if path:
            data = dict(_read_yaml(Path(path)))
            _check_keys(data, _YAML_KEYS, path, "")
            sources.append(f"{path} (GRADIENTMAIL_CONFIG)")
        diloco_in = data.get("diloco")
        if diloco_in is not None and not isinstance(diloco_in, Mapping):
            raise ConfigError(f"{path}: diloco must be a mapping, got {_kind(diloco_in)}")
        diloco: dict[str, Any] = dict(diloco_in or {})
        unknown = []
        overrides = False
        for var in sorted(env):
            if not var.startswith(ENV_PREFIX):
                continue
            key = var[len(ENV_PREFIX) :].lower()
            if key.upper() in _OTHER_VARIABLES:
                continue
            if key in _PLUGIN_KINDS:
                data[key] = _from_string(env[var], _PLUGIN_KINDS[key], var)
            elif key in _DILOCO_KINDS:
                diloco[key] = _from_string(env[var], _DILOCO_KINDS[key], var)
            else:
                unknown.append(var)
                continue
            overrides = True
        if unknown:
            valid = [ENV_PREFIX + k.upper() for k in (*_PLUGIN_KINDS, *_DILOCO_KINDS)]
            warnings.warn(
                f"ignoring environment variables {unknown}: no such gradientmail setting; "
                f"valid: {', '.join(valid)} (and GRADIENTMAIL_CONFIG)",
                stacklevel=2,
            )
        if overrides or not sources:
            sources.append("GRADIENTMAIL_* variables")
        data.pop("diloco", None)
        if diloco:
            data["diloco"] = diloco
        plugin = cls.from_mapping(data, source=" + ".join(sources))
        run_key = env_run_key(env)
        if run_key:
            plugin = dataclasses.replace(plugin, run_key=run_key)
        return plugin


def algorithm_from_mapping(data: Any, source: str = "config") -> DiLoCo:
    """A DiLoCo configuration from a mapping of its fields (the YAML `diloco:` section,
    in the recipes' words: `gradientmail.algorithms.words`); missing fields take
    DiLoCo's defaults."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: diloco must be a mapping, got {_kind(data)}")
    _check_keys(data, DILOCO_KEYS, source, "diloco.")
    kw = {k: _typed(k, v, _DILOCO_KINDS[k], source, prefix="diloco.") for k, v in data.items()}
    return diloco_from_mapping(kw, source)


def _build(cls: Any, kw: dict[str, Any], source: str, prefix: str = "") -> Any:
    try:
        return cls(**kw)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {prefix}{exc}") from None


def _read_yaml(path: Path) -> Mapping[str, Any]:
    try:
        import yaml
    except ImportError:
        raise MissingExtra("accelerate", "reading the plugin's YAML config") from None
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the gradientmail config {os.fspath(path)!r}: {exc.strerror}; "
            "point GRADIENTMAIL_CONFIG at an existing YAML file"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{os.fspath(path)}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{os.fspath(path)}: the config must be a mapping, got {_kind(data)}")
    return data


def _check_keys(data: Mapping[str, Any], valid: tuple[str, ...], source: str, where: str) -> None:
    unknown = [k for k in data if k not in valid]
    if unknown:
        raise ConfigError(
            f"{source}: unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(where + str(k) for k in unknown)}; valid keys: {', '.join(valid)}"
        )


def _kind(v: object) -> str:
    return f"{type(v).__name__} {v!r:.60}"


def _typed(key: str, v: Any, kind: str, source: str, prefix: str = "") -> Any:
    """`v` (a YAML value) checked against `kind`; merge/partition specs are built here."""
    name = f"{source}: {prefix}{key}={v!r:.80}"
    if kind.endswith("?") and v is None:
        return None
    base = kind.rstrip("?")
    if base == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{name} must be an integer{' or null' if kind[-1] == '?' else ''}")
        return v
    if base == "float":
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ConfigError(f"{name} must be a number")
        return float(v)
    if base == "bool":
        if not isinstance(v, bool):
            raise ConfigError(f"{name} must be true or false")
        return v
    if base == "str":
        if key == "compression" and v is False:
            return v  # DiLoCoPlugin explains the YAML `off` pitfall
        if not isinstance(v, str):
            raise ConfigError(f"{name} must be a string{' or null' if kind[-1] == '?' else ''}")
        return v
    if base == "mapping":
        if not isinstance(v, Mapping):
            raise ConfigError(f"{name} must be a mapping, e.g. {{egress_per_gb: 0.0}}")
        return v
    return v  # a merge or partition: `diloco_from_mapping` reads its words


def _from_string(raw: str, kind: str, var: str) -> Any:
    """An environment variable's text as the value `kind` wants."""
    text = raw.strip()
    where = f"{var}={raw!r:.80}"
    if kind.endswith("?") and text.lower() in ("", "none", "null"):
        return None
    base = kind.rstrip("?")
    if base == "int":
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{where} is not an integer") from None
    if base == "float":
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{where} is not a number") from None
        return value
    if base == "bool":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"{where} is not a bool; use one of {', '.join(_TRUE + _FALSE)}")
    if base == "str":
        return text
    if text.startswith("{") or base == "mapping":
        import yaml

        try:
            parsed = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where} is not a YAML flow mapping: {exc}") from None
        return parsed
    return text  # a merge or partition word
