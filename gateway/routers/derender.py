"""Derender routes: a ``/inference/v1/generate`` answer turned back into the OpenAI answer of the request.

The last third of the scale-out triad, as vLLM serves it: render (``routers.render``: a request → the token ids
and sampling params an engine gets) → generate (``routers.native``: token ids in, token ids out) → derender
(here: those token ids → the chat completion or completion the direct route would have answered).

``POST /v1/chat/completions/derender`` takes ``{"chat_request": <the /v1/chat/completions body>, "generate":
<what /inference/v1/generate answered>, "request_id": <optional id of the answer>}``; ``POST
/v1/completions/derender`` takes ``completion_request`` and, in ``generate``, a list of one answer per rendered
prompt. A generate answer is its JSON body, or the data of its streamed events in order. The request is planned
again exactly as the direct route plans it (``serving.plans``: its chat template, tool and reasoning parsers,
stop strings, sampling) and the answer replayed through the same text pipeline and shaping
(``serving.replay``, ``serving.completions``), so derendering gives the direct route's answer: whole, or streamed
when the request says ``stream``. Nothing runs on an engine: render servers (``launch render``) serve these too.
"""

from __future__ import annotations

from typing import Annotated

from aiohttp import web
from pydantic import Field

from ..errors import bad_request
from ..openai_schemas import ChatCompletionRequest, CompletionRequest, RequestBody, parse_nested
from ..openapi import JSON, SSE, request_body, response
from ..serving.completions import answer
from ..serving.plans import Plan, plan_chat, plan_completion
from ..serving.replay import GenerateAnswer, Replay
from ..state import STATE

routes = web.RouteTableDef()

AnswerId = Annotated[str, Field(min_length=1, max_length=256)]


class ChatDerenderRequest(RequestBody):
    """``chat_request``: the body sent to ``/v1/chat/completions/render``; ``generate``: what
    ``/inference/v1/generate`` answered for its ids and sampling params (the JSON body, or the streamed events'
    data in order, without ``[DONE]``); ``request_id``: the answer's id (the render's, say; a new one if none)."""

    chat_request: ChatCompletionRequest
    generate: GenerateAnswer
    request_id: AnswerId | None = None


class CompletionDerenderRequest(RequestBody):
    """``completion_request``: the body sent to ``/v1/completions/render``; ``generate``: one generate answer
    per prompt it rendered, in its order (each a JSON body or a list of streamed events); ``request_id``: as
    the chat route's."""

    completion_request: CompletionRequest
    generate: Annotated[list[GenerateAnswer], Field(min_length=1)]
    request_id: AnswerId | None = None


def _replayable(plan: Plan, where: str) -> None:
    """Prompt logprobs (asked, or completions' echo with logprobs) are a 400: a generate answer carries no ranks."""
    if any(c.sampling.prompt_logprobs is not None for c in plan.choices):
        raise bad_request(f"{where}: prompt logprobs (prompt_logprobs, or echo with logprobs) cannot be derendered: "
                          "the generate answer does not carry the prompt's ranks", param=f"{where}.prompt_logprobs")


@routes.post("/v1/chat/completions/derender")
@request_body(ChatDerenderRequest)
@response(200, JSON, SSE)
async def derender_chat_completion(request: web.Request) -> web.StreamResponse:
    body: ChatDerenderRequest = parse_nested(ChatDerenderRequest, await request.read(), "chat_request",
                                             ChatCompletionRequest)
    req = body.chat_request
    plan = await plan_chat(request.app[STATE], req)
    _replayable(plan, "chat_request")
    replay = Replay(plan.state, plan.choices, plan.n, plan.opts, [body.generate], bool(req.logprobs))
    return await answer(request, plan, req, replay, body.request_id)


@routes.post("/v1/completions/derender")
@request_body(CompletionDerenderRequest)
@response(200, JSON, SSE)
async def derender_completion(request: web.Request) -> web.StreamResponse:
    body: CompletionDerenderRequest = parse_nested(CompletionDerenderRequest, await request.read(),
                                                   "completion_request", CompletionRequest)
    req = body.completion_request
    plan = await plan_completion(request.app[STATE], req)
    _replayable(plan, "completion_request")
    replay = Replay(plan.state, plan.choices, plan.n, plan.opts, body.generate, req.logprobs is not None)
    return await answer(request, plan, req, replay, body.request_id)
