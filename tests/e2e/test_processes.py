"""Process hygiene: no orphans after `kill -9` of the supervisor; the gateway never loads torch."""

from __future__ import annotations

import shutil
import signal
import subprocess

import httpx
import psutil
import pytest

from protocol.constants import LISTEN_BACKLOG
from tests.helpers import LAUNCH, ROOT, Server, wait_until


def test_kill_9_of_the_supervisor_leaves_no_process_and_the_port_is_free():
    s = Server("--count", "2", "--model", "tiny-random", log_name="kill9")
    kids = s.descendants()
    assert len(kids) == 3  # 2 gateways + 1 engine
    titles = sorted(" ".join(k.cmdline()) for k in kids)
    assert any("zserve: engine 0" in t for t in titles) and any("zserve: gateway 1" in t for t in titles)
    port = s.port
    s.proc.kill()
    s.proc.wait()

    def all_gone():
        return not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]

    wait_until(all_gone, 5, what="every child to die with the supervisor")
    # restarting on the very same port works at once
    again = Server("--model", "tiny-random", port=port, ready_timeout=60, log_name="kill9-again")
    try:
        assert again.url.endswith(f":{port}"), again.url
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        assert again.stop(timeout=30) == 0


def test_gateways_do_not_load_torch(tiny_server):
    gateways = [k for k in tiny_server.descendants() if "gateway" in " ".join(k.cmdline())]
    assert gateways
    for g in gateways:
        maps = open(f"/proc/{g.pid}/maps").read()
        assert "libtorch" not in maps, f"gateway {g.pid} loaded torch"


@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) is not installed")
def test_the_listening_socket_keeps_the_supervisors_backlog_once_gateways_serve(tiny_server):
    """aiohttp calls listen() again on the inherited socket; with its default (128) a burst of connections waits
    for SYN retries. The socket every gateway serves keeps the supervisor's backlog."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{tiny_server.port}"], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[:3] == ["LISTEN", "0", str(LISTEN_BACKLOG)], out


def test_sigterm_stops_everything_with_exit_0():
    s = Server("--count", "2", "--model", "tiny-random", log_name="sigterm")
    kids = s.descendants()
    assert s.stop(signal.SIGTERM) == 0
    wait_until(lambda: not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE], 5,
               what="children to exit")


def test_invalid_arguments_fail_fast_naming_the_flag():
    for args, flag in [(["--count", "0"], "--count"), (["--port", "70000"], "--port"), (["--model", "nope"], "--model"),
                       (["--dtype", "int3"], "--dtype")]:
        r = subprocess.run([*LAUNCH, "api-server", *args], cwd=ROOT, capture_output=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert flag in r.stderr.decode(), r.stderr


def test_port_in_use_is_reported(tiny_server):
    r = subprocess.run([*LAUNCH, "api-server", "--model", "tiny-random", "--port", str(tiny_server.port)], cwd=ROOT,
                       capture_output=True, timeout=60)
    assert r.returncode != 0 and b"already in use" in r.stderr
