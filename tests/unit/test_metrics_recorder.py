"""The gateway's buffered request metrics (gateway/metrics.py) against direct prometheus_client calls.

The same events go down both paths: the cheap one (``Recorder`` buffers, ``TokenTimer``, flushed in bulk) and
the straightforward one (``.labels(...).inc()`` / ``.observe()`` per event on the same metric definitions, as
the gateway did before). The scraped samples must be the same, in one process and in multiprocess mode, where
a gateway writes mmap files and any gateway's ``MultiProcessCollector`` reads them.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import REGISTRY

from gateway import metrics
from gateway.metrics import Recorder, TokenTimer
from tests.helpers import ROOT

HTTP_BOUNDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TTFT_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40)
ITL_BOUNDS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
PROMPT, MODEL, ENGINE = 11, "m", "0"  # each stream's prompt tokens, and vLLM's model_name and engine labels


def spanning(bounds: tuple[float, ...]) -> list[float]:
    """Durations in every bucket: 0, each bound exactly, a value just past it, and past the last (+Inf)."""
    return [0.0, *bounds, *(b * 1.001 for b in bounds), bounds[-1] * 10]


def events() -> list[tuple]:
    ev: list[tuple] = []
    routes = [("POST", "/v1/chat/completions", 200), ("POST", "/v1/chat/completions", 400),
              ("GET", "/v1/models/{model}", 200), ("GET", "unmatched", 404), ("POST", "/v1/completions", 500)]
    for i, d in enumerate(spanning(HTTP_BOUNDS)):
        ev.append(("request", *routes[i % len(routes)], d))
        if i == 7:
            ev.append(("flush",))  # several flushes add up
    ev += [("enter",), ("enter",), ("enter",), ("exit",), ("flush",), ("enter",), ("exit",), ("exit",), ("exit",)]
    ev += [("prompt", n) for n in (0, 1, 17, 4096)]
    ev += [("ttft", d) for d in spanning(TTFT_BOUNDS)]
    ev += [("gaps", d, n) for n in (1, 3) for d in spanning(ITL_BOUNDS)]
    ev.append(("flush",))
    # streams: (request start, [(chunk time, tokens in the chunk)], finish reason: None for one that ended without
    # one), several tokens per chunk included
    ev.append(("stream", 100.0, [(100.3, 1), (100.32, 1), (100.4, 4), (101.0, 2), (104.0, 1), (104.0, 3)], "length"))
    ev.append(("stream", 200.0, [(200.005, 5), (200.5, 7), (230.0, 1)], "stop"))
    ev.append(("stream", 300.0, [(350.0, 2)], None))
    ev.append(("stream", 400.0, [(9000.0, 1)], "length"))  # past vLLM's last e2e bound
    ev.append(("unsent", 500.0))  # a request no engine took: only its prompt tokens count (zserve's)
    ev.append(("enter",))  # one request still in flight when scraped
    return ev


@contextmanager
def clock_at(t: float) -> Iterator[None]:
    saved = metrics.monotonic
    metrics.monotonic = lambda: t
    try:
        yield
    finally:
        metrics.monotonic = saved


def record_cheaply(r: Recorder, evs: list[tuple]) -> None:
    """The gateway's path: buffers, TokenTimer, explicit flushes."""
    for kind, *args in evs:
        if kind == "request":
            method, route, status, seconds = args
            r.http_requests.inc(1, (method, route, status))
            r.http_duration.observe(seconds, (route,))
        elif kind == "prompt":
            r.prompt_tokens.inc(args[0])
        elif kind == "ttft":
            r.ttft.observe(args[0])
        elif kind == "gaps":
            r.inter_token.observe(args[0], n=args[1])
        elif kind == "stream":
            start, chunks, finish = args
            with clock_at(start):
                timer = TokenTimer(r, prompt_tokens=PROMPT, model=MODEL)
            timer.engine = ENGINE
            for t, n in chunks:
                with clock_at(t):
                    timer.tokens(n)
            if finish is not None:
                timer.finished(finish)
            with clock_at(chunks[-1][0] + 0.5):
                timer.end()
        elif kind == "unsent":
            with clock_at(args[0]):
                timer = TokenTimer(r, prompt_tokens=PROMPT, model=MODEL)
                timer.end()
        elif kind == "enter":  # as a request's TextPipeline counts itself in and out
            r.in_flight.inc()
        elif kind == "exit":
            r.in_flight.dec()
        elif kind == "flush":
            r.flush()


