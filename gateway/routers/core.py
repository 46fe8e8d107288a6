"""Core routes: liveness, readiness, version, load."""

from __future__ import annotations

import os

from aiohttp import web

import zserve
from protocol import PROTOCOL_VERSION

from .. import metrics
from ..errors import APIError
from ..state import STATE

routes = web.RouteTableDef()


def _ready(request: web.Request) -> None:
    if not request.app[STATE].engines.ready_engines:
        raise APIError(503, "no engine is ready", headers={"Retry-After": "1"})


def _health(state) -> dict:
    ready = len(state.engines.ready_engines)
    desired = state.cluster.engines_desired if state.cluster else len(state.engines.engines)
    status = "ok" if ready and ready >= desired else ("degraded" if ready else "unavailable")
    return {"status": status, "engines_ready": ready, "engines_desired": desired, "paused": state.paused}


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """200 while at least one engine is ready (``status`` says ``degraded`` when some are missing),
    503 when none is — what a load balancer's health check needs."""
    body = _health(request.app[STATE])
    headers = {"Retry-After": "1"} if body["status"] == "unavailable" else None
    return web.json_response(body, status=200 if body["engines_ready"] else 503, headers=headers)


@routes.get("/ping")
@routes.post("/ping")
async def ping(request: web.Request) -> web.Response:
    """SageMaker's liveness probe: the same answer as /health."""
    _ready(request)
    return web.Response(status=200)


@routes.get("/version")
async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": zserve.__version__, "protocol_version": PROTOCOL_VERSION})


@routes.get("/load")
async def load(request: web.Request) -> web.Response:
    """This gateway's in-flight requests and each engine's last reported load."""
    state = request.app[STATE]
    engines = [e.describe() for e in state.engines.engines.values()]
    return web.json_response({"gateway": state.index, "pid": os.getpid(), "in_flight": state.engines.in_flight,
                              "engines": engines})


@routes.get("/metrics")
async def prometheus_metrics(request: web.Request) -> web.Response:
    """Prometheus text: request metrics of every gateway process plus every engine's load."""
    body = metrics.render(request.app)
    return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})
