"""Cluster-wide control: pause/resume admission, elastic expert parallelism, LoRA adapters and the cluster status,
from any gateway.

A gateway holds no control state of its own: ``POST /pause`` (and ``POST /scale_elastic_ep``) is forwarded
to the supervisor, which changes the cluster state and answers only once every gateway has applied it. So
whichever gateway a client reaches, ``/is_paused``, ``/is_scaling_elastic_ep`` and ``/status`` say the same.
The same goes for LoRA adapters (``launch.ops.lora``): a load or unload through any gateway answers once every
engine of the model loaded (or dropped) it and every gateway serves the new set. Pause, resume, scaling and
adapters are admin routes: once keys are configured they take the admin key (``gateway.security``).
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

import orjson
from aiohttp import web
from pydantic import AfterValidator, ConfigDict, Field

from protocol.cluster import ELASTIC_PHASES
from protocol.control import (
    DEFAULT_DRAIN_TIMEOUT,
    ELASTIC_OUTCOMES,
    LORA_OUTCOMES,
    MAX_SCALE,
    ElasticScaleCommand,
    ElasticScaleReply,
    LoraLoadCommand,
    LoraReply,
    LoraUnloadCommand,
    PauseCommand,
    PauseReply,
    ReloadCommand,
    ReloadReply,
    ResumeCommand,
    ScaleCommand,
    ScaleReply,
)
from protocol.messages import MAX_LORA_NAME_LEN, valid_lora_name

from ..errors import APIError
from ..openai_schemas import RequestBody, parse
from ..openapi import JSON, request_body, response
from ..security import admin_route
from ..serving.supervisor import forward
from ..state import STATE, GatewayState

routes = web.RouteTableDef()

RESIZE_MARGIN = 600.0  # seconds a resize may take beyond its drain: new members load, the group re-forms
LORA_TIMEOUT = 300.0  # seconds a LoRA load may take: every engine reads it (launch.ops.lora.ENGINE_TIMEOUT), rolls back


async def _model_asked(request: web.Request) -> str | None:
    """The model a /pause or /resume names (``?model=NAME`` or a JSON body ``{"model": NAME}``), as the supervisor
    names it; None: every model."""
    name = request.query.get("model")
    body = await request.read()
    if name is None and body.strip():
        try:
            name = orjson.loads(body).get("model")
        except (orjson.JSONDecodeError, AttributeError):
            raise APIError(400, 'the body must be a JSON object such as {"model": "NAME"}') from None
    if name is None:
        return None
    if not isinstance(name, str):
        raise APIError(400, "model must be a model name", param="model")
    return request.app[STATE].for_model(name).model.model_id


def _paused_body(paused: bool, reply: PauseReply) -> dict:
    return {"paused": paused, "version": reply.version, "unacknowledged": list(reply.unacknowledged),
            **({"model": reply.model} if reply.model else {})}


@routes.post("/pause")
@admin_route
async def pause(request: web.Request) -> web.Response:
    """Stop admitting new requests on every gateway (of one model with ``{"model": NAME}``, of every model
    without); in-flight ones finish. Answered once every gateway applied it."""
    reply = await forward(request.app[STATE], PauseCommand(await _model_asked(request)), PauseReply)
    return web.json_response(_paused_body(True, reply))


@routes.post("/resume")
@admin_route
async def resume(request: web.Request) -> web.Response:
    """Admit again what an operator paused: one model's pause with ``{"model": NAME}``, every pause without."""
    reply = await forward(request.app[STATE], ResumeCommand(await _model_asked(request)), PauseReply)
    return web.json_response(_paused_body(False, reply))


@routes.get("/is_paused")
async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[STATE].paused})


class ScaleElasticRequest(RequestBody):
    """vLLM's body of ``/scale_elastic_ep`` (strict numbers: ``true`` or ``"4"`` is no size)."""

    model_config = ConfigDict(extra="ignore")

    new_data_parallel_size: Annotated[int, Field(ge=1, le=MAX_SCALE, strict=True)]
    drain_timeout: Annotated[float, Field(gt=0, le=86400, strict=True)] = DEFAULT_DRAIN_TIMEOUT
    model: Annotated[str, Field(min_length=1, max_length=1024)] | None = None  # needed with several EP models


