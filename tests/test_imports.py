"""The import graph, read from the source: no circles, layers import downward only, the library never imports the app."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ghosted_core", "studio")

# Lowest first. A module may import its own layer and the layers below it, never one above.
# Top-level modules of ghosted_core are named as themselves, packages by their folder.
LAYERS = (
    ("ghosted_core", "ghosted_core.errors", "ghosted_core.stopping", "ghosted_core.hub", "ghosted_core.registry",
     "ghosted_core.plan", "ghosted_core.hadamard", "ghosted_core.files", "ghosted_core.oom", "ghosted_core.products",
     "ghosted_core.progress"),
    ("ghosted_core.config_values", "ghosted_core.statistics", "ghosted_core.memory_parts", "ghosted_core.memory", "ghosted_core.architectures"),
    ("ghosted_core.data",),
    ("ghosted_core.model",),
    ("ghosted_core.calibration",),
    ("ghosted_core.selection", "ghosted_core.recovery"),
    ("ghosted_core.evaluation",),
    ("ghosted_core.distill",),
    ("ghosted_core.export",),
    ("ghosted_core.run",),
    ("ghosted_core.planning",),
    ("ghosted_core.report",),
    ("ghosted_core.cli_distill", "ghosted_core.cli_summary", "ghosted_core.cli", "ghosted_core.__main__"),
    ("studio",),
)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its source (function-level imports included)."""
    files = [p for package in PACKAGES for p in (root / package).rglob("*.py")]
    modules = {module_name(p, root): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from package import module` imports the module; `from module import name` the module
                found = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                         for alias in node.names]
            else:
                continue
            targets.update(t for t in found if t in modules and t != name)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def layer_of(module: str) -> int:
    best, depth = None, -1
    for index, members in enumerate(LAYERS):
        for member in members:
            if (module == member or module.startswith(member + ".")) and len(member) > depth:
                best, depth = index, len(member)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {Path(__file__).name}")
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{source} imports {target}" for source, targets in graph.items() for target in targets
                  if layer_of(target) > layer_of(source))


def test_the_cycle_finder_finds_a_synthetic_circle_and_passes_a_tree():
    tree = {"a": {"b", "c"}, "b": {"c"}, "c": set()}
    assert find_cycle(tree) is None
    circle = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(circle) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"x"}}) == ["x", "y", "x"]


def test_layer_check_flags_an_upward_import():
    assert upward_imports({"ghosted_core.memory": {"ghosted_core.run.options"}}) == [
        "ghosted_core.memory imports ghosted_core.run.options"]
    assert upward_imports({"ghosted_core.run.options": {"ghosted_core.memory"}}) == []


def test_graph_reader_sees_function_level_imports(tmp_path):
    package = tmp_path / "ghosted_core"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from ghosted_core.sub import b\n")
    (package / "sub" / "b.py").write_text("import ghosted_core.a\n")
    (tmp_path / "studio").mkdir()
    graph = import_graph(tmp_path)
    assert graph["ghosted_core.a"] == {"ghosted_core.sub.b"}
    assert find_cycle(graph) == ["ghosted_core.a", "ghosted_core.sub.b", "ghosted_core.a"]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_no_import_circle(graph):
    assert find_cycle(graph) is None


def test_layers_import_downward_only(graph):
    assert upward_imports(graph) == []


def test_the_library_never_imports_the_app(graph):
    offenders = sorted(f"{m} imports {t}" for m, targets in graph.items() if m.startswith("ghosted_core")
                       for t in targets if t.startswith("studio"))
    assert offenders == []


def test_every_package_says_what_its_modules_do():
    """A stage folder's __init__ docstring names each of its modules (ls plus one docstring shows the stage)."""
    for init in (ROOT / "ghosted_core").glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        modules = sorted(p.stem for p in init.parent.glob("*.py") if p.stem != "__init__")
        missing = [m for m in modules if f"{m}" not in doc]
        assert doc and not missing, f"{init.relative_to(ROOT)} does not name {missing or 'its modules'}"
