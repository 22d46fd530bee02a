"""The tree shows the architecture: each layer imports only from the layers below it, and
no module at the package root only re-exports another."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "gradientmail"

#: Bottom to top. A module may import from its own layer and any layer before it.
LAYERS = [
    ("errors", "clock", "testing", "events", "traffic"),
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
    unplaced = sorted(layered - set(RANK))
    assert unplaced == []


def test_layers_import_only_from_below() -> None:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent == ROOT and path.stem == "__init__":
            continue  # the package's front door may name any layer
        own = RANK[_layer(path)]
        for line, target in _imports(path):
            if target in RANK and RANK[target] > own:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert wrong == []


def test_learner_and_syncer_packages_export_their_runtimes() -> None:
    from gradientmail.learner import Learner
    from gradientmail.learner.runtime import Learner as RuntimeLearner
    from gradientmail.run.replica import theta_digest as runtime_digest
    from gradientmail.syncer import Syncer, theta_digest
    from gradientmail.syncer.runtime import Syncer as RuntimeSyncer

    assert (Learner, Syncer, theta_digest) == (RuntimeLearner, RuntimeSyncer, runtime_digest)


def _only_reexports(path: pathlib.Path) -> bool:
    """True when a module's body is imports and `__all__` alone: a hub, not a home."""
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return bool(body) and all(
        isinstance(node, (ast.Import, ast.ImportFrom))
        or (isinstance(node, (ast.Assign, ast.AnnAssign)) and "__all__" in ast.unparse(node))
        for node in body
    )


def test_no_module_only_reexports_another() -> None:
    hubs = sorted(
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
        if p.stem != "__init__" and _only_reexports(p)
    )
    assert hubs == []


def test_integrations_sit_on_the_library_not_the_app() -> None:
    wrong = [
        f"{path.relative_to(ROOT.parent)}:{line}"
        for pkg in ("gradientmail_lightning", "gradientmail_accelerate")
        for path in sorted((ROOT.parent / pkg).rglob("*.py"))
        for line, target in _imports(path) if target == "app"
    ]
    assert wrong == []


def test_each_name_is_exported_by_the_module_that_defines_it() -> None:
    passed_on = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.stem == "__init__":
            continue  # a package's front door exports its modules' names
        tree = ast.parse(path.read_text())
        imported = {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom)
                    for a in node.names}
        listed = {elt.value for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(t, "id", None) == "__all__" for t in node.targets)
                  for elt in getattr(node.value, "elts", []) if isinstance(elt, ast.Constant)}
        if listed & imported:
            passed_on[str(path.relative_to(ROOT))] = listed & imported
    assert passed_on == {}
