"""`DiLoCoPlugin`: what the Accelerate wrapper needs to run a learner, as one dataclass.

Accelerate refuses custom `kwargs_handlers` and its config YAML rejects unknown keys, so
gradientmail's settings live apart: in a `DiLoCoPlugin` built in code, or read by
`DiLoCoPlugin.from_env()` from the YAML file named by `GRADIENTMAIL_CONFIG` and from
`GRADIENTMAIL_*` variables (a variable overrides the same key of the file). This module is
the one place the wrapper reads the environment.

The YAML file::

    mailbox: runs/demo            # a directory, file:///dir, s3://bucket/prefix
    learner_id: node-3            # optional; default <host>-<pid> of rank 0
    poll_interval: 0.5            # and sync, compression, tokens_per_step, lease_every,
                                  # lease_timeout, prefix, wait_for_learners,
                                  # wait_timeout
    diloco:                       # the fields of gradientmail.DiLoCo
      sync_every: 50
      fragments: 2
      merge: {type: rda, direct_pattern: embed}   # or: rda, weighted_mean
      partition: by_bytes                         # or: {type: strided, block_pattern: ...}

Missing `diloco` fields take `DEFAULT_ALGORITHM`'s values, except that `fragments`
defaults to min(4, sync_every) and `in_flight` to min(2, fragments). Each key has a
variable: `GRADIENTMAIL_MAILBOX`, `GRADIENTMAIL_SYNC_EVERY`, `GRADIENTMAIL_MERGE` (`rda`,
`weighted_mean` or a YAML flow mapping such as `{type: rda, direct_pattern: null}`), ...;
`none` (or an empty value) sets an optional field to None. The run key of an authenticated
run comes from `GRADIENTMAIL_RUN_KEY` only (a secret does not belong in a config file), as
for the `gradientmail` command.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gradientmail.algorithms.diloco import ByBytes, DiLoCo, Rda, Strided, WeightedMean
from gradientmail.algorithms.merge import Merge
from gradientmail.algorithms.partition import Partition
from gradientmail.errors import ConfigError, MissingExtra
from gradientmail.integration.together import check_wait
from gradientmail.learner.runtime import WAIT_TIMEOUT
from gradientmail.mailbox.base import Mailbox
from gradientmail.traffic import S3_STANDARD, Prices
from gradientmail.wire.auth import RUN_KEY_VARIABLE, env_run_key

__all__ = [
    "DEFAULT_ALGORITHM",
    "ENV_PREFIX",
    "RUN_KEY_VARIABLE",
    "DiLoCoPlugin",
    "algorithm_from_mapping",
]

#: The algorithm of a plugin built without one: Streaming + Decoupled DiLoCo, H = 100.
DEFAULT_ALGORITHM = DiLoCo(sync_every=100, fragments=4)
ENV_PREFIX = "GRADIENTMAIL_"
#: Variables of the GRADIENTMAIL_ namespace that belong to other parts of the package.
_OTHER_VARIABLES = frozenset({"CONFIG", "RUN_KEY", "REGOLD"})

# Each setting's kind, shared by the YAML reader (typed values) and the environment
# reader (strings): "int", "int?", "float", "bool", "bool?", "str", "str?", "merge",
# "partition".
_PLUGIN_KINDS = {
    "mailbox": "str",
    "learner_id": "str?",
    "tokens_per_step": "int?",
    "sync": "bool",
    "poll_interval": "float",
    "compression": "str",
    "lease_every": "float",
    "lease_timeout": "float",
    "prefix": "str",
    "wait_for_learners": "int?",
    "wait_timeout": "float",
}
_DILOCO_KINDS = {
    "sync_every": "int",
    "fragments": "int",
    "in_flight": "int",
    "overlap_steps": "int?",
    "mixing": "float",
    "quorum_size": "int",
    "outer_lr": "float",
    "outer_momentum": "float",
    "merge": "merge",
    "partition": "partition",
    "global_batch_size": "int?",
    "delta_dtype": "str?",
    "commit_dtype": "str?",
    "flush_on_close": "bool",
    "rebase": "bool?",
    "outlier_factor": "float?",
    "checkpoint_every": "int",
    "keep_rounds": "int?",
}
_YAML_KEYS = (*_PLUGIN_KINDS, "diloco")
_COMPRESSIONS = ("off", "zstd")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class DiLoCoPlugin:
    """The wrapper's settings: where the run lives and how this learner takes part.

    `mailbox` is a Mailbox or a URL; `algorithm` the run's DiLoCo configuration (None:
    `DEFAULT_ALGORITHM`); `learner_id` (None: `<host>-<pid>` of rank 0, or the id a loaded
    checkpoint carries); `tokens_per_step`: tokens one process consumes per optimizer
    step, an int or a callable returning this step's count (None: count with
    `DiLoCo.count(batch)`, or 0, which merges learners as equals); `sync` runs a syncer
    in the learner; `wait_for_learners` learners (this one included; None: those a
    barrier needs, `quorum_size` when `overlap_steps=0`; 0: none) are waited for at
    `start()`, for up to `wait_timeout` seconds; the rest go to `gradientmail.Learner` as
    they are.
    """

    mailbox: Mailbox | str
    algorithm: DiLoCo | None = None
    learner_id: str | None = None
    tokens_per_step: int | Callable[[], int] | None = None
    sync: bool = True
    poll_interval: float = 1.0
    compression: str = "off"
    lease_every: float = 60.0
    lease_timeout: float = 120.0
    prefix: str = ""
    wait_for_learners: int | None = None
    wait_timeout: float = WAIT_TIMEOUT
    run_key: str | bytes | None = dataclasses.field(default=None, repr=False)
    #: What the learner's traffic is priced at (`Learner.traffic`, the `diloco/cost_*`
    #: metrics): S3 Standard by default.
    prices: Prices = S3_STANDARD

    def __post_init__(self) -> None:
        if not isinstance(self.prices, Prices):
            raise ConfigError(
                f"prices={self.prices!r} must be a gradientmail.traffic.Prices, e.g. "
                "Prices(egress_per_gb=0.0) for learners in the bucket's region"
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
        if not isinstance(self.sync, bool):
            raise ConfigError(f"sync={self.sync!r} must be a bool")
        for name in ("poll_interval", "lease_every", "lease_timeout"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not (math.isfinite(v) and v > 0)
            ):
                raise ConfigError(f"{name}={v!r} must be a finite number of seconds > 0")
        if self.lease_timeout <= self.lease_every:
            raise ConfigError(
                f"lease_timeout={self.lease_timeout} must exceed lease_every="
                f"{self.lease_every}; use about twice lease_every"
            )
        if self.compression not in _COMPRESSIONS:
            hint = (
                ' (YAML reads a bare off as false: write compression: "off")'
                if self.compression is False  # type: ignore[comparison-overlap]
                else ""
            )
            raise ConfigError(
                f"compression={self.compression!r} is not a codec; use 'off' or 'zstd'{hint}"
            )
        check_wait(self.wait_for_learners, self.wait_timeout)
        if not isinstance(self.prefix, str):
            raise ConfigError(f"prefix={self.prefix!r} must be a string")
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
        kw: dict[str, Any] = {
            k: _typed(k, v, _PLUGIN_KINDS[k], source) for k, v in data.items() if k != "diloco"
        }
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
    """A DiLoCo configuration from a mapping of its fields (the YAML `diloco:` section)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: diloco must be a mapping, got {_kind(data)}")
    _check_keys(data, tuple(_DILOCO_KINDS), source, "diloco.")
    kw = {k: _typed(k, v, _DILOCO_KINDS[k], source, prefix="diloco.") for k, v in data.items()}
    kw.setdefault("sync_every", DEFAULT_ALGORITHM.sync_every)
    if "fragments" not in kw and isinstance(kw["sync_every"], int):
        kw["fragments"] = max(1, min(DEFAULT_ALGORITHM.fragments, kw["sync_every"]))
    if "in_flight" not in kw and isinstance(kw["fragments"], int):
        kw["in_flight"] = max(1, min(2, kw["fragments"]))
    algorithm: DiLoCo = _build(DiLoCo, kw, source, prefix="diloco.")
    return algorithm


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
    if base == "merge":
        return _merge(v, f"{source}: {prefix}merge")
    return _partition(v, f"{source}: {prefix}partition")


