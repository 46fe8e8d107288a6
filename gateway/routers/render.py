"""Render routes: what a completions or chat-completions request would send to the engine, without generating.

``POST /v1/chat/completions/render`` and ``POST /v1/completions/render`` take the bodies of
``/v1/chat/completions`` and ``/v1/completions`` and run the same code up to the engine
(``serving.plans.plan_chat``, ``serving.plans.plan_completion``): the same checks and 400s, chat template, tokenizer
and sampling parameters. Instead of generating, they answer what the engine would get, shaped like
vLLM's render routes (a chat request renders to one object, a completions request to a list with one
object per prompt, each carrying ``token_ids`` and ``sampling_params``), with the prompt's text beside
the ids. Every gateway serves them; a render server (``launch render``, no engine) serves little else.
"""

from __future__ import annotations

from aiohttp import web

from ..openai_schemas import ChatCompletionRequest, CompletionRequest, parse
from ..openapi import request_body
from ..serving.plans import plan_chat, plan_completion
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
