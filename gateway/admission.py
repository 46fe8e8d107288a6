"""The gateway's cross-cutting request handling, each concern once, in one aiohttp middleware
(``gateway_middleware``; each middleware layer costs every request a call frame):

- first, every response carries ``X-Request-Id`` — the client's when it is a valid one (1..128 printable
  ASCII characters, no spaces), else a fresh one — and every log line written while serving the request
  names it (``gateway.logs``), on the gateway and, carried in the engine request, on the engine. CORS
  preflights (``OPTIONS``) are answered there, before any key is asked for.
- then, counted in the request metrics and with errors in the route family's shape (so a refusal is
  counted, shaped and carries the request id; a request whose client left before its answer ended is counted
  as 499, nginx's status for it, never as a server error): API keys (``gateway.security``), then
  ``--max-concurrent-requests`` (past it a request is refused at once with 429 and ``Retry-After``
  rather than queued without bound), then the limits of the key's tenant (``gateway.tenancy``: a 429 with
  OpenAI's rate-limit headers, which every response of a limited tenant carries), then the body's read deadline
  (``gateway.body_timeout``), so no stranger's body is read.
- last, a hold on the request's model that waits (a resize, a rolling restart of its only engine):
  ``serving.admission.admit`` raises ``ScalingPaused``, and the request, body read and concurrency slot kept,
  waits up to ``--scaling-wait`` for that model's hold to end and is then served again from the top; past
  that, the 503. Requests of other models are not held.
  Only a refused request pays for this (a handler is called inside a ``try``, which costs nothing).
"""

from __future__ import annotations

import asyncio
import logging
from time import monotonic

from aiohttp import web

from protocol.messages import valid_trace_id

from .body_timeout import BODY_TIMEOUT_S, read_body
from .errors import APIError, handler_error
from .ids import random_hex
from .logs import REQUEST_ID
from .metrics import CLIENT_CLOSED_REQUEST, client_left, record_request
from .security import CorsPolicy, Keys, authorize
from .serving.admission import ScalingPaused
from .state import STATE
from .tenancy import SERVED, Served, Tenancy

# Liveness and monitoring stay answerable when the gateway is full: a load balancer must see it alive.
UNLIMITED_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load", "/is_paused", "/status",
                             "/is_scaling_elastic_ep"})

log = logging.getLogger("zserve.gateway.access")


def holds_slot(request: web.Request) -> bool:
    """Whether a tenant's request takes one of its concurrent slots (``max_concurrent``): requests that put a model
    to work do; reads, deletes and cancels do not, so a tenant whose slots are all busy (its background responses
    among them) can still poll, cancel and delete."""
    return request.method not in ("GET", "HEAD", "DELETE") and not request.path.endswith(("/cancel", "abort_requests"))


RID: web.RequestKey[str] = web.RequestKey("zserve_request_id", str)

CORS: web.AppKey[CorsPolicy] = web.AppKey("zserve_cors", CorsPolicy)


class Guard:
    """What ``gateway_middleware`` enforces (keys, the concurrency limit), and how many requests it is letting
    through now."""

    def __init__(self, keys: Keys, metrics_auth: bool, max_concurrent: int | None, tenancy: Tenancy | None = None,
                 body_timeout: float = BODY_TIMEOUT_S):
        self.keys = keys
        self.metrics_auth = metrics_auth
        self.max_concurrent = max_concurrent
        self.body_timeout = body_timeout
        self.active = 0
        self.tenancy = tenancy  # the tenants' limits and accounting; used while the keys name tenants

    async def admit(self, request: web.Request, tenant) -> Served | None:
        """A request of a tenant (a tenants file is in force) is admitted against its limits: its ``Served``."""
        if tenant is None or self.tenancy is None or not self.keys.tenants.tenants or request.path in UNLIMITED_PATHS:
            return None
        served = await self.tenancy.admit(tenant, holds_slot(request))
        request[SERVED_KEY] = served
        return served


GUARD: web.AppKey[Guard] = web.AppKey("zserve_guard", Guard)
SERVED_KEY: web.RequestKey[Served] = web.RequestKey("zserve_served", Served)


