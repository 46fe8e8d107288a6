"""Serving on a Unix socket (``--uds``) for a proxy on the same host, on IPv6, and the start-up line that says
how the server was started (secrets redacted)."""

from __future__ import annotations

import os
import stat
import subprocess

import httpx
import openai
import pytest

from tests.helpers import LAUNCH, ROOT, Server, wait_until

pytestmark = pytest.mark.slow

SECRET = "sk-test-do-not-log-7f3a9c"


def test_the_openai_sdk_reaches_gateways_sharing_a_unix_socket_removed_on_exit(tmp_path):
    path = tmp_path / "zserve.sock"
    s = Server("--uds", str(path), "--model", "tiny-random", "--count", "2", "--dtype", "float32", "--api-key",
               SECRET, log_name="uds")
    try:
        assert s.url == f"unix:{path}"
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://zserve", timeout=60)
        client = openai.OpenAI(base_url="http://zserve/v1", api_key=SECRET, max_retries=0, http_client=http)
        r = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
        seen: set[int] = set()

        def both_gateways() -> bool:  # a fresh connection each time: the gateways share the listening socket
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://zserve") as c:
                seen.add(c.get("/status", headers={"Authorization": f"Bearer {SECRET}"}).json()["gateway"])
            return len(seen) == 2

        wait_until(both_gateways, 60, 0.0, "both gateways answering on the socket")
        st = subprocess.run([*LAUNCH, "status", "--uds", str(path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=30)
        assert st.returncode == 0 and "gateway" in st.stdout and f"unix:{path}" in st.stdout, st.stderr
        second = subprocess.run([*LAUNCH, "api-server", "--uds", str(path), "--model", "tiny-random"], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "already listening" in second.stderr
        log = s.tail(1 << 20)
        start = next(line for line in log.splitlines() if "zserve 0." in line and ": launch api-server" in line)
        assert f"--uds={path}" in start and "--model=tiny-random" in start and "--api-key=<1 redacted>" in start
        assert SECRET not in log
    finally:
        assert s.stop() == 0
    assert not path.exists()


def test_an_ipv6_host_is_served(tmp_path):
    s = Server("--host", "::1", "--model", "tiny-random", "--count", "1", "--dtype", "float32", log_name="ipv6")
    try:
        assert s.url.startswith("http://[::1]:")
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = client.completions.create(model="tiny-random", prompt="hello", max_tokens=3)
        assert r.usage.completion_tokens > 0
    finally:
        s.stop()


def test_redaction_of_urls_and_keys():
    from zserve.proc import redact_url

    assert redact_url("redis://:hunter2@cache:6379/0") == "redis://:***@cache:6379/0"
    assert redact_url("redis://user:hunter2@cache/1") == "redis://user:***@cache/1"
    assert redact_url("redis://cache:6379/0") == "redis://cache:6379/0"
    assert redact_url("sqlite:///var/lib/zserve/r.db") == "sqlite:///var/lib/zserve/r.db"
