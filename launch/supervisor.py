"""The supervisor: spawn the engine and gateway tiers, watch them, stop them cleanly.

It is one loop over declared tiers (gunicorn's arbiter is the model): wake on a child's status
pipe, a child's exit or a signal, and act on each kind of event in one place. Children are
started in their own session (the terminal's Ctrl-C reaches only the supervisor) with a
parent-death signal, so no child can outlive the supervisor, even after ``kill -9``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

import orjson

from zserve.catalog import ModelSource

from .sockets import create_listener

log = logging.getLogger("zserve.launch")

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _child_setup() -> None:  # runs in the child between fork and exec
    if _libc is not None:
        _libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the supervisor


class StartupError(RuntimeError):
    pass


@dataclass
class ServeConfig:
    source: ModelSource
    host: str = "127.0.0.1"
    port: int = 8000
    gateways: int = 2
    engines: int = 1
    dtype: str = "auto"
    max_num_seqs: int = 32
    max_model_len: int = 4096
    max_num_batched_tokens: int = 512
    served_model_names: list[str] = field(default_factory=list)
    engine_threads: int | None = None
    ready_timeout: float = 600.0
    shutdown_timeout: float = 10.0


@dataclass
class Child:
    tier: str
    index: int
    proc: subprocess.Popen
    status_fd: int
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    buf: bytes = b""

    @property
    def name(self) -> str:
        return f"{self.tier} {self.index}"


class Supervisor:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.children: list[Child] = []
        self.sel = selectors.DefaultSelector()
        self.run_dir = ""
        self.listener: socket.socket | None = None
        self._signal_r, self._signal_w = socket.socketpair()
        self._signal_r.setblocking(False)
        self._signal_w.setblocking(False)
        self.stopping = False
        self.exit_code = 0

    # -- spawning ----------------------------------------------------------------------------
    def engine_endpoint(self, rank: int) -> str:
        return f"ipc://{self.run_dir}/engine-{rank}.sock"

    def _spawn(self, tier: str, index: int, module: str, args: list[str], pass_fds: tuple[int, ...] = ()) -> Child:
        r, w = os.pipe()
        cmd = [sys.executable, "-m", module, *args, "--status-fd", str(w), "--parent-pid", str(os.getpid())]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, pass_fds=(w, *pass_fds), start_new_session=True, preexec_fn=_child_setup,
                                env=env, stdin=subprocess.DEVNULL)
        os.close(w)
        os.set_blocking(r, False)
        child = Child(tier, index, proc, r)
        self.sel.register(r, selectors.EVENT_READ, child)
        self.children.append(child)
        log.debug("started %s as pid %d", child.name, proc.pid)
        return child

    def spawn_engine(self, rank: int) -> Child:
        c = self.cfg
        threads = c.engine_threads or max(1, (os.cpu_count() or 1) // c.engines)
        args = ["--rank", str(rank), "--endpoint", self.engine_endpoint(rank),
                "--model-source", orjson.dumps(c.source.to_json()).decode(), "--dtype", c.dtype,
                "--max-num-seqs", str(c.max_num_seqs), "--max-model-len", str(c.max_model_len),
                "--max-num-batched-tokens", str(c.max_num_batched_tokens), "--threads", str(threads)]
        return self._spawn("engine", rank, "engine_worker", args)

    def spawn_gateway(self, index: int) -> Child:
        assert self.listener is not None
        fd = self.listener.fileno()
        args = ["--index", str(index), "--fd", str(fd), "--model-source", orjson.dumps(self.cfg.source.to_json()).decode(),
                "--cache-dir", os.path.join(self.run_dir, "cache")]
        for rank in range(self.cfg.engines):
            args += ["--engine", self.engine_endpoint(rank)]
        for name in self.cfg.served_model_names:
            args += ["--served-model-name", name]
        return self._spawn("gateway", index, "gateway", args, pass_fds=(fd,))

    # -- events ------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame) -> None:
        try:
            self._signal_w.send(bytes([signum]))
        except OSError:
            pass

    def _read_status(self, child: Child) -> None:
        try:
            data = os.read(child.status_fd, 65536)
        except BlockingIOError:
            return
        if not data:  # EOF: the child exited (or closed its pipe)
            self.sel.unregister(child.status_fd)
            os.close(child.status_fd)
            child.status_fd = -1
            return
        child.buf += data
        *lines, child.buf = child.buf.split(b"\n")
        for line in lines:
            try:
                msg = orjson.loads(line)
            except orjson.JSONDecodeError:
                log.warning("%s sent an unreadable status line", child.name)
                continue
            if isinstance(msg, dict) and msg.get("event") == "ready":
                child.ready = True
                log.info("%s ready (pid %d) after %.1fs", child.name, child.proc.pid, time.monotonic() - child.started)

    def _poll(self, timeout: float) -> list[int]:
        """Wait for status lines or signals; return the signals that arrived."""
        signals: list[int] = []
        for key, _ in self.sel.select(timeout):
            if key.data is None:
                try:
                    signals.extend(self._signal_r.recv(64))
                except BlockingIOError:
                    pass
            else:
                self._read_status(key.data)
        return signals

    def _dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def _wait_ready(self, tier: str, deadline: float) -> None:
        while True:
            kids = [c for c in self.children if c.tier == tier]
            if all(c.ready for c in kids):
                return
            dead = self._dead()
            if dead:
                c = dead[0]
                raise StartupError(f"{c.name} exited with code {c.proc.returncode} while starting (see its log above)")
            if time.monotonic() > deadline:
                waiting = ", ".join(c.name for c in kids if not c.ready)
                raise StartupError(f"{waiting} not ready within {self.cfg.ready_timeout:.0f}s (--ready-timeout)")
            if self._poll(0.2):
                raise StartupError("interrupted while starting")

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> str:
        t0 = time.monotonic()
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        self.run_dir = tempfile.mkdtemp(prefix="zserve-", dir=base)
        os.makedirs(os.path.join(self.run_dir, "cache"), exist_ok=True)
        self.listener = create_listener(self.cfg.host, self.cfg.port)
        self.sel.register(self._signal_r, selectors.EVENT_READ, None)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(s, self._on_signal)
        deadline = time.monotonic() + self.cfg.ready_timeout
        log.info("starting %d engine(s) for %s", self.cfg.engines, self.cfg.source.model_id)
        # Both tiers start at once: gateways build their tokenizer while engines load weights, then
        # wait for every engine's hello before they report ready.
        for rank in range(self.cfg.engines):
            self.spawn_engine(rank)
        for i in range(self.cfg.gateways):
            self.spawn_gateway(i)
        self._wait_ready("engine", deadline)
        self._wait_ready("gateway", deadline)
        host, port = self.listener.getsockname()[:2]
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        self._check_health(url, deadline)
        n_gw, n_en = self.cfg.gateways, self.cfg.engines
        print(f"zserve: serving {self.cfg.source.model_id} at {url} ({n_gw} gateway{'s' * (n_gw != 1)}, "
              f"{n_en} engine{'s' * (n_en != 1)}; ready in {time.monotonic() - t0:.1f}s)", flush=True)
        return url

    def _check_health(self, url: str, deadline: float) -> None:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise StartupError(f"{url}/health did not answer 200")
            self._poll(0.1)

    def run(self) -> int:
        """Serve until a signal or a child's death; return the exit code."""
        while not self.stopping:
            for signum in self._poll(1.0):
                if signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    log.info("received %s: stopping", signal.Signals(signum).name)
                    self.stopping = True
            dead = self._dead()
            if dead and not self.stopping:
                for c in dead:
                    log.error("%s (pid %d) exited with code %s; stopping the server", c.name, c.proc.pid, c.proc.returncode)
                self.exit_code = 1
                self.stopping = True
        return self.exit_code

    def stop(self) -> None:
        """Terminate gateways first (stop taking requests), then engines; kill what lingers."""
        for tier in ("gateway", "engine"):
            kids = [c for c in self.children if c.tier == tier and c.proc.poll() is None]
            for c in kids:
                try:
                    c.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + self.cfg.shutdown_timeout
            for c in kids:
                try:
                    c.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in time; killing it", c.name)
                    c.proc.kill()
                    c.proc.wait()
        for c in self.children:
            if c.status_fd >= 0:
                try:
                    self.sel.unregister(c.status_fd)
                except (KeyError, ValueError):
                    pass
                os.close(c.status_fd)
                c.status_fd = -1
        if self.listener is not None:
            self.listener.close()
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
