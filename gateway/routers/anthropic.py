"""Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

The request is translated into chat messages (system prompt, text / tool_use / tool_result blocks)
and OpenAI-style tools, rendered with the model's chat template like a chat completion
(``serving.anthropic_plan``, which ``/v1/messages/render`` shows), and run through the serving layer.
Responses, stream events and errors take Anthropic's shapes, which the official ``anthropic`` SDK
parses. An assistant message last in ``messages`` is a prefill: the model continues its text.
``x-api-key`` and ``anthropic-version`` are accepted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from aiohttp import web
from pydantic import BaseModel

from ..errors import APIError, error_shape
from ..openai_schemas import parse
from ..openapi import JSON, SSE, error_schema, request_body, response
from ..serving.admission import admit
from ..serving.anthropic_plan import CountTokensRequest, MessagesRequest, messages_prompt, plan_messages
from ..serving.choices import Choice, collect, run_choices
from ..serving.engine_errors import ENGINE_ERRORS, engine_error
from ..serving.shapes import json_body
from ..serving.tools import ToolUse, arguments_dict, final_tool_calls
from ..sse import open_stream, send_event
from ..state import STATE, ModelState
from ..text.message import MessagePiece
from ..text.tool_parsers import ToolCall

log = logging.getLogger("zserve.gateway.anthropic")
routes = web.RouteTableDef()

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(err: APIError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error shape (``anthropic_error``), as /openapi.json describes it."""

    type: Literal["error"]
    error: AnthropicErrorDetail


error_schema(anthropic_error, AnthropicError)


# -- response shapes ------------------------------------------------------------------------------

def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_use_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": arguments_dict(call)}


def stop_reason(c: Choice, calls: list) -> tuple[str, str | None]:
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.stop_str is not None:
        return "stop_sequence", c.stop_str
    return ("tool_use" if calls else "end_turn"), None


def _usage(prompt_tokens: int, c: Choice) -> dict:
    # Anthropic counts prefix-cache hits apart: input = input_tokens + cache_read_input_tokens.
    return {"input_tokens": prompt_tokens - c.cached_tokens, "output_tokens": c.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": c.cached_tokens}


def full_message(rid: str, model: str, c: Choice, use: ToolUse, prompt_tokens: int) -> dict:
    content: list[dict] = []
    calls: list[ToolCall] = []
    if c.msg is not None:
        calls = final_tool_calls(use, c)
        reasoning = c.msg.reasoning_text()
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        text = c.msg.text()
        text = text.strip() if calls else text
    else:
        text = "".join(c.text)
    if text or not calls:
        content.append({"type": "text", "text": text})
    content += [tool_use_block(t) for t in calls]
    reason, seq = stop_reason(c, calls)
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": _usage(prompt_tokens, c)}


class BlockStream:
    """Anthropic's content blocks as a stream: open a block when its kind of output starts, close
    it when another kind begins or the message ends."""

    def __init__(self, resp: web.StreamResponse):
        self.resp = resp
        self.index = -1
        self.kind: str | None = None
        self.opened: set[str] = set()  # kinds of block opened so far
        self.pinged = False

    async def _open(self, kind: str, block: dict) -> None:
        await self.close()
        self.index += 1
        self.kind = kind
        self.opened.add(kind)
        await send_event(self.resp, {"type": "content_block_start", "index": self.index, "content_block": block},
                         "content_block_start")
        if not self.pinged:
            self.pinged = True
            await send_event(self.resp, {"type": "ping"}, "ping")

    async def _delta(self, delta: dict) -> None:
        await send_event(self.resp, {"type": "content_block_delta", "index": self.index, "delta": delta},
                         "content_block_delta")

    async def close(self) -> None:
        if self.kind is not None:
            if self.kind == "thinking":
                await self._delta({"type": "signature_delta", "signature": ""})
            await send_event(self.resp, {"type": "content_block_stop", "index": self.index}, "content_block_stop")
            self.kind = None

    async def empty_text(self) -> None:
        """The empty text block a message without text or tool calls still has (as ``full_message``)."""
        await self._open("text", {"type": "text", "text": ""})

    async def push(self, piece: MessagePiece) -> None:
        if piece.reasoning:
            if self.kind != "thinking":
                await self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            await self._delta({"type": "thinking_delta", "thinking": piece.reasoning})
        if piece.content:
            if self.kind != "text":
                await self._open("text", {"type": "text", "text": ""})
            await self._delta({"type": "text_delta", "text": piece.content})
        for t in piece.tool_calls:
            if t.id is not None:
                await self._open("tool_use", {"type": "tool_use", "id": tool_use_id(t.id), "name": t.name,
                                              "input": {}})
            if t.arguments:
                await self._delta({"type": "input_json_delta", "partial_json": t.arguments})


async def stream_message(request: web.Request, state: ModelState, rid: str, model: str, c: Choice, use: ToolUse,
                         prompt_tokens: int, opts) -> web.StreamResponse:
    resp = await open_stream(request)
    blocks = BlockStream(resp)
    started = False
    try:
        async for _, d in run_choices(state, rid, [c], opts):
            c.take(d)
            if not started:
                # Sent with the first output, when the engine has said how much of the prompt its prefix cache
                # held: message_start's usage then splits the input as message_delta and a non-streamed reply do.
                started = True
                start = {"id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
                         "stop_reason": None, "stop_sequence": None, "usage": {**_usage(prompt_tokens, c),
                                                                               "output_tokens": 0}}
                await send_event(resp, {"type": "message_start", "message": start}, "message_start")
            await blocks.push(c.piece(d))
        calls = final_tool_calls(use, c)
        if "text" not in blocks.opened and not calls:
            await blocks.empty_text()
        await blocks.close()
        if not blocks.pinged:
            await send_event(resp, {"type": "ping"}, "ping")
        reason, seq = stop_reason(c, calls)
        await send_event(resp, {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                                "usage": _usage(prompt_tokens, c)}, "message_delta")
        await send_event(resp, {"type": "message_stop"}, "message_stop")
    except (*ENGINE_ERRORS, APIError) as e:
        err = e if isinstance(e, APIError) else engine_error(e)
        await send_event(resp, anthropic_error(err), "error")
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client went away during %s; aborted its generation", rid)
        raise
    await resp.write_eof()
    return resp


# -- routes ---------------------------------------------------------------------------------------

@routes.post("/v1/messages")
@request_body(MessagesRequest)
@response(200, JSON, SSE)
@error_shape(anthropic_error)
async def messages(request: web.Request) -> web.StreamResponse:
    req: MessagesRequest = parse(MessagesRequest, await request.read())
    plan = await plan_messages(request.app[STATE], req)
    state, c, rid = plan.state, plan.choices[0], plan.request_id
    admit(state)
    if req.stream:
        return await stream_message(request, state, rid, req.model, c, plan.use, plan.prompt_tokens, plan.opts)
    await collect(state, rid, [c], plan.opts)
    return json_body(full_message(rid, req.model, c, plan.use, plan.prompt_tokens))


@routes.post("/v1/messages/count_tokens")
@request_body(CountTokensRequest)
@error_shape(anthropic_error)
async def count_tokens(request: web.Request) -> web.Response:
    req: CountTokensRequest = parse(CountTokensRequest, await request.read())
    state = request.app[STATE].for_model(req.model)
    prompt, _ = messages_prompt(state, req, counting=True)
    return web.json_response({"input_tokens": len(prompt.ids)})
