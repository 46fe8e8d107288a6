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
from ..serving.plans import Plan, plan_chat, plan_completion
from ..serving.shapes import json_body
from ..state import STATE

routes = web.RouteTableDef()


def rendered(plan: Plan, i: int) -> dict:
    """Prompt ``i`` of a plan as the engine would get it.

    ``sampling_params`` is the engine's ``SamplingParams`` of the prompt's first choice, exactly as it
    travels (max_tokens resolved against the context); choice j of ``n`` differs only in its seed (seed + j).
    ``text_options`` is what the gateway applies to the engine's tokens on the way back."""
    text, ids = plan.prompts[i]
    first = plan.choices[i * plan.n]
    return {
        "request_id": plan.request_id,
        "model": plan.model,
        "prompt": text if text is not None else plan.state.tokenizer.decode(ids, skip_special_tokens=False),
        "token_ids": ids,
        "n": plan.n,
        "sampling_params": first.sampling.to_wire(),
        "text_options": {"stop": plan.opts.stop, "include_stop_str_in_output": plan.opts.include_stop_str_in_output,
                         "skip_special_tokens": plan.opts.skip_special_tokens},
    }


@routes.post("/v1/chat/completions/render")
@request_body(ChatCompletionRequest)
async def render_chat_completion(request: web.Request) -> web.Response:
    plan = await plan_chat(request.app[STATE], parse(ChatCompletionRequest, await request.read()))
    return json_body(rendered(plan, 0))


@routes.post("/v1/completions/render")
@request_body(CompletionRequest)
async def render_completion(request: web.Request) -> web.Response:
    plan = await plan_completion(request.app[STATE], parse(CompletionRequest, await request.read()))
    return json_body([rendered(plan, i) for i in range(len(plan.prompts))])
