"""The gateway's cross-cutting request handling, each concern once, as aiohttp middlewares:

- ``front_middleware`` (outermost): every response carries ``X-Request-Id`` — the client's when it is
  a valid one (1..128 printable ASCII characters, no spaces), else a fresh one — and every log line written
  while serving the request names it (``gateway.logs``), on the gateway and, carried in the engine
  request, on the engine. It also answers CORS preflights (``OPTIONS``) before any key is asked for.
- ``guard_middleware`` (inside the error middleware, so refusals take the route family's error shape):
  API keys (``gateway.security``), then ``--max-concurrent-requests`` (past it a request is refused at
  once with 429 and ``Retry-After`` rather than queued without bound), then the body's read deadline
  (``gateway.body_timeout``).

Two layers, not one per concern: each aiohttp middleware costs every request a call frame.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from protocol.messages import valid_trace_id

from .body_timeout import read_body
from .errors import APIError
from .ids import random_hex
from .logs import REQUEST_ID
from .security import CorsPolicy, Keys, authorize

# Liveness and monitoring stay answerable when the gateway is full: a load balancer must see it alive.
UNLIMITED_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load", "/is_paused", "/status"})

log = logging.getLogger("zserve.gateway.access")

RID: web.RequestKey[str] = web.RequestKey("zserve_request_id", str)

CORS: web.AppKey[CorsPolicy] = web.AppKey("zserve_cors", CorsPolicy)


class Guard:
    """What ``guard_middleware`` enforces, and how many requests it is letting through now."""

    def __init__(self, keys: Keys, metrics_auth: bool, max_concurrent: int | None):
        self.keys = keys
        self.metrics_auth = metrics_auth
        self.max_concurrent = max_concurrent
        self.active = 0


GUARD: web.AppKey[Guard] = web.AppKey("zserve_guard", Guard)


@web.middleware
async def front_middleware(request: web.Request, handler):
    """Outermost: the request's id (and the access line at debug level); CORS preflights are answered here,
    before any key is asked for."""
    given = request.headers.get("X-Request-Id")
    rid = given if given is not None and valid_trace_id(given) else random_hex()
    request[RID] = rid
    token = REQUEST_ID.set(rid)
    try:
        if request.method == "OPTIONS":
            return request.app[CORS].preflight(request)
        if not log.isEnabledFor(logging.DEBUG):
            return await handler(request)
        start, status = time.monotonic(), 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        finally:  # one access line (with the id, as every line of the request)
            log.debug("%s %s -> %d in %.1f ms", request.method, request.path, status,
                      (time.monotonic() - start) * 1e3)
    finally:
        REQUEST_ID.reset(token)


@web.middleware
async def guard_middleware(request: web.Request, handler):
    """Inside the error middleware: keys, the concurrency limit, then the body within its deadline."""
    guard = request.app[GUARD]
    authorize(request, guard.keys, guard.metrics_auth)
    if guard.max_concurrent is None or request.path in UNLIMITED_PATHS:
        await read_body(request)
        return await handler(request)
    if guard.active >= guard.max_concurrent:
        raise APIError(429, f"this gateway is serving {guard.max_concurrent} requests, its limit "
                            "(--max-concurrent-requests); retry shortly", code="too_many_requests",
                       headers={"Retry-After": "1"})
    guard.active += 1
    try:
        await read_body(request)
        return await handler(request)
    finally:
        guard.active -= 1


async def response_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``X-Request-Id`` and CORS headers on every response, streamed ones included (set before it starts)."""
    rid = request.get(RID)
    if rid is not None:
        response.headers["X-Request-Id"] = rid
    if request.method != "OPTIONS":  # a preflight's CORS headers are its own
        request.app[CORS].decorate(request, response)
