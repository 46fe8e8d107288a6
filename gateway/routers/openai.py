"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each handler validates its body and turns it into a ``Plan`` — prompt ids and SamplingParams for
every choice (``serving.plans``), which is what the render routes show (``routers.render``) — then runs
every choice through ``serving.choices.ChoiceRun`` concurrently, and shapes the deltas as the OpenAI API
does (``serving.completions``), as one JSON body or as an SSE stream.
Chat completions also carry tool calls and reasoning (``reasoning_content``) when the server runs a
tool-call or reasoning parser.
"""

from __future__ import annotations

from aiohttp import web

from ..openai_schemas import ChatCompletionRequest, CompletionRequest, parse
from ..openapi import JSON, SSE, request_body, response
from ..serving.completions import answer
from ..serving.plans import plan_chat, plan_completion
from ..serving.shapes import json_body
from ..state import STATE, ModelState

routes = web.RouteTableDef()


def model_card(view: ModelState) -> dict:
    """One entry of /v1/models: a name clients use, the model it names, its context and its tasks now. A LoRA
    adapter's, as vLLM's: its directory as ``root`` and its base model's (first) name as ``parent``."""
    model = view.model
    return {"id": view.name, "object": "model", "created": int(view.gateway.started_at), "owned_by": "zserve",
            "root": model.model_id if view.lora is None else model.loras[view.lora],
            "parent": None if view.lora is None else model.names[0], "max_model_len": view.max_model_len,
            "tasks": sorted(view.tasks), "weight_version": view.gateway.weight_version(model.model_id)}


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    return json_body({"object": "list", "data": [model_card(view) for view in request.app[STATE].views]})


@routes.get("/v1/models/{model:.+}")
async def get_model(request: web.Request) -> web.Response:
    return json_body(model_card(request.app[STATE].for_model(request.match_info["model"])))


@routes.post("/v1/completions")
@request_body(CompletionRequest)
@response(200, JSON, SSE)
async def completions(request: web.Request) -> web.StreamResponse:
    req: CompletionRequest = parse(CompletionRequest, await request.read())
    return await answer(request, await plan_completion(request.app[STATE], req), req)


@routes.post("/v1/chat/completions")
@request_body(ChatCompletionRequest)
@response(200, JSON, SSE)
async def chat_completions(request: web.Request) -> web.StreamResponse:
    req: ChatCompletionRequest = parse(ChatCompletionRequest, await request.read())
    return await answer(request, await plan_chat(request.app[STATE], req), req)
