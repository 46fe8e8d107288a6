"""Prometheus metrics: request metrics recorded by every gateway, aggregated across gateway
processes (prometheus_client's multiprocess mode; the supervisor owns the directory and removes a
dead gateway's files), plus engine metrics from the stats every engine publishes to every gateway.

Recording is cheap on purpose: a request only adds to plain numbers in this process
(``gateway.metric_buffers``, one buffer per metric), and a streamed token to its request's own numbers
(``TokenTimer``, folded into the buffers at each flush), because each prometheus_client call in
multiprocess mode is a locked mmap write (~10 per request, 2-3 per token). ``Recorder.flush`` adds what was
recorded to the prometheus_client metrics in bulk: every ``FLUSH_INTERVAL`` s when something changed
(the app's ``flush_periodically``), right before this gateway renders ``/metrics`` (so one gateway's
own numbers are always exact) and at shutdown. Other gateways' numbers in a scrape, the in-flight
gauge included, may lag by up to ``FLUSH_INTERVAL``. Recording and flushing happen on the event
loop's thread only.

Names follow Prometheus conventions: ``zserve_`` prefix, base units, ``_total`` for counters. vLLM's metrics
under vLLM's names are exported beside them (``gateway.vllm_metrics``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from bisect import bisect_left
from collections.abc import AsyncIterator
from contextlib import suppress
from time import monotonic

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY

from protocol import EngineStats

from .metric_buffers import BufferedCounter, BufferedGauge, BufferedHistogram
from .state import STATE
from .tenancy import TenantMetrics
from .vllm_metrics import VllmRequestMetrics, engine_families

log = logging.getLogger("zserve.gateway")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CLIENT_CLOSED_REQUEST = 499  # the status a request is counted with when its client left first (nginx's convention)
FLUSH_INTERVAL = 0.5  # seconds: how far another gateway's request metrics may lag in a scrape


class Recorder:
    """One process's gateway request metrics (in ``registry``), recorded in memory and written by ``flush``."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY):
        self.http_requests = BufferedCounter(Counter(
            "zserve_http_requests_total", "HTTP requests answered, by route and status code.",
            ["method", "route", "status"], registry=registry))
        self.http_duration = BufferedHistogram(
            "zserve_http_request_duration_seconds", "Time to answer an HTTP request (whole stream).", ["route"],
            (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry)
        self.ttft = BufferedHistogram(
            "zserve_time_to_first_token_seconds", "From a request's arrival to its first generated token.", (),
            (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40), registry)
        self.inter_token = BufferedHistogram(
            "zserve_inter_token_latency_seconds", "Time between consecutive generated tokens.", (),
            (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5), registry)
        self.prompt_tokens = BufferedCounter(Counter(
            "zserve_prompt_tokens_total", "Prompt tokens sent to engines.", registry=registry))
        self.generation_tokens = BufferedCounter(Counter(
            "zserve_generation_tokens_total", "Tokens generated for clients.", registry=registry))
        self.in_flight = BufferedGauge(Gauge(
            "zserve_requests_in_flight", "Generation requests being served by gateways.",
            multiprocess_mode="livesum", registry=registry))
        self.migrations = BufferedCounter(Counter(
            "zserve_migrations_total", "Requests moved to another engine, with the tokens they had generated, when "
            "their engine was lost while they streamed; by cause (engine_lost, drain_timeout, group_lost).",
            ["cause"], registry=registry))
        self.migrations_exhausted = BufferedCounter(Counter(
            "zserve_migrations_exhausted_total", "Requests that lost their engine while streaming and failed instead "
            "of moving: --migration-limit moves already made, or longer than --migration-max-len; by cause.",
            ["cause"], registry=registry))
        self.lora_requests = BufferedCounter(Counter(
            "zserve_lora_requests_total", "Generation requests through a LoRA adapter (each choice of one counts), "
            "by adapter.", ["lora"], registry=registry))
        self.lora_prompt_tokens = BufferedCounter(Counter(
            "zserve_lora_prompt_tokens_total", "Prompt tokens sent through a LoRA adapter, by adapter.", ["lora"],
            registry=registry))
        self.lora_generation_tokens = BufferedCounter(Counter(
            "zserve_lora_generation_tokens_total", "Tokens generated through a LoRA adapter, by adapter.", ["lora"],
            registry=registry))
        self.routing_decisions = BufferedCounter(Counter(
            "zserve_routing_decisions_total", "Requests routed to an engine of a model with two or more, by engine "
            "and reason (gateway.routing: cache, hash, bound, load, round-robin).", ["model", "engine", "reason"],
            registry=registry))
        self.vllm = VllmRequestMetrics(registry)
        # The requests streaming now (``TokenTimer``): what they counted is folded into the buffers at each flush.
        self.streaming: set[TokenTimer] = set()
        self.itl_bounds = self.inter_token.bounds
        self.vllm_itl_bounds = self.vllm.inter_token.bounds
        self.tenants = TenantMetrics(registry)
        self._all = (*self.tenants.all, self.http_requests, self.http_duration, self.ttft, self.inter_token,
                     self.prompt_tokens, self.generation_tokens, self.in_flight, self.migrations,
                     self.migrations_exhausted, self.lora_requests, self.lora_prompt_tokens,
                     self.lora_generation_tokens, self.routing_decisions, self.vllm)

    def migration(self, cause: str, moved: bool) -> None:
        """A request lost its engine while streaming (``EngineClient.on_migration``)."""
        (self.migrations if moved else self.migrations_exhausted).inc(labels=(cause,))

    def routing(self, model: str | None, reason: str, engine: int | None) -> None:
        """A request was routed (``routing.Router.on_decision``)."""
        self.routing_decisions.inc(labels=(model or "", "" if engine is None else engine, reason))

    def flush(self) -> None:
        """Add everything recorded since the last flush to the prometheus_client metrics."""
        for timer in self.streaming:
            timer.fold()
        for metric in self._all:
            metric.flush()


RECORDER = Recorder()
HTTP_REQUESTS = RECORDER.http_requests  # labels (method, route, status: int)
HTTP_DURATION = RECORDER.http_duration  # labels (route,)
TTFT = RECORDER.ttft
INTER_TOKEN = RECORDER.inter_token
PROMPT_TOKENS = RECORDER.prompt_tokens
GENERATION_TOKENS = RECORDER.generation_tokens
IN_FLIGHT = RECORDER.in_flight


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
        reporting: list[tuple[str, str, EngineStats]] = []  # (model, rank, stats) of each engine with stats
        # The cluster's weight version and sleep level of each model (POST /update_weights, /sleep).
        cl = getattr(state, "cluster", None)  # (None before the first cluster state, and without a supervisor)
        weights = GaugeMetricFamily("zserve_model_weight_version_info", "1 for the weight version each model serves "
                                    "(POST /update_weights).", labels=["model", "version"])
        sleeping = GaugeMetricFamily("zserve_model_sleep_level", "A model's sleep level (POST /sleep; 0: awake).",
                                     labels=["model"])
        for m in getattr(state, "models", ()):
            model = m.model_id
            weights.add_metric([model, cl.weight_versions.get(model, "default") if cl else "default"], 1.0)
            sleeping.add_metric([model], float(cl.sleeping.get(model, 0) if cl else 0))
        yield weights
        yield sleeping
        for e in state.engines.engines.values():
            if e.hello is None:
                continue
            values = [str(e.hello.rank), e.hello.model_id]
            up.add_metric(values, 1.0 if e.routable else 0.0)
            if e.stats is None:
                continue
            for key, fam in families.items():
                fam.add_metric(values, float(getattr(e.stats, key)))
            reporting.append((values[1], values[0], e.stats))
        yield from families.values()
        yield up
        yield from engine_families(reporting)


def gateways_registry() -> CollectorRegistry:
    """Every gateway's request metrics, read afresh at each ``collect()`` (prometheus_client's multiprocess
    directory, which the supervisor owns), or this process's alone when it runs without a supervisor."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    gateways = CollectorRegistry()
    multiprocess.MultiProcessCollector(gateways)
    return gateways


def render(app: web.Application) -> bytes:
    """All gateways' request metrics (or this process's, when run without a supervisor) + engines'."""
    RECORDER.flush()
    engines = CollectorRegistry()
    engines.register(EngineCollector(app))
    return generate_latest(gateways_registry()) + generate_latest(engines)


