"""Serving a request for its tenant (``zserve.tenants``): its limits checked before it starts, its tokens charged
as they become known, and what each tenant was served counted in ``/metrics``.

- ``Tenancy.admit`` (the gateway's middleware, after the key and the gateway's own concurrency limit) takes one
  request, a concurrency slot and a look at the tokens bucket from the tenant's quota (``gateway.quota``: one shared
  store per host, or Redis across hosts), or raises the 429 with ``Retry-After``. Either way the request carries the
  verdict, whose OpenAI rate-limit headers every response of a limited tenant gets (``headers``), so the official SDKs
  back off by themselves.
- The engine client finds the request's ``Served`` in ``SERVED`` (a context variable the middleware sets: the
  handler and everything it calls see it) and charges the prompt's tokens when it sends the request, each generated
  token when it arrives. Tokens are charged after the fact — nobody knows how many a request will generate — so a
  tenant's token bucket can go into debt, and its next request waits for the refill to pay it back.
- ``Served.ended`` gives the concurrency slot back when the response is over (the middleware's ``finally``).

Charges are gathered per tenant and written by one task per loop turn, so a stream's tokens cost the quota store
one write per batch of outputs, not one per token.
"""

from __future__ import annotations

import asyncio
import logging
from contextvars import ContextVar

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.registry import REGISTRY

from zserve.tenants import DEFAULT, Tenant

from .errors import APIError
from .metric_buffers import BufferedCounter, BufferedHistogram
from .quota import Quota, Rules, Verdict

log = logging.getLogger("zserve.gateway")


class TenantMetrics:
    """What each tenant was served, labelled by its name (never a key)."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY):
        self.requests = BufferedCounter(Counter(
            "zserve_tenant_requests_total", "Requests admitted, by tenant.", ["tenant"], registry=registry))
        self.prompt_tokens = BufferedCounter(Counter(
            "zserve_tenant_prompt_tokens_total", "Prompt tokens sent to engines, by tenant.", ["tenant"],
            registry=registry))
        self.generation_tokens = BufferedCounter(Counter(
            "zserve_tenant_generation_tokens_total", "Tokens generated, by tenant.", ["tenant"], registry=registry))
        self.rate_limited = BufferedCounter(Counter(
            "zserve_tenant_rate_limited_total", "Requests refused with 429 for a tenant's limit, by tenant and the "
            "limit (requests, tokens, concurrency).", ["tenant", "limit"], registry=registry))
        self.queue_time = BufferedHistogram(
            "zserve_tenant_queue_time_seconds", "Time a generation request waited in an engine's queue before it was "
            "first scheduled, by tenant.", ["tenant"],
            (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry)
        self.all = (self.requests, self.prompt_tokens, self.generation_tokens, self.rate_limited, self.queue_time)

    def flush(self) -> None:
        for metric in self.all:
            metric.flush()


class Served:
    """One request's tenant while it is served: what the engine client charges, and the verdict its headers say."""

    __slots__ = ("tenant", "tenancy", "verdict", "_holders")

    def __init__(self, tenant: Tenant, tenancy: Tenancy, verdict: Verdict | None):
        self.tenant = tenant
        self.tenancy = tenancy
        self.verdict = verdict  # None: a tenant without limits
        self._holders = 1  # the admission middleware, until the response is over; ``keep`` adds one

    @property
    def engine_tenant(self) -> tuple[str, float]:
        """The tenant and weight its engine requests carry ("" without a tenants file, or for ``--api-key`` keys)."""
        return ("", 1.0) if self.tenant is DEFAULT else (self.tenant.name, self.tenant.weight)

    def prompt(self, n: int) -> None:
        self.tenancy.metrics.prompt_tokens.inc(n, (self.tenant.name,))
        self.tenancy.charge(self.tenant, n)

    def generated(self, n: int) -> None:
        if n:
            self.tenancy.metrics.generation_tokens.inc(n, (self.tenant.name,))
            self.tenancy.charge(self.tenant, n)

    def queued(self, seconds: float) -> None:
        self.tenancy.metrics.queue_time.observe(seconds, (self.tenant.name,))

    def headers(self) -> dict[str, str]:
        return self.verdict.headers() if self.verdict is not None else {}

    def keep(self) -> None:
        """The request goes on after its HTTP response (a background Responses request): its concurrency slot is
        given back only once the one that called this calls ``ended`` too."""
        self._holders += 1

    def ended(self) -> None:
        """A holder is done (the middleware, once the response is over; a ``keep`` caller, once its work is): the
        concurrency slot goes back when the last one is."""
        if self._holders <= 0:
            return
        self._holders -= 1
        lease = self.verdict.lease if self.verdict is not None else None
        if not self._holders and lease is not None:
            self.tenancy.release(lease)


SERVED: ContextVar[Served | None] = ContextVar("zserve_served", default=None)
"""The request being served's tenant, for the engine client (set by the middleware for the handler's context)."""


class Tenancy:
    """One gateway's side of the tenants: admission against each tenant's quota, charges, metrics."""

    def __init__(self, quota: Quota | None, metrics: TenantMetrics):
        self.quota = quota  # None: no tenant has limits (no tenants file)
        self.metrics = metrics
        self._owed: dict[str, tuple[Tenant, int]] = {}
        self._flushing = False
        self._tasks: set[asyncio.Task] = set()

    async def admit(self, tenant: Tenant, slot: bool = True) -> Served:
        """The request may start for ``tenant``; else the 429 its limit gives, with the headers saying when to retry.
        ``slot``: it takes one of the tenant's concurrent slots (``max_concurrent``) while it is served."""
        verdict = None
        if tenant.limited and self.quota is not None:
            verdict = await self.quota.admit(tenant.name, Rules.of(tenant, slot))
            if not verdict.allowed:
                self.metrics.rate_limited.inc(1, (tenant.name, verdict.reason))
                raise APIError(429, _REFUSALS[verdict.reason].format(name=tenant.name, wait=verdict.retry_after),
                               code="rate_limit_exceeded", headers=verdict.headers(), type="rate_limit_error")
        self.metrics.requests.inc(1, (tenant.name,))
        return Served(tenant, self, verdict)

    def charge(self, tenant: Tenant, n: int) -> None:
        if tenant.tokens_per_minute is None or self.quota is None or n <= 0:
            return
        _, owed = self._owed.get(tenant.name, (tenant, 0))
        self._owed[tenant.name] = (tenant, owed + n)
        if not self._flushing:
            self._flushing = True
            self._spawn(self._flush())

    async def _flush(self) -> None:
        try:
            while self._owed:
                owed, self._owed = self._owed, {}
                for name, (tenant, n) in owed.items():
                    await self.quota.charge(name, Rules.of(tenant), n)  # type: ignore[union-attr]
        except Exception:
            log.exception("charging tenants' tokens failed")
        finally:
            self._flushing = False

    def release(self, lease: object) -> None:
        self._spawn(self.quota.release(lease))  # type: ignore[union-attr]

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.quota is not None:
            await self.quota.close()


_REFUSALS = {
    "requests": "tenant {name!r} is over its requests per minute; retry in {wait:.1f} s",
    "tokens": "tenant {name!r} is over its tokens per minute; retry in {wait:.1f} s",
    "concurrency": "tenant {name!r} has as many requests in flight as it may (max_concurrent); retry once one ends",
}
