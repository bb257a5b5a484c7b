"""The layout's rules (ARCHITECTURE.md), checked on the source (tests/import_graph.py): the one
direction of imports between packages and between api's jobs, no import cycles, one home per name, one
door into the engine, tests that share code only through the harness; settings read only in api/, and
our `kernels` package never mistaken by transformers for the Hugging Face kernel hub. Every failure
names the file, the line and the import."""

from __future__ import annotations

import ast
import sys

import pytest

from tests.import_graph import (
    PRODUCT,
    ROOT,
    SCRIPTS,
    Edges,
    Import,
    Module,
    defined_in,
    imported_from_elsewhere,
    imports_in,
    module_imports,
    modules_under,
    one_cycle,
    project_modules,
    strongly_connected,
    syntax_tree,
    top_level_definitions,
    within,
)

STDLIB = set(sys.stdlib_module_names)

# package -> project packages it must never import
FORBIDDEN = {
    "kernels": {"api", "base_engine", "adapters", "registry"},
    "adapters": {"api", "base_engine", "registry"},
    "registry": {"api", "base_engine", "kernels", "migrations"},
    "base_engine": {"api", "registry"},
    "migrations": {"api", "base_engine", "kernels"},
}


def imports_of(module: Module) -> set[str]:
    """The dotted names the file's imports name (`import a.b` -> a.b, `from a.b import c` -> a.b)."""
    return {imp.module for imp in imports_in(module)}


def report(violations: list[str]) -> str:
    return f"{len(violations)} violation(s):\n  " + "\n  ".join(violations)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package: str) -> None:
    violations = [
        f"{imp.where} imports {imp.module}"
        for module in modules_under(package)
        for imp in imports_in(module)
        if imp.module.split(".")[0] in FORBIDDEN[package]
    ]
    assert not violations, report(violations)


def test_nothing_imports_api() -> None:
    for module in modules_under("base_engine", "adapters", "registry", "kernels", "migrations"):
        assert not any(n.split(".")[0] == "api" for n in imports_of(module)), module.file


def test_kernels_import_only_torch_and_triton() -> None:
    for module in modules_under("kernels"):
        for name in imports_of(module):
            top = name.split(".")[0]
            assert top in STDLIB or top in {"torch", "triton", "kernels", "__future__"}, (
                f"{module.file} imports {name}"
            )


def test_registry_uses_only_adapter_types() -> None:
    for module in modules_under("registry"):
        for name in imports_of(module):
            if name.split(".")[0] == "adapters":
                assert name == "adapters.types", f"{module.file} imports {name}"


def test_environment_read_only_in_api_settings() -> None:
    for module in modules_under("base_engine", "adapters", "registry", "kernels"):
        text = module.path.read_text()
        assert "os.environ" not in text and "getenv" not in text, f"{module.file} reads the env"


def test_transformers_does_not_take_our_kernels_for_the_hub() -> None:
    from transformers.utils import import_utils

    assert import_utils.is_kernels_available() is False


# ---------------------------------------------------------------------------------------------------
# No import cycles between product files.


def product_import_graph() -> Edges:
    edges: Edges = {}
    for imp, target in module_imports(modules_under(*PRODUCT)):
        if target.split(".")[0] in PRODUCT and target != imp.source.name:
            edges.setdefault(imp.source.name, {}).setdefault(target, imp)
    return edges


def test_no_import_cycles_between_product_files() -> None:
    edges, known = product_import_graph(), project_modules()
    violations = []
    for component in strongly_connected(edges):
        files = ", ".join(known[name].file for name in component)
        chain = " -> ".join(f"{imp.where} imports {imp.module}" for imp in one_cycle(edges, component))
        violations.append(f"import cycle between {files}: {chain}")
    assert not violations, report(violations)


def test_cycle_finder_names_the_cycle() -> None:
    def imp(source: str, target: str) -> Import:
        return Import(Module(source, ROOT / f"{source}.py", False), target, (), 1)

    edges: Edges = {"a": {"b": imp("a", "b")}, "b": {"c": imp("b", "c")}, "c": {"a": imp("c", "a")}, "d": {}}
    edges["d"]["a"] = imp("d", "a")
    assert strongly_connected(edges) == [["a", "b", "c"]]
    assert [i.module for i in one_cycle(edges, ["a", "b", "c"])] == ["b", "c", "a"]
    assert strongly_connected({"a": {"b": imp("a", "b")}, "b": {}}) == []


# ---------------------------------------------------------------------------------------------------
# One home per name: `from module import name` takes the name from the module that defines it.


