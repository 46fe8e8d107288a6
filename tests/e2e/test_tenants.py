"""Tenants over real HTTP (docs/tenants.md): one `launch api-server` with 4 gateways and a tenants file. A tenant's
rate holds across the gateways (a new connection per request, so the kernel spreads them), every response carries
OpenAI's rate-limit headers and the SDK's own retry gets through a 429; the tokens and concurrency limits, the
model and admin restrictions, the per-tenant metrics; a reload under load drops nothing, a malformed one is refused
and the tenants in force stay; a malformed file stops the start naming its line."""

from __future__ import annotations

import subprocess
import threading
import time

import httpx
import openai
import pytest

from tests.helpers import LAUNCH, ROOT, Server, metric, offer_paced, wait_until
from zserve.tenants import key_digest

MODEL = "tiny-random"
KEYS = {name: f"sk-{name}-0123456789" for name in ("rate", "tok", "pair", "narrow", "ops", "sdk", "free", "flood")}
PLAIN = "sk-plain-api-key-00"  # an --api-key key: the default tenant
RATE_RPM = 600  # 10 requests a second, a burst of 100


def tenants_toml(rate_rpm: int = RATE_RPM) -> str:
    rows = {
        "rate": f"requests_per_minute = {rate_rpm}",
        "tok": "tokens_per_minute = 600",
        "pair": "max_concurrent = 2",
        "narrow": 'models = ["no-such-model"]',
        "ops": "admin = true",
        "sdk": "requests_per_minute = 60",
        "free": "weight = 3",
        "flood": "weight = 1",
    }
    return "\n".join(f'[[tenant]]\nname = "{n}"\nkey_sha256 = ["{key_digest(KEYS[n])}"]\n{rows[n]}\n' for n in rows)


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(tenants_toml())
    return path


@pytest.fixture(scope="module")
def server(tenants_file):
    s = Server("--model", MODEL, "--dtype", "float32", "--count", "4", "--max-num-seqs", "16", "--tenants",
               str(tenants_file), "--api-key", PLAIN, log_name="tenants")
    yield s
    s.stop()


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def complete(url: str, name: str, max_tokens: int = 1, prompt: str = "hi", **kw) -> httpx.Response:
    """One completion on a new connection (the kernel hands it to any of the gateways)."""
    return httpx.post(url + "/v1/completions", headers={**auth(name), "Connection": "close"}, timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **kw})


def test_a_tenants_rate_holds_across_four_gateways_within_five_percent(server):
    # Empty the burst first (10 s worth), then offer 3x the rate for a window and count what passed.
    wait_until(lambda: complete(server.url, "rate").status_code == 429, 60, 0.0, "the burst to run out")
    codes, span = offer_paced(lambda _: complete(server.url, "rate").status_code, 3 * RATE_RPM / 60, 6.0)
    passed, refused = codes.count(200), codes.count(429)
    assert passed + refused == len(codes), sorted(set(codes))
    expected = RATE_RPM / 60 * span
    assert abs(passed - expected) <= 0.05 * expected, (passed, expected, len(codes), span)


def test_every_response_carries_openais_headers_and_a_429_says_when_to_retry(server):
    ok = complete(server.url, "sdk")
    if ok.status_code == 200:
        h = ok.headers
        assert h["x-ratelimit-limit-requests"] == "60" and 0 <= int(h["x-ratelimit-remaining-requests"]) < 10
        assert h["x-ratelimit-reset-requests"].endswith("s") and "x-ratelimit-limit-tokens" not in h
    wait_until(lambda: complete(server.url, "sdk").status_code == 429, 30, 0.0, "the sdk tenant's burst to end")
    refused = complete(server.url, "sdk")
    assert refused.status_code == 429, refused.text
    err = refused.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error" and "sdk" in err["message"]
    assert 1 <= int(refused.headers["Retry-After"]) <= 2 and refused.headers["x-ratelimit-remaining-requests"] == "0"
    # The official SDK backs off by itself and gets through.
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["sdk"], max_retries=5, timeout=60)
    r = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=1)
    assert r.http_response.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "60"
    # A tenant without limits, and an --api-key key, get no rate-limit headers.
    for headers in (auth("free"), {"Authorization": f"Bearer {PLAIN}"}):
        r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200 and "x-ratelimit-limit-requests" not in r.headers


