"""The layers stay layers: ``protocol/``, the wire contract, is the bottom one and imports nothing else of zserve
(every other package imports it). Read from the source (``import_graph``) and checked again by importing every
protocol module in a fresh interpreter, so an import hidden from ``ast`` (``importlib``) cannot slip through."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.unit.import_graph import PACKAGES, ROOT, Import, cycles, import_graph, leaving, module_files, within


def test_protocol_imports_no_other_package_of_the_project() -> None:
    outside = leaving(import_graph(), "protocol")
    assert not outside, "protocol/ is the bottom layer; move what it needs into it:\n" + "\n".join(map(str, outside))


def test_protocol_has_no_import_circle() -> None:
    assert cycles(within(import_graph(), "protocol")) == []


def test_no_import_circle_anywhere_in_the_project() -> None:
    """Not in one package nor across packages, counting imports inside functions and under TYPE_CHECKING: a
    circle means two modules that cannot be understood, tested or moved apart (there were six)."""
    found = cycles(import_graph())
    assert found == [], "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_importing_every_protocol_module_loads_nothing_else_of_the_project() -> None:
    modules = sorted(module_files(["protocol"]))
    script = textwrap.dedent(f"""
        import importlib, sys
        for name in {modules!r}:
            importlib.import_module(name)
        print("\\n".join(sorted(m for m in sys.modules if m.split(".")[0] in {PACKAGES!r} and m != "protocol"
                                and not m.startswith("protocol."))))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []


def test_import_graph_finds_relative_deferred_and_circular_imports(tmp_path) -> None:
    """The helper itself, on a made-up project: what later layer tests (no circle in launch/) rely on."""
    (tmp_path / "low").mkdir()
    (tmp_path / "low" / "__init__.py").write_text("from .wire import Message\n")
    (tmp_path / "low" / "wire.py").write_text("import json\n")
    (tmp_path / "high").mkdir()
    (tmp_path / "high" / "__init__.py").write_text("")
    (tmp_path / "high" / "a.py").write_text("from low import Message\nfrom . import b\n")
    (tmp_path / "high" / "b.py").write_text(textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from high.a import A
        def later():
            import low.wire
    """))
    graph = import_graph(["low", "high"], tmp_path)
    assert graph["low"] == [Import("low", "low.wire", 1, False)]
    assert graph["high.a"] == [Import("high.a", "low", 1, False), Import("high.a", "high.b", 2, False)]
    assert graph["high.b"] == [Import("high.b", "high.a", 4, True), Import("high.b", "low.wire", 6, True)]
    assert [str(i) for i in leaving(graph, "high")] == [
        "high/a.py:1: high.a imports low", "high/b.py:6: high.b imports low.wire (deferred)"]
    assert leaving(graph, "low") == []
    assert cycles(within(graph, "high")) == [["high.a", "high.b"]]
    assert cycles(within(graph, "high", deferred=False)) == []
