"""Assemble the aiohttp application: middlewares, then each route family's routes and the endpoint plugins'."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from aiohttp import web

from .admission import CORS, GUARD, Guard, gateway_middleware, response_headers
from .metrics import flush_periodically
from .plugins import PLUGIN_CONTEXT, EndpointPlugin, PluginContext, add_hooks, mount_routes
from .routers import (
    anthropic,
    audio,
    cohere,
    console,
    control,
    core,
    derender,
    docs,
    info,
    native,
    openai,
    operations,
    pooling,
    render,
    responses,
    sagemaker,
)
from .security import CorsPolicy, Keys
from .series import SERIES, Series
from .state import STATE, GatewayState

log = logging.getLogger("zserve.gateway")

# Route families, each a module with a ``routes`` table (docs/api.md describes them); their names, in this order, are
# ``gateway.families.FAMILY_NAMES``, which the supervisor checks --disable-family against without importing a router.
# A render-only gateway mounts them all too: its generation routes refuse with a clear 400 in their own
# error shape (``serving.admission.admit``) rather than a bare 404.
ROUTE_FAMILIES = {"core": core, "control": control, "operations": operations, "openai": openai, "responses": responses,
                  "anthropic": anthropic, "native": native, "pooling": pooling, "render": render,
                  "sagemaker": sagemaker, "docs": docs, "derender": derender, "cohere": cohere, "info": info,
                  "console": console, "audio": audio}

MAX_BODY_BYTES = 32 << 20


def build_app(state: GatewayState, families: list[str] | None = None, plugins: Sequence[EndpointPlugin] = (),
              context: PluginContext | None = None, guard: Guard | None = None,
              cors: CorsPolicy | None = None) -> web.Application:
    """The gateway's app: ``families`` (default: all) and ``plugins`` (gateway.plugins; ``PluginError`` for a
    route two of them claim) with ``context`` for the plugins' hooks and handlers; ``guard`` (keys, the
    concurrency limit) and ``cors`` default to none.

    One middleware (gateway/admission.py): request id and CORS preflights, then metrics and errors (in the
    family's shape) around keys, the concurrency limit and the body's read deadline — so a refusal is counted,
    shaped, and carries the request id, and no stranger's body is read."""
    # (an audio upload may be larger than any JSON body: --max-audio-mb, and the multipart form around it)
    largest = max(MAX_BODY_BYTES, int(state.max_audio_mb * (1 << 20)) + (1 << 20))
    app = web.Application(middlewares=[gateway_middleware], client_max_size=largest)
    app[STATE] = state
    app[GUARD] = guard or Guard(Keys(), metrics_auth=False, max_concurrent=None)
    app[CORS] = cors or CorsPolicy()
    app.cleanup_ctx.append(flush_periodically)  # request metrics are buffered: write them out
    app.on_response_prepare.append(response_headers)
    chosen = {name: ROUTE_FAMILIES[name].routes for name in families or list(ROUTE_FAMILIES)}
    if "console" in chosen:  # the console's charts: sampled from the first time a console asks
        app[SERIES] = Series(state)
        app.on_cleanup.append(lambda app: app[SERIES].close())
    # Every gateway mounts the same routes: only gateway 0 says so at warning level.
    app.add_routes(mount_routes(chosen, plugins, warn=log.warning if state.index == 0 else log.debug))
    if context is not None:
        app[PLUGIN_CONTEXT] = context
        add_hooks(app, plugins, context)
    return app

