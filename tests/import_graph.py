"""The project's import graph, read with `ast`, for tests/test_architecture.py's rules.

Every project file is a dotted module (`registry/store.py` -> `registry.store`, a package is its
`__init__.py`) and every import it writes counts, wherever it is written: at module level, inside a
function (lazy) or under `if TYPE_CHECKING:`. `from pkg import mod`, where `mod` is a submodule, is an
import of `pkg.mod`. Cycles are found as strongly connected components (Tarjan, 1972).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("api", "base_engine", "adapters", "registry", "kernels", "migrations")  # the shipped packages
SCRIPTS = ("tests", "reliability", "benchmarks", "scripts")  # code that drives them


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
