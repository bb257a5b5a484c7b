"""registry imports only `adapters.types` from its siblings, and never base_engine, api or kernels."""

from __future__ import annotations

import ast
from pathlib import Path

import registry


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_registry_import_direction() -> None:
    root = Path(registry.__file__).parent
    for path in root.rglob("*.py"):
        for name in _imports(path):
            top = name.split(".")[0]
            assert top not in ("base_engine", "api", "kernels"), f"{path.name} imports {name}"
            if top == "adapters":
                assert name == "adapters.types", f"{path.name} imports {name}; only adapters.types is allowed"