@web.middleware
async def gateway_middleware(request: web.Request, handler):
    """Every request's cross-cutting handling, in this order (the module's docstring says why each):

    1. its id, set for the log lines written while it is served; a CORS preflight is answered now;
    2. then, counted in the request metrics whatever happens (``metrics.record_request``), and any error
       rendered in the route family's shape (``errors.handler_error``):
       keys, the concurrency limit, the body within its deadline, and the handler."""
    given = request.headers.get("X-Request-Id")
    rid = given if given is not None and valid_trace_id(given) else random_hex()
    request[RID] = rid
    token = REQUEST_ID.set(rid)
    try:
        if request.method == "OPTIONS":
            return request.app[CORS].preflight(request)
        start, status = monotonic(), 500
        try:
            try:
                guard = request.app[GUARD]
                tenant = authorize(request, guard.keys, guard.metrics_auth)
                counted = guard.max_concurrent is not None and request.path not in UNLIMITED_PATHS
                if counted:
                    if guard.active >= guard.max_concurrent:
                        raise APIError(429, f"this gateway is serving {guard.max_concurrent} requests, its limit "
                                            "(--max-concurrent-requests); retry shortly", code="too_many_requests",
                                       headers={"Retry-After": "1"})
                    guard.active += 1
                served = None
                try:
                    if (served := await guard.admit(request, tenant)) is not None:
                        SERVED.set(served)  # (the handler runs in this task's context)
                    await read_body(request, guard.body_timeout)
                    try:
                        resp = await handler(request)
                    except ScalingPaused as refused:  # (a try costs nothing until it catches)
                        resp = await _hold(request, handler, refused)
                finally:
                    if counted:
                        guard.active -= 1
                    if served is not None:
                        served.ended()
                        SERVED.set(None)
            except Exception as e:
                # A write to a client that left (a stream's) raises ConnectionResetError: nothing can be sent, and
                # the answer aiohttp tries to send of this status goes nowhere, quietly.
                resp = web.Response(status=CLIENT_CLOSED_REQUEST) if isinstance(e, ConnectionError) and \
                    client_left(request) else handler_error(request, e)
            status = resp.status
            return resp
        except web.HTTPException as e:  # a redirect, which aiohttp sends
            status = e.status
            raise
        except asyncio.CancelledError:  # aiohttp cancels the handler of a client that left (handler_cancellation)
            if client_left(request):
                status = CLIENT_CLOSED_REQUEST
            raise
        finally:
            record_request(request, status, start)
            if log.isEnabledFor(logging.DEBUG):  # one access line (with the id, as every line of the request)
                log.debug("%s %s -> %d in %.1f ms", request.method, request.path, status,
                          (monotonic() - start) * 1e3)
    finally:
        REQUEST_ID.reset(token)


async def _hold(request: web.Request, handler, refused: ScalingPaused) -> web.StreamResponse:
    """Serve a request again each time the hold on its model that refused it ends (another may begin meanwhile),
    for up to ``--scaling-wait`` s in all; then raise the last refusal. ``admit`` comes before any side effect and
    aiohttp keeps the body, so serving it again from the top is safe."""
    state = request.app[STATE]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.scaling_wait
    while (left := deadline - loop.time()) > 0 and await state.released(refused.model_id, left):
        try:
            return await handler(request)
        except ScalingPaused as again:
            refused = again
    raise refused


async def response_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``X-Request-Id`` and CORS headers on every response, streamed ones included (set before it starts); while
    the gateway drains, ``Connection: close``: it answers what reaches it, but keep-alive clients should reconnect
    (to a gateway that is staying)."""
    rid = request.get(RID)
    if rid is not None:
        response.headers["X-Request-Id"] = rid
    served = request.get(SERVED_KEY)
    if served is not None and served.verdict is not None:
        response.headers.update(served.verdict.headers())
    if request.method != "OPTIONS":  # a preflight's CORS headers are its own
        request.app[CORS].decorate(request, response)
    if request.app[STATE].draining:
        response.headers["Connection"] = "close"
