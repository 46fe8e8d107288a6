"""Who may call the gateway and how much: API keys and the admin key, CORS, request ids, and the admission
limits, over real HTTP against `launch api-server` with the official SDKs."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import anthropic
import httpx
import openai
import psutil
import pytest

from tests.helpers import Server, metric, wait_until

# An access log line of a completion (--log-level debug): the gateway's index and the status it answered.
ACCESS_LINE = re.compile(r"\[gateway (\d+) \d+\] zserve\.gateway\.access: POST /v1/completions -> (\d+) ")

KEY, FILE_KEY, ADMIN = "sk-zs-test-0123456789abcdef", "sk-zs-file-fedcba9876543210", "adm-zs-test-5555aaaa"
SECRETS = (KEY, FILE_KEY, ADMIN)
MODEL = "tiny-random"
ORIGIN = "https://app.example"
CONTEXT = 256
AUTH = {"Authorization": f"Bearer {KEY}"}

# Every protected route family, with a body it would accept: each must answer 401 without a key.
PROTECTED = [
    ("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None), ("GET", "/load", None),
    ("GET", "/status", None), ("GET", "/version", None), ("GET", "/is_paused", None),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}),
    ("POST", "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/responses", {"model": MODEL, "input": "hi"}),
    ("POST", "/v1/embeddings", {"model": MODEL, "input": "hi"}),
    ("POST", "/pooling", {"model": MODEL, "input": "hi"}),
    ("POST", "/score", {"model": MODEL, "text_1": "a", "text_2": "b"}),
    ("POST", "/v1/rerank", {"model": MODEL, "query": "a", "documents": ["b"]}),
    ("POST", "/classify", {"model": MODEL, "input": "hi"}),
    ("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [1, 2]}),
    ("POST", "/inference/v1/generate", {"model": MODEL, "token_ids": [1, 2, 3]}),
    ("POST", "/v1/chat/completions/render", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/invocations", {"prompt": "hi"}),
    ("POST", "/pause", None), ("POST", "/resume", None),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# one key a line\n{FILE_KEY}\n")
    s = Server("--model", MODEL, "--dtype", "float32", "--count", "2", "--api-key", KEY, "--api-key-file",
               str(key_file), "--allowed-origins", ORIGIN, "--max-concurrent-requests", "64", "--max-num-seqs", "16",
               "--max-model-len", str(CONTEXT), "--log-level", "debug", log_name="security",
               env={"ZSERVE_ADMIN_KEY": ADMIN})
    yield s
    s.stop()


def engine_steps(server: Server) -> float:
    return metric(server.url, "zserve_engine_steps_total")  # open to scrapers by default (--metrics-auth closes it)


def test_without_a_key_every_protected_route_is_401_in_its_familys_shape_and_reaches_no_engine(server):
    steps = engine_steps(server)
    for method, path, body in PROTECTED:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"x-api-key": "wrong-key"},
                        {"Authorization": f"Bearer {ADMIN}"}):  # the admin key is no API key
            if path in ("/pause", "/resume") and headers.get("Authorization", "").endswith(ADMIN):
                continue
            r = httpx.request(method, server.url + path, json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.headers["WWW-Authenticate"] == "Bearer"
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and KEY not in r.text and "wrong-key" not in r.text
            if path.startswith("/v1/messages"):
                assert r.json()["type"] == "error"  # Anthropic's shape
    assert httpx.get(server.url + "/health").status_code == 200  # liveness stays open
    assert httpx.post(server.url + "/ping").status_code == 200
    assert httpx.get(server.url + "/readyz").status_code == 200  # so do readiness probes
    # ...and so does the API's description; every route it lists (plugins' too) is closed without a key.
    spec = httpx.get(server.url + "/openapi.json").json()
    assert httpx.get(server.url + "/docs").status_code == 200
    listed = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert {(m, p.replace(MODEL, "{model}")) for m, p, _ in PROTECTED} - listed == set()  # the spec lists them all
    for method, path in sorted(listed):
        if path in ("/health", "/ping", "/ready", "/readyz", "/metrics", "/openapi.json", "/docs", "/redoc", "/ui") or \
                path.startswith("/docs/assets/"):
            continue  # (the console's page is open, its data routes are not: /ui/api/series is checked here)
        r = httpx.request(method, server.url + path.replace("{", "").replace("}", ""), json={})
        assert r.status_code == 401, (method, path, r.status_code)
    assert engine_steps(server) == steps  # not one of them reached an engine


def test_with_a_key_the_official_sdks_work_and_the_key_file_counts(server):
    for key in (KEY, FILE_KEY):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert out.choices[0].finish_reason in ("length", "stop")
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)  # sends x-api-key
    msg = claude.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert msg.usage.output_tokens >= 1
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0).messages.create(
            model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_the_admin_key_works_only_on_admin_routes(server):
    r = httpx.post(server.url + "/pause", headers=AUTH)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    try:
        assert httpx.post(server.url + "/pause", headers=admin, timeout=30).json()["paused"] is True
        assert httpx.get(server.url + "/is_paused", headers=AUTH).json() == {"is_paused": True}
    finally:
        assert httpx.post(server.url + "/resume", headers=admin, timeout=30).json()["paused"] is False
    assert httpx.get(server.url + "/v1/models", headers=admin).status_code == 401


def test_engine_operations_take_the_admin_key(server):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    for route in ("/sleep", "/wake_up", "/update_weights", "/update_weight_version", "/reset_prefix_cache",
                  "/reset_mm_cache", "/reset_encoder_cache", "/start_profile", "/stop_profile", "/abort_requests",
                  "/inference/v1/abort_requests"):
        assert httpx.post(server.url + route).status_code == 401, route
        r = httpx.post(server.url + route, headers=AUTH)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", route
    r = httpx.post(server.url + "/reset_encoder_cache", headers=admin, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    for route in ("/is_sleeping", "/weight_info", "/get_world_size"):  # reading the state takes an API key
        assert httpx.get(server.url + route, headers=AUTH).status_code == 200, route


def test_cors_preflights_are_answered_for_the_allowed_origin_only(server):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": ORIGIN, **pre})
    assert ok.status_code == 204 and ok.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in ok.headers["Access-Control-Allow-Methods"]
    assert "authorization" in ok.headers["Access-Control-Allow-Headers"]
    other = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": "https://evil.example", **pre})
    assert other.status_code == 204 and not [h for h in other.headers if h.lower().startswith("access-control-")]
    r = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN, **AUTH})
    assert r.headers["Access-Control-Allow-Origin"] == ORIGIN and "X-Request-Id" in r.headers[
        "Access-Control-Expose-Headers"]
    refused = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN})  # a browser can read the 401 too
    assert refused.status_code == 401 and refused.headers["Access-Control-Allow-Origin"] == ORIGIN


def test_request_ids_are_echoed_or_made_and_name_the_requests_log_lines_on_gateway_and_engine(server):
    rid = "trace-7f3a-client-given"
    r = httpx.post(server.url + "/v1/completions", headers={**AUTH, "X-Request-Id": rid},
                   json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["X-Request-Id"] == rid
    for bad in ("has spaces in it", "x" * 129, "tab\there"):
        made = httpx.get(server.url + "/v1/models", headers={**AUTH, "X-Request-Id": bad}).headers["X-Request-Id"]
        assert made != bad and len(made) == 32
    assert httpx.get(server.url + "/health").headers["X-Request-Id"]  # every response carries one

    def logged() -> list[str]:
        return [line for line in Path(server.log_path).read_text(errors="replace").splitlines() if rid in line]

    lines = wait_until(lambda: (ls := logged()) and any("[gateway" in x for x in ls) and
                       any("[engine" in x for x in ls) and ls, 10, what="the request's log lines")
    assert any("POST /v1/completions -> 200" in x for x in lines)


def test_a_malformed_authorization_header_is_one_warning_that_quotes_nothing(server):
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\x01\r\n\r\n".encode())
            assert s.recv(64).startswith(b"HTTP/1.")
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200  # still serving
    log = Path(server.log_path).read_text(errors="replace")
    warnings = [line for line in log.splitlines() if "refused a malformed HTTP request" in line]
    assert 1 <= len(warnings) <= 2 and "Traceback" not in log  # rate-limited, one line each, no traceback


def test_each_limit_passes_just_under_and_refuses_just_over(server):
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.url + path, headers=AUTH, json={"model": MODEL, **body}, timeout=60)

    for field, under, over in (("n", 16, 17), ("logprobs", 20, 21)):
        assert post("/v1/completions", {"prompt": "hi", "max_tokens": 1, field: under}).status_code == 200
        r = post("/v1/completions", {"prompt": "hi", "max_tokens": 1, field: over})
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    for stop, ok in ((["x"] * 16, True), (["x"] * 17, False), (["y" * 1024], True), (["y" * 1025], False)):
        assert post("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": stop}).status_code == (
            200 if ok else 400)
    ids = list(range(1000, 1000 + CONTEXT - 1))  # the prompt fills the context but one token
    assert post("/v1/completions", {"prompt": ids, "max_tokens": 1}).status_code == 200
    r = post("/v1/completions", {"prompt": ids + [7], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    big = httpx.post(server.url + "/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                     content=b'{"prompt": "' + b"a" * (32 << 20) + b'"}', timeout=60)
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"


def test_a_flood_past_max_concurrent_requests_gets_429s_never_5xx_and_memory_stays_bounded(server):
    gateways = [p for p in psutil.Process(server.proc.pid).children() if "gateway" in " ".join(p.cmdline())]
    rss = sum(g.memory_info().rss for g in gateways)
    log_at = server.log_path.stat().st_size

    async def flood() -> list[int]:
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            async def one(i: int) -> int:
                r = await client.post(server.url + "/v1/completions", headers=AUTH, json={
                    "model": MODEL, "prompt": f"flood {i}", "max_tokens": 32, "ignore_eos": True})
                if r.status_code == 429:
                    assert r.headers["Retry-After"] and r.json()["error"]["code"] == "too_many_requests"
                return r.status_code
            return await asyncio.gather(*(one(i) for i in range(500)))

    codes = asyncio.run(flood())
    assert not [c for c in codes if c >= 500], sorted(set(codes))
    assert codes.count(429) > 0
    # Each gateway holds its own 64. The gateways share one accept queue, so a burst goes to whichever accepts first:
    # usually about half each, but once 437 of the 500 went to one gateway and 63 to the other. So per gateway, from
    # its access log: one that refused any request had served 64 at once, at least, and one that got fewer
    # connections served them all.
    def flood_lines() -> list[tuple[str, str]]:
        with open(server.log_path, "rb") as f:
            f.seek(log_at)
            return ACCESS_LINE.findall(f.read().decode(errors="replace"))

    wait_until(lambda: len(flood_lines()) >= len(codes), 30, 0.05, "the flood's access log lines")
    lines = flood_lines()
    by_gateway: dict[str, list[int]] = {}
    for gateway, code in lines:
        by_gateway.setdefault(gateway, []).append(int(code))
    assert sorted(c for got in by_gateway.values() for c in got) == sorted(codes)
    for gateway, got in by_gateway.items():
        assert got.count(200) >= 64 or 429 not in got, (gateway, got.count(200), got.count(429))
    assert set(codes) <= {200, 429}
    assert sum(g.memory_info().rss for g in gateways) - rss < 64 << 20  # bounded: no queue behind the limit
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200  # serving normally afterwards


def test_engines_with_full_queues_answer_429_across_gateways():
    s = Server("--model", MODEL, "--dtype", "float32", "--count", "2", "--max-num-seqs", "1", "--max-waiting", "2",
               log_name="max-waiting")
    try:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(client.post(s.url + "/v1/completions", json={
                    "model": MODEL, "prompt": f"q {i}", "max_tokens": 16, "ignore_eos": True}) for i in range(24)))

        rs = asyncio.run(burst())
        codes = [r.status_code for r in rs]
        assert set(codes) <= {200, 429} and codes.count(200) >= 2 and codes.count(429) >= 1, codes  # 2 queue
        busy = next(r for r in rs if r.status_code == 429)
        assert "--max-waiting" in busy.json()["error"]["message"] and busy.headers["Retry-After"] == "1"
    finally:
        s.stop()


def test_no_key_appears_in_any_log_of_the_run(server):
    # Last in this module: every request above (good keys, wrong keys, malformed headers) is in the log now.
    log = Path(server.log_path).read_bytes()
    for secret in SECRETS:
        assert secret.encode() not in log
