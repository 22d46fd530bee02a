"""Every test that starts a process carries the `slow` marker, so `-m 'not slow'` is the
quick in-process subset the README promises.

The check reads the test modules' syntax; it imports and runs nothing. A function starts
a process when its body uses `subprocess`, `multiprocessing` (or torch's), `os.fork`,
`os.system`, `os.posix_spawn*`, `os.exec*`, `pty.spawn` or asyncio's subprocess calls,
passes a DataLoader `num_workers` other than 0, calls gradientmail's `run_demo` (outside
`pytest.raises`, where it refuses before starting anything), or calls a function, in its
own module or imported from another module under tests/, that does. A test starts one when
its body does or a fixture it names does. The CLI's `demo` command (`main(["demo", ...])`)
is out of its sight: such tests are marked by hand.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SPAWNING_MODULES = {"subprocess", "multiprocessing", "torch.multiprocessing"}
SPAWNING_CALLS = {
    "os": {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "execv",
           "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe"},
    "pty": {"spawn", "fork"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
}
# gradientmail's own entry points that start processes, called by tests in-process
LIBRARY_SPAWNERS = {"gradientmail.app.demo": {"run_demo"}}


class Module:
    """One parsed file: its top-level functions, the names it imports from modules under
    tests/, and the local names bound to process-starting modules and calls."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {
            node.name: node for node in self.tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        self.imported: dict[str, tuple[Path, str]] = {}
        self.spawning_names: set[str] = set()    # `subprocess`, `mp`, `Popen`, `fork`...
        self.library_spawners: set[str] = set()  # `run_demo`
        self.module_aliases: dict[str, str] = {}  # local name -> module, for `os.fork`
        for node in ast.walk(self.tree):  # function-local imports count too
            if isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name.split(".")[0]
                    if alias.name in SPAWNING_MODULES:
                        self.spawning_names.add(local)
                    self.module_aliases[local] = alias.name if alias.asname else local
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    local = alias.asname or alias.name
                    if {node.module, f"{node.module}.{alias.name}"} & SPAWNING_MODULES or (
                            alias.name in SPAWNING_CALLS.get(node.module, set())):
                        self.spawning_names.add(local)
                    elif alias.name in LIBRARY_SPAWNERS.get(node.module, set()):
                        self.library_spawners.add(local)
                    source = TESTS.joinpath(*node.module.split(".")).with_suffix(".py")
                    if source.is_file():
                        self.imported[local] = (source, alias.name)

    def spawns_directly(self, fn: ast.AST) -> bool:
        if any(isinstance(node, ast.Name) and node.id in self.library_spawners
               for node in walk_outside_raises(fn)):
            return True
        for node in ast.walk(fn):
            if isinstance(node, ast.Name) and node.id in self.spawning_names:
                return True
            if (isinstance(node, ast.keyword) and node.arg == "num_workers"
                    and not (isinstance(node.value, ast.Constant) and node.value.value == 0)):
                return True  # a DataLoader's worker processes
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.attr in SPAWNING_CALLS.get(
                        self.module_aliases.get(node.value.id, ""), set())):
                return True
        return False


def walk_outside_raises(node: ast.AST) -> Iterator[ast.AST]:
    """`ast.walk`, leaving out the bodies of `with pytest.raises(...)`: a library entry
    point called there is expected to refuse before it starts anything."""
    yield node
    if isinstance(node, ast.With | ast.AsyncWith) and any(
            isinstance(item.context_expr, ast.Call)
            and ast.unparse(item.context_expr.func).endswith("raises")
            for item in node.items):
        return
    for child in ast.iter_child_nodes(node):
        yield from walk_outside_raises(child)


class Spawners:
    """Which functions start a process, followed through calls and imports."""

    def __init__(self) -> None:
        self.modules: dict[Path, Module] = {}
        self.known: dict[tuple[Path, str], bool] = {}

    def module(self, path: Path) -> Module:
        if path not in self.modules:
            self.modules[path] = Module(path)
        return self.modules[path]

    def spawns(self, path: Path, name: str) -> bool:
        key = (path, name)
        if key in self.known:
            return self.known[key]
        self.known[key] = False  # a recursive call adds nothing
        mod = self.module(path)
        if name in mod.imported:
            found = self.spawns(*mod.imported[name])
        elif name in mod.functions:
            found = self.body_spawns(path, mod.functions[name])
        else:
            found = False
        self.known[key] = found
        return found

    def body_spawns(self, path: Path, fn: ast.AST) -> bool:
        mod = self.module(path)
        called = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
        return mod.spawns_directly(fn) or any(
            self.spawns(path, c) for c in sorted(called)
            if c in mod.functions or c in mod.imported)


