"""Prometheus metrics: request metrics recorded by every gateway, aggregated across gateway
processes (prometheus_client's multiprocess mode; the supervisor owns the directory and removes a
dead gateway's files), plus engine metrics from the stats every engine publishes to every gateway.

Recording is cheap on purpose: a request or a streamed token only adds to plain numbers in this
process (``Buffered*`` below, one per metric), because each prometheus_client call in multiprocess
mode is a locked mmap write (~10 per request, 2-3 per token). ``Recorder.flush`` adds what was
recorded to the prometheus_client metrics in bulk: every ``FLUSH_INTERVAL`` s when something changed
(the app's ``flush_periodically``), right before this gateway renders ``/metrics`` (so one gateway's
own numbers are always exact) and at shutdown. Other gateways' numbers in a scrape, the in-flight
gauge included, may lag by up to ``FLUSH_INTERVAL``. Recording and flushing happen on the event
loop's thread only.

Names follow Prometheus conventions: ``zserve_`` prefix, base units, ``_total`` for counters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
from bisect import bisect_left
from collections.abc import AsyncIterator, Sequence
from contextlib import suppress
from time import monotonic

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY

from protocol import EngineStats

from .state import STATE

log = logging.getLogger("zserve.gateway")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CLIENT_CLOSED_REQUEST = 499  # the status a request is counted with when its client left first (nginx's convention)
FLUSH_INTERVAL = 0.5  # seconds: how far another gateway's request metrics may lag in a scrape

Labels = tuple[object, ...]  # label values in the metric's label order; str() is applied when flushed


class BufferedCounter:
    """A Counter's increments, summed per label tuple until ``flush`` adds them to it."""

    __slots__ = ("metric", "_pending")

    def __init__(self, metric: Counter):
        self.metric = metric
        self._pending: dict[Labels, float] = {}

    def inc(self, amount: float = 1, labels: Labels = ()) -> None:
        pending = self._pending
        pending[labels] = pending.get(labels, 0) + amount

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for labels, amount in pending.items():
            (self.metric.labels(*labels) if labels else self.metric).inc(amount)


class BufferedHistogram:
    """A Histogram's observations, as bucket counts and a sum per label tuple until ``flush`` adds them to it."""

    __slots__ = ("metric", "_bounds", "_pending")

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry | None):
        self.metric = Histogram(name, documentation, labelnames, buckets=buckets, registry=registry)
        self._bounds = [float(b) for b in buckets]
        if self._bounds[-1] != math.inf:
            self._bounds.append(math.inf)
        self._pending: dict[Labels, list[float]] = {}

    def observe(self, amount: float, labels: Labels = (), n: int = 1) -> None:
        """Observe ``amount`` ``n`` times."""
        acc = self._pending.get(labels)
        if acc is None:
            acc = self._pending[labels] = [0] * len(self._bounds) + [0.0]  # bucket counts (not cumulative), sum
        acc[bisect_left(self._bounds, amount)] += n  # the first bucket with amount <= bound, as observe() picks
        acc[-1] += amount * n

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for labels, acc in pending.items():
            child = self.metric.labels(*labels) if labels else self.metric
            # prometheus_client has no public bulk observe(): add to the values observe() adds to, one per
            # bucket (not cumulative) and the sum (tests/unit/test_metrics_recorder.py pins this).
            for value, count in zip(child._buckets, acc):
                if count:
                    value.inc(count)
            child._sum.inc(acc[-1])


class BufferedGauge:
    """A (livesum) Gauge's net change until ``flush`` adds it."""

    __slots__ = ("metric", "_pending")

    def __init__(self, metric: Gauge):
        self.metric = metric
        self._pending = 0.0

    def inc(self, amount: float = 1) -> None:
        self._pending += amount

    def dec(self, amount: float = 1) -> None:
        self._pending -= amount

    def flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, 0.0
            self.metric.inc(pending)


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
        self._all = (self.http_requests, self.http_duration, self.ttft, self.inter_token, self.prompt_tokens,
                     self.generation_tokens, self.in_flight, self.migrations, self.migrations_exhausted,
                     self.lora_requests, self.lora_prompt_tokens, self.lora_generation_tokens, self.routing_decisions)

    def migration(self, cause: str, moved: bool) -> None:
        """A request lost its engine while streaming (``EngineClient.on_migration``)."""
        (self.migrations if moved else self.migrations_exhausted).inc(labels=(cause,))

    def routing(self, model: str | None, reason: str, engine: int | None) -> None:
        """A request was routed (``routing.Router.on_decision``)."""
        self.routing_decisions.inc(labels=(model or "", "" if engine is None else engine, reason))

    def flush(self) -> None:
        """Add everything recorded since the last flush to the prometheus_client metrics."""
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
        # vLLM's: one sample per engine serving adapters, its labels saying which run and wait; the value is when.
        lora_info = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running stats on LoRA requests: the adapters of the running and waiting "
            "requests, and max_lora (the value is the time of the engine's stats).",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters", *labels])
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
            st = e.stats
            if st.max_loras:
                lora_info.add_metric([str(st.max_loras), ",".join(st.waiting_loras), ",".join(st.running_loras),
                                      *values], st.timestamp)
        yield from families.values()
        yield up
        yield lora_info


def render(app: web.Application) -> bytes:
    """All gateways' request metrics (or this process's, when run without a supervisor) + engines'."""
    RECORDER.flush()
    engines = CollectorRegistry()
    engines.register(EngineCollector(app))
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        gateways = CollectorRegistry()
        multiprocess.MultiProcessCollector(gateways)
    else:
        gateways = REGISTRY
    return generate_latest(gateways) + generate_latest(engines)


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
    """Records one request's time to first token, inter-token gaps and token count."""

    __slots__ = ("start", "last", "_recorder", "_lora")

    def __init__(self, recorder: Recorder = RECORDER, lora: str | None = None, prompt_tokens: int = 0) -> None:
        self.start = monotonic()
        self.last: float | None = None
        self._recorder = recorder
        self._lora = (lora,) if lora is not None else None  # counted per LoRA adapter too
        recorder.prompt_tokens.inc(prompt_tokens)
        if lora is not None:
            recorder.lora_requests.inc(labels=self._lora)
            recorder.lora_prompt_tokens.inc(prompt_tokens, labels=self._lora)

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = monotonic()
        r = self._recorder
        r.generation_tokens.inc(n)
        if self._lora is not None:
            r.lora_generation_tokens.inc(n, labels=self._lora)
        if self.last is None:
            r.ttft.observe(now - self.start)
        else:
            r.inter_token.observe((now - self.last) / n, n=n)  # n tokens in one chunk: n equal gaps
        self.last = now
