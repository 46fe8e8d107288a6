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

from ..errors import bad_request
from ..openai_schemas import BatchChatCompletionRequest, ChatCompletionRequest, CompletionRequest, parse
from ..openapi import JSON, SSE, request_body, response
from ..serving.completions import ChatShape, answer, respond
from ..serving.plans import plan_chat, plan_completion
from ..serving.shapes import json_body
from ..serving.tools import NO_TOOLS
from ..state import STATE, ModelState
from ..tenancy import SERVED

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
    served = SERVED.get()  # a tenant sees the models it may use
    return json_body({"object": "list", "data": [model_card(view) for view in request.app[STATE].views
                                                 if served is None or served.tenant.may_use(view.name)]})


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


@routes.post("/v1/chat/completions/batch")
@request_body(BatchChatCompletionRequest)
@response(200, JSON)
async def chat_completions_batch(request: web.Request) -> web.Response:
    """vLLM's batch of conversations: ``messages`` is a list of conversations, each planned as its own chat
    completion with the body's other fields, all generated at once; the answer is one chat completion whose choice i
    answers conversation i. As vLLM's: not streamed, without tools, n 1."""
    req: BatchChatCompletionRequest = parse(BatchChatCompletionRequest, await request.read())
    for name, refused in (("stream", req.stream), ("tools", req.tools), ("n", req.n != 1)):
        if refused:
            raise bad_request(f"{name} is not supported by /v1/chat/completions/batch", param=name)
    state = request.app[STATE]
    plans = [await plan_chat(state, req.model_copy(update={"messages": conv})) for conv in req.messages]
    choices = [p.choices[0] for p in plans]
    for i, c in enumerate(choices):
        c.index = i
    first = plans[0]
    shape = ChatShape(first.state.token_text, req.logprobs, NO_TOOLS)
    return await respond(request, first.state, request_id=first.request_id, model=first.model, choices=choices,
                         opts=first.opts, prompt_tokens=sum(p.prompt_tokens for p in plans), stream=False,
                         shape=shape)
