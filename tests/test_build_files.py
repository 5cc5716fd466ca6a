"""The Makefile's and the Dockerfile's Python lines name modules and names that exist (a moved module breaks setup)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_snippets() -> list[tuple[str, str]]:
    """(where, code) for every `python -c "…"`, `python -m module` and `python - <<'PY'` heredoc."""
    found = []
    for name in ("Makefile", "Dockerfile"):
        text = (ROOT / name).read_text()
        found += [(f"{name}: -c", code) for code in re.findall(r'python -c "([^"]+)"', text.replace("$(PY)", "python"))]
        found += [(f"{name}: -m {module}", f"import {module}") for module in
                  re.findall(r"python -m ([\w.]+)", text.replace("$(PY)", "python")) if module.startswith("ghosted_core")]
        found += [(f"{name}: heredoc", code) for code in re.findall(r"<<'PY'\n(.*?)\nPY\n", text, flags=re.S)]
    return found


def project_imports(code: str) -> list[tuple[str, str | None]]:
    pairs = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("ghosted_core", "studio"):
            pairs += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            pairs += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] in ("ghosted_core", "studio")]
    return pairs


def test_snippets_are_found():
    wheres = [where for where, _ in python_snippets()]
    assert any(w.startswith("Makefile: -m ghosted_core.model.embedded") for w in wheres) and any(w.startswith("Dockerfile: heredoc") for w in wheres)


@pytest.mark.parametrize("where, code", python_snippets(), ids=[where for where, _ in python_snippets()])
def test_build_file_python_imports_exist(where, code):
    for module, name in project_imports(code):
        imported = importlib.import_module(module)
        assert name is None or hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}"), \
            f"{where}: {module} has no {name}"
