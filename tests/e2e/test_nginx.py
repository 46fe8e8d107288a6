"""nginx in front of zserve's Unix socket: a real nginx runs the shipped config (deploy/nginx/zserve.conf) with
only its socket path and listen address replaced, in the foreground, with every file it writes in a temp prefix
(so it runs as any user).

- the official SDK gets completions through it, and a stream arrives event by event (nginx buffers nothing);
- /health passes through;
- once zserve stops, its socket file is gone and nginx answers 502.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import httpx
import openai
import pytest

from tests.helpers import ROOT, TINY, Server, free_port, wait_until

pytestmark = pytest.mark.slow

# /usr/sbin is not on every user's PATH.
NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
CONFIG = ROOT / "deploy" / "nginx" / "zserve.conf"
# The two lines of the shipped file marked "# tests: replaced".
SOCKET = "server unix:/run/zserve/zserve.sock "
LISTEN = "listen 8080;  # tests: replaced"

# The main context a distribution's nginx.conf has, with every path nginx writes under the test's prefix
# (the compiled-in temp dirs are under /var/lib/nginx, which only root may write).
MAIN = """\
worker_processes 1;
{user}
events {{ worker_connections 256; }}
http {{
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    include {prefix}/zserve.conf;
}}
"""


def shipped_config(sock: str, port: int) -> str:
    text = CONFIG.read_text()
    # Each placeholder is there exactly once: the file the test runs is the shipped one.
    assert text.count(SOCKET) == 1 and text.count(LISTEN) == 1
    return text.replace(SOCKET, f"server unix:{sock} ").replace(LISTEN, f"listen 127.0.0.1:{port};")


@pytest.fixture
def zserve_behind_nginx(tmp_path):
    if NGINX is None:
        pytest.skip("nginx is not installed (.ci/run installs it from Debian's packages)")
    sock = tmp_path / "zserve.sock"
    prefix = tmp_path / "nginx"
    prefix.mkdir()
    port = free_port()
    (prefix / "zserve.conf").write_text(shipped_config(str(sock), port))
    # As root, workers would run as nobody, who may not enter tmp_path nor open the 0660 socket.
    user = "user root;" if os.geteuid() == 0 else ""
    (prefix / "nginx.conf").write_text(MAIN.format(prefix=prefix, user=user))
    cmd = [NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "error.log"),
           "-g", f"daemon off; master_process on; pid {prefix}/nginx.pid;"]
    check = subprocess.run([*cmd, "-t"], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    server = Server(*TINY, "--count", "2", "--uds", str(sock), log_name="nginx-uds")
    log = open(prefix / "nginx.out", "wb")
    proc = None
    url = f"http://127.0.0.1:{port}"
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        wait_until(lambda: _health(url) == 200 or proc.poll() is not None, 30, 0.05, "nginx to pass /health")
        assert proc.poll() is None, (prefix / "error.log").read_text(errors="replace")
        yield url, server, sock
    finally:
        server.stop()
        if proc is not None:
            proc.terminate()  # nginx's fast shutdown
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_the_sdk_streams_through_nginx_until_zserve_stops(zserve_behind_nginx):
    url, server, sock = zserve_behind_nginx
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.completions.create(model="tiny-random", prompt="hello", max_tokens=4)
    assert r.choices[0].text and r.usage.completion_tokens > 0

    messages = [{"role": "user", "content": "count to ten"}]
    client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=2)  # warm: template, kernels

    # A stream: each event is its own chunk, and the first one arrives long before the last is written (a proxy
    # that held the events back would deliver them together, at the end or a buffer at a time). Long enough that
    # the decoding, not the first token's latency, is most of it: tiny-random wrote 96 tokens in 60 ms after a
    # first token at 106 ms once, and the check failed on a stream that was not held back.
    max_tokens = 512
    start = time.monotonic()
    arrived: list[float] = []
    finish = None
    for chunk in client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=max_tokens,
                                                stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            arrived.append(time.monotonic())
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    end = time.monotonic()
    assert finish == "length"
    assert len(arrived) >= 10, len(arrived)
    assert arrived[0] - start < 0.5 * (end - start), (arrived[0] - start, end - start)

    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()

    assert server.stop() == 0
    assert not sock.exists()
    assert httpx.get(url + "/health", timeout=10).status_code == 502
    r = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 502
