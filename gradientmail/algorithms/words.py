"""DiLoCo's settings as words: the one vocabulary every entry point reads.

A recipe's `diloco:` section, the Accelerate YAML's `diloco:` mapping and its
`GRADIENTMAIL_*` variables all name a run's algorithm the same way: `DiLoCo`'s fields,
flat, with `merge: rda | mean` (and `direct_pattern` for rda) and `partition: bytes |
strided` (and `block_pattern` for strided). `diloco_from_mapping` reads them; the
spellings of earlier releases (`{type: rda, direct_pattern: ...}`, `weighted_mean`,
`by_bytes`, `{type: strided, block_pattern: ...}`) still read, with a
`DeprecationWarning` naming the new one. The manifest's JSON (`DiLoCo.to_json`) is a
wire format with its own words and does not change.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Merge, Rda, WeightedMean
from gradientmail.algorithms.partition import ByBytes, Partition, Strided
from gradientmail.errors import ConfigError

__all__ = [
    "COMMIT_DTYPES",
    "DELTA_DTYPES",
    "DILOCO_KEYS",
    "MERGES",
    "PARTITIONS",
    "diloco_from_mapping",
    "diloco_to_mapping",
    "merge_from_words",
    "partition_from_words",
]

#: The words of `merge`, `partition` and the transfer formats.
MERGES = ("rda", "mean")
PARTITIONS = ("bytes", "strided")
DELTA_DTYPES = ("F32", "BF16", "F8_E4M3", "F4", "TOPK_F8", "TOPK_Q2", "SIGN1")
COMMIT_DTYPES = ("BF16", "F8_E4M3", "F4")
_DEFAULT_DIRECT = Rda().direct_pattern
_DEFAULT_BLOCK = Strided().block_pattern
# The keys of a flat `diloco:` mapping: DiLoCo's fields, with the options of its merge
# and partition beside them.
DILOCO_KEYS: tuple[str, ...] = tuple(
    k for f in dataclasses.fields(DiLoCo)
    for k in ((f.name, "direct_pattern") if f.name == "merge"
              else (f.name, "block_pattern") if f.name == "partition" else (f.name,))
)
# Old word -> (canonical word, its option).
_OLD_MERGES = {"weighted_mean": "mean", "rda": "rda"}
_OLD_PARTITIONS = {"by_bytes": "bytes", "strided": "strided"}


def _deprecated(old: str, new: str, where: str) -> None:
    warnings.warn(
        f"{where}: {old} is deprecated and will be refused in the next release; write {new}",
        DeprecationWarning,
        stacklevel=4,
    )


def _option(spec: Mapping[str, Any], option: str | None, where: str) -> tuple[bool, Any]:
    extra = sorted(str(k) for k in spec if k not in ("type", option))
    if extra:
        allowed = option or "none"
        raise ConfigError(
            f"{where}: unknown option{'s' if len(extra) > 1 else ''} {', '.join(extra)} "
            f"for {spec['type']}; its options: {allowed}"
        )
    return (option in spec, spec.get(option)) if option else (False, None)


def _word(v: Any, where: str, key: str, canonical: tuple[str, ...], old: Mapping[str, str],
          option: str) -> tuple[str, bool, Any]:
    """(canonical word, whether the old mapping form gave the option, its value)."""
    if isinstance(v, Mapping) and isinstance(v.get("type"), str) and v["type"] in old:
        word = old[v["type"]]
        has, value = _option(v, option if word in ("rda", "strided") else None, where)
        new = f"{key}: {word}"
        if has:
            new += f" and {option}: {value!r} beside it"
        _deprecated(f"{{type: {v['type']}, ...}}", new, where)
        return word, has, value
    if isinstance(v, str) and v in canonical:
        return v, False, None
    if isinstance(v, str) and v in old:
        _deprecated(f"{key}: {v}", f"{key}: {old[v]}", where)
        return old[v], False, None
    raise ConfigError(f"{where}={v!r:.80} is not one of {', '.join(canonical)}")


def merge_from_words(merge: Any = "rda", direct_pattern: Any = _DEFAULT_DIRECT, *,
                     where: str = "merge", pattern_given: bool = False) -> Merge:
    """`merge` "rda" (tensors whose name contains `direct_pattern` merged by weighted
    mean; None: no pattern) or "mean" (which has no pattern: one given is unused); a
    Merge object is returned as is. `pattern_given` says the caller set
    `direct_pattern`."""
    if isinstance(merge, Rda | WeightedMean):
        if pattern_given:
            raise ConfigError(f"{where}: direct_pattern is given with merge={merge!r}; "
                              "set it in the Rda(...) instead")
        return merge
    word, has, value = _word(merge, where, "merge", MERGES, _OLD_MERGES, "direct_pattern")
    if has and pattern_given:
        raise ConfigError(f"{where}: direct_pattern is given twice; write it beside merge")
    if has:
        direct_pattern, pattern_given = value, True
    if word == "mean":
        # rda's option, beside a mean: a file's pattern stays when a variable switches
        # its merge to mean (GRADIENTMAIL_MERGE=mean), as a recipe's default does.
        return WeightedMean()
    try:
        return Rda(direct_pattern=direct_pattern)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def partition_from_words(partition: Any = "bytes", block_pattern: Any = _DEFAULT_BLOCK, *,
                         where: str = "partition", pattern_given: bool = False) -> Partition:
    """`partition` "bytes" (which has no pattern: one given is unused) or "strided"
    (blocks whose index `block_pattern` captures, dealt round-robin); a Partition object
    is returned as is. `pattern_given` says the caller set `block_pattern`."""
    if isinstance(partition, ByBytes | Strided):
        if pattern_given:
            raise ConfigError(f"{where}: block_pattern is given with partition={partition!r}; "
                              "set it in the Strided(...) instead")
        return partition
    word, has, value = _word(
        partition, where, "partition", PARTITIONS, _OLD_PARTITIONS, "block_pattern")
    if has and pattern_given:
        raise ConfigError(f"{where}: block_pattern is given twice; write it beside partition")
    if has:
        block_pattern, pattern_given = value, True
    if word == "bytes":
        return ByBytes()  # strided's option is left unused, as rda's by mean

    try:
        return Strided(block_pattern)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def diloco_from_mapping(data: Any, source: str = "config", prefix: str = "diloco.") -> DiLoCo:
    """The `DiLoCo` a flat mapping of `DILOCO_KEYS` describes; a missing key takes
    DiLoCo's default. Errors name `source`, the key (after `prefix`) and the fix."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: {prefix.rstrip('.')} must be a mapping, "
                          f"got {type(data).__name__} {data!r:.60}")
    unknown = [str(k) for k in data if k not in DILOCO_KEYS]
    if unknown:
        raise ConfigError(
            f"{source}: unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(prefix + k for k in unknown)}; valid keys: {', '.join(DILOCO_KEYS)}"
        )
    kw = {k: v for k, v in data.items() if k not in ("direct_pattern", "block_pattern")}
    kw["merge"] = merge_from_words(
        data.get("merge", "rda"), data.get("direct_pattern", _DEFAULT_DIRECT),
        where=f"{source}: {prefix}merge", pattern_given="direct_pattern" in data)
    kw["partition"] = partition_from_words(
        data.get("partition", "bytes"), data.get("block_pattern", _DEFAULT_BLOCK),
        where=f"{source}: {prefix}partition", pattern_given="block_pattern" in data)
    try:
        return DiLoCo(**kw)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {prefix}{exc}") from None


def diloco_to_mapping(algorithm: DiLoCo) -> dict[str, Any]:
    """The flat mapping `diloco_from_mapping` reads back as `algorithm` (canonical words;
    an Rda's `direct_names`, which a learner fills in from its model, are left out)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(DiLoCo):
        v = getattr(algorithm, f.name)
        if f.name == "merge":
            out["merge"] = "rda" if isinstance(v, Rda) else "mean"
            if isinstance(v, Rda):
                out["direct_pattern"] = v.direct_pattern
        elif f.name == "partition":
            out["partition"] = "strided" if isinstance(v, Strided) else "bytes"
            if isinstance(v, Strided):
                out["block_pattern"] = v.block_pattern
        else:
            out[f.name] = v
    return out
