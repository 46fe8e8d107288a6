"""A tenant's limit across two gateway hosts (two `launch api-server` groups) sharing one Redis
(`--state-url redis://…`): requests spread over both hosts and all their gateways pass at the configured rate within
5%, the rest are 429s, and `launch status --tenants` on either host reports the shared buckets."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from tests.helpers import LAUNCH, ROOT, TINY, hosts_sharing, offer_paced, wait_until
from zserve.tenants import key_digest

pytestmark = pytest.mark.slow

KEY = "sk-two-hosts-0123456789"
RPM = 600  # 10 a second, a burst of 100


@pytest.fixture(scope="module")
def hosts(redis_port, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants-hosts") / "tenants.toml"
    path.write_text(f'[[tenant]]\nname = "shared"\nkey_sha256 = ["{key_digest(KEY)}"]\nrequests_per_minute = {RPM}\n')
    url = f"redis://127.0.0.1:{redis_port}/3"
    with hosts_sharing(url, *TINY, "--tenants", str(path), log_name="tenants-host") as ab:
        yield ab


def complete(url: str) -> int:
    return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}", "Connection": "close"},
                      json={"model": "tiny-random", "prompt": "hi", "max_tokens": 1}, timeout=60).status_code


def test_a_tenants_rate_holds_across_two_hosts_within_five_percent(hosts):
    a, b = hosts
    wait_until(lambda: complete(a.url) == 429 and complete(b.url) == 429, 60, 0.0, "the shared burst to run out")
    codes, span = offer_paced(lambda i: complete((a, b)[i % 2].url), 3 * RPM / 60, 6.0)
    expected = RPM / 60 * span
    assert set(codes) <= {200, 429} and abs(codes.count(200) - expected) <= 0.05 * expected, \
        (codes.count(200), expected, len(codes), span)
    r = subprocess.run([*LAUNCH, "status", "--tenants", "--port", str(b.port)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    row = next(line.split() for line in r.stdout.splitlines() if line.startswith("shared"))
    assert r.returncode == 0 and row[-1] == "redis" and row[3].endswith("/100"), r.stdout