def record_directly(r: Recorder, evs: list[tuple]) -> None:
    """The straightforward path: one prometheus_client call per event, on the same metric definitions."""
    for kind, *args in evs:
        if kind == "request":
            method, route, status, seconds = args
            r.http_requests.metric.labels(method, route, str(status)).inc()
            r.http_duration.metric.labels(route).observe(seconds)
        elif kind == "prompt":
            r.prompt_tokens.metric.inc(args[0])
        elif kind == "ttft":
            r.ttft.metric.observe(args[0])
        elif kind == "gaps":
            for _ in range(args[1]):
                r.inter_token.metric.observe(args[0])
        elif kind == "stream":
            start, chunks, finish = args
            v, labels = r.vllm, (MODEL, ENGINE)
            r.prompt_tokens.metric.inc(PROMPT)
            last = None
            for t, n in chunks:
                r.generation_tokens.metric.inc(n)
                v.generation_tokens.metric.labels(*labels).inc(n)
                if last is None:
                    r.ttft.metric.observe(t - start)
                    v.ttft.metric.labels(*labels).observe(t - start)
                    v.prompt_tokens.metric.labels(*labels).inc(PROMPT)
                else:
                    for _ in range(n):
                        r.inter_token.metric.observe((t - last) / n)
                        v.inter_token.metric.labels(*labels).observe((t - last) / n)
                last = t
            v.e2e.metric.labels(*labels).observe(chunks[-1][0] + 0.5 - start)
            v.request_success.metric.labels(*labels, finish or "abort").inc()
        elif kind == "unsent":
            r.prompt_tokens.metric.inc(PROMPT)
        elif kind == "enter":
            r.in_flight.metric.inc()
        elif kind == "exit":
            r.in_flight.metric.dec()


def samples(text: str) -> list[tuple]:
    """(family, type, help, sample name, labels, value) for every sample but the per-process ``_created``."""
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out.append((fam.name, fam.type, fam.documentation, s.name, tuple(sorted(s.labels.items())), s.value))
    return sorted(out, key=lambda s: s[:5])


def assert_same(cheap: str, direct: str) -> None:
    got, want = samples(cheap), samples(direct)
    assert [s[:5] for s in got] == [s[:5] for s in want]
    for g, w in zip(got, want):
        if g[3].endswith("_sum"):  # the same observations, added up in another order
            assert g[5] == pytest.approx(w[5], rel=1e-12), g
        else:
            assert g[5] == w[5], g


def test_buffered_recording_scrapes_the_same_as_direct_prometheus_calls():
    cheap_registry, direct_registry = CollectorRegistry(), CollectorRegistry()
    cheap, direct = Recorder(cheap_registry), Recorder(direct_registry)
    record_cheaply(cheap, events())
    record_directly(direct, events())
    cheap.flush()
    text = generate_latest(cheap_registry).decode()
    assert_same(text, generate_latest(direct_registry).decode())
    # every bucket was reached, +Inf and the request in flight at scrape time included
    got = {(s[3], s[4]): s[5] for s in samples(text)}
    assert got["zserve_time_to_first_token_seconds_bucket", (("le", "40.0"),)] < \
        got["zserve_time_to_first_token_seconds_bucket", (("le", "+Inf"),)]
    assert got["zserve_requests_in_flight", ()] == 1
    assert got["zserve_http_requests_total", (("method", "GET"), ("route", "unmatched"), ("status", "404"))] > 0
    assert got["zserve_generation_tokens_total", ()] == 1 + 1 + 4 + 2 + 1 + 3 + 5 + 7 + 1 + 2 + 1
    # vLLM's: per (model_name, engine); a request counts its prompt with its first token, and once it has ended
    vllm = (("engine", ENGINE), ("model_name", MODEL))
    assert got["vllm:generation_tokens_total", vllm] == got["zserve_generation_tokens_total", ()]
    assert got["vllm:prompt_tokens_total", vllm] == 4 * PROMPT
    assert got["zserve_prompt_tokens_total", ()] == 1 + 17 + 4096 + 5 * PROMPT
    assert [got["vllm:request_success_total", (*vllm[:1], ("finished_reason", f), *vllm[1:])]
            for f in ("length", "stop", "abort")] == [2, 1, 1]
    assert got["vllm:e2e_request_latency_seconds_count", vllm] == 4
    assert got["vllm:e2e_request_latency_seconds_bucket", (*vllm[:1], ("le", "7680.0"), *vllm[1:])] == 3


def test_nothing_is_scraped_before_a_flush_and_a_second_flush_adds_nothing():
    registry = CollectorRegistry()
    r = Recorder(registry)
    r.in_flight.inc()
    try:
        r.prompt_tokens.inc(5)
        r.http_duration.observe(0.2, ("/x",))
        assert registry.get_sample_value("zserve_prompt_tokens_total") == 0
        assert registry.get_sample_value("zserve_http_request_duration_seconds_count", {"route": "/x"}) is None
        r.flush()
        r.flush()
        assert registry.get_sample_value("zserve_prompt_tokens_total") == 5
        assert registry.get_sample_value("zserve_http_request_duration_seconds_count", {"route": "/x"}) == 1
        assert registry.get_sample_value("zserve_requests_in_flight") == 1
    finally:
        r.in_flight.dec()
    r.flush()
    assert registry.get_sample_value("zserve_requests_in_flight") == 0


