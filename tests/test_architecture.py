"""The layout's rules (ARCHITECTURE.md), checked on the source with `ast`: the one direction of imports
between packages and between api's jobs, no import cycles, one home per name, one door into the
engine, tests that share code only through the harness; settings read only in api/, and our
`kernels` package never mistaken by transformers for the Hugging Face kernel hub.

Every import counts, wherever it is written: at module level, inside a function (lazy) or under
`if TYPE_CHECKING:`. `from pkg import mod`, where `mod` is a submodule, is an import of `pkg.mod`.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("api", "base_engine", "adapters", "registry", "kernels")
STDLIB = set(sys.stdlib_module_names)

# package -> project packages it must never import
FORBIDDEN = {
    "kernels": {"api", "base_engine", "adapters", "registry"},
    "adapters": {"api", "base_engine", "registry"},
    "registry": {"api", "base_engine", "kernels", "migrations"},
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


# ---------------------------------------------------------------------------------------------------
# The import graph: every project file as a dotted module, every import it writes.

PRODUCT = ("api", "base_engine", "adapters", "registry", "kernels", "migrations")
SCRIPTS = ("tests", "reliability", "benchmarks", "scripts")


@dataclass(frozen=True)
class Module:
    name: str  # dotted: "registry.store"; a package is its __init__.py ("registry")
    path: Path
    is_package: bool

    @property
    def file(self) -> str:
        return str(self.path.relative_to(ROOT))


@dataclass(frozen=True)
class Import:
    source: Module
    module: str  # absolute dotted name after `import` / `from`
    names: tuple[str, ...]  # `from module import a, b` -> ("a", "b"); `import module` -> ()
    line: int

    @property
    def where(self) -> str:
        return f"{self.source.file}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def project_modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for top in PRODUCT + SCRIPTS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if any(part.startswith(".") or part == "node_modules" for part in path.relative_to(ROOT).parts):
                continue
            found[module_name(path)] = Module(module_name(path), path, path.name == "__init__.py")
    return found


def modules_under(*tops: str) -> list[Module]:
    return [m for m in project_modules().values() if m.name.split(".")[0] in tops]


@functools.cache
def syntax_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def absolute_module(source: Module, module: str | None, level: int) -> str:
    """The dotted name a (possibly relative) `from` names, seen from `source`."""
    if level == 0:
        return module or ""
    package = source.name.split(".") if source.is_package else source.name.split(".")[:-1]
    package = package[: len(package) - (level - 1)]
    return ".".join([*package, module] if module else package)


@functools.cache
def imports_in(module: Module) -> tuple[Import, ...]:
    """Every import statement of the file, lazy and `TYPE_CHECKING` ones included."""
    found: list[Import] = []
    for node in ast.walk(syntax_tree(module.path)):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = absolute_module(module, node.module, node.level)
            found.append(Import(module, target, tuple(a.name for a in node.names), node.lineno))
    return tuple(found)


def imported_modules(imp: Import) -> list[str]:
    """The project modules an import names: `from pkg import mod` -> pkg.mod when mod is a submodule,
    else the module itself. Outside modules (stdlib, third-party) give nothing."""
    known = project_modules()
    submodules = [f"{imp.module}.{n}" for n in imp.names if f"{imp.module}.{n}" in known]
    takes_names = len(submodules) < len(imp.names) or not imp.names
    return submodules + ([imp.module] if takes_names and imp.module in known else [])


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def module_imports(modules: Iterable[Module]) -> Iterator[tuple[Import, str]]:
    """(import statement, project module it imports) for every import of `modules`."""
    for module in modules:
        for imp in imports_in(module):
            for target in imported_modules(imp):
                yield imp, target


def report(violations: list[str]) -> str:
    return f"{len(violations)} violation(s):\n  " + "\n  ".join(violations)


# ---------------------------------------------------------------------------------------------------
# No import cycles between product files.

Edges = dict[str, dict[str, Import]]  # module -> module it imports -> the (first) import doing it


def strongly_connected(edges: Edges) -> list[list[str]]:
    """Tarjan's strongly connected components of `edges`, those with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in edges.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def one_cycle(edges: Edges, component: list[str]) -> list[Import]:
    """A shortest cycle through the component's first module, as the imports that make it."""
    start, members = component[0], set(component)
    came_from: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for succ, imp in sorted(edges.get(node, {}).items()):
                if succ not in members or succ in came_from:
                    continue
                came_from[succ] = imp
                if succ == start:
                    path, at = [], start
                    while True:
                        path.append(came_from[at])
                        at = came_from[at].source.name
                        if at == start:
                            return path[::-1]
                next_frontier.append(succ)
        frontier = next_frontier
    raise AssertionError(f"no cycle through {start} in its own component {component}")


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


def bound_names(target: ast.expr) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Tuple | ast.List):
        return set().union(*(bound_names(e) for e in target.elts))
    if isinstance(target, ast.Starred):
        return bound_names(target.value)
    return set()


def top_level_definitions(body: list[ast.stmt]) -> set[str]:
    """Names a module body binds by def, class or assignment (inside top-level if/try/with/for too);
    imports bind names as well, but those names live elsewhere."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names = names.union(*(bound_names(t) for t in node.targets))
        elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.For | ast.AsyncFor):
            names |= bound_names(node.target)
        elif isinstance(node, ast.With | ast.AsyncWith):
            names = names.union(*(bound_names(i.optional_vars) for i in node.items if i.optional_vars))
        for block in ("body", "orelse", "finalbody"):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names |= top_level_definitions(getattr(node, block, []))
        for handler in getattr(node, "handlers", []):
            names |= top_level_definitions(handler.body)
    return names


@functools.cache
def defined_in(module: Module) -> frozenset[str]:
    return frozenset(top_level_definitions(syntax_tree(module.path).body))


def imported_from_elsewhere(module: Module, name: str) -> Import | None:
    for imp in imports_in(module):
        if name in imp.names or (not imp.names and imp.module.split(".")[0] == name):
            return imp
    return None


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
BEHIND_THE_FACADE = ("api", "registry", "adapters", "reliability", "scripts")
# attribute chains that reach through the facade: `<x>.engine.engine`, `<x>.lora.cache`
REACH_THROUGH = {("engine", "engine"), ("lora", "cache")}


def test_only_bootstrap_imports_engine_internals() -> None:
    violations = [
        f"{imp.where} imports {target}"
        for imp, target in module_imports(modules_under(*BEHIND_THE_FACADE))
        if any(within(target, internal) for internal in ENGINE_INTERNALS)
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
