"""An example zserve endpoint plugin, and the template for writing one (docs/plugins.md).

- ``POST /example/v1/reverse`` ``{"text": "...", "model": "..."}`` (``model`` optional): the text reversed and
  the number of tokens it is in the model's tokenizer.
- ``GET /example/v1/info``: the plugin, the gateway that answered and the models it serves.

Everything a plugin needs comes from ``gateway.plugins``: ``EndpointPlugin`` (what the entry point names),
``PLUGIN_CONTEXT`` (the gateway as a handler sees it), ``APIError`` (an error in the gateway's shape).
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from gateway.plugins import PLUGIN_CONTEXT, APIError, EndpointPlugin, PluginContext

log = logging.getLogger("zserve.example_plugin")

routes = web.RouteTableDef()
_started_at: float | None = None  # set by the start-up hook; each gateway is its own process


@routes.post("/example/v1/reverse")
async def reverse(request: web.Request) -> web.Response:
    ctx = request.app[PLUGIN_CONTEXT]
    try:
        body = await request.json()
    except ValueError:
        raise APIError(400, "the body must be a JSON object") from None
    if not isinstance(body, dict) or not isinstance(body.get("text"), str):
        raise APIError(400, "`text` must be a string", param="text")
    if not isinstance(body.get("model"), str | None):
        raise APIError(400, "`model` must be a string", param="model")
    model = ctx.model(body.get("model"))  # 404 model_not_found for a name no model has, as the core routes do
    text = body["text"]
    return web.json_response({"model": model.name, "text": text[::-1], "tokens": len(model.tokenizer.encode(text)),
                              "gateway": ctx.gateway_index})


@routes.get("/example/v1/info")
async def info(request: web.Request) -> web.Response:
    ctx = request.app[PLUGIN_CONTEXT]
    return web.json_response({"plugin": plugin.name, "gateway": ctx.gateway_index, "started_at": _started_at,
                              "models": [{"name": m.name, "names": m.names, "tasks": sorted(m.tasks)}
                                         for m in ctx.models]})


async def on_startup(ctx: PluginContext) -> None:
    """Runs once per gateway, after its engines are ready and before it accepts requests; raising here stops
    the server with this plugin's name and the error."""
    global _started_at
    _started_at = time.time()


async def on_shutdown(ctx: PluginContext) -> None:
    """Runs once per gateway after it drained; the engines still answer here."""
    log.debug("example plugin: gateway %d stopping", ctx.gateway_index)


plugin = EndpointPlugin(name="example", routes=routes, on_startup=on_startup, on_shutdown=on_shutdown)
