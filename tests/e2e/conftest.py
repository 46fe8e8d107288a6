"""Real servers for end-to-end tests: `launch api-server` as a subprocess on a free port.

Servers are shared per session (one SmolLM2, one tiny-random) because starting one costs seconds;
tests that kill or reconfigure a server start their own.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "launch"]
URL_RE = re.compile(r"zserve: serving (\S+) at (http://\S+) ")


class Server:
    """A running `launch api-server`; ``url`` is its base URL once ready."""

    def __init__(self, *args: str, ready_timeout: float = 240.0, log_name: str = "server"):
        self.args = ["api-server", "--port", "0", *args]
        log_dir = Path(os.environ.get("ZSERVE_TEST_LOGS", "/tmp/zserve-test-logs"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{log_name}-{os.getpid()}-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([*LAUNCH, *self.args], cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log,
                                     stdin=subprocess.DEVNULL)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = self._wait_url(ready_timeout)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace"))

    def _wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}: {self.tail()}")
                continue
            m = URL_RE.search(line)
            if m:
                return m.group(2)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout}s: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def wait_until(cond, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll ``cond`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def smollm_server():
    s = Server("--count", "2", "--dtype", "float32", "--max-model-len", "2048", log_name="smollm")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def tiny_server():
    s = Server("--count", "2", "--model", "tiny-random", "--dtype", "float32", "--max-num-seqs", "16",
               log_name="tiny")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def scripted_model(tmp_path_factory) -> Path:
    """The scripted test model (tests/e2e/scripted_model.py): its output is chosen by the prompt's last token."""
    from .scripted_model import build_scripted_model

    return build_scripted_model(tmp_path_factory.mktemp("scripted") / "scripted")


@pytest.fixture(scope="session")
def scripted_server(scripted_model):
    """Two gateways with the hermes tool-call parser and the think reasoning parser, on the scripted model;
    shared by the tool-calling, Anthropic, Responses and native-route tests."""
    s = Server("--model", str(scripted_model), "--count", "2", "--dtype", "float32", "--max-model-len", "1024",
               "--tool-call-parser", "hermes", "--reasoning-parser", "think", log_name="scripted")
    yield s
    s.stop()
