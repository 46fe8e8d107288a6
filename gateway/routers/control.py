"""Cluster-wide control: pause/resume admission and the cluster status, from any gateway.

A gateway holds no control state of its own: ``POST /pause`` is forwarded to the supervisor,
which changes the cluster state and answers only once every gateway has applied it. So whichever
gateway a client reaches, ``/is_paused`` and ``/status`` say the same. Pause and resume are admin
routes: once keys are configured they take the admin key (``gateway.security``).
"""

from __future__ import annotations

import os

from aiohttp import web

from protocol import ProtocolError
from protocol.control import ErrorReply, PauseCommand, PauseReply, ResumeCommand
from zserve import control

from ..errors import APIError
from ..security import admin_route
from ..state import STATE, GatewayState

routes = web.RouteTableDef()


async def _forward(state: GatewayState, cmd: PauseCommand | ResumeCommand) -> PauseReply:
    if not state.control_socket:
        raise APIError(503, "this gateway runs without a supervisor; cluster control is unavailable")
    try:
        reply = await control.request_async(state.control_socket, cmd, timeout=10)
    except (OSError, ConnectionError, TimeoutError) as e:
        raise APIError(503, f"the supervisor did not answer: {e}", headers={"Retry-After": "1"}) from None
    except ProtocolError as e:
        raise APIError(500, f"the supervisor's reply was malformed: {e}") from None
    if isinstance(reply, ErrorReply):
        raise APIError(500, reply.error)
    if not isinstance(reply, PauseReply):
        raise APIError(500, f"the supervisor answered {reply.TYPE} to {cmd.TYPE}")
    return reply


@routes.post("/pause")
@admin_route
async def pause(request: web.Request) -> web.Response:
    """Stop admitting new generation requests on every gateway; in-flight ones finish."""
    reply = await _forward(request.app[STATE], PauseCommand())
    return web.json_response({"paused": True, "version": reply.version})


@routes.post("/resume")
@admin_route
async def resume(request: web.Request) -> web.Response:
    reply = await _forward(request.app[STATE], ResumeCommand())
    return web.json_response({"paused": False, "version": reply.version})


@routes.get("/is_paused")
async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[STATE].paused})


@routes.get("/status")
async def status(request: web.Request) -> web.Response:
    """This gateway's view of the cluster (the same on every gateway once they acknowledged)."""
    state = request.app[STATE]
    cl = state.cluster
    engines = [e.describe() for e in state.engines.engines.values()]
    return web.json_response({
        "gateway": state.index, "pid": os.getpid(), "models": [m.model_id for m in state.models],
        "paused": state.paused,
        "draining": state.draining, "cluster_version": cl.version if cl else None,
        "gateways_desired": cl.gateways_desired if cl else None, "engines": engines,
        "in_flight": state.engines.in_flight,
    })
