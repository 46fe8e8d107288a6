"""Two zserve hosts (two `launch api-server` groups on their own ports) behind a real HAProxy running the
shipped config (deploy/haproxy/haproxy.cfg): requests through it succeed and reach both hosts, and killing
one host's whole process group mid-run fails at most the requests it had in flight; HAProxy sends the rest to
the other host."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import httpx
import pytest

from tests.helpers import ROOT, Server, Traffic, free_port, wait_until

pytestmark = pytest.mark.slow

HAPROXY = shutil.which("haproxy")
CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"


@pytest.fixture
def hosts():
    args = ("--model", "tiny-random", "--count", "2", "--dtype", "float32", "--max-num-seqs", "16")
    a = Server(*args, log_name="lb-host-a")
    try:
        b = Server(*args, log_name="lb-host-b")
    except Exception:
        a.stop()
        raise
    yield a, b
    for s in (a, b):
        s.stop()


@pytest.fixture
def haproxy(hosts, tmp_path):
    if HAPROXY is None:
        pytest.skip("haproxy is not installed (.ci/run installs it from Debian's packages)")
    a, b = hosts
    port = free_port()
    env = {**os.environ, "ZSERVE_LB_BIND": f"127.0.0.1:{port}", "ZSERVE_LB_ADMIN_SOCKET": str(tmp_path / "admin.sock"),
           "ZSERVE_HOST_1": a.url.removeprefix("http://"), "ZSERVE_HOST_2": b.url.removeprefix("http://")}
    check = subprocess.run([HAPROXY, "-c", "-f", str(CONFIG)], env=env, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    log = open(tmp_path / "haproxy.log", "wb")
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(CONFIG)], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(url), 30, 0.1, "HAProxy to see both hosts healthy")
        yield url, proc, tmp_path / "haproxy.log"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def host_of(url: str) -> str:
    """Which host answered: its engine's ipc endpoint lies in that host's private run directory."""
    return httpx.get(url + "/status", headers={"Connection": "close"}, timeout=10).json()["engines"][0]["endpoint"]


def test_requests_through_haproxy_survive_the_loss_of_a_host(hosts, haproxy):
    a, b = hosts
    url, _, log = haproxy
    with Traffic(url, "tiny-random", workers=4, keepalive=False) as traffic:
        wait_until(lambda: traffic.ok >= 20, 60, what="requests through HAProxy")
        assert {host_of(url) for _ in range(40)} == {host_of(a.url), host_of(b.url)}  # both hosts serve
        before_kill = traffic.ok
        os.kill(a.proc.pid, signal.SIGKILL)  # host 1's supervisor: its gateways and engines die with it
        wait_until(lambda: traffic.ok >= before_kill + 40, 120, what="requests after the host died")
    assert len(traffic.failed) <= 4, traffic.failed  # at most what was in flight on the dead host (4 workers)
    assert {host_of(url) for _ in range(10)} == {host_of(b.url)}
    wait_until(lambda: "host1 is DOWN" in log.read_text(errors="replace"), 30, what="HAProxy to mark host1 down")
