"""Core routes: health, version, load, metrics."""

from __future__ import annotations

import os

from aiohttp import web

import zserve
from protocol import PROTOCOL_VERSION

from .. import metrics
from ..openapi import JSON, response
from ..state import STATE, GatewayState

routes = web.RouteTableDef()


def health_response(state: GatewayState) -> web.Response:
    """200 while this gateway can serve (an engine of some model is ready, or it renders only: a render server
    desires no engine), else 503 — the answer of /health and of SageMaker's /ping. ``status`` says
    ``degraded`` while some model has fewer ready engines than it desires (``models`` says which): the other
    models still serve, so a load balancer keeps sending them traffic."""
    cluster = state.cluster
    models = {}
    for m in state.models:
        desired = cluster.models.get(m.model_id, 0) if cluster else len(m.engines.engines)
        models[m.model_id] = {"engines_ready": len(m.engines.ready_engines), "engines_desired": desired}
    ready = sum(m["engines_ready"] for m in models.values())
    whole = all(m["engines_ready"] >= m["engines_desired"] for m in models.values())
    status = ("ok" if whole else "degraded") if state.can_serve else "unavailable"
    desired = sum(m["engines_desired"] for m in models.values())
    body = {"status": status, "engines_ready": ready, "engines_desired": desired, "paused": state.paused,
            "models": models}
    headers = {"Retry-After": "1"} if status == "unavailable" else None
    return web.json_response(body, status=200 if state.can_serve else 503, headers=headers)


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
