"""The configuration reference, generated from the code: `python -m gradientmail.app.reference`.

Every setting of `DiLoCo` (a run's algorithm) and `LearnerOptions` (one learner's
settings) with its type, its default, its spelling at each entry point and its one line
of meaning (the dataclass field's `doc`), written to docs/configuration.md. A test
regenerates the page and fails when it differs from the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Rda
from gradientmail.algorithms.partition import Strided
from gradientmail.algorithms.words import COMMIT_DTYPES, DELTA_DTYPES, MERGES, PARTITIONS
from gradientmail.learner.options import COMPRESSIONS, LearnerOptions
from gradientmail.traffic import Prices

__all__ = ["CLI_FLAGS", "DEFAULT_PATH", "OPTION_DOCS", "main", "render"]

#: Where the page lives, from the repository root.
DEFAULT_PATH = Path("docs") / "configuration.md"
#: The `gradientmail` command's flags that set a setting (the closer's are the learner's).
CLI_FLAGS: dict[str, tuple[str, ...]] = {
    "poll_interval": ("gradientmail sync --poll-interval",),
    "lease_timeout": ("gradientmail sync --lease-timeout",),
    "keep_versions": ("gradientmail sync --keep", "gradientmail sweep --keep"),
    "prices": ("gradientmail status --put-per-1000 --get-per-1000 --egress-per-gb",),
    "outlier_factor": ("gradientmail demo --outlier-factor",),
}
#: The options of `merge` and `partition`, which are keys of their own in a recipe.
OPTION_DOCS = {
    "direct_pattern": (
        "merge", Rda().direct_pattern,
        "with merge rda: tensors whose lowercased name contains it are merged by the "
        "weighted mean (None: no pattern; the model's embeddings always are)"),
    "block_pattern": (
        "partition", Strided().block_pattern,
        "with partition strided: the regular expression whose one group captures a "
        "tensor's block index"),
}
_PYTHON = {
    "merge": "`DiLoCo(merge=...)`: `Rda(...)`, `WeightedMean()`",
    "partition": "`DiLoCo(partition=...)`: `ByBytes()`, `Strided(...)`",
}
_COMMAND = "PYTHONPATH=$PWD python -m gradientmail.app.reference"


def _code(text: str) -> str:
    return f"`{text}`" if "`" not in text else f"`` {text} ``"


def _default(name: str, value: Any) -> str:
    if name == "merge":
        return _code("rda")
    if name == "partition":
        return _code("bytes")
    if isinstance(value, Prices):
        fields = ", ".join(f"{f.name}={getattr(value, f.name)!r}"
                           for f in dataclasses.fields(value))
        return f"S3 Standard ({fields})"
    if isinstance(value, str):
        return _code(f"'{value}'")  # as written in YAML, not Python's escaped repr
    return _code(repr(value))


def _type(name: str, annotation: Any) -> str:
    words = {
        "merge": " \\| ".join(MERGES),
        "partition": " \\| ".join(PARTITIONS),
        "delta_dtype": " \\| ".join((*DELTA_DTYPES, "None")),
        "commit_dtype": " \\| ".join((*COMMIT_DTYPES, "None")),
        "compression": " \\| ".join(COMPRESSIONS),
        "prices": "mapping of put_per_1000, get_per_1000, egress_per_gb",
    }
    if name in words:
        return words[name]
    return str(annotation).replace("|", "\\|")


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(rows: list[list[str]]) -> list[str]:
    head = ["Setting", "Type", "Default", "Python", "Recipe `diloco:`",
            "Accelerate YAML / variable", "`gradientmail` CLI", "Meaning"]
    return [_row(head), _row(["---"] * len(head)), *(_row(r) for r in rows)]


def _diloco_rows() -> list[list[str]]:
    rows = []
    for f in dataclasses.fields(DiLoCo):
        rows.append([
            _code(f.name), _type(f.name, f.type), _default(f.name, f.default),
            _PYTHON.get(f.name, _code(f"DiLoCo({f.name}=...)")), _code(f.name),
            f"{_code('diloco.' + f.name)} / {_code('GRADIENTMAIL_' + f.name.upper())}",
            "<br>".join(_code(c) for c in CLI_FLAGS.get(f.name, ())) or "—",
            f.metadata["doc"],
        ])
        for option, (owner, default, doc) in OPTION_DOCS.items():
            if owner != f.name:
                continue
            cls = "Rda" if owner == "merge" else "Strided"
            rows.append([
                _code(option), "str \\| None" if owner == "merge" else "str",
                _default(option, default), _code(f"{cls}({option}=...)"), _code(option),
                f"{_code('diloco.' + option)} / {_code('GRADIENTMAIL_' + option.upper())}",
                "—", doc,
            ])
    return rows


def _option_rows() -> list[list[str]]:
    return [[
        _code(f.name), _type(f.name, f.type), _default(f.name, f.default),
        _code(f"LearnerOptions({f.name}=...)"), _code(f.name),
        f"{_code(f.name)} / {_code('GRADIENTMAIL_' + f.name.upper())}",
        "<br>".join(_code(c) for c in CLI_FLAGS.get(f.name, ())) or "—",
        f.metadata["doc"],
    ] for f in dataclasses.fields(LearnerOptions)]


def render() -> str:
    """The page's text."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the code by `{_COMMAND}`; do not edit by hand. -->",
        "",
        "A run is configured by two frozen, validated dataclasses: `gradientmail.DiLoCo`, "
        "the run's algorithm (every party of a run shares it; its JSON goes into the "
        "manifest), and `gradientmail.LearnerOptions`, how one learner takes part. Every "
        "entry point reads them with the same names, words and defaults:",
        "",
        "- **Python**: `Learner(adapter, DiLoCo(...), mailbox, options=LearnerOptions(...))`; "
        "`DiLoCoCallback(mailbox, DiLoCo(...), options=LearnerOptions(...))` (or the "
        "settings by name); `DiLoCoPlugin(mailbox, DiLoCo(...), options=LearnerOptions(...))`.",
        "- **Recipes** (`gradientmail-train`): the `diloco:` section holds both, flat.",
        "- **Accelerate** (`DiLoCoPlugin.from_env()`): the YAML named by "
        "`GRADIENTMAIL_CONFIG` holds the learner's settings at the top and the algorithm "
        "under `diloco:`; each key has a `GRADIENTMAIL_<KEY>` variable, which wins "
        "(`none` sets an optional one to None; `GRADIENTMAIL_PRICES` is a YAML flow "
        "mapping such as `{egress_per_gb: 0}`).",
        "- **CLI**: the `gradientmail` command's flags in the table.",
        "",
        "Given nothing, every entry point builds `DiLoCo()` and `LearnerOptions()`: "
        "Decoupled DiLoCo with H = 100, one fragment (set `fragments` for Streaming "
        "DiLoCo), quorum 1, no barrier. The run key of an authenticated run is never a "
        "setting: it comes from `GRADIENTMAIL_RUN_KEY` (or `run_key=` in Python).",
        "",
        "## The run's algorithm: `DiLoCo`",
        "",
        *_table(_diloco_rows()),
        "",
        "## A learner's settings: `LearnerOptions`",
        "",
        *_table(_option_rows()),
        "",
        "Beside them, each integration has a few of its own: the learner id "
        "(`learner_id`), `tokens_per_step` (recipes, Accelerate) and `log_every_n_steps` "
        "(recipes).",
        "",
        "## Spellings of earlier releases",
        "",
        "These still read, for one release, with a `DeprecationWarning` naming the new one.",
        "",
        _row(["Earlier", "Now"]),
        _row(["---", "---"]),
        _row(["`merge: {type: rda, direct_pattern: P}`", "`merge: rda` and `direct_pattern: P`"]),
        _row(["`merge: weighted_mean`, `{type: weighted_mean}`", "`merge: mean`"]),
        _row(["`partition: by_bytes`", "`partition: bytes`"]),
        _row(["`partition: {type: strided, block_pattern: P}`",
              "`partition: strided` and `block_pattern: P`"]),
        _row(["`Learner(..., poll_interval=1.0, ...)`",
              "`Learner(..., options=LearnerOptions(poll_interval=1.0, ...))`"]),
        _row(["`DiLoCoPlugin(mailbox, poll_interval=1.0, ...)`",
              "`DiLoCoPlugin(mailbox, options=LearnerOptions(poll_interval=1.0, ...))`"]),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Write the page (default docs/configuration.md), or with --check exit 1 when the
    file differs from what the code gives."""
    parser = argparse.ArgumentParser(prog="python -m gradientmail.app.reference",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out", nargs="?", default=str(DEFAULT_PATH), help="the file to write")
    parser.add_argument("--check", action="store_true",
                        help="compare instead of writing; exit 1 when they differ")
    args = parser.parse_args(argv)
    path = Path(args.out)
    text = render()
    if args.check:
        same = path.is_file() and path.read_text() == text
        if not same:
            print(f"{path} differs from the code; regenerate it with: {_COMMAND}",
                  file=sys.stderr)
        return 0 if same else 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
