"""The web console: ``GET /ui``, a page of the cluster's processes and a chat playground (``gateway/console/``).

The page and its two files are static, shipped in the package and served from it (no CDN, no build step), and
carry no data: they need no key, as a browser opening a page sends none. What the page shows it fetches from the
public API with the key the user types (kept in the tab's sessionStorage): the processes from ``/server_info`` (an
admin route once keys are set), the engines' load and the holds from ``/status``, the models from ``/v1/models``,
and the playground's chat from ``/v1/chat/completions``, streamed. All its URLs are relative, so it works behind a
proxy that adds a path prefix."""

from __future__ import annotations

import math

from aiohttp import web

from ..console import ASSETS, DIRECTORY, PAGE
from ..errors import APIError, bad_request
from ..openapi import JSON, response
from ..series import SERIES
from ..serving.shapes import json_body

routes = web.RouteTableDef()
# The page and its files change with the package: a browser asks again (a 304 when unchanged: aiohttp's ETag).
CACHE = "no-cache"


@routes.get("/ui")
@response(200, "text/html")
async def console_page(request: web.Request) -> web.StreamResponse:
    """The web console (docs/console.md)."""
    return web.FileResponse(DIRECTORY / PAGE, headers={"Content-Type": "text/html; charset=utf-8",
                                                                 "Cache-Control": CACHE})


@routes.get("/ui/{name}")
@response(200, *sorted(set(ASSETS.values())))
async def console_asset(request: web.Request) -> web.StreamResponse:
    """A static file of the web console."""
    name = request.match_info["name"]
    if name not in ASSETS:
        raise APIError(404, f"no console file {name!r}")
    return web.FileResponse(DIRECTORY / name, headers={"Content-Type": ASSETS[name], "Cache-Control": CACHE})


@routes.get("/ui/api/series")
@response(200, JSON)
async def console_series(request: web.Request) -> web.Response:
    """The cluster's load second by second for the console's charts (``gateway.series``): ``samples`` taken after
    ``since`` (seconds since the epoch; default: every sample kept, the last five minutes), oldest first. The first
    call starts the sampling, so its answer may hold no sample yet. Each sample: ``t``, ``requests_per_s``,
    ``errors_per_s`` by status code, ``tokens_per_s``, ``ttft_p50``/``ttft_p99`` and ``itl_p50``/``itl_p99`` in
    seconds (null in a second without one), ``running``, ``waiting`` and per model its ``engines``, ``running``,
    ``waiting``, ``kv_used``, ``tokens_per_s`` and ``prefix_hit_rate``."""
    series = request.app[SERIES]
    series.start()
    raw = request.query.get("since", "0")
    try:
        since = float(raw)
    except ValueError:
        since = math.nan
    if not math.isfinite(since):
        raise bad_request(f"since must be seconds since the epoch, not {raw!r}", param="since")
    return json_body({"interval": series.interval, "keep": series.samples.maxlen, "samples": series.since(since)})
