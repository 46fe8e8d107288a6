"""Prometheus metrics: request metrics recorded by every gateway, aggregated across gateway
processes (prometheus_client's multiprocess mode; the supervisor owns the directory and removes a
dead gateway's files), plus engine metrics from the stats every engine publishes to every gateway.

Names follow Prometheus conventions: ``zserve_`` prefix, base units, ``_total`` for counters.
"""

from __future__ import annotations

import dataclasses
import os
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY

from protocol import EngineStats

from .state import STATE

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

HTTP_REQUESTS = Counter("zserve_http_requests_total", "HTTP requests answered, by route and status code.",
                        ["method", "route", "status"])
HTTP_DURATION = Histogram("zserve_http_request_duration_seconds", "Time to answer an HTTP request (whole stream).",
                          ["route"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
TTFT = Histogram("zserve_time_to_first_token_seconds", "From a request's arrival to its first generated token.",
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40))
INTER_TOKEN = Histogram("zserve_inter_token_latency_seconds", "Time between consecutive generated tokens.",
                        buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5))
PROMPT_TOKENS = Counter("zserve_prompt_tokens_total", "Prompt tokens sent to engines.")
GENERATION_TOKENS = Counter("zserve_generation_tokens_total", "Tokens generated for clients.")
IN_FLIGHT = Gauge("zserve_requests_in_flight", "Generation requests being served by gateways.",
                  multiprocess_mode="livesum")


# EngineStats field -> (gauge or counter, metric name, help): the fields the dataclass marks as metrics.
ENGINE_METRICS = {f.name: f.metadata["metric"] for f in dataclasses.fields(EngineStats) if "metric" in f.metadata}
_FAMILY = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


class EngineCollector:
    """Engine gauges from the latest EngineStats this gateway has seen (every gateway sees all)."""

    def __init__(self, app: web.Application):
        self.app = app

    def collect(self):
        state = self.app[STATE]
        labels = ["engine", "model"]
        families = {name: _FAMILY[kind](metric, doc, labels=labels)
                    for name, (kind, metric, doc) in ENGINE_METRICS.items()}
        up = GaugeMetricFamily("zserve_engine_up", "1 when the engine is connected and routable.", labels=labels)
        for e in state.engines.engines.values():
            if e.hello is None:
                continue
            values = [str(e.hello.rank), e.hello.model_id]
            up.add_metric(values, 1.0 if e.routable else 0.0)
            if e.stats is None:
                continue
            for key, fam in families.items():
                fam.add_metric(values, float(getattr(e.stats, key)))
        yield from families.values()
        yield up


def render(app: web.Application) -> bytes:
    """All gateways' request metrics (or this process's, when run without a supervisor) + engines'."""
    engines = CollectorRegistry()
    engines.register(EngineCollector(app))
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        gateways = CollectorRegistry()
        multiprocess.MultiProcessCollector(gateways)
    else:
        gateways = REGISTRY
    return generate_latest(gateways) + generate_latest(engines)


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    start = time.monotonic()
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as e:
        status = e.status
        raise
    finally:
        HTTP_REQUESTS.labels(request.method, route, str(status)).inc()
        HTTP_DURATION.labels(route).observe(time.monotonic() - start)


class TokenTimer:
    """Records one request's time to first token, inter-token gaps and token count."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        GENERATION_TOKENS.inc(n)
        if self.last is None:
            TTFT.observe(now - self.start)
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                INTER_TOKEN.observe(gap)
        self.last = now
