"""Engine operations from any gateway: sleep and wake, weight updates, cache resets, profiling and aborts (vLLM's
admin routes, and SGLang's weight routes), answered once every engine of the model has done it.

A gateway carries out none of them itself: each becomes an ``OperationCommand`` (or ``AbortCommand``) to the
supervisor (``launch.ops.engine_ops``), which has every engine of the model (default: the only model, or every one)
do it, changes the cluster state (a sleeping model's requests are held, then refused with 503; the weight version)
and answers once every gateway applied it. So the call and the check may go to different gateways. The reply lists
each engine's result; a failure names the engine and why. Parameters come as vLLM sends them (``?level=1``,
``?tags=weights``) or in a JSON body. What reads the cluster state (``/is_sleeping``, ``/weight_info``,
``/get_world_size``) is answered here, the same on every gateway.
"""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from aiohttp import web
from pydantic import ConfigDict, Field, ValidationError

from protocol.control import (
    MAX_ABORT_IDS,
    OPERATION_OUTCOMES,
    SLEEP_LEVELS,
    WAKE_TAGS,
    AbortCommand,
    AbortReply,
    OperationCommand,
    OperationReply,
)

from ..errors import APIError
from ..openai_schemas import RequestBody
from ..security import admin_route
from ..serving.supervisor import forward
from ..state import STATE, GatewayState

routes = web.RouteTableDef()

OPERATION_TIMEOUT = 1200.0  # a sleep waits for running requests, an update reads a checkpoint on every engine
Model = Annotated[str, Field(min_length=1, max_length=1024)] | None


class _Body(RequestBody):
    model_config = ConfigDict(extra="forbid")
    model: Model = None


class SleepBody(_Body):
    level: Annotated[int, Field(strict=True)] = 1


class WakeBody(_Body):
    tags: list[str] | None = None


class ResetBody(_Body):
    reset_running: bool = False
    reset_running_requests: bool = False  # vLLM's newer name


class ProfileBody(_Body):
    record_shapes: bool = False


class WeightsBody(_Body):
    path: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    model_path: Annotated[str, Field(min_length=1, max_length=4096)] | None = None  # SGLang's name
    version: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    weight_version: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # SGLang's name
    update_info: dict[str, Any] | None = None  # vLLM's wrapper of the same fields


class VersionBody(_Body):
    version: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    new_version: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # SGLang's name


class AbortBody(RequestBody):
    request_ids: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]],
                           Field(min_length=1, max_length=MAX_ABORT_IDS)]


