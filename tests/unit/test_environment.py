"""zserve/environment.py lists every environment variable: each ZSERVE_* name written in the repository, and each
variable the Python code reads by name; each entry's files still mention it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from zserve.environment import ENVIRONMENT, SCOPES

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTED = {e.name for e in ENVIRONMENT}
VARIABLE_NAME = re.compile(r"\bZSERVE_[A-Z0-9_]*[A-Z0-9]\b")
PACKAGES = ("gateway", "engine_worker", "protocol", "launch", "zserve")
# Where a name can be written: the code, its tests, the deployment files and the hand-written docs
# (docs/cli.md is generated from the registry itself).
SEARCHED = (*PACKAGES, "tests", "deploy", "docs", "examples", "Dockerfile", "Makefile", "README.md", "pyproject.toml")
GENERATED = {ROOT / "docs" / "cli.md"}


def _files():
    for name in SEARCHED:
        path = ROOT / name
        paths = [path] if path.is_file() else sorted(path.rglob("*"))
        for p in paths:
            if (p.is_file() and p not in GENERATED and "__pycache__" not in p.parts
                    and not any(part.endswith(".egg-info") for part in p.parts) and p.stat().st_size < 1 << 20):
                yield p


def test_every_zserve_name_in_the_repository_is_documented():
    missing = {}
    for path in _files():
        for name in VARIABLE_NAME.findall(path.read_bytes().decode(errors="replace")):
            if name not in DOCUMENTED:
                missing.setdefault(name, str(path.relative_to(ROOT)))
    assert not missing, f"add these to zserve/environment.py (name: first file using it): {missing}"


def _read_by_name(tree: ast.AST):
    """Names in os.environ.get/[...]/setdefault/pop("X"), os.getenv("X") and click's envvar="X"."""
    def literal(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            yield literal(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if (is_environ(f.value) and f.attr in ("get", "setdefault", "pop")) or f.attr == "getenv":
                yield literal(node.args[0])
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "envvar":
                    yield literal(kw.value)


def test_every_variable_the_code_reads_is_documented():
    missing = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in _read_by_name(ast.parse(path.read_text(), str(path))):
                if name is not None and name not in DOCUMENTED:
                    missing.setdefault(name, str(path.relative_to(ROOT)))
    assert not missing, f"add these to zserve/environment.py (name: first file reading it): {missing}"


def test_each_entry_is_still_read_where_it_says():
    stale = []
    for e in ENVIRONMENT:
        assert e.scope in SCOPES, e
        assert e.meaning and e.default and e.read_by, e
        for where in e.read_by:
            if where.startswith("("):  # a reader outside the repository
                continue
            path = ROOT / where
            if not path.is_file() or e.name not in path.read_text():
                stale.append(f"{e.name}: {where}")
    assert not stale, f"zserve/environment.py names files that no longer mention these: {stale}"
    assert len(DOCUMENTED) == len(ENVIRONMENT), "a variable is listed twice"
