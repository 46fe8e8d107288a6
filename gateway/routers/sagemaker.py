"""SageMaker's container contract: ``GET/POST /ping`` and ``POST /invocations``.

``/ping`` answers as ``/health`` does (200 while the server can serve). ``/invocations`` takes the
body of another route and picks that route by the payload's fields (``INVOCATIONS``: the first row
whose fields are all present). The route is looked up among the app's own routes and its handler
called with the request as it came, so the answer — status, body, stream, error shape — is that
route's own. A route the app does not have (its family switched off or not written yet) gets the
404 the app gives for it. A new family needs a row here only if it brings a new payload shape.
SageMaker's ``X-Amzn-SageMaker-Custom-Attributes`` header is accepted and ignored.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

from ..errors import APIError, bad_request, error_response, routing_error, shape_of
from ..openai_schemas import json_object
from ..openapi import JSON, SSE, request_body, response
from ..serving.admission import ScalingPaused
from ..serving.shapes import health_response
from ..state import STATE

routes = web.RouteTableDef()

# Payload fields → the route that serves such a payload. Order matters: the first match wins.
INVOCATIONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("messages",), "/v1/chat/completions"),
    (("prompt",), "/v1/completions"),
    (("input",), "/v1/embeddings"),
    (("query", "documents"), "/v1/rerank"),
)


def invocation_path(payload: dict) -> str:
    """The route an /invocations payload is for, or a 400 listing the shapes it could have."""
    for fields, path in INVOCATIONS:
        if all(f in payload for f in fields):
            return path
    shapes = "; ".join(f"{' and '.join(repr(f) for f in fields)} for {path}" for fields, path in INVOCATIONS)
    raise bad_request(f"the payload matches no invocation; it needs {shapes}")


def route_handler(app: web.Application, method: str, path: str) -> Handler:
    """The handler the app would run for ``method path``; else the 404/405 the app would answer."""
    allowed = []
    for route in app.router.routes():
        if route.resource is None or route.resource.canonical != path:
            continue
        if route.method == method:
            return route.handler
        allowed.append(route.method)
    if allowed:
        raise routing_error(405, method, path, allow=",".join(sorted(allowed)))
    raise routing_error(404, method, path)


@routes.get("/ping")
@routes.post("/ping")
@response(200, JSON)
@response(503, JSON, description="the server cannot serve yet (the same body as /health)")
async def ping(request: web.Request) -> web.Response:
    """SageMaker's health check: the same answer as /health."""
    return health_response(request.app[STATE])


# Any JSON object: the route its fields name validates it (``INVOCATIONS``).
_PAYLOAD = {"type": "object", "description": "; ".join(
    f"{' and '.join(fields)}: the body of POST {path}" for fields, path in INVOCATIONS)}


@routes.post("/invocations")
@request_body(_PAYLOAD)
@response(200, JSON, SSE)
async def invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker's inference call: the body of another route, served by the route its fields name."""
    handler = route_handler(request.app, "POST", invocation_path(json_object(await request.read())))
    try:
        return await handler(request)  # it reads the same body again (aiohttp keeps it)
    except ScalingPaused:  # held by the middleware, like the route's own requests
        raise
    except APIError as e:  # in the route's own error shape, as if it had been called directly
        return error_response(e, shape_of(handler))
