"""Native token routes, in vLLM's shapes: ``/tokenize``, ``/detokenize`` and ``/inference/v1/generate``.

``/tokenize`` with ``messages`` renders the chat template exactly as ``/v1/chat/completions`` does
(``serving.prompts.chat_prompt``), so its ids are the ones the chat route would feed the engine: with a
forced ``tool_choice``, the opening of the call too.
``/inference/v1/generate`` is token ids in, token ids out: the shared pipeline runs without
detokenizing, for clients (RL trainers, disaggregated front-ends) that do their own text work; its
``sampling_params`` take vLLM's ``structured_outputs`` (and ``response_format``, ``guided_*``) as
the text routes do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from aiohttp import web
from pydantic import ConfigDict, Field, field_validator

from .. import structured
from ..errors import APIError, bad_request
from ..generation import TextOptions
from ..ids import random_hex
from ..openai_schemas import ChatMessage, ChatTool, RequestBody, SamplingFields, parse
from ..openapi import JSON, SSE, request_body, response
from ..serving.admission import admit
from ..serving.choices import Choice, collect, run_choices
from ..serving.engine_errors import ENGINE_ERRORS, engine_error
from ..serving.prompts import chat_prompt, check_prompt_ids, wants_generation_prompt
from ..serving.sampling import build_sampling
from ..serving.shapes import json_body
from ..serving.tools import NO_TOOLS, chat_tool_use
from ..sse import open_stream, send_done, send_event
from ..state import STATE, ModelState
from ..text.token_text import TokenLogprob

log = logging.getLogger("zserve.gateway.native")
routes = web.RouteTableDef()

MAX_IDS = 1 << 20  # ids in one /detokenize or /inference/v1/generate body


class TokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # as the chat route's: a forced call's opening is fed too
    parallel_tool_calls: bool = True
    add_special_tokens: bool | None = None  # vLLM: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_IDS)]


class GenerateSampling(SamplingFields):
    """vLLM's SamplingParams as JSON (the fields this engine implements); also as the render routes show them
    (the engine's own form: ``logit_bias`` as [id, bias] pairs, a checked constraint as ``structured``), so a
    render's ``sampling_params`` are generated with as they are."""

    max_tokens: Annotated[int, Field(ge=1)] = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    structured: tuple[str, str] | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_pairs(cls, v: Any) -> Any:
        if isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
            return {str(k): b for k, b in v}
        return v


class GenerateRequest(RequestBody):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_IDS)]
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False


def _check_ids(state: ModelState, ids: list[int], param: str) -> None:
    vocab = state.tokenizer.vocab_size
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range [0, {vocab})", param=param)


@routes.post("/tokenize")
@request_body(TokenizeRequest)
async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req: TokenizeRequest = parse(TokenizeRequest, await request.read())
    state = state.for_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    if req.messages is not None:
        if not req.messages:
            raise bad_request("messages must not be empty", param="messages")
        add_gp = wants_generation_prompt(req.add_generation_prompt, req.continue_final_message, req.model_fields_set)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        # Without a tool-call parser the tools are still rendered (counting needs none); the chat route refuses them.
        use = NO_TOOLS if state.tool_parser is None else chat_tool_use(state, tools, req.tool_choice,
                                                                       req.parallel_tool_calls)
        prompt = chat_prompt(state, [m.model_dump(exclude_none=True) for m in req.messages], tools=tools, use=use,
                             add_generation_prompt=add_gp, continue_final_message=req.continue_final_message,
                             template_kwargs=req.chat_template_kwargs)
        ids = prompt.ids
        if req.add_special_tokens:
            ids = state.tokenizer.encode(prompt.text, add_special_tokens=True)
    else:
        ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    strs = state.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return json_body({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                      "token_strs": strs})


@routes.post("/detokenize")
@request_body(DetokenizeRequest)
async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req: DetokenizeRequest = parse(DetokenizeRequest, await request.read())
    state = state.for_model(req.model)
    _check_ids(state, req.tokens, "tokens")
    return json_body({"prompt": state.tokenizer.decode(req.tokens)})


def _logprobs(lps: list[TokenLogprob]) -> list[dict]:
    return [{"token_id": lp.token_id, "logprob": lp.logprob,
             "top_logprobs": [{"token_id": t, "logprob": v} for t, v in lp.top or ()]} for lp in lps]