def test_no_module_re_exports_a_name_it_does_not_define() -> None:
    known, violations = project_modules(), []
    for module in modules_under(*PRODUCT, *SCRIPTS):
        for imp in imports_in(module):
            source = known.get(imp.module)
            if source is None or source.is_package or not imp.names:
                continue
            for name in imp.names:
                if name in defined_in(source) or f"{imp.module}.{name}" in known:
                    continue
                home = imported_from_elsewhere(source, name)
                also = f" (it imports it itself: {home.where} from {home.module})" if home else ""
                violations.append(
                    f"{imp.where} imports {name} from {imp.module}, which {source.file} does not define{also}"
                )
    assert not violations, report(violations)


def test_top_level_definitions() -> None:
    body = ast.parse(
        "import os\nfrom x import y\nA = B, C = 1, 2\nD: int\ndef f(): E = 1\nclass G: H = 1\n"
        "if os: I = 1\nelse:\n    J = 1\ntry:\n    K = 1\nexcept Exception:\n    L = 1\n"
        "with open('f') as M: N = 1\n"
    ).body
    assert top_level_definitions(body) == {"A", "B", "C", "D", "f", "G", "I", "J", "K", "L", "M", "N"}


# ---------------------------------------------------------------------------------------------------
# Inside api: jobs import one way, the app state stays at the composition root and the routes.

FRONT_JOBS = ("api.inference", "api.http", "api.routes", "api.admin", "api.fleet", "api.cli")
# api job -> api packages it must never import
API_JOB_FORBIDDEN = {
    "api.tenancy": FRONT_JOBS,
    "api.metering": FRONT_JOBS,
    "api.metrics": FRONT_JOBS,
    "api.inference": ("api.routes", "api.admin", "api.fleet", "api.cli"),
}
APP_STATE_USERS = ("api.deps", "api.app", "api.bootstrap", "api.routes")


@pytest.mark.parametrize("job", sorted(API_JOB_FORBIDDEN))
def test_api_jobs_import_one_way(job: str) -> None:
    violations = [
        f"{imp.where} imports {target}"
        for imp, target in module_imports(m for m in modules_under("api") if within(m.name, job))
        if any(within(target, forbidden) for forbidden in API_JOB_FORBIDDEN[job])
    ]
    assert not violations, report(violations)


def test_only_the_composition_root_and_routes_see_the_app_state() -> None:
    violations = [
        f"{imp.where} imports {target}"
        for imp, target in module_imports(modules_under("api"))
        if within(target, "api.state") and not any(within(imp.source.name, user) for user in APP_STATE_USERS)
    ]
    assert not violations, report(violations)


def test_checkpoints_import_nothing_else_from_api() -> None:
    violations = [
        f"{imp.where} imports {target}"
        for imp, target in module_imports(
            m for m in modules_under("api") if within(m.name, "api.checkpoints")
        )
        if within(target, "api") and not within(target, "api.checkpoints")
    ]
    assert not violations, report(violations)


# ---------------------------------------------------------------------------------------------------
# One door into the engine: outside base_engine only the AsyncEngine facade is used.

ENGINE_INTERNALS = ("base_engine.engine", "base_engine.lora", "base_engine.scheduler", "base_engine.runner")
# value helpers under runner/ that hold no engine state: the dtype names a setting may take and the
# device check `serve` runs before it builds anything
ENGINE_VALUES = ("base_engine.runner.device",)
BEHIND_THE_FACADE = ("api", "registry", "adapters", "reliability", "scripts")
# attribute chains that reach through the facade: `<x>.engine.engine`, `<x>.lora.cache`
REACH_THROUGH = {("engine", "engine"), ("lora", "cache")}


def test_only_bootstrap_imports_engine_internals() -> None:
    violations = [
        f"{imp.where} imports {target}"
        for imp, target in module_imports(modules_under(*BEHIND_THE_FACADE))
        if any(within(target, internal) for internal in ENGINE_INTERNALS)
        and not any(within(target, value) for value in ENGINE_VALUES)
        and imp.source.name != "api.bootstrap"
    ]
    assert not violations, report(violations)


def receiver_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else ""


def test_api_does_not_reach_past_the_engine_facade() -> None:
    violations = []
    for module in modules_under("api"):
        for node in ast.walk(syntax_tree(module.path)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                if (node.value.attr, node.attr) in REACH_THROUGH:
                    violations.append(f"{module.file}:{node.lineno} uses .{node.value.attr}.{node.attr}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "_call"
            ):
                if "engine" in receiver_name(node.func.value).lower():
                    violations.append(
                        f"{module.file}:{node.lineno} calls {receiver_name(node.func.value)}._call("
                    )
    assert not violations, report(violations)


# ---------------------------------------------------------------------------------------------------
# Tests share code through tests.harness, never by importing another test module.


def is_test_module(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return name.split(".")[0] == "tests" and (last.startswith("test_") or last == "conftest")


def test_no_test_imports_another_test_module() -> None:
    violations = [
        f"{imp.where} imports {target}"
        for imp, target in module_imports(modules_under(*SCRIPTS))
        if is_test_module(target) and target != imp.source.name
    ]
    assert not violations, report(violations)
