"""Render routes: what a completions, chat-completions, Messages or Responses request would send to the engine,
without generating.

``POST /v1/chat/completions/render``, ``/v1/completions/render``, ``/v1/messages/render`` and
``/v1/responses/render`` take the bodies of ``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages`` and
``/v1/responses`` and run the same code up to the engine (``serving.plans.plan_chat``, ``plan_completion``,
``serving.anthropic_plan.plan_messages``, ``serving.responses_plan.plan_response``): the same checks and 400s,
chat template, tokenizer and sampling parameters. Instead of generating, they answer what the engine would get,
shaped like vLLM's render routes (a chat, Messages or Responses request renders to one object, a completions
request to a list with one object per prompt, each carrying ``token_ids`` and ``sampling_params``), with the
prompt's text beside the ids. Errors take OpenAI's shape on every render route (the render family's). Every
gateway serves them; a render server (``launch render``, no engine) serves little else. What the engine then
generates (``/inference/v1/generate``) turns back into the direct route's answer through ``routers.derender``.
"""

from __future__ import annotations

from aiohttp import web

from .. import structured
from ..openai_schemas import ChatCompletionRequest, CompletionRequest, parse
from ..openapi import request_body
from ..serving.anthropic_plan import MessagesRequest, plan_messages
from ..serving.plans import plan_chat, plan_completion
from ..serving.responses_plan import ResponsesRequest, conversation, plan_response
from ..serving.shapes import json_body
from ..state import STATE

routes = web.RouteTableDef()


@routes.post("/v1/chat/completions/render")
@request_body(ChatCompletionRequest)
async def render_chat_completion(request: web.Request) -> web.Response:
    plan = await plan_chat(request.app[STATE], parse(ChatCompletionRequest, await request.read()))
    return json_body(plan.render(0))


@routes.post("/v1/completions/render")
@request_body(CompletionRequest)
async def render_completion(request: web.Request) -> web.Response:
    plan = await plan_completion(request.app[STATE], parse(CompletionRequest, await request.read()))
    return json_body([plan.render(i) for i in range(len(plan.prompts))])


@routes.post("/v1/messages/render")
@request_body(MessagesRequest)
async def render_messages(request: web.Request) -> web.Response:
    plan = await plan_messages(request.app[STATE], parse(MessagesRequest, await request.read()))
    return json_body(plan.render(0))


@routes.post("/v1/responses/render")
@request_body(ResponsesRequest)
async def render_response(request: web.Request) -> web.Response:
    """The turn the engine would get: after ``previous_response_id``'s conversation, read from the store (nothing
    is stored by rendering)."""
    req: ResponsesRequest = parse(ResponsesRequest, await request.read())
    state = request.app[STATE].for_model(req.model, "generate")
    planned = plan_response(state, req, await conversation(state.gateway, req))
    await structured.check(planned.constraint, state.tokenizer)
    return json_body(planned.plan.render(0))
