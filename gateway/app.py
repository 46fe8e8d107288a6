"""Assemble the aiohttp application: middlewares, then each route family's routes."""

from __future__ import annotations

from aiohttp import web

from .errors import error_middleware
from .metrics import metrics_middleware
from .routers import anthropic, control, core, native, openai, pooling, render, responses, sagemaker
from .state import STATE, GatewayState

# Route families, each a module with a ``routes`` table (docs/api.md describes them).
# A render-only gateway mounts them all too: its generation routes refuse with a clear 400 in their own
# error shape (``common.admit``) rather than a bare 404.
ROUTE_FAMILIES = {"core": core, "control": control, "openai": openai, "responses": responses,
                  "anthropic": anthropic, "native": native, "pooling": pooling, "render": render,
                  "sagemaker": sagemaker}

MAX_BODY_BYTES = 32 << 20


def build_app(state: GatewayState, families: list[str] | None = None) -> web.Application:
    app = web.Application(middlewares=[metrics_middleware, error_middleware], client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app.on_response_prepare.append(_close_while_draining)
    for name in families or list(ROUTE_FAMILIES):
        app.add_routes(ROUTE_FAMILIES[name].routes)
    return app


async def _close_while_draining(request: web.Request, response: web.StreamResponse) -> None:
    """A draining gateway answers what reaches it, but tells keep-alive clients to reconnect
    (to a gateway that is staying)."""
    if request.app[STATE].draining:
        response.headers["Connection"] = "close"
