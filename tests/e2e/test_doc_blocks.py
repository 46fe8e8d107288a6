"""Every command block of README.md and docs/*.md runs, or says why not.

A fenced ```bash / ```sh / ```python block is a command a reader will paste. Each one is run here against the
shared two-model server of the e2e tests (``rag_server``: tiny-random in SmolLM2's place, MiniLM beside it), with the
page's address and model swapped for the server's: curl fails on an HTTP error, a shell block stops at its first
failing command, a Python block must exit 0. A block that cannot run here (it starts a server of its own, needs a
GPU, systemd, a second host, or minutes) carries ``<!-- not run: why -->`` on the line before its fence, so a new
block is either run or excluded on purpose. docs/deploy.md (its recipes have their own test) and the generated
docs/cli.md are not read.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md",
         *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in ("deploy.md", "cli.md"))]
COMMAND_LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(.*?)\s*-->\s*$")
OPEN = re.compile(r"^(\s*)(```|~~~)\s*([\w+-]*)")
# What a page says, and what the test server is.
DEFAULT_URLS = re.compile(r"(?:https?://)?(?:127\.0\.0\.1|localhost):8000")
CHAT_MODEL = "SmolLM2-135M-Instruct"
TEST_CHAT_MODEL = "tiny-random"
CONTROL_COMMANDS = ("status", "scale", "reload", "stop")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence
    language: str  # bash or python
    code: str
    not_run: str | None  # the marker's reason

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    out = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if lang.lower() in COMMAND_LANGUAGES:
            body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end]]
            marker = NOT_RUN.match(lines[i - 1]) if i else None
            out.append(Block(page, i + 1, COMMAND_LANGUAGES[lang.lower()], "\n".join(body) + "\n",
                             marker.group(1) if marker else None))
        i = end + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]
RUN = [b for b in ALL if b.not_run is None]


def test_the_pages_have_command_blocks_and_each_exclusion_says_why():
    assert len(RUN) >= 10, [b.id for b in RUN]
    vague = [b.id for b in ALL if b.not_run is not None and len(b.not_run) < 10]
    assert not vague, f"a <!-- not run: ... --> marker must give its reason: {vague}"


def for_the_test_server(code: str, url: str, port: int) -> str:
    """The block as it runs here: the test server's address and model, the venv's `launch`, and the control
    commands pointed at the test server's port (the pages leave it at the default)."""
    code = DEFAULT_URLS.sub(url, code).replace(CHAT_MODEL, TEST_CHAT_MODEL)
    code = code.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    return re.sub(rf"\blaunch ({'|'.join(CONTROL_COMMANDS)})\b", rf"launch \1 --port {port}", code)


SHELL_PRELUDE = 'set -euo pipefail\ncurl() { command curl --fail-with-body -sS --max-time 60 "$@"; }\n'


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.id)
def test_the_command_block_runs(block: Block, rag_server, tmp_path):
    code = for_the_test_server(block.code, rag_server.url, rag_server.port)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if block.language == "bash":
        cmd = ["bash", "-c", SHELL_PRELUDE + code]
    else:
        cmd = [sys.executable, "-c", code]
    try:
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.id} ran past 90 s:\n{code}\n{e.stdout}{e.stderr}")
    assert done.returncode == 0, (f"{block.id} failed (exit {done.returncode}), as run:\n{code}\n"
                                  f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")


STATUS_HEADER = re.compile(r"^\S.* at \S+  supervisor pid \d+  up \d+s  (PAUSED  )?desired: \d+ gateways, "
                           r"(\d+ engines? for \S+)(, \d+ engines? for \S+)*$")
STATUS_ROW = re.compile(r"^(engine|gateway) +\d+ +\d+ \w+ +\d+ +\d+s  (\S+: )?(running \d+ waiting \d+ kv \d+%"
                        r"( cached \d+ blocks)?|in-flight \d+)$")


def test_the_status_sample_in_operations_is_what_launch_status_prints(rag_server):
    """docs/operations.md shows `launch status`'s output; the real output and the sample have the same shape."""
    text = (ROOT / "docs" / "operations.md").read_text()
    sample = text[text.index("$ launch status\n"):].split("```")[0].splitlines()[1:]
    real = subprocess.run([sys.executable, "-m", "launch", "status", "--port", str(rag_server.port)], cwd=ROOT,
                          capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    for lines in (real, sample):
        assert STATUS_HEADER.match(lines[0]), lines[0]
        assert lines[1] == real[1]  # the column titles
        assert all(STATUS_ROW.match(row) for row in lines[2:]), lines[2:]
