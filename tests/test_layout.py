"""The tree shows the architecture: each layer imports only from the layers below it, and
the design's public module names still import, as re-exports of the layered modules."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "gradientmail"

#: Bottom to top. A module may import from its own layer and any layer before it.
LAYERS = [
    ("errors", "clock", "events", "traffic"),
    ("mailbox",),
    ("wire",),
    ("backends", "adapters"),
    ("algorithms",),
    ("run",),
    ("syncer",),
    ("learner",),
    ("integration",),
    ("app",),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}

#: Public module name (DESIGN §9) -> the module that holds it now.
REEXPORTS = {
    "gradientmail.tensor_bytes": "gradientmail.wire.tensor_bytes",
    "gradientmail.serialization": "gradientmail.wire.serialization",
    "gradientmail.quantization": "gradientmail.wire.quantization",
    "gradientmail.compression": "gradientmail.wire.compression",
    "gradientmail.records": "gradientmail.wire.records",
    "gradientmail.auth": "gradientmail.wire.auth",
    "gradientmail.keyspace": "gradientmail.run.keyspace",
    "gradientmail.protocol": "gradientmail.run.protocol",
}


def _layer(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, the gradientmail layer named) for every import, top-level or in a function."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = (
                [f"{node.module}.{a.name}" for a in node.names]
                if node.module == "gradientmail"
                else [node.module]
            )
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "gradientmail" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def test_every_module_belongs_to_a_layer() -> None:
    layered = {_layer(p) for p in ROOT.rglob("*.py") if p.parent != ROOT or p.stem != "__init__"}
    unplaced = sorted(layered - set(RANK) - {n.rsplit(".", 1)[1] for n in REEXPORTS})
    assert unplaced == []


def test_layers_import_only_from_below() -> None:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent == ROOT and (path.stem == "__init__" or path.stem in
                                    {n.rsplit(".", 1)[1] for n in REEXPORTS}):
            continue  # the package's front door and the re-exports may name any layer
        own = RANK[_layer(path)]
        for line, target in _imports(path):
            if target in RANK and RANK[target] > own:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert wrong == []


@pytest.mark.parametrize("public,module", sorted(REEXPORTS.items()))
def test_public_module_names_reexport_the_layered_modules(public: str, module: str) -> None:
    front, real = importlib.import_module(public), importlib.import_module(module)
    assert front.__all__ == real.__all__
    assert all(getattr(front, name) is getattr(real, name) for name in real.__all__)


def test_learner_and_syncer_packages_export_their_runtimes() -> None:
    from gradientmail.learner import Learner
    from gradientmail.learner.runtime import Learner as RuntimeLearner
    from gradientmail.syncer import Syncer, theta_digest
    from gradientmail.syncer.runtime import Syncer as RuntimeSyncer
    from gradientmail.syncer.runtime import theta_digest as runtime_digest

    assert (Learner, Syncer, theta_digest) == (RuntimeLearner, RuntimeSyncer, runtime_digest)
