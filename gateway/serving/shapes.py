"""Answers every route family writes alike: a JSON body through orjson (``json_body``), and whether this gateway
can serve (``health_response``: ``/health``'s answer and SageMaker's ``/ping``)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ..state import GatewayState


def json_body(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """``web.json_response`` through orjson, its bytes as the body (no str in between); the same
    ``application/json; charset=utf-8``."""
    return web.Response(body=orjson.dumps(obj), status=status, headers=headers, content_type="application/json",
                        charset="utf-8")


def health_response(state: GatewayState) -> web.Response:
    """200 while this gateway can serve (an engine of some model is ready, or it renders only: a render server
    desires no engine), else 503 — the answer of /health and of SageMaker's /ping. ``status`` says
    ``degraded`` while some model has fewer ready engines than it desires or failed (every engine of it
    crash-loops; ``models`` says which, and ``holds`` why): the other models still serve, so a load balancer
    keeps sending them traffic."""
    cluster = state.cluster
    models = {}
    for m in state.models:
        desired = cluster.models.get(m.model_id, 0) if cluster else len(m.engines.engines)
        models[m.model_id] = {"engines_ready": len(m.engines.ready_engines), "engines_desired": desired}
        hold = state.hold_for(m.model_id)
        if hold is not None:
            models[m.model_id]["held"] = hold.reason
    ready = sum(m["engines_ready"] for m in models.values())
    whole = all(m["engines_ready"] >= m["engines_desired"] and m.get("held") != "failed" for m in models.values())
    status = ("ok" if whole else "degraded") if state.can_serve else "unavailable"
    desired = sum(m["engines_desired"] for m in models.values())
    body = {"status": status, "engines_ready": ready, "engines_desired": desired, "paused": state.paused,
            "models": models, **({"holds": [h.to_json() for h in state.holds]} if state.holds else {})}
    headers = {"Retry-After": "1"} if status == "unavailable" else None
    return web.json_response(body, status=200 if state.can_serve else 503, headers=headers)
