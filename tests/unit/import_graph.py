"""The project's import graph, read from the source with ``ast`` (nothing is imported), for tests that keep the
layers apart: ``protocol/`` at the bottom imports nothing else of ours, and a package has no circle of imports.

    graph = import_graph()                      # every module of PACKAGES → the project modules it imports
    leaving(graph, "protocol")                  # imports from protocol.* to any other package of ours
    cycles(within(graph, "launch"))             # the circles among launch's modules (each a sorted list)

Nodes are dotted module names (``protocol.control``; a package's ``__init__.py`` is the package, ``protocol``).
An edge goes to the module an import names: ``from protocol.cluster import ClusterState`` → ``protocol.cluster``,
``from gateway import app`` → ``gateway.app`` (a module) but ``from protocol import ProtocolError`` → ``protocol``.
Python also runs the parent packages' ``__init__`` for ``import a.b``; those implied edges are left out, so a
circle is one the code writes. Every import counts, also one inside a function or under ``if TYPE_CHECKING:``
(each ``Import`` says whether it is ``deferred`` so that a test may choose to skip those).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "zserve", "engine_worker", "gateway", "launch")
"""The project's top-level packages (pyproject's packages.find), bottom layer first."""


@dataclass(frozen=True)
class Import:
    importer: str  # the module whose source holds the import
    imported: str  # the project module it names
    line: int
    deferred: bool  # inside a function, or under ``if TYPE_CHECKING:``: not run when the importer is imported

    def __str__(self) -> str:
        where = self.importer.replace(".", "/") + f".py:{self.line}"
        return f"{where}: {self.importer} imports {self.imported}" + (" (deferred)" if self.deferred else "")


def module_files(packages: Iterable[str] = PACKAGES, root: Path = ROOT) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(nodes: Iterable[ast.AST], deferred: bool = False) -> Iterable[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement among ``nodes`` and below, with whether it runs only later (in a function, or for
    type checkers)."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, deferred
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _walk(node.body, True)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, True)
            yield from _walk(node.orelse, deferred)
        else:
            yield from _walk(ast.iter_child_nodes(node), deferred)


def imports_of(module: str, path: Path, modules: Iterable[str]) -> list[Import]:
    """The imports of project modules (``modules``: every dotted name of the project) in one module's source."""
    known = set(modules)
    tops = {m.split(".")[0] for m in known}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def add(name: str, stmt: ast.stmt, deferred: bool) -> None:
        while name and name not in known and "." in name:  # a name from a module: the module
            name = name.rpartition(".")[0]
        imp = Import(module, name, stmt.lineno, deferred)
        if name in known and name != module and imp not in found:  # one edge per statement and module
            found.append(imp)

    for stmt, deferred in _walk(ast.parse(path.read_text(), str(path)).body):
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.name.split(".")[0] in tops:
                    add(alias.name, stmt, deferred)
            continue
        if stmt.level:  # relative: from . / .. / .x
            base = package.split(".")[: len(package.split(".")) - (stmt.level - 1)]
            source = ".".join(base + ([stmt.module] if stmt.module else []))
        else:
            source = stmt.module or ""
        if source.split(".")[0] not in tops:
            continue
        for alias in stmt.names:
            full = f"{source}.{alias.name}"
            add(full if full in known else source, stmt, deferred)
    return found


def import_graph(packages: Iterable[str] = PACKAGES, root: Path = ROOT) -> dict[str, list[Import]]:
    """Each module of ``packages`` → its imports of modules of the same packages, in source order."""
    files = module_files(packages, root)
    return {module: imports_of(module, path, files) for module, path in files.items()}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def leaving(graph: dict[str, list[Import]], package: str, allowed: Iterable[str] = ()) -> list[Import]:
    """The imports from ``package``'s modules of project modules outside it (and outside ``allowed`` packages)."""
    inside = (package, *allowed)
    return [imp for module, imps in graph.items() if _in(module, package)
            for imp in imps if not any(_in(imp.imported, p) for p in inside)]


def within(graph: dict[str, list[Import]], package: str, deferred: bool = True) -> dict[str, list[Import]]:
    """The part of ``graph`` among ``package``'s modules (without deferred imports unless ``deferred``)."""
    return {module: [imp for imp in imps if _in(imp.imported, package) and (deferred or not imp.deferred)]
            for module, imps in graph.items() if _in(module, package)}


def cycles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """The circles of imports: each strongly connected set of two or more modules, sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for imp in graph.get(node, ()):
            nxt = imp.imported
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)
