"""Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

The request is translated into chat messages (system prompt, text / tool_use / tool_result blocks)
and OpenAI-style tools, rendered with the model's chat template like a chat completion, and run
through the serving layer (``gateway.serving``). Responses, stream events and errors take Anthropic's
shapes, which the official ``anthropic`` SDK parses. An assistant message last in ``messages`` is a
prefill: the model continues its text. ``x-api-key`` and ``anthropic-version`` are accepted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .. import structured
from ..errors import APIError, bad_request, error_shape
from ..ids import random_hex
from ..openai_schemas import MAX_STOP, MAX_STOP_LEN, MAX_TOOLS, MAX_TOP_K, RequestBody, SamplingFields, parse
from ..openapi import JSON, SSE, error_schema, request_body, response
from ..serving.admission import admit
from ..serving.choices import Choice, collect, run_choices
from ..serving.engine_errors import ENGINE_ERRORS, engine_error
from ..serving.prompts import ChatPrompt, chat_prompt, check_prompt_ids
from ..serving.sampling import build_sampling, text_options
from ..serving.shapes import json_body
from ..serving.tools import NO_TOOLS, ToolUse, arguments_dict, final_tool_calls, message_parser, tool_use
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


# -- request schema -------------------------------------------------------------------------------

class _Block(RequestBody):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(RequestBody):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(RequestBody):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(RequestBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(RequestBody):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[Annotated[str, Field(max_length=MAX_STOP_LEN)]] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K)] | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    def sampling_fields(self) -> SamplingFields:
        stops = [s for s in self.stop_sequences or [] if s]
        return SamplingFields.model_construct(temperature=self.temperature, top_p=self.top_p,
                                              top_k=self.top_k or None, stop=stops)


# -- request → chat ------------------------------------------------------------------------------

def _text(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(b.text for b in content)


def chat_messages(req: CountTokensRequest) -> list[dict]:
    """Anthropic's conversation as chat-template messages: tool_use blocks become an assistant's
    tool_calls, tool_result blocks become tool messages (before the user's text of that turn)."""
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts = [b.text for b in m.content if isinstance(b, TextBlock)]
        if m.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            msg: dict = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
            elif isinstance(b, ToolUseBlock):
                raise bad_request("tool_use blocks belong to assistant messages", param="messages")
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tools(req: CountTokensRequest) -> list[dict] | None:
    if not req.tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in req.tools]


def _tool_use(state: ModelState, req: CountTokensRequest, tools: list[dict] | None) -> ToolUse:
    tc = req.tool_choice
    if tc is None:
        return tool_use(state, tools, "auto")
    mode = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[tc.type]
    if mode in ("required", "function") and not tools:  # named as the client wrote it, not as ToolUse names it
        raise bad_request(f'tool_choice of type "{tc.type}" needs tools', param="tool_choice")
    if mode == "function" and not tc.name:
        raise bad_request('tool_choice of type "tool" needs a name', param="tool_choice")
    return tool_use(state, tools, mode, tc.name, parallel=not tc.disable_parallel_tool_use)


def _prompt(state: ModelState, req: CountTokensRequest, counting: bool = False) -> tuple[ChatPrompt, ToolUse]:
    tools = _tools(req)
    # Counting renders the tools whether or not this server can parse calls (nothing is generated).
    use = NO_TOOLS if counting and state.tool_parser is None else _tool_use(state, req, tools)
    messages = chat_messages(req)
    prefill = req.messages[-1].role == "assistant"  # Anthropic's prefill: continue the assistant's text
    if prefill and messages[-1].get("tool_calls"):
        raise bad_request("the final assistant message cannot hold tool_use blocks", param="messages")
    prompt = chat_prompt(state, messages, tools=tools, use=use, add_generation_prompt=not prefill,
                         continue_final_message=prefill)
    return prompt, use


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
    state = request.app[STATE].for_model(req.model, "generate")
    prompt, use = _prompt(state, req)
    max_tokens = check_prompt_ids(state, prompt.ids, req.max_tokens, param="messages")
    fields = req.sampling_fields()
    constraint = await structured.check(prompt.forced, state.tokenizer)  # a forced call follows the input_schema
    c = Choice(0, prompt.ids, build_sampling(state, fields, max_tokens, None, 0, structured=constraint),
               msg=message_parser(state, use, prompt.prefill))
    rid = f"msg_{random_hex()}"
    admit(state)
    if req.stream:
        return await stream_message(request, state, rid, req.model, c, use, len(prompt.ids), text_options(fields))
    await collect(state, rid, [c], text_options(fields))
    return json_body(full_message(rid, req.model, c, use, len(prompt.ids)))


@routes.post("/v1/messages/count_tokens")
@request_body(CountTokensRequest)
@error_shape(anthropic_error)
async def count_tokens(request: web.Request) -> web.Response:
    req: CountTokensRequest = parse(CountTokensRequest, await request.read())
    state = request.app[STATE].for_model(req.model)
    prompt, _ = _prompt(state, req, counting=True)
    return web.json_response({"input_tokens": len(prompt.ids)})
