"""API docs: ``GET /openapi.json`` (generated from the app's router, ``gateway/openapi.py``), Swagger UI at
``GET /docs`` and ReDoc at ``GET /redoc``.

The pages load their JavaScript and CSS from this gateway (``/docs/assets/...``), taken from the
``fastapi-offline`` package's static files, so they render with no network beyond the server: no CDN.
That package is installed without its dependencies (``make install``) and never imported: only its
directory is read. All URLs are relative, so the pages work behind a proxy that adds a path prefix.
"""

from __future__ import annotations

import html

from aiohttp import web

import zserve
from zserve.catalog import _package_dir  # finds a package's directory without importing it

from ..errors import APIError
from ..openapi import openapi_document, response

routes = web.RouteTableDef()

ASSETS_PACKAGE = "fastapi_offline"
# The files the pages load; nothing else under the package is served.
ASSETS = {"swagger-ui-bundle.js": "application/javascript", "swagger-ui.css": "text/css",
          "redoc.standalone.js": "application/javascript", "favicon.png": "image/png"}
TITLE = "zserve"

_SWAGGER_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title} — Swagger UI</title>
<link rel="icon" type="image/png" href="docs/assets/favicon.png">
<link rel="stylesheet" href="docs/assets/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="docs/assets/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({{url: "openapi.json", dom_id: "#swagger-ui", deepLinking: true,
  validatorUrl: null, presets: [SwaggerUIBundle.presets.apis], layout: "BaseLayout"}});
</script></body></html>
"""

_REDOC_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title} — ReDoc</title>
<link rel="icon" type="image/png" href="docs/assets/favicon.png">
<meta name="viewport" content="width=device-width, initial-scale=1"></head>
<body><redoc spec-url="openapi.json" hide-download-button></redoc>
<script src="docs/assets/redoc.standalone.js"></script></body></html>
"""


@routes.get("/openapi.json")
async def openapi_json(request: web.Request) -> web.Response:
    """This server's OpenAPI 3.1 document, generated from its routes and request schemas."""
    return web.json_response(openapi_document(request.app, title=TITLE, version=zserve.__version__))


@routes.get("/docs")
@response(200, "text/html")
async def swagger_ui(request: web.Request) -> web.Response:
    """Swagger UI over /openapi.json."""
    return web.Response(text=_SWAGGER_PAGE.format(title=html.escape(TITLE)), content_type="text/html")


@routes.get("/redoc")
@response(200, "text/html")
async def redoc(request: web.Request) -> web.Response:
    """ReDoc over /openapi.json."""
    return web.Response(text=_REDOC_PAGE.format(title=html.escape(TITLE)), content_type="text/html")


@routes.get("/docs/assets/{name}")
@response(200, *sorted(set(ASSETS.values())))
async def asset(request: web.Request) -> web.StreamResponse:
    """A static file of the docs pages (Swagger UI's and ReDoc's bundles)."""
    name = request.match_info["name"]
    directory = _package_dir(ASSETS_PACKAGE)
    if name not in ASSETS:
        raise APIError(404, f"no docs asset {name!r}")
    if directory is None or not (directory / "static" / name).is_file():
        raise APIError(404, f"the docs assets are not installed: `pip install --no-deps {ASSETS_PACKAGE}` "
                            "(`make install` does this)")
    return web.FileResponse(directory / "static" / name, headers={"Content-Type": ASSETS[name],
                                                                  "Cache-Control": "public, max-age=86400"})