@routes.post("/scale_elastic_ep")
@admin_route
@request_body(ScaleElasticRequest)
async def scale_elastic_ep(request: web.Request) -> web.Response:
    """Resize a model's expert-parallel engine group; answered when the resize is over.

    Admission pauses (new requests are held, up to --scaling-wait), in-flight requests drain within
    drain_timeout, the group re-forms at new_data_parallel_size and admission resumes. 408: in-flight
    requests did not finish in time (nothing changed); 409: another resize runs; 500: it failed (the
    old group serves on)."""
    state = request.app[STATE]
    req: ScaleElasticRequest = parse(ScaleElasticRequest, await request.read())
    model = None if req.model is None else state.for_model(req.model).model.model_id  # the supervisor's name
    cmd = ElasticScaleCommand(req.new_data_parallel_size, req.drain_timeout, model)
    reply = await forward(state, cmd, ElasticScaleReply, timeout=req.drain_timeout + RESIZE_MARGIN, refused=400)
    status = ELASTIC_OUTCOMES[reply.outcome]
    if status != 200:
        raise APIError(status, f"{reply.message} (the group has {reply.size} members; "
                               f"new_data_parallel_size {req.new_data_parallel_size} was asked)", code=reply.outcome)
    return web.json_response({"message": reply.message, "new_data_parallel_size": reply.size,
                              "pause_s": reply.pause_s, "gateway": request.app[STATE].index})


class ScaleRequest(RequestBody):
    """The body of ``/scale``: a tier and its new size, as ``launch scale`` takes them."""

    model_config = ConfigDict(extra="forbid")

    tier: Literal["api-server", "gateway", "engine"]
    count: Annotated[int, Field(ge=1, le=MAX_SCALE, strict=True)]
    model: Annotated[str, Field(min_length=1, max_length=1024)] | None = None  # an engine tier's, with several models


@routes.post("/scale")
@admin_route
@request_body(ScaleRequest)
async def scale(request: web.Request) -> web.Response:
    """Scale the gateway tier (``api-server`` or ``gateway``) or one model's engine tier to ``count`` processes while
    serving, as ``launch scale`` does. Answered once the supervisor has taken the new size; the processes start or
    drain after that (``/server_info``, ``launch status`` and the console show them). An expert-parallel model's tier
    is resized as one group and answered when the resize is over."""
    state = request.app[STATE]
    req: ScaleRequest = parse(ScaleRequest, await request.read())
    tier = "api-server" if req.tier == "gateway" else req.tier
    if req.model is not None and tier != "engine":
        raise APIError(400, "model chooses an engine tier; gateways serve every model", param="model")
    model = None if req.model is None else state.for_model(req.model).model.model_id  # the supervisor's name
    reply = await forward(state, ScaleCommand(tier, req.count, model), ScaleReply,
                          timeout=DEFAULT_DRAIN_TIMEOUT + RESIZE_MARGIN, refused=400)
    return web.json_response({"tier": reply.tier, "desired": reply.desired, "model": reply.model})


RELOAD_ANSWER_WAIT = 2.0  # seconds /reload waits for the supervisor's answer before answering 202 (it goes on)


@routes.post("/reload")
@admin_route
@response(200, JSON, description="the rolling restart was over within RELOAD_ANSWER_WAIT")
@response(202, JSON, description="the rolling restart goes on")
async def reload(request: web.Request) -> web.Response:
    """Replace every process one at a time, as ``launch reload`` (or SIGHUP) does: the tenants file is read again
    first (a malformed one refuses the reload: 400), then each engine and gateway is replaced while the others
    serve. A rolling restart outlasts this request (the gateway answering it is one of the processes replaced), so
    the answer is a 202 once the supervisor has started it (``{"reloading": true}``); follow it in ``/server_info``
    (each process's pid and uptime) or the console."""
    reply = await forward(request.app[STATE], ReloadCommand(), ReloadReply, timeout=RELOAD_ANSWER_WAIT, refused=400,
                          goes_on=True)
    if reply is None:
        return web.json_response({"reloading": True}, status=202)
    return web.json_response({"reloading": False, "replaced": reply.replaced, "seconds": reply.seconds})


@routes.post("/is_scaling_elastic_ep")
@routes.get("/is_scaling_elastic_ep")
async def is_scaling_elastic_ep(request: web.Request) -> web.Response:
    """Whether an expert-parallel resize runs, and its phase (the same on every gateway, which says who it is)."""
    state = request.app[STATE]
    phase = state.scaling if state.scaling in ELASTIC_PHASES else ""
    return web.json_response({"is_scaling_elastic_ep": bool(phase), "phase": phase or None, "gateway": state.index})


# -- LoRA adapters: vLLM's routes and SageMaker's ---------------------------------------------------------------
def _lora_name(name: str) -> str:
    if not valid_lora_name(name):
        raise ValueError(f"an adapter name is 1..{MAX_LORA_NAME_LEN} printable characters")
    return name


LoraName = Annotated[str, AfterValidator(_lora_name)]
LoraPath = Annotated[str, Field(min_length=1, max_length=4096)]