_MERGES: dict[str, tuple[type[Any], tuple[str, ...]]] = {
    "rda": (Rda, ("direct_pattern",)),
    "weighted_mean": (WeightedMean, ()),
}
_PARTITIONS: dict[str, tuple[type[Any], tuple[str, ...]]] = {
    "by_bytes": (ByBytes, ()),
    "strided": (Strided, ("block_pattern",)),
}


def _spec(v: Any, where: str, table: dict[str, tuple[type[Any], tuple[str, ...]]]) -> Any:
    """`name` or `{type: name, option: value}` → the configured object."""
    kinds = ", ".join(table)
    if isinstance(v, tuple(cls for cls, _ in table.values())):
        return v  # already built (a value from the environment)
    if isinstance(v, str):
        v = {"type": v}
    if not isinstance(v, Mapping) or not isinstance(v.get("type"), str):
        raise ConfigError(
            f"{where}={v!r:.80} must be one of {kinds} or a mapping with a 'type' "
            f"(e.g. {{type: {next(iter(table))}}})"
        )
    entry = table.get(v["type"])
    if entry is None:
        raise ConfigError(f"{where}: type {v['type']!r} is unknown; use one of {kinds}")
    cls, options = entry
    extra = [k for k in v if k != "type" and k not in options]
    if extra:
        allowed = ", ".join(options) if options else "none"
        raise ConfigError(
            f"{where}: unknown option{'s' if len(extra) > 1 else ''} {', '.join(map(str, extra))} "
            f"for {v['type']}; its options: {allowed}"
        )
    try:
        return cls(**{k: v[k] for k in options if k in v})
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _merge(v: Any, where: str) -> Merge:
    merge: Merge = _spec(v, where, _MERGES)
    return merge


def _partition(v: Any, where: str) -> Partition:
    partition: Partition = _spec(v, where, _PARTITIONS)
    return partition


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
    if text.startswith("{"):
        import yaml

        try:
            parsed = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where} is not a YAML flow mapping: {exc}") from None
    else:
        parsed = text
    return _merge(parsed, var) if base == "merge" else _partition(parsed, var)