async def flush_periodically(app: web.Application) -> AsyncIterator[None]:
    """The app's cleanup context: flush ``RECORDER`` every ``FLUSH_INTERVAL`` s, and once more at shutdown."""
    task = asyncio.create_task(_flush_every(FLUSH_INTERVAL))
    try:
        yield
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        RECORDER.flush()


async def _flush_every(interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            RECORDER.flush()
        except Exception:  # e.g. the metrics directory is gone: lose these numbers, keep serving
            log.exception("could not write request metrics to prometheus_client (those are dropped); "
                          "trying again in %.1fs", interval)


def client_left(request: web.Request) -> bool:
    """Whether the request's client closed its connection (aiohttp drops the transport when it sees that): its
    request is counted as ``CLIENT_CLOSED_REQUEST``, a cancellation rather than a server error."""
    transport = request.transport
    return transport is None or transport.is_closing()


def record_request(request: web.Request, status: int, start: float) -> None:
    """Count an answered request by its route's pattern (not its path: ids would make a label per request)."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    HTTP_REQUESTS.inc(1, (request.method, route, status))
    HTTP_DURATION.observe(monotonic() - start, (route,))


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    """``record_request`` alone, for an app without the gateway's middleware (``admission.gateway_middleware``
    does the same inside)."""
    start = monotonic()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as e:
        status = e.status
        raise
    except (asyncio.CancelledError, ConnectionError):
        if client_left(request):
            status = CLIENT_CLOSED_REQUEST
        raise
    finally:
        record_request(request, status, start)


class TokenTimer:
    """Records one request's time to first token, inter-token gaps, token counts and end, under zserve's names
    and vLLM's (``gateway.vllm_metrics``). ``engine`` is the rank of the engine the request went to, set by whoever
    sent it there (``serving.choices``); vLLM's series carry it from the first token on.

    A streamed token only adds to the timer's own numbers (its count, and its gap's bucket in each inter-token
    histogram): this runs for every token. They go to the recorder's buffers when the request ends, and at each
    ``Recorder.flush`` for the requests still streaming (``fold``), so a scrape counts every token so far."""

    __slots__ = ("start", "last", "engine", "_recorder", "_lora", "_model", "_prompt_tokens", "_labels", "_finish",
                 "_tokens", "_gaps", "_gap_sum", "_itl", "_vllm_itl")

    def __init__(self, recorder: Recorder = RECORDER, lora: str | None = None, prompt_tokens: int = 0,
                 model: str = "") -> None:
        self.start = monotonic()
        self.last: float | None = None
        self.engine: str | None = None
        self._recorder = recorder
        self._lora = (lora,) if lora is not None else None  # counted per LoRA adapter too
        self._model = model
        self._prompt_tokens = prompt_tokens  # vLLM counts them with the first token, by engine
        self._labels: tuple[str, str] = (model, "")  # vLLM's (model_name, engine), fixed at the first token
        self._finish = "abort"  # what vllm:request_success counts the request as unless a finish reason comes
        self._tokens = 0  # generated, not yet folded
        self._gaps = 0  # inter-token gaps observed, not yet folded: their counts per bucket and their sum
        self._gap_sum = 0.0
        self._itl: list[int] = []
        self._vllm_itl: list[int] = []
        recorder.prompt_tokens.inc(prompt_tokens)
        if lora is not None:
            recorder.lora_requests.inc(labels=self._lora)
            recorder.lora_prompt_tokens.inc(prompt_tokens, labels=self._lora)

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = monotonic()
        last = self.last
        self.last = now
        self._tokens += n
        if last is None:
            self._first(now)
            return
        gap = (now - last) / n  # n tokens in one chunk: n equal gaps
        self._itl[bisect_left(self._recorder.itl_bounds, gap)] += n
        self._vllm_itl[bisect_left(self._recorder.vllm_itl_bounds, gap)] += n
        self._gaps += n
        self._gap_sum += gap * n

    def _first(self, now: float) -> None:
        r = self._recorder
        labels = self._labels = (self._model, self.engine or "")
        r.ttft.observe(now - self.start)
        v = r.vllm
        v.ttft.observe(now - self.start, labels)
        v.prompt_tokens.inc(self._prompt_tokens, labels)
        self._itl = [0] * len(r.itl_bounds)
        self._vllm_itl = [0] * len(r.vllm_itl_bounds)
        r.streaming.add(self)

    def fold(self) -> None:
        """Add what the timer counted since the last fold to the recorder's buffers."""
        r = self._recorder
        if self._tokens:
            n, self._tokens = self._tokens, 0
            r.generation_tokens.inc(n)
            if self._lora is not None:
                r.lora_generation_tokens.inc(n, labels=self._lora)
            r.vllm.generation_tokens.inc(n, self._labels)
        if self._gaps:
            r.inter_token.add(self._itl, self._gap_sum)
            r.vllm.inter_token.add(self._vllm_itl, self._gap_sum, self._labels)
            self._gaps, self._gap_sum = 0, 0.0
            self._itl = [0] * len(self._itl)
            self._vllm_itl = [0] * len(self._vllm_itl)

    def finished(self, reason: str) -> None:
        """The request's finish reason (stop, length, ...), once it has one."""
        self._finish = reason

    def end(self) -> None:
        """The request is over: its end-to-end latency and finish reason, when it reached an engine."""
        if self.last is not None:
            self.fold()
            self._recorder.streaming.discard(self)
        if self.engine is None and self.last is None:
            return  # never sent (no engine would take it): vLLM counts only the requests its engine took
        labels = self._labels if self.last is not None else (self._model, self.engine or "")
        v = self._recorder.vllm
        v.e2e.observe(monotonic() - self.start, labels)
        v.request_success.inc(1, (*labels, self._finish))
