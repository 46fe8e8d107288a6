"""What a server is and whether it takes traffic: ``/ready`` and ``/readyz`` (readiness probes), ``/server_info``
(version, models, options, processes) and ``/tokenizer_info`` (a model's tokenizer configuration and chat template).

``/health`` says whether this gateway can serve at all (liveness, and a load balancer's check); readiness also turns
false while the gateway drains (SIGTERM: it finishes its requests, then exits) or while an operator paused it, so an
orchestrator stops sending it new requests before it goes. Readiness is open like ``/health``
(``gateway.security.PUBLIC_PATHS``): probes send no key.
"""

from __future__ import annotations

import os

from aiohttp import web

import zserve
from protocol import PROTOCOL_VERSION, ProtocolError
from protocol.control import CONTROL_VERSION, StatusCommand, StatusReply
from protocol.kv_events import DEFAULT_TOPIC, replay_endpoint
from zserve import control

from ..openapi import JSON, response
from ..security import admin_route
from ..serving.shapes import json_body
from ..state import STATE, GatewayState

routes = web.RouteTableDef()

STATUS_TIMEOUT = 5.0  # seconds the supervisor has to say how its processes are


def readiness(state: GatewayState) -> tuple[bool, str | None]:
    """Whether this gateway should get new requests now, and why not."""
    if state.draining:
        return False, "draining: this gateway finishes its requests and exits"
    if not state.can_serve:
        return False, "no engine is ready"
    if state.paused:
        return False, "paused: new requests are held (POST /resume)"
    return True, None


@routes.get("/ready")
@routes.get("/readyz")
@response(200, JSON)
@response(503, JSON, description="not ready: draining, paused, or no engine is ready (reason says which)")
async def ready(request: web.Request) -> web.Response:
    """200 ``{"status": "ready"}`` while this gateway takes new requests; 503 with the reason otherwise."""
    ok, reason = readiness(request.app[STATE])
    if ok:
        return json_body({"status": "ready"})
    return json_body({"status": "not ready", "reason": reason}, status=503, headers={"Retry-After": "1"})


async def supervisor_status(state: GatewayState) -> tuple[StatusReply | None, str | None]:
    """The supervisor's status (its processes and the server's options), or why there is none: a gateway started
    without a supervisor, or one that does not answer, still describes itself."""
    if not state.control_socket:
        return None, "this gateway runs without a supervisor"
    try:
        reply = await control.request_async(state.control_socket, StatusCommand(), timeout=STATUS_TIMEOUT)
    except (OSError, ConnectionError, TimeoutError, ProtocolError) as e:  # reported in the answer, not raised
        return None, f"the supervisor did not answer: {e}"
    if not isinstance(reply, StatusReply):
        return None, f"the supervisor answered {reply.TYPE}"
    return reply, None


def model_info(state: GatewayState) -> list[dict]:
    return [{"id": m.model_id, "names": m.names, "loras": sorted(m.loras), "weights": m.source.weights,
             "engines": [e.describe() for e in m.engines.engines.values()]} for m in state.models]


@routes.get("/server_info")
@admin_route
@response(200, JSON)
async def server_info(request: web.Request) -> web.Response:
    """zserve's version and wire versions, the models, every option of the server (secrets redacted: API and admin
    keys are counted, a Redis URL's password masked; CURVE keys are files the options only name the directory of)
    and every process of the host, from the supervisor.

    An admin route: process ids, paths, options and the engines' endpoints are the operator's business, not an API
    user's (vLLM shows its configuration only in development mode). Without a supervisor, ``supervisor`` is null and
    ``supervisor_error`` says why."""
    state = request.app[STATE]
    reply, error = await supervisor_status(state)
    wire = reply.to_wire() if reply is not None else None
    options = wire.pop("options", None) if wire is not None else None
    processes = wire.pop("processes", []) if wire is not None else []
    return json_body({
        "version": zserve.__version__, "protocol_version": PROTOCOL_VERSION, "control_version": CONTROL_VERSION,
        "gateway": {"index": state.index, "pid": os.getpid(), "started_at": state.started_at,
                    "render_only": state.render_only, "draining": state.draining},
        "models": model_info(state), "options": options, "processes": processes, "supervisor": wire,
        **({"supervisor_error": error} if error else {}),
    })


@routes.get("/tokenizer_info")
@response(200, JSON)
async def tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's tokenizer information (``?model=NAME`` for another than the default model): what a client needs to
    tokenize and render chats as the server does, as a ``tokenizer_config.json`` says it (its special tokens, its
    context, its chat template), ``tokenizer_class`` being what transformers loads a ``tokenizer.json`` as."""
    view = request.app[STATE].for_model(request.query.get("model"))
    tok = view.tokenizer

    def token(token_id: int | None) -> str | None:
        return None if token_id is None else tok.convert_ids_to_tokens([token_id])[0]

    return json_body({
        "model": view.name, "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(tok.bos_token_id), "eos_token": token(tok.eos_token_id),
        "pad_token": token(tok.pad_token_id), "unk_token": token(tok.unk_token_id),
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "vocab_size": tok.vocab_size,
        "model_max_length": view.max_model_len, "chat_template": tok.chat_template,
        "all_special_ids": sorted(tok.all_special_ids),
    })


@routes.get("/kv_event_sources")
@response(200, JSON)
async def kv_event_sources(request: web.Request) -> web.Response:
    """Where each engine publishes its KV cache events (vLLM's format: ``protocol.kv_events``), for routers that
    follow them: its PUB endpoint, the replay socket beside it, the topic. The same on every gateway."""
    state = request.app[STATE]
    engines = state.cluster.engines if state.cluster else ()
    sources = [{"engine": e.rank, "model": e.model, "state": str(e.state), "endpoint": e.kv_events,
                "replay_endpoint": replay_endpoint(e.kv_events), "topic": DEFAULT_TOPIC.decode(),
                "format": "vllm.kv_events (msgpack)"} for e in engines if e.kv_events]
    return json_body({"sources": sources})