def is_slow_mark(node: ast.expr) -> bool:
    """`pytest.mark.slow`, called or not."""
    if isinstance(node, ast.Call):
        node = node.func
    return (isinstance(node, ast.Attribute) and node.attr == "slow"
            and isinstance(node.value, ast.Attribute) and node.value.attr == "mark")


def module_is_slow(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            marks = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [
                node.value]
            return any(is_slow_mark(m) for m in marks)
    return False


def fixtures(path: Path, spawners: Spawners) -> dict[str, tuple[Path, str]]:
    """Fixture name -> where it is defined: the conftest.py files from tests/ down to the
    module, then the module itself (a nearer definition overrides)."""
    parts = path.parent.relative_to(TESTS).parts if path.is_relative_to(TESTS) else ()
    dirs = [TESTS.joinpath(*parts[:i]) for i in range(len(parts) + 1)]
    sources = [d / "conftest.py" for d in dirs if (d / "conftest.py").is_file()]
    found: dict[str, tuple[Path, str]] = {}
    for source in [*sources, path]:
        for name, fn in spawners.module(source).functions.items():
            if any("fixture" in ast.unparse(d) for d in fn.decorator_list):
                found[name] = (source, name)
    return found


def collected(
    tree: ast.Module,
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, list[ast.expr]]]:
    """(id, function, marks on it and its class) for the module's test functions and the
    test methods of its `Test*` classes."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name.startswith("test"):
                yield node.name, node, node.decorator_list
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if (isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                        and item.name.startswith("test")):
                    yield (f"{node.name}::{item.name}", item,
                           [*node.decorator_list, *item.decorator_list])


def unmarked(path: Path, spawners: Spawners) -> Iterator[str]:
    """The tests of one module that start a process without the `slow` marker."""
    mod = spawners.module(path)
    if module_is_slow(mod.tree):
        return
    named = fixtures(path, spawners)
    for name, fn, marks in collected(mod.tree):
        if any(is_slow_mark(m) for m in marks):
            continue
        params = [a.arg for a in fn.args.args]
        if spawners.body_spawns(path, fn) or any(
                spawners.spawns(*named[p]) for p in params if p in named):
            yield name


def test_every_test_that_starts_a_process_is_marked_slow() -> None:
    spawners = Spawners()
    missing = [f"{path.relative_to(TESTS)}::{name}"
               for path in sorted(TESTS.rglob("test_*.py")) for name in unmarked(path, spawners)]
    assert not missing, (
        "these tests start processes; mark them `@pytest.mark.slow` (or the module "
        "`pytestmark = pytest.mark.slow`) so `-m 'not slow'` stays in-process:\n  "
        + "\n  ".join(missing))


def test_the_check_sees_spawning_through_helpers_and_fixtures(tmp_path: Path) -> None:
    spawners = Spawners()
    source = tmp_path / "test_example.py"
    source.write_text(
        "import subprocess\nimport multiprocessing as mpx\nimport os\n"
        "import pytest\n"
        "def helper():\n    return subprocess.run(['true'])\n"
        "def indirect():\n    return helper()\n"
        "def pool():\n    return mpx.get_context('spawn')\n"
        "def forks():\n    return os.fork()\n"
        "def quiet(mp):\n    mp.setenv('A', '1')\n    return os.getpid()\n"
        "@pytest.fixture\ndef started():\n    yield helper()\n"
        "def test_uses_fixture(started):\n    pass\n"
        "@pytest.mark.slow\ndef test_marked():\n    indirect()\n"
        "class TestThem:\n    def test_method(self):\n        pool()\n"
        "def test_in_process(tmp_path):\n    quiet(None)\n"
        "def test_loader():\n    return dict(num_workers=1)\n"
        "def test_no_loader_workers():\n    return dict(num_workers=0)\n"
        "from gradientmail.app.demo import run_demo as demo\n"
        "def test_demo():\n    demo(None)\n"
        "def test_demo_refuses():\n    with pytest.raises(ValueError):\n        demo(None)\n")
    mod = spawners.module(source)
    assert [n for n in mod.functions if spawners.spawns(source, n)] == [
        "helper", "indirect", "pool", "forks", "started", "test_marked",
        "test_loader", "test_demo"]
    named = fixtures(source, spawners)
    assert named["started"] == (source, "started")
    assert "mailbox_factory" in named  # tests/conftest.py's
    assert list(unmarked(source, spawners)) == [
        "test_uses_fixture", "TestThem::test_method", "test_loader", "test_demo"]
    marked = ast.parse("import pytest\npytestmark = [pytest.mark.slow]\n")
    assert module_is_slow(marked)
    assert not module_is_slow(ast.parse("import pytest\npytestmark = pytest.mark.cuda\n"))
