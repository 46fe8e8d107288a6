"""The web console's static files, served at ``/ui`` by ``gateway.routers.console``: hand-written, no build step,
nothing loaded from elsewhere."""

from __future__ import annotations

from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent
PAGE = "index.html"
# The files the page loads and their types; nothing else in the directory is served.
ASSETS = {"console.js": "text/javascript; charset=utf-8", "console.css": "text/css; charset=utf-8"}
# Paths that carry no data and need no key (a browser sends none when it opens a page).
PATHS = frozenset({"/ui", *(f"/ui/{name}" for name in ASSETS)})