def _record_in_child(how: str) -> None:
    """Run in a fresh process with PROMETHEUS_MULTIPROC_DIR set: record ``events()`` into the mmap files
    the way the gateway does (``cheap``, written by rendering /metrics) or one call per event (``direct``)."""
    assert metrics.RECORDER.http_requests.metric._labelnames  # the module's metrics, now in multiprocess mode
    if how == "cheap":
        record_cheaply(metrics.RECORDER, events())
        metrics.render({metrics.STATE: SimpleNamespace(engines=SimpleNamespace(engines={}))})  # type: ignore[arg-type]
    else:
        record_directly(metrics.RECORDER, events())


def test_multiprocess_files_after_a_flush_read_the_same_as_direct_recording(tmp_path):
    texts = {}
    for how in ("cheap", "direct"):
        d = tmp_path / how
        d.mkdir()
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(d)}
        code = f"from tests.unit.test_metrics_recorder import _record_in_child; _record_in_child({how!r})"
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=60)
        assert os.listdir(d), f"the {how} recording wrote no multiprocess file"
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(d))
        texts[how] = generate_latest(registry).decode()
    assert_same(texts["cheap"], texts["direct"])
    assert 'zserve_requests_in_flight 1.0' in texts["cheap"]


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _bad(request: web.Request) -> web.Response:
    raise web.HTTPBadRequest()


async def _boom(request: web.Request) -> web.Response:
    raise RuntimeError("boom")


def _app() -> web.Application:
    app = web.Application(middlewares=[metrics.metrics_middleware])
    app.cleanup_ctx.append(metrics.flush_periodically)
    app.router.add_get("/items/{item}", _ok)
    app.router.add_post("/bad", _bad)
    app.router.add_get("/boom", _boom)
    return app


def _requests(method: str, route: str, status: str) -> float:
    labels = {"method": method, "route": route, "status": status}
    return REGISTRY.get_sample_value("zserve_http_requests_total", labels) or 0.0


WANT = {("GET", "/items/{item}", "200"): 3, ("POST", "/bad", "400"): 1, ("GET", "/boom", "500"): 1,
        ("GET", "unmatched", "404"): 2}


async def _send(client: TestClient) -> None:
    for path in ("/items/a", "/items/b", "/items/c", "/nowhere", "/nowhere/else", "/boom"):
        await client.get(path)
    await client.post("/bad")


def test_the_middleware_counts_by_route_template_and_status_and_the_app_flushes_periodically(monkeypatch):
    monkeypatch.setattr(metrics, "FLUSH_INTERVAL", 0.02)
    before = {k: _requests(*k) for k in WANT}

    async def run() -> None:
        async with TestClient(TestServer(_app())) as client:
            await _send(client)
            deadline = asyncio.get_running_loop().time() + 10
            while {k: _requests(*k) - before[k] for k in WANT} != WANT:  # no scrape here: the periodic flush
                assert asyncio.get_running_loop().time() < deadline, "the periodic flush never came"
                await asyncio.sleep(0.01)

    asyncio.run(run())
    count = REGISTRY.get_sample_value("zserve_http_request_duration_seconds_count", {"route": "/items/{item}"})
    assert count is not None and count >= 3


def test_the_app_flushes_at_shutdown(monkeypatch):
    monkeypatch.setattr(metrics, "FLUSH_INTERVAL", 3600.0)
    metrics.RECORDER.flush()
    before = {k: _requests(*k) for k in WANT}

    async def run() -> None:
        async with TestClient(TestServer(_app())) as client:
            await _send(client)
            assert {k: _requests(*k) for k in WANT} == before  # still buffered

    asyncio.run(run())
    assert {k: _requests(*k) - before[k] for k in WANT} == WANT


def test_infinite_and_negative_observations_land_where_prometheus_puts_them():
    registry = CollectorRegistry()
    r = Recorder(registry)
    r.inter_token.observe(math.inf)
    r.inter_token.observe(-1.0)
    r.flush()
    assert registry.get_sample_value("zserve_inter_token_latency_seconds_bucket", {"le": "0.005"}) == 1
    assert registry.get_sample_value("zserve_inter_token_latency_seconds_bucket", {"le": "2.5"}) == 1
    assert registry.get_sample_value("zserve_inter_token_latency_seconds_bucket", {"le": "+Inf"}) == 2