class LoadLoraRequest(RequestBody):
    """vLLM's body of ``/v1/load_lora_adapter`` (``model``: the base model, needed when several serve adapters)."""

    lora_name: LoraName
    lora_path: LoraPath
    model: Annotated[str, Field(min_length=1, max_length=1024)] | None = None


class UnloadLoraRequest(RequestBody):
    """vLLM's body of ``/v1/unload_lora_adapter`` (its ``lora_int_id`` is not needed: names are unique)."""

    lora_name: LoraName


class AdapterRequest(RequestBody):
    """SageMaker's body of ``POST /adapters``: the adapter's ``name`` and its directory ``src``."""

    name: LoraName
    src: LoraPath
    model: Annotated[str, Field(min_length=1, max_length=1024)] | None = None


async def _lora(state: GatewayState, cmd: LoraLoadCommand | LoraUnloadCommand) -> LoraReply:
    """Send a load or unload to the supervisor; an outcome other than done is its status, in OpenAI's shape."""
    reply = await forward(state, cmd, LoraReply, timeout=LORA_TIMEOUT, refused=400)
    status = LORA_OUTCOMES[reply.outcome]
    if status != 200:
        code = {"not_found": "model_not_found", "invalid": "invalid_lora_adapter"}.get(reply.outcome, reply.outcome)
        raise APIError(status, reply.message, param="lora_name", code=code)
    return reply


def _adapter_body(reply: LoraReply) -> dict:
    return {"name": reply.name, "model": reply.model, "status": reply.outcome, "engines": reply.engines,
            "version": reply.version, "seconds": reply.seconds, "unacknowledged": list(reply.unacknowledged)}


@routes.post("/v1/load_lora_adapter")
@admin_route
@request_body(LoadLoraRequest)
async def load_lora_adapter(request: web.Request) -> web.Response:
    """Load a LoRA adapter (a PEFT directory inside ``--lora-dir``) on every engine of its base model and serve
    its name on every gateway; answered once all do. 400: bad input (nothing changed, everywhere)."""
    req: LoadLoraRequest = parse(LoadLoraRequest, await request.read())
    reply = await _lora(request.app[STATE], LoraLoadCommand(req.lora_name, req.lora_path, req.model))
    return web.Response(text=f"Success: LoRA adapter '{reply.name}' added successfully.")


@routes.post("/v1/unload_lora_adapter")
@admin_route
@request_body(UnloadLoraRequest)
async def unload_lora_adapter(request: web.Request) -> web.Response:
    """Stop serving a LoRA adapter on every gateway (404 from then on) and drop it from every engine once its
    running requests end. 404: no such adapter."""
    req: UnloadLoraRequest = parse(UnloadLoraRequest, await request.read())
    reply = await _lora(request.app[STATE], LoraUnloadCommand(req.lora_name))
    return web.Response(text=f"Success: LoRA adapter '{reply.name}' removed successfully.")


@routes.post("/adapters")
@admin_route
@request_body(AdapterRequest)
async def register_adapter(request: web.Request) -> web.Response:
    """SageMaker's adapter registration: ``/v1/load_lora_adapter`` with ``name`` and ``src``; answers JSON."""
    req: AdapterRequest = parse(AdapterRequest, await request.read())
    reply = await _lora(request.app[STATE], LoraLoadCommand(req.name, req.src, req.model))
    return web.json_response(_adapter_body(reply))


@routes.delete("/adapters/{name}")
@admin_route
async def delete_adapter(request: web.Request) -> web.Response:
    """SageMaker's adapter removal: ``/v1/unload_lora_adapter`` of the adapter the path names; answers JSON."""
    name = request.match_info["name"]
    if not valid_lora_name(name):
        raise APIError(400, f"an adapter name is 1..{MAX_LORA_NAME_LEN} printable characters", param="name")
    reply = await _lora(request.app[STATE], LoraUnloadCommand(name))
    return web.json_response(_adapter_body(reply))


@routes.get("/status")
async def status(request: web.Request) -> web.Response:
    """This gateway's view of the cluster (the same on every gateway once they acknowledged)."""
    state = request.app[STATE]
    cl = state.cluster
    followers = state.engines.followers
    # kv_blocks_known: the blocks this gateway's router knows the engine holds (its KV events); None: not followed
    engines = [{**e.describe(), "kv_blocks_known": len(f.state.blocks) if (f := followers.get(ep)) else None}
               for ep, e in state.engines.engines.items()]
    return web.json_response({
        "gateway": state.index, "pid": os.getpid(), "models": [m.model_id for m in state.models],
        "paused": state.paused, "holds": [h.to_json() for h in state.holds],
        "draining": state.draining, "cluster_version": cl.version if cl else None,
        "gateways_desired": cl.gateways_desired if cl else None, "engines": engines,
        "in_flight": state.engines.in_flight, "routing_policy": state.engines.router.policy,
    })
