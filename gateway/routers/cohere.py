"""Cohere's v2 API: chat (``/cohere/v2/chat``, vLLM's path, and ``/v2/chat``, where the ``cohere`` SDK's
``ClientV2(base_url=...)`` sends it), what a chat would send to the engine (``/cohere/v2/chat/render``), and embed
(``/v2/embed``, served by an embedding model; Cohere's ``/v2/rerank`` is the pooling family's).

A chat body is translated into a chat completion (``gateway.cohere_schemas``) and planned and run by the same serving
code as ``/v1/chat/completions``; only the answer takes Cohere's shapes: one JSON body, or Cohere's stream events
(``message-start``, ``content-start``/``-delta``/``-end`` for text and reasoning, ``tool-call-start``/``-delta``/
``-end``, ``message-end`` with the finish reason and usage). Errors are Cohere's ``{"message": ...}`` with the
status the SDK maps to its exceptions (400 BadRequestError, 404 NotFoundError, 429 TooManyRequestsError, ...).
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from pydantic import BaseModel

from ..cohere_schemas import CohereChatRequest, CohereEmbedRequest, chat_request
from ..errors import APIError, bad_request, error_shape
from ..ids import random_hex
from ..openai_schemas import parse
from ..openapi import JSON, SSE, error_schema, request_body, response
from ..serving.admission import admit
from ..serving.choices import Choice, collect, run_choices
from ..serving.engine_errors import ENGINE_ERRORS, engine_error
from ..serving.plans import Plan, plan_chat
from ..serving.pooling import check_count, check_dimensions, encode_input, float32_base64, pool, pool_hello
from ..serving.shapes import json_body
from ..serving.tools import final_tool_calls
from ..sse import open_stream, send_event
from ..state import STATE
from ..text.message import MessagePiece
from ..text.token_text import TokenLogprob, TokenText, finite
from ..text.tool_parsers import ToolCall

log = logging.getLogger("zserve.gateway.cohere")
routes = web.RouteTableDef()


def cohere_error(err: APIError) -> dict:
    return {"message": err.message}


class CohereError(BaseModel):
    """Cohere's error body (``cohere_error``), as /openapi.json describes it."""

    message: str


error_schema(cohere_error, CohereError)


# -- answers --------------------------------------------------------------------------------------

def finish_reason(c: Choice, calls: list) -> str:
    if c.finish_reason == "length":
        return "MAX_TOKENS"
    if c.stop_reason is not None:
        return "STOP_SEQUENCE"
    return "TOOL_CALL" if calls else "COMPLETE"


def usage(prompt_tokens: int, c: Choice) -> dict:
    tokens = {"input_tokens": prompt_tokens, "output_tokens": c.completion_tokens}
    return {"billed_units": tokens, "tokens": tokens, "cached_tokens": c.cached_tokens}


def logprob_item(tt: TokenText, lps: list[TokenLogprob]) -> dict:
    """Cohere's logprobs of a run of tokens: their ids, their text and each one's logprob."""
    return {"token_ids": [lp.token_id for lp in lps], "text": "".join(tt(lp.token_id)[0] for lp in lps),
            "logprobs": [finite(lp.logprob) if lp.logprob is not None else None for lp in lps]}


def tool_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def full_message(plan: Plan, c: Choice, want_logprobs: bool) -> dict:
    """A whole answer: reasoning and text as content parts; with tool calls, the text before them is the plan."""
    calls: list[ToolCall] = final_tool_calls(plan.use, c) if c.msg is not None else []
    text = c.msg.text() if c.msg is not None else "".join(c.text)
    reasoning = c.msg.reasoning_text() if c.msg is not None else None
    content = [{"type": "thinking", "thinking": reasoning}] if reasoning else []
    message: dict = {"role": "assistant"}
    if calls:
        if text.strip():
            message["tool_plan"] = text.strip()
        message["tool_calls"] = [tool_call(t) for t in calls]
    else:
        content.append({"type": "text", "text": text})
    if content:
        message["content"] = content
    body = {"id": plan.request_id, "finish_reason": finish_reason(c, calls), "message": message,
            "usage": usage(plan.prompt_tokens, c)}
    if want_logprobs:
        body["logprobs"] = [logprob_item(plan.state.token_text, [lp]) for lp in c.logprobs]
    return body


class EventStream:
    """Cohere's stream events: a content part (text or thinking) opens when its kind of output starts and ends when
    another begins; each tool call is a start, argument deltas and an end."""

    def __init__(self, resp: web.StreamResponse):
        self.resp = resp
        self.open: str | None = None  # "text", "thinking" or "tool"
        self.content = self.calls = -1  # the index of the last content part, of the last tool call

    async def send(self, event: dict) -> None:
        await send_event(self.resp, event, event["type"])

    async def close(self) -> None:
        if self.open is not None:
            kind, index = ("tool-call", self.calls) if self.open == "tool" else ("content", self.content)
            await self.send({"type": f"{kind}-end", "index": index})
            self.open = None

    async def part(self, kind: str, text: str, logprobs: dict | None = None) -> None:
        if self.open != kind:
            await self.close()
            self.open, self.content = kind, self.content + 1
            await self.send({"type": "content-start", "index": self.content,
                             "delta": {"message": {"content": {"type": kind, kind: ""}}}})
        event = {"type": "content-delta", "index": self.content, "delta": {"message": {"content": {kind: text}}}}
        await self.send({**event, "logprobs": logprobs} if logprobs else event)

    async def push(self, piece: MessagePiece, logprobs: dict | None) -> None:
        if piece.reasoning:
            await self.part("thinking", piece.reasoning)
        if piece.content:
            await self.part("text", piece.content, logprobs)
        for t in piece.tool_calls:
            if t.id is not None:
                await self.close()
                self.open, self.calls = "tool", self.calls + 1
                await self.send({"type": "tool-call-start", "index": self.calls, "delta": {"message": {"tool_calls": {
                    "id": t.id, "type": "function", "function": {"name": t.name, "arguments": ""}}}}})
            if t.arguments:
                await self.send({"type": "tool-call-delta", "index": self.calls,
                                 "delta": {"message": {"tool_calls": {"function": {"arguments": t.arguments}}}}})