def _prompt_logprobs(ids: list[int], lps: list[TokenLogprob] | None) -> list[dict] | None:
    # Aligned with the prompt, as vLLM's are: its first token has no context to be scored in.
    return None if lps is None else _logprobs([TokenLogprob(ids[0], None, None), *lps])


def _choice(c: Choice, token_ids: list[int], lps: list | None, finish: str | None) -> dict:
    return {"index": c.index, "token_ids": token_ids, "finish_reason": finish,
            "logprobs": None if lps is None else {"content": _logprobs(lps)}}


@routes.post("/inference/v1/generate")
@request_body(GenerateRequest)
@response(200, JSON, SSE)
async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req: GenerateRequest = parse(GenerateRequest, await request.read())
    state = state.for_model(req.model, "generate")
    sp = req.sampling_params
    if sp.stop:
        raise bad_request("stop strings need text; this route takes and returns token ids: use stop_token_ids",
                          param="sampling_params.stop")
    ids = list(req.token_ids)
    max_tokens = check_prompt_ids(state, ids, sp.max_tokens, param="token_ids",
                                  max_tokens_param="sampling_params.max_tokens")
    asked = structured.from_request(sp, where="sampling_params.")
    given = structured.from_pair(sp.structured, "sampling_params.structured")
    if asked is not None and given is not None:
        raise bad_request(f"{asked.source} and sampling_params.structured both constrain the output; give one",
                          param="sampling_params.structured")
    constraint = await structured.check(asked or given, state.tokenizer)
    choices = [Choice(j, ids, build_sampling(state, sp, max_tokens, sp.logprobs, j, sp.prompt_logprobs,
                                               "sampling_params.", structured=constraint))
               for j in range(sp.n)]
    rid = req.request_id or f"gen-{random_hex()}"
    # The client's request_id is echoed, never used as the engine's: two requests naming the same id
    # would otherwise share one stream in this gateway (one of them hangs) or be refused by the engine
    # as already running (a 500). Nor is it part of it: the wire caps ids at 128 characters.
    engine_rid = f"gen-{random_hex()}" if req.request_id else rid
    opts = TextOptions(stop=[], detokenize=False)
    admit(state, parts=len(choices), param="sampling_params.n", what="choices (n)")
    with abortable(state.engines.client, req.request_id, engine_rid):
        return await _generate(request, state, req, rid, engine_rid, ids, choices, opts)


@contextmanager
def abortable(client, alias: str | None, engine_rid: str) -> Iterator[None]:
    """While the request runs, POST /abort_requests finds it by the id its client gave (through any gateway)."""
    if alias is None:
        yield
        return
    client.aliases.setdefault(alias, set()).add(engine_rid)
    try:
        yield
    finally:
        left = client.aliases.get(alias)
        if left is not None:
            left.discard(engine_rid)
            if not left:
                del client.aliases[alias]


async def _generate(request: web.Request, state: ModelState, req: GenerateRequest, rid: str, engine_rid: str,
                    ids: list[int], choices: list[Choice], opts: TextOptions) -> web.StreamResponse:
    sp = req.sampling_params
    if not req.stream:
        await collect(state, engine_rid, choices, opts)
        outs = [_choice(c, c.token_ids, c.logprobs if sp.logprobs is not None else None, c.finish_reason)
                for c in choices]
        return json_body({"request_id": rid, "choices": outs,
                          "prompt_logprobs": _prompt_logprobs(ids, choices[0].prompt_logprobs)})
    resp = await open_stream(request)
    try:
        async for c, d in run_choices(state, engine_rid, choices, opts):
            c.take(d)
            if d.token_ids or d.finish_reason:
                lps = d.logprobs if sp.logprobs is not None else None
                event = {"request_id": rid, "choices": [_choice(c, d.token_ids, lps, d.finish_reason)]}
                if c.index == 0 and d.prompt_logprobs is not None:  # the first chunk, as non-streamed has them once
                    event["prompt_logprobs"] = _prompt_logprobs(ids, d.prompt_logprobs)
                await send_event(resp, event)
    except (*ENGINE_ERRORS, APIError) as e:
        await send_event(resp, (e if isinstance(e, APIError) else engine_error(e)).body())
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client went away during %s; aborted its generation", rid)
        raise
    await send_done(resp)
    await resp.write_eof()
    return resp
