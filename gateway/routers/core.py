"""Core routes: health, version, load, metrics."""

from __future__ import annotations

import os

from aiohttp import web

import zserve
from protocol import PROTOCOL_VERSION

from .. import metrics
from ..openapi import JSON, response
from ..serving.shapes import health_response
from ..state import STATE

routes = web.RouteTableDef()


@routes.get("/health")
@response(200, JSON)
@response(503, JSON, description="no engine is ready (the same body, status unavailable)")
async def health(request: web.Request) -> web.Response:
    """What a load balancer's health check needs (``health_response``)."""
    return health_response(request.app[STATE])


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
@response(200, "text/plain")
async def prometheus_metrics(request: web.Request) -> web.Response:
    """Prometheus text: request metrics of every gateway process plus every engine's load."""
    body = metrics.render(request.app)
    return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})