def test_generated_tokens_are_charged_and_put_a_tenant_over_its_tokens_limit(server):
    # A burst of 100 tokens: each request spends its prompt and 40 generated tokens, so the bucket runs dry.
    codes = []
    for _ in range(6):
        r = complete(server.url, "tok", max_tokens=40, ignore_eos=True)
        codes.append(r.status_code)
        if r.status_code == 429:
            break
    assert codes[0] == 200 and codes[-1] == 429, codes
    assert int(r.headers["x-ratelimit-remaining-tokens"]) == 0 and r.headers["x-ratelimit-limit-tokens"] == "600"
    assert "tokens per minute" in r.json()["error"]["message"]


def test_a_tenants_concurrency_holds_across_gateways(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["pair"], max_retries=0, timeout=60,
                           http_client=httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=60))
    streams = [client.completions.create(model=MODEL, prompt="a long story", max_tokens=4000, stream=True,
                                         extra_body={"ignore_eos": True}) for _ in range(2)]
    try:
        for s in streams:
            next(iter(s))  # both are generating
        third = complete(server.url, "pair")
        assert third.status_code == 429 and "max_concurrent" in third.json()["error"]["message"], third.text
    finally:
        for s in streams:
            s.close()
    wait_until(lambda: complete(server.url, "pair").status_code == 200, 30, 0.05, "a slot to be given back")


def test_a_background_response_holds_its_tenants_slot_until_it_ends_and_polls_and_cancels_get_through(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["pair"], max_retries=0, timeout=60,
                           http_client=httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=60))
    # Random weights almost never write EOS: thousands of tokens, far longer than this test waits.
    ids = [client.responses.create(model=MODEL, input="Write a very long story.", max_output_tokens=4000,
                                   extra_body={"ignore_eos": True}, background=True).id for _ in range(2)]
    try:
        third = complete(server.url, "pair")  # both slots are the background responses', after their HTTP replies
        assert third.status_code == 429 and "max_concurrent" in third.json()["error"]["message"], third.text
        assert all(client.responses.retrieve(i).status in ("queued", "in_progress") for i in ids)  # polls get through
    finally:
        for i in ids:
            assert client.responses.cancel(i).status == "cancelled"  # and so do cancels
    wait_until(lambda: complete(server.url, "pair").status_code == 200, 30, 0.05, "the slots to be given back")


def test_models_and_admin_routes_are_restricted_per_tenant(server):
    r = complete(server.url, "narrow")
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed", r.text
    listed = httpx.get(server.url + "/v1/models", headers=auth("narrow"), timeout=30).json()["data"]
    assert listed == []
    assert [m["id"] for m in httpx.get(server.url + "/v1/models", headers=auth("free"), timeout=30).json()["data"]] \
        == [MODEL]
    assert httpx.post(server.url + "/pause", headers=auth("free"), timeout=30).status_code == 403
    assert httpx.post(server.url + "/pause", headers=auth("ops"), timeout=30).status_code == 200
    assert httpx.post(server.url + "/resume", headers=auth("ops"), timeout=30).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer sk-nobody"}).status_code == 401


def test_metrics_count_per_tenant_by_name_and_never_show_a_key(server):
    complete(server.url, "free", max_tokens=3, ignore_eos=True)

    def counted() -> str | None:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return text if 'zserve_tenant_generation_tokens_total{tenant="free"}' in text else None

    text = wait_until(counted, 30, 0.2, "the tenant metrics")
    assert 'zserve_tenant_requests_total{tenant="free"}' in text
    assert 'zserve_tenant_rate_limited_total{limit="requests",tenant="rate"}' in text
    assert 'zserve_tenant_queue_time_seconds_count{tenant="free"}' in text
    assert not any(k in text or key_digest(k) in text for k in (*KEYS.values(), PLAIN))