async def stream_chat(request: web.Request, plan: Plan, want_logprobs: bool) -> web.StreamResponse:
    """The answer as Cohere's events; a failure after the stream opened ends it with finish reason ERROR."""
    resp = await open_stream(request)
    events = EventStream(resp)
    c, rid = plan.choices[0], plan.request_id
    await events.send({"type": "message-start", "id": rid, "delta": {"message": {
        "role": "assistant", "content": [], "tool_plan": "", "tool_calls": [], "citations": []}}})
    try:
        async for _, d in run_choices(plan.state, rid, [c], plan.opts):
            c.take(d)
            lps = logprob_item(plan.state.token_text, d.logprobs) if want_logprobs and d.logprobs else None
            await events.push(c.piece(d), lps)
        calls = final_tool_calls(plan.use, c) if c.msg is not None else []
        await events.close()
        end = {"finish_reason": finish_reason(c, calls), "usage": usage(plan.prompt_tokens, c)}
    except (*ENGINE_ERRORS, APIError) as e:
        err = e if isinstance(e, APIError) else engine_error(e)
        end = {"finish_reason": "ERROR", "error": err.message}
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client went away during %s; aborted its generation", rid)
        raise
    await events.send({"type": "message-end", "id": rid, "delta": end})
    await resp.write_eof()
    return resp


# -- routes ---------------------------------------------------------------------------------------

async def _plan(request: web.Request) -> tuple[CohereChatRequest, Plan]:
    req: CohereChatRequest = parse(CohereChatRequest, await request.read())
    return req, await plan_chat(request.app[STATE], chat_request(req))


@routes.post("/cohere/v2/chat")
@routes.post("/v2/chat")
@request_body(CohereChatRequest)
@response(200, JSON, SSE)
@error_shape(cohere_error)
async def chat(request: web.Request) -> web.StreamResponse:
    req, plan = await _plan(request)
    admit(plan.state)
    if req.stream:
        return await stream_chat(request, plan, req.logprobs)
    await collect(plan.state, plan.request_id, plan.choices, plan.opts)
    return json_body(full_message(plan, plan.choices[0], req.logprobs))


@routes.post("/cohere/v2/chat/render")
@request_body(CohereChatRequest)
@error_shape(cohere_error)
async def render_chat(request: web.Request) -> web.Response:
    """What a Cohere chat would send to the engine (as ``/v1/chat/completions/render`` shows a chat completion)."""
    _, plan = await _plan(request)
    return json_body(plan.render(0))


@routes.post("/v2/embed")
@request_body(CohereEmbedRequest)
@error_shape(cohere_error)
async def embed(request: web.Request) -> web.Response:
    """Cohere's embed of ``texts``: ``embedding_types`` float and base64 (float32, little-endian); ``truncate`` END
    keeps each text's first tokens (``max_tokens`` of them, or what the model takes), NONE refuses a longer one."""
    req: CohereEmbedRequest = parse(CohereEmbedRequest, await request.read())
    if req.images or req.inputs or not req.texts:
        raise bad_request("this server embeds texts: give texts (images and inputs are not supported)", param="texts")
    unsupported = sorted(set(req.embedding_types) - {"float", "base64"})
    if unsupported:
        raise bad_request(f"embedding_types {unsupported} are not supported here: float or base64",
                          param="embedding_types")
    if req.truncate == "START":
        raise bad_request("truncate START is not supported here: END or NONE", param="truncate")
    state = request.app[STATE].for_model(req.model, "embed")
    check_count(len(req.texts), "texts")
    hello = pool_hello(state, "embed", len(req.texts), "texts")
    check_dimensions(hello, req.output_dimension, "output_dimension")
    cap = min(req.max_tokens or hello.max_model_len, hello.max_model_len)
    truncate = cap if req.truncate == "END" else None
    ids = [encode_input(state, t, cap, truncate, "texts") for t in req.texts]
    rid = f"embed-{random_hex()}"
    outs = await pool(state, rid, ids, "embed", None, req.output_dimension)
    shapes = {"float": lambda v: list(v), "base64": float32_base64}
    embeddings = {kind: [shapes[kind](o.data) for o in outs] for kind in dict.fromkeys(req.embedding_types)}
    tokens = sum(o.num_prompt_tokens for o in outs)
    return json_body({"id": rid, "response_type": "embeddings_by_type", "embeddings": embeddings, "texts": req.texts,
                      "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens}}})
