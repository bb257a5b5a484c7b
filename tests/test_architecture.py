"""The one direction of imports (ARCHITECTURE.md), settings read only in api/, and our `kernels`
package never mistaken by transformers for the Hugging Face kernel hub."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("api", "base_engine", "adapters", "registry", "kernels")
STDLIB = set(sys.stdlib_module_names)

# package -> project packages it must never import
FORBIDDEN = {
    "kernels": {"api", "base_engine", "adapters", "registry"},
    "adapters": {"api", "base_engine", "registry"},
    "registry": {"api", "base_engine", "kernels"},
    "base_engine": {"api", "registry"},
    "migrations": {"api", "base_engine", "kernels"},
}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def package_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package: str) -> None:
    for path in package_files(package):
        for name in imports_of(path):
            top = name.split(".")[0]
            assert top not in FORBIDDEN[package], f"{path.relative_to(ROOT)} imports {name}"


def test_nothing_imports_api() -> None:
    for package in ("base_engine", "adapters", "registry", "kernels", "migrations"):
        for path in package_files(package):
            assert not any(n.split(".")[0] == "api" for n in imports_of(path)), path


def test_kernels_import_only_torch_and_triton() -> None:
    for path in package_files("kernels"):
        for name in imports_of(path):
            top = name.split(".")[0]
            assert top in STDLIB or top in {"torch", "triton", "kernels", "__future__"}, (
                f"{path.relative_to(ROOT)} imports {name}"
            )


def test_registry_uses_only_adapter_types() -> None:
    for path in package_files("registry"):
        for name in imports_of(path):
            if name.split(".")[0] == "adapters":
                assert name == "adapters.types", f"{path.relative_to(ROOT)} imports {name}"


def test_environment_read_only_in_api_settings() -> None:
    for package in ("base_engine", "adapters", "registry", "kernels"):
        for path in package_files(package):
            text = path.read_text()
            assert "os.environ" not in text and "getenv" not in text, (
                f"{path.relative_to(ROOT)} reads the env"
            )


def test_transformers_does_not_take_our_kernels_for_the_hub() -> None:
    from transformers.utils import import_utils

    assert import_utils.is_kernels_available() is False