def test_a_flood_of_one_tenant_does_not_queue_another_tenants_request_behind_it(server):
    # 40 long streams of "flood" fill the engine's 16 slots and queue 24; then "free" sends one request. The engine
    # admits it at the next free slot (fair scheduling), not after the 24 queued before it (first come, first
    # served): few flood requests start between its arrival and its first token.
    http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=120)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["flood"], max_retries=0, timeout=120,
                           http_client=http)
    started: list[float] = []
    stop = threading.Event()

    def flood(i: int) -> None:
        # (lengths all different: the engine's slots free one at a time)
        s = client.completions.create(model=MODEL, prompt=f"flood {i}", max_tokens=100 + 10 * i, stream=True,
                                      extra_body={"ignore_eos": True})
        for n, _ in enumerate(s):
            if n == 0:
                started.append(time.monotonic())
            if stop.is_set():
                break
        s.close()

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(started) >= 16, 60, 0.05, "the flood to fill the engine")
        waiting = wait_until(lambda: (n := metric(server.url, "zserve_engine_requests_waiting{")) >= 20 and n, 30, 0.05,
                             "the flood to queue")
        sent = time.monotonic()
        r = complete(server.url, "free", max_tokens=1)
        first = time.monotonic()
        assert r.status_code == 200, r.text
        overtook = sum(sent <= t <= first for t in started)
        assert overtook <= 4, (overtook, waiting)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        http.close()


def reload(server: Server) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCH, "reload", "--tenants-only", "--port", str(server.port)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_a_reload_under_load_drops_nothing_and_a_malformed_one_is_refused(server, tenants_file):
    failed: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            r = complete(server.url, "free", max_tokens=4)
            if r.status_code != 200:
                failed.append(f"{r.status_code} {r.text}")

    threads = [threading.Thread(target=traffic) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        tenants_file.write_text(tenants_toml(rate_rpm=1200))
        done = reload(server)
        assert done.returncode == 0 and "in force" in done.stdout, done.stderr
        assert complete(server.url, "rate").headers.get("x-ratelimit-limit-requests") == "1200"
        tenants_file.write_text(tenants_toml() + '\n[[tenant]]\nname = "leaky"\nkey_sha256 = ["sk-live-key"]\n')
        refused = reload(server)
        assert refused.returncode != 0 and "tenants.toml:" in refused.stderr and "plaintext" in refused.stderr
        assert "sk-live-key" not in refused.stderr
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        tenants_file.write_text(tenants_toml())
    assert not failed, failed[:3]
    assert complete(server.url, "rate").headers.get("x-ratelimit-limit-requests") == "1200"  # the old ones stay


def test_a_malformed_tenants_file_stops_the_start_naming_its_line(tmp_path):
    bad = tmp_path / "tenants.toml"
    bad.write_text('[[tenant]]\nname = "a"\nkey_sha256 = ["sk-plaintext"]\n')
    r = subprocess.run([*LAUNCH, "api-server", "--model", MODEL, "--tenants", str(bad)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{bad}:3:" in r.stderr and "sk-plaintext" not in r.stderr, r.stderr


def test_launch_keys_hash_prints_the_digest_a_tenants_file_takes():
    r = subprocess.run([*LAUNCH, "keys", "hash"], input="sk-team-a\n", cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == key_digest("sk-team-a")
    new = subprocess.run([*LAUNCH, "keys", "hash", "--new"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    key, digest = (line.split()[-1] for line in new.stdout.splitlines())
    assert key.startswith("sk-") and digest == key_digest(key)


def test_launch_status_shows_each_tenants_usage_against_its_limits(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["pair"], max_retries=0, timeout=60)
    stream = client.completions.create(model=MODEL, prompt="a story", max_tokens=4000, stream=True,
                                       extra_body={"ignore_eos": True})
    try:
        next(iter(stream))
        r = subprocess.run([*LAUNCH, "status", "--tenants", "--port", str(server.port)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    finally:
        stream.close()
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()[1:-1]}
    assert set(rows) == set(KEYS), r.stdout
    assert rows["pair"][5] == "1/2" and rows["pair"][6] == "host"  # its stream in flight, on this host's store
    assert rows["tok"][4].endswith("/100") and rows["free"][1] == "3" and rows["free"][3] == "-"
    assert not any(k in r.stdout for k in KEYS.values())
