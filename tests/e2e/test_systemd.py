"""systemd integration: sd_notify messages, socket activation, SIGTTIN/SIGTTOU scaling, and the shipped units."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from tests.helpers import ROOT, TINY, Server, complete, ready_pids, wait_until


def test_notify_ready_watchdog_and_stopping(tmp_path):
    path = str(tmp_path / "notify.sock")
    sd = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sd.bind(path)
    sd.settimeout(30)
    s = Server(*TINY, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"}, log_name="notify")
    try:
        got: list[str] = []

        def saw(prefix: str) -> bool:
            while not any(m.startswith(prefix) for m in got):
                got.append(sd.recv(4096).decode())
            return True

        assert saw("READY=1") and saw("WATCHDOG=1")
        s.proc.send_signal(signal.SIGTERM)
        assert saw("STOPPING=1")
        assert s.proc.wait(60) == 0
    finally:
        s.stop(signal.SIGKILL)
        sd.close()


def test_socket_activation_uses_the_inherited_socket():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    fd = listener.fileno()

    def as_fd_3():
        os.dup2(fd, 3)
        os.set_inheritable(3, True)

    # LISTEN_PID must be the pid of the process that reads it: `exec` keeps the shell's pid.
    cmd = ["sh", "-c", f'export LISTEN_PID=$$ LISTEN_FDS=1; exec {sys.executable} -m launch api-server '
                       f'--port 1 --model tiny-random --dtype float32']
    s = Server(command=cmd, preexec_fn=as_fd_3, pass_fds=(3,), log_name="socket-activation")
    # (fds are closed after preexec_fn, except pass_fds)
    try:
        assert s.url.endswith(f":{port}")  # not port 1: systemd's socket was used
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        assert complete(f"http://127.0.0.1:{port}").status_code == 200
    finally:
        s.stop(timeout=60)
        listener.close()


def test_sigttin_and_sigttou_scale_the_gateway_tier():
    s = Server("--count", "1", *TINY, log_name="ttin")
    try:
        s.proc.send_signal(signal.SIGTTIN)
        wait_until(lambda: len(ready_pids(s, "gateway")) == 2, 60, what="a second gateway")
        s.proc.send_signal(signal.SIGTTOU)
        wait_until(lambda: len(ready_pids(s, "gateway")) == 1, 60, what="back to one gateway")
        assert complete(s.url).status_code == 200
    finally:
        s.stop()


def test_the_shipped_units_pass_systemd_analyze_verify(tmp_path):
    """deploy/systemd's units, with the install paths pointed at this checkout, are valid to systemd itself."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    deploy = ROOT / "deploy" / "systemd"
    names = ("zserve.service", "zserve.socket", "zserve-engine.service")
    for name in names:
        text = (deploy / name).read_text().replace("/opt/zserve/.venv", str(ROOT / ".venv"))
        (tmp_path / name).write_text(text.replace("WorkingDirectory=/opt/zserve", f"WorkingDirectory={ROOT}"))
    r = subprocess.run([analyze, "verify", *(str(tmp_path / n) for n in names)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    for name, command in (("zserve.service", "launch api-server"), ("zserve-engine.service", "launch engine")):
        unit = (deploy / name).read_text()
        for line in ("Type=notify", "WatchdogSec=", "KillMode=mixed", "ExecReload=/bin/kill -HUP $MAINPID",
                     "NoNewPrivileges=true", "ProtectSystem=strict", "PrivateTmp=true", "RuntimeDirectory=zserve",
                     "EnvironmentFile=", "User=zserve", command,
                     # a cache that survives restarts, where ProtectSystem=strict lets it be written
                     "CacheDirectory=zserve", "Environment=XDG_CACHE_HOME=/var/cache"):
            assert line in unit, (name, line)
        stop = int(unit.split("TimeoutStopSec=")[1].split()[0])
        drain = float(unit.split("--shutdown-timeout ")[1].split()[0])
        assert stop >= drain + 5  # systemd waits out the drain before it kills
