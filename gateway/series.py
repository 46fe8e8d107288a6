"""The cluster's load second by second, for the web console's charts (``GET /ui/api/series``).

Once the console first asks, the gateway samples every ``INTERVAL`` s and keeps the last ``KEEP`` samples: from
every gateway's request metrics (prometheus_client's multiprocess files, which every gateway reads alike) the
requests answered per second, the errors per second by status code and the 50th and 99th percentiles of the time
to first token and of the inter-token latency over the second (from the histograms' bucket counts, interpolated
within a bucket as Prometheus' ``histogram_quantile`` does); from the stats every engine publishes to every gateway,
per model: requests running and waiting, KV cache use, tokens generated per second and the prefix cache's hit rate.
So every gateway of a host answers the same numbers, and a page polled through a load balancer draws one chart.
Nothing is sampled until a console asks (a gateway whose console is never opened pays nothing); then a sample
costs the gateway about a millisecond a second (docs/console.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from contextlib import suppress

from aiohttp import web
from prometheus_client import CollectorRegistry

from .metrics import RECORDER, gateways_registry
from .state import GatewayState

log = logging.getLogger("zserve.gateway.series")

INTERVAL = 1.0  # seconds between samples
KEEP = 300  # samples kept: the last five minutes
TTFT = "zserve_time_to_first_token_seconds"
ITL = "zserve_inter_token_latency_seconds"
REQUESTS = "zserve_http_requests"
# Routes left out of the requests and errors: what watches the server (this console's own polls among them), not
# what it serves.
WATCHING = frozenset({"/ui", "/ui/{name}", "/ui/api/series", "/server_info", "/status", "/health", "/metrics",
                      "/load", "/ready", "/readyz", "/ping", "/version", "/v1/models", "/is_paused"})


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of observations counted in cumulative ``buckets`` [(upper bound, count)], sorted, the last
    +Inf; linear within the bucket it falls in, as Prometheus' ``histogram_quantile``. None without observations."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # past the last finite bound: the bound, as Prometheus answers
            return lower + (upper - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = upper, count
    return lower


class _Totals:
    """The cumulative numbers one sample reads: requests by status, and each histogram's buckets."""

    def __init__(self, registry: CollectorRegistry):
        self.requests: dict[str, float] = {}
        self.buckets: dict[str, dict[float, float]] = {TTFT: {}, ITL: {}}
        for family in registry.collect():
            if family.name == REQUESTS:
                for s in family.samples:
                    if s.name.endswith("_total") and s.labels.get("route") not in WATCHING:
                        status = str(s.labels.get("status", ""))
                        self.requests[status] = self.requests.get(status, 0.0) + s.value
            elif family.name in self.buckets:
                for s in family.samples:
                    if s.name.endswith("_bucket"):
                        le = float(s.labels["le"])
                        self.buckets[family.name][le] = self.buckets[family.name].get(le, 0.0) + s.value


def _window(now: dict[float, float], before: dict[float, float]) -> list[tuple[float, float]]:
    """A histogram's bucket counts over one interval (now minus before), sorted by bound."""
    return [(le, now[le] - before.get(le, 0.0)) for le in sorted(now)]


class Series:
    """Per-second samples of the cluster's load, the last ``keep``, taken once ``start`` was called."""

    def __init__(self, state: GatewayState, interval: float = INTERVAL, keep: int = KEEP):
        self.state = state
        self.interval = interval
        self.samples: deque[dict] = deque(maxlen=keep)
        self._registry: CollectorRegistry | None = None
        self._task: asyncio.Task | None = None
        self._last: tuple[float, _Totals, dict[str, dict]] | None = None  # (time, totals, per-engine counters)

    def start(self) -> None:
        """Sample from now on (again if a sampling task died); a no-op while sampling."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task

    def since(self, t: float) -> list[dict]:
        """The samples taken after time ``t`` (seconds since the epoch), oldest first."""
        return [s for s in self.samples if s["t"] > t]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                self.sample()
            except Exception:  # a bad file of a gateway that died mid-write: the next second reads it again
                log.exception("could not sample the cluster's load")
            next_at += self.interval
            await asyncio.sleep(max(0.0, next_at - loop.time()))

    def _engines(self) -> dict[str, dict]:
        """Each engine's last stats that this gateway has, by endpoint, with its model."""
        out = {}
        for ep, e in self.state.engines.engines.items():
            st = e.stats
            if st is not None and e.hello is not None:
                out[ep] = {"model": e.model or e.hello.model_id, "running": st.running,
                           "waiting": st.waiting, "kv_used": st.kv_used, "generated": st.generated_tokens,
                           "hits": st.prefix_cache_hits, "queries": st.prefix_cache_queries}
        return out

    def sample(self) -> dict | None:
        """Take one sample (the first only sets the baseline; None then)."""
        if self._registry is None:
            self._registry = gateways_registry()
        RECORDER.flush()  # (this gateway's own numbers, exact; the others' lag by at most their flush interval)
        now, totals, engines = time.time(), _Totals(self._registry), self._engines()
        last, self._last = self._last, (now, totals, engines)
        if last is None:
            return None
        then, before, engines_before = last
        dt = max(now - then, 1e-3)
        requests = {k: (v - before.requests.get(k, 0.0)) / dt for k, v in totals.requests.items()}
        models: dict[str, dict] = {}
        for ep, e in engines.items():
            m = models.setdefault(e["model"], {"engines": 0, "running": 0, "waiting": 0, "kv_used": 0.0,
                                               "tokens_per_s": 0.0, "_hits": 0, "_queries": 0})
            m["engines"] += 1
            m["running"] += e["running"]
            m["waiting"] += e["waiting"]
            m["kv_used"] += e["kv_used"]
            b = engines_before.get(ep)
            if b is not None and e["generated"] >= b["generated"]:  # (not across an engine's restart)
                m["tokens_per_s"] += (e["generated"] - b["generated"]) / dt
                m["_hits"] += e["hits"] - b["hits"]
                m["_queries"] += e["queries"] - b["queries"]
        for m in models.values():
            m["kv_used"] = round(m["kv_used"] / m["engines"], 4)
            m["tokens_per_s"] = round(m["tokens_per_s"], 2)
            hits, queries = m.pop("_hits"), m.pop("_queries")
            m["prefix_hit_rate"] = round(hits / queries, 4) if queries > 0 else None
        ttft, itl = (_window(totals.buckets[h], before.buckets[h]) for h in (TTFT, ITL))
        sample = {
            "t": round(now, 3),
            "requests_per_s": round(sum(requests.values()), 3),
            "errors_per_s": {k: round(v, 3) for k, v in sorted(requests.items()) if k[:1] in "45" and v > 0},
            "tokens_per_s": round(sum(m["tokens_per_s"] for m in models.values()), 2),
            "ttft_p50": _rounded(quantile(0.5, ttft)), "ttft_p99": _rounded(quantile(0.99, ttft)),
            "itl_p50": _rounded(quantile(0.5, itl)), "itl_p99": _rounded(quantile(0.99, itl)),
            "waiting": sum(m["waiting"] for m in models.values()),
            "running": sum(m["running"] for m in models.values()),
            "models": models,
        }
        self.samples.append(sample)
        return sample


def _rounded(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


SERIES: web.AppKey[Series] = web.AppKey("zserve_series", Series)