async def _params(request: web.Request, schema: type[RequestBody]) -> Any:
    """The operation's parameters: a JSON body, and vLLM's query parameters (``?level=2``, ``?tags=a&tags=b``)."""
    raw = await request.read()
    body: Any = {}
    if raw.strip():
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise APIError(400, "the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
    for key in set(request.query):
        values = request.query.getall(key)
        if key == "tags":
            body[key] = values
        elif key == "level":
            try:
                body[key] = int(values[-1])
            except ValueError:
                raise APIError(400, f"level must be one of {', '.join(map(str, SLEEP_LEVELS))}",
                               param="level") from None
        else:
            body[key] = values[-1] if key not in ("reset_running", "reset_running_requests", "record_shapes") else (
                values[-1].lower() in ("1", "true", "yes"))
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{where}: {first['msg']}" if where else first["msg"], param=where) from None


def _model(state: GatewayState, name: str | None) -> str | None:
    """The supervisor's id of the model a request names (404 for one no gateway serves); None: every model."""
    return None if name is None else state.for_model(name).model.model_id


async def _operate(request: web.Request, op: str, model: str | None, args: dict | None = None) -> web.Response:
    state = request.app[STATE]
    cmd = OperationCommand(op, _model(state, model), args or None)
    reply = await forward(state, cmd, OperationReply, timeout=OPERATION_TIMEOUT, refused=400)
    status = OPERATION_OUTCOMES[reply.outcome]
    body = {"op": reply.op, "status": reply.outcome, "message": reply.message, "models": list(reply.models),
            "engines": list(reply.engines), "seconds": reply.seconds, "pause_s": reply.pause_s,
            "cluster_version": reply.version, "unacknowledged": list(reply.unacknowledged),
            "gateway": state.index}
    if status != 200:
        error = APIError(status, reply.message, code=reply.outcome).body()
        error["error"]["engines"] = body["engines"]
        return web.json_response(error, status=status)
    return web.json_response(body)


# -- sleep mode --------------------------------------------------------------------------------------------------
@routes.post("/sleep")
@admin_route
async def sleep(request: web.Request) -> web.Response:
    """Put every engine of the model to sleep once its started requests end: level 1 frees the KV cache (and moves
    a GPU's weights to host memory), level 2 frees the weights too (read again from the checkpoint on wake). Its new
    requests are held up to --scaling-wait, then refused with 503 until ``/wake_up``."""
    p: SleepBody = await _params(request, SleepBody)
    if p.level not in SLEEP_LEVELS:
        raise APIError(400, f"level must be one of {', '.join(map(str, SLEEP_LEVELS))}", param="level")
    return await _operate(request, "sleep", p.model, {"level": p.level})


@routes.post("/wake_up")
@admin_route
async def wake_up(request: web.Request) -> web.Response:
    """Bring back what ``tags`` name (``weights``, ``kv_cache``; default both); the model serves again once both
    are back."""
    p: WakeBody = await _params(request, WakeBody)
    bad = [t for t in p.tags or () if t not in WAKE_TAGS]
    if bad or p.tags == []:
        raise APIError(400, f"tags must be some of {', '.join(WAKE_TAGS)}", param="tags")
    return await _operate(request, "wake_up", p.model, {"tags": list(dict.fromkeys(p.tags))} if p.tags else None)


@routes.get("/is_sleeping")
async def is_sleeping(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = _model(state, request.query.get("model"))
    asleep = state.cluster.sleeping if state.cluster else {}
    levels = {m: lvl for m, lvl in asleep.items() if model in (None, m)}
    return web.json_response({"is_sleeping": bool(levels), "models": levels, "gateway": state.index})


# -- weights -----------------------------------------------------------------------------------------------------
@routes.post("/update_weights")
@admin_route
async def update_weights(request: web.Request) -> web.Response:
    """Load a checkpoint of the same architecture into every engine of the model: every engine reads it first (one
    refusal and none changes, 400); then the model's new requests are held while every engine finishes the requests
    it started on the old weights and swaps; requests that had not started run on the new ones. No response mixes
    the two."""
    p: WeightsBody = await _params(request, WeightsBody)
    info = p.update_info or {}
    path = p.path or p.model_path or info.get("path") or info.get("model_path")
    version = p.version or p.weight_version or info.get("version") or info.get("weight_version")
    if not isinstance(path, str) or not path:
        raise APIError(400, "path must name a checkpoint directory (or .gguf file) of the served architecture",
                       param="path")
    if version is not None and not (isinstance(version, str) and 0 < len(version) <= 256):
        raise APIError(400, "version must be a label of 1..256 characters", param="version")
    return await _operate(request, "update_weights", p.model or info.get("model"),
                          {"path": path, **({"version": version} if version else {})})


@routes.post("/update_weight_version")
@admin_route
async def update_weight_version(request: web.Request) -> web.Response:
    """Relabel the weights every engine of the model serves (SGLang's route)."""
    p: VersionBody = await _params(request, VersionBody)
    version = p.version or p.new_version
    if version is None:
        raise APIError(400, "version is required", param="version")
    return await _operate(request, "update_weight_version", p.model, {"version": version})


@routes.get("/weight_info")
async def weight_info(request: web.Request) -> web.Response:
    """The weight version of each model and of each engine (the same on every gateway)."""
    state = request.app[STATE]
    cl = state.cluster
    engines = [{"engine": e.rank, "model": e.model, "weight_version": e.weight_version, "state": str(e.state),
                "sleeping": e.sleeping} for e in (cl.engines if cl else ())]
    return web.json_response({"models": {m.model_id: state.weight_version(m.model_id) for m in state.models},
                              "engines": engines, "gateway": state.index})


@routes.get("/get_world_size")
async def get_world_size(request: web.Request) -> web.Response:
    """How many engines serve (of the model ``?model=`` names, or of every model)."""
    state = request.app[STATE]
    model = _model(state, request.query.get("model"))
    ready = [e for e in (state.cluster.engines if state.cluster else ()) if e.state == "ready"
             and model in (None, e.model)]
    per_model: dict[str, int] = {}
    for e in ready:
        per_model[e.model] = per_model.get(e.model, 0) + 1
    return web.json_response({"world_size": len(ready), "models": per_model})


# -- caches and profiling ----------------------------------------------------------------------------------------
@routes.post("/reset_prefix_cache")
@admin_route
async def reset_prefix_cache(request: web.Request) -> web.Response:
    """Forget every engine's cached prefixes: the next identical request computes its whole prompt. 409 while
    requests run on an engine, unless ``reset_running`` (their prompts are computed again)."""
    p: ResetBody = await _params(request, ResetBody)
    return await _operate(request, "reset_prefix_cache", p.model,
                          {"reset_running": p.reset_running or p.reset_running_requests})


@routes.post("/reset_mm_cache")
@admin_route
async def reset_mm_cache(request: web.Request) -> web.Response:
    """vLLM's multimodal cache reset: zserve's engines keep no multimodal cache (200, nothing to reset)."""
    p: _Body = await _params(request, _Body)
    return await _operate(request, "reset_mm_cache", p.model)


@routes.post("/reset_encoder_cache")
@admin_route
async def reset_encoder_cache(request: web.Request) -> web.Response:
    """vLLM's encoder cache reset: zserve's engines keep no encoder cache (200, nothing to reset)."""
    p: _Body = await _params(request, _Body)
    return await _operate(request, "reset_encoder_cache", p.model)


@routes.post("/start_profile")
@admin_route
async def start_profile(request: web.Request) -> web.Response:
    """Start the torch profiler in every engine (needs --profiler-dir)."""
    p: ProfileBody = await _params(request, ProfileBody)
    return await _operate(request, "start_profile", p.model, {"record_shapes": p.record_shapes})


@routes.post("/stop_profile")
@admin_route
async def stop_profile(request: web.Request) -> web.Response:
    """Stop the profiler: every engine writes a Chrome trace under --profiler-dir, named by engine and time (the
    reply lists each one's path)."""
    p: _Body = await _params(request, _Body)
    return await _operate(request, "stop_profile", p.model)


# -- aborts ------------------------------------------------------------------------------------------------------
@routes.post("/abort_requests")
@routes.post("/inference/v1/abort_requests")
@admin_route
async def abort_requests(request: web.Request) -> web.Response:
    """End the requests ``request_ids`` names (``/inference/v1/generate``'s ``request_id``, or any request's
    ``X-Request-Id``) on whichever gateway serves them: their streams end with finish reason ``abort``. Ids no
    gateway serves are listed as unknown, not an error."""
    p: AbortBody = await _params(request, AbortBody)
    reply = await forward(request.app[STATE], AbortCommand(tuple(dict.fromkeys(p.request_ids))), AbortReply)
    return web.json_response({"aborted": list(reply.aborted), "unknown": list(reply.unknown)})
