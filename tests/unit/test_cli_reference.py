"""docs/cli.md is what launch/cli_reference.py makes of the click commands and zserve/environment.py, byte for byte,
on any machine; the generator refuses an option without help and a default computed at import."""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from launch import cli_reference
from launch.cli_reference import PAGE, REGENERATE, render

ROOT = Path(__file__).resolve().parents[2]


def test_docs_cli_md_is_what_the_commands_generate():
    page = render()
    checked_in = PAGE.read_text() if PAGE.exists() else ""
    if page != checked_in:
        diff = "".join(list(difflib.unified_diff(checked_in.splitlines(True), page.splitlines(True),
                                                 "docs/cli.md (checked in)", "docs/cli.md (generated)"))[:60])
        pytest.fail(f"docs/cli.md is stale: regenerate it with\n    {REGENERATE}\nand commit it.\n{diff}")


def test_the_page_is_the_same_on_another_machine(tmp_path):
    """Another home, cache and runtime directory, working directory, CPU count and set of GPUs, and keys in the
    environment (click's envvar must not become a shown default): the same page, naming no path of this one."""
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "XDG_RUNTIME_DIR": str(tmp_path / "run"), "TMPDIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": "",
           "ZSERVE_API_KEY": "sk-from-the-environment", "ZSERVE_ADMIN_KEY": "adm-from-the-environment",
           "OPENAI_API_KEY": "sk-openai", "COLUMNS": "37", "PYTHONPATH": str(ROOT)}
    one_cpu = {"preexec_fn": lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})} \
        if hasattr(os, "sched_setaffinity") else {}
    there = subprocess.run([sys.executable, "-m", "launch.cli_reference"], cwd=tmp_path, env=env, timeout=120,
                           capture_output=True, text=True, **one_cpu)
    assert there.returncode == 0, there.stderr
    here = render()
    assert there.stdout == here
    for machine_specific in {f"{ROOT}/", f"{Path.home()}/", f"{sys.prefix}/", "sk-from-the-environment"}:
        assert machine_specific not in here


def test_check_fails_on_a_stale_page_and_names_the_command(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "cli.md"
    stale.write_text(render().replace("--scaling-wait", "--scaling-delay"))
    monkeypatch.setattr(cli_reference, "PAGE", stale)
    assert cli_reference.main(["--check"]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert cli_reference.main(["--write"]) == 0 and cli_reference.main(["--check"]) == 0


def _group(**option) -> click.Group:
    group = click.Group("tool", help="A tool.")
    group.add_command(click.Command("run", help="Run it.", params=[click.Option(["--workers"], **option)]))
    return group


def test_an_option_without_help_stops_the_generator():
    assert "| `--workers` | integer | `4` | Worker processes. |" in render(_group(type=int, default=4,
                                                                              help="Worker processes."), "tool")
    with pytest.raises(ValueError, match="tool run --workers: no help text"):
        render(_group(type=int, default=4), "tool")


def test_a_default_computed_on_this_machine_stops_the_generator():
    with pytest.raises(TypeError, match="may differ between machines"):
        render(_group(type=int, default=os.cpu_count, help="Worker processes."), "tool")
