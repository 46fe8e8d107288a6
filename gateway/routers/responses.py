"""OpenAI Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel``.

A response is a chat turn: ``input`` (a string, or message / function_call / function_call_output
items) after the conversation of ``previous_response_id``, with ``instructions`` as the system
prompt of this turn only. Its output items (reasoning, message, function_call) come from the same
``MessageParser`` as chat completions.

Stored responses (``store``, on by default) live in the store every gateway shares
(``gateway.store``), so a response created through one gateway process is fetched, chained and
cancelled through any other. A response whose id the client learns while it is generated
(``background``, or ``stream``: the id comes in ``response.created``) is written ``in_progress``
before generation starts; the gateway generating it polls the store and stops when another gateway
marked it ``cancelled``, and writes its result only if it was not. A plain request's id is known
only with its answer, so it is written once, finished. ``background: true`` answers at once and
generates in this gateway's event loop; the client polls ``GET``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import ConfigDict, Field

from .. import structured
from ..errors import APIError, bad_request
from ..ids import random_hex
from ..openai_schemas import RequestBody, parse, parse_query
from ..openapi import JSON, SSE, query, request_body, response
from ..serving.admission import admit
from ..serving.choices import run_choices
from ..serving.engine_errors import ENGINE_ERRORS, engine_error
from ..serving.responses_plan import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
    conversation,
    load_response,
    plan_response,
    store_call,
)
from ..serving.shapes import json_body
from ..serving.tools import final_tool_calls
from ..sse import encode_event, open_stream
from ..state import STATE, ModelState
from ..store import StoreUnavailable
from ..tenancy import SERVED, Served
from ..text.message import MessagePiece
from ..text.token_text import TokenLogprob

log = logging.getLogger("zserve.gateway.responses")
routes = web.RouteTableDef()

CANCEL_POLL_S = 0.25  # how soon a generating gateway notices a cancel made through another one
LIVE = ("queued", "in_progress")
_background_tasks: set[asyncio.Task] = set()


# -- request schema -------------------------------------------------------------------------------

class InputItemsQuery(RequestBody):
    """The query of ``GET /v1/responses/{id}/input_items``: OpenAI's paging of input items."""

    model_config = ConfigDict(extra="ignore")

    order: Literal["asc", "desc"] = "desc"
    limit: Annotated[int, Field(ge=1, le=100)] = 20
    after: str | None = None


# -- input → chat ---------------------------------------------------------------------------------

def input_items(items: str | list) -> list[dict]:
    """This turn's input as the API lists it (``GET /v1/responses/{id}/input_items``), each with an id."""
    if isinstance(items, str):
        items = [MessageItem(role="user", content=items)]
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            content = [{"type": "input_text", "text": item.content}] if isinstance(item.content, str) else item.content
            out.append({"type": "message", "id": _new_id("msg"), "role": item.role, "status": "completed",
                        "content": content})
        elif isinstance(item, FunctionCallItem):
            out.append({"type": "function_call", "id": _new_id("fc"), "call_id": item.call_id, "name": item.name,
                        "arguments": item.arguments, "status": "completed"})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"type": "function_call_output", "id": _new_id("fco"), "call_id": item.call_id,
                        "output": item.output, "status": "completed"})
    return out


# -- the response object --------------------------------------------------------------------------

def _new_id(prefix: str) -> str:
    return f"{prefix}_{random_hex()}"


def text_config(req: ResponsesRequest) -> dict:
    """The response's ``text`` field: the request's, with its format (``{"type": "text"}`` by default)."""
    text = dict(req.text or {})
    text["format"] = text.get("format") or {"type": "text"}
    return text


def response_object(rid: str, model: str, req: ResponsesRequest, status: str, created: float) -> dict:
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": model,
        "output": [], "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id, "store": req.store, "background": req.background,
        "metadata": req.metadata or {}, "text": text_config(req), "truncation": "disabled",
        "top_logprobs": req.top_logprobs, "user": req.user, "usage": None,
    }


class OutputBuilder:
    """Folds message pieces into Responses output items, emitting the stream events as it goes.

    An item opens when its kind of output starts (reasoning, message text, a function call) and is
    done when another begins or the output ends; non-streamed responses use the same builder with
    no listener, so both paths build the same items.

    Logprobs (``include`` of the output text's) go with the text their tokens wrote, token by token
    (``Choice.pieces``): a token's go out with its output text; the tokens of reasoning or of a call have none (nor
    do those that write nothing while one is open: ``</think>``); those of held-back text (a parser waiting to see
    what it is) go with the text when it comes, and the end's (the EOS token) close the message. What one push adds
    to an item goes out as one delta event.
    """

    def __init__(self, emit: Callable[[str, dict], Awaitable[None]] | None):
        self.emit = emit
        self.items: list[dict] = []
        self.open: dict | None = None
        self.pending: list[dict] = []  # logprobs of tokens whose text has not come out yet
        self.unsent = ""  # what this push added to the open item, not yet in a delta event
        self.unsent_logprobs: list[dict] = []

    async def _event(self, kind: str, **fields: Any) -> None:
        if self.emit is not None:
            await self.emit(kind, fields)

    async def _start(self, item: dict) -> None:
        await self.close()
        self.items.append(item)
        self.open = item
        await self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))
        if item["type"] == "message":
            await self._event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})

    async def push(self, pieces: list[tuple[MessagePiece, list[dict] | None]]) -> None:
        """One delta's parts, each with the logprob entries of the tokens that wrote it (``Choice.pieces``)."""
        for piece, logprobs in pieces:
            await self._add(piece, logprobs)
        await self._send()

    async def _add(self, piece: MessagePiece, logprobs: list[dict] | None) -> None:
        if logprobs:
            self.pending.extend(logprobs)
        if not piece.content and (piece.reasoning or piece.tool_calls
                                  or (self.open is not None and self.open["type"] != "message")):
            self.pending = []  # those tokens wrote reasoning or a call, not output text
        if piece.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                await self._start({"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": [],
                                   "status": "in_progress", "_text": ""})
            self.open["_text"] += piece.reasoning
            self.unsent += piece.reasoning
        if piece.content:
            if self.open is None or self.open["type"] != "message":
                await self._start(_message_item())
            self.open["_text"] += piece.content
            lps, self.pending = self.pending, []
            self.open["_logprobs"].extend(lps)
            self.unsent += piece.content
            self.unsent_logprobs.extend(lps)
        for t in piece.tool_calls:
            if t.id is not None:
                await self._start({"type": "function_call", "id": _new_id("fc"), "call_id": t.id, "name": t.name,
                                   "arguments": "", "status": "in_progress"})
            if t.arguments:
                self.open["arguments"] += t.arguments
                self.unsent += t.arguments

    async def _send(self) -> None:
        """The open item's delta event: what was added to it since the last one."""
        item, text, lps = self.open, self.unsent, self.unsent_logprobs
        if item is None or not (text or lps):
            return
        self.unsent, self.unsent_logprobs = "", []
        i = len(self.items) - 1
        if item["type"] == "message":
            await self._event("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0,
                              delta=text, logprobs=lps)
        elif item["type"] == "reasoning":
            await self._event("response.reasoning_text.delta", item_id=item["id"], output_index=i, content_index=0,
                              delta=text)
        else:
            await self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                              delta=text)

    async def close(self, status: str = "completed") -> None:
        item = self.open
        if item is None:
            return
        if item["type"] == "message" and self.pending:
            # The last tokens' (the EOS token's): they wrote nothing, but were generated here.
            item["_logprobs"].extend(self.pending)
            self.unsent_logprobs.extend(self.pending)
            self.pending = []
        await self._send()
        self.open = None
        i = self.items.index(item)
        item["status"] = status
        if item["type"] == "message":
            text = item.pop("_text")
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": item.pop("_logprobs")}
            item["content"] = [part]
            await self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                              text=text, logprobs=part["logprobs"])
            await self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                              part=part)
        elif item["type"] == "reasoning":
            text = item.pop("_text")
            item["content"] = [{"type": "reasoning_text", "text": text}]
            await self._event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                              text=text)
        else:
            await self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                              arguments=item["arguments"], name=item["name"])
        await self._event("response.output_item.done", output_index=i, item=item)

    async def finish(self, status: str) -> list[dict]:
        if not self.items or (self.open is None and all(i["type"] == "reasoning" for i in self.items)):
            if self.open is None or self.open["type"] != "message":
                await self._start(_message_item())
        await self.close(status)
        return self.items


def _message_item() -> dict:
    """A new output message; the builder's accumulators are its ``_`` keys (never sent: ``_public``)."""
    return {"type": "message", "id": _new_id("msg"), "status": "in_progress", "role": "assistant", "content": [],
            "_text": "", "_logprobs": []}


def assistant_turn(items: list[dict]) -> dict:
    """The output as one chat-template message, for chaining the next response onto it."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    msg: dict = {"role": "assistant", "content": text}
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    if calls:
        msg["tool_calls"] = calls
    return msg


# -- generation -----------------------------------------------------------------------------------

class Turn:
    """One response being generated: its request, prompt, choice and the object clients see."""

    def __init__(self, state: ModelState, req: ResponsesRequest, model: str, history: list[dict]):
        self.state, self.req, self.model = state, req, model
        planned = plan_response(state, req, history)
        self.rid = planned.plan.request_id
        self.created = time.time()
        self.messages = planned.messages
        self.input_items = input_items(req.input)
        self.use, self.opts, self.choice = planned.plan.use, planned.plan.opts, planned.plan.choices[0]
        self.logprobs = planned.logprobs
        self.constraint = planned.constraint  # checked (compiled) by the caller before the turn runs
        self.obj = response_object(self.rid, model, req, "in_progress", self.created)

    def output_logprobs(self, lps: list[TokenLogprob] | None) -> list[dict] | None:
        """OpenAI's logprob entries of a delta's tokens, when the request includes them."""
        return self.state.token_text.entries(lps) if lps and self.logprobs is not None else None

    @property
    def announced(self) -> bool:
        """Whether the client learns the id while the response is generated (background: at once;
        streamed: in response.created), so it is stored in_progress first and can be cancelled."""
        return self.req.background or self.req.stream

    def usage(self) -> dict:
        c = self.choice
        n_in = len(c.prompt_ids)
        return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": c.cached_tokens},
                "output_tokens": c.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": n_in + c.completion_tokens}

    async def generate(self, builder: OutputBuilder) -> dict:
        """Run to the end and return the final response object (completed, incomplete or failed)."""
        c = self.choice
        status, error = "completed", None
        try:
            async for _, d in run_choices(self.state, self.rid, [c], self.opts):
                c.take(d)
                await builder.push([(piece, self.output_logprobs(lps)) for piece, lps in c.pieces(d)])
            final_tool_calls(self.use, c)  # raises if a forced call is missing
        except (*ENGINE_ERRORS, APIError) as e:
            err = e if isinstance(e, APIError) else engine_error(e)
            status, error = "failed", {"code": "server_error", "message": err.message}
        if status == "completed" and c.finish_reason == "length":
            status = "incomplete"
        items = await builder.finish("incomplete" if status == "incomplete" else "completed")
        obj = {**self.obj, "status": status, "output": items, "error": error, "usage": self.usage(),
               "completed_at": time.time() if status == "completed" else None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}
        return obj

    def record(self, obj: dict) -> dict:
        """What the store keeps: the object, this turn's input items, and (once it can be continued:
        completed, or cut by max_output_tokens) the conversation a next turn chains onto."""
        done = obj["status"] in ("completed", "incomplete")
        messages = self.messages + [assistant_turn(obj["output"])] if done else None
        return {"status": obj["status"], "response": obj, "messages": messages, "input_items": self.input_items}

    async def run(self, builder: OutputBuilder) -> dict:
        """Generate, watching the store for a cancel from any gateway; store the result.

        A background response whose record was deleted (or expired) stops too: nobody can read its result, and
        it would hold an engine slot until max_output_tokens. A streamed one goes on: its client still reads."""
        store = self.state.responses
        if not self.req.store:
            return await self.generate(builder)
        if not self.announced:  # nobody knows the id before the answer: one write, at the end
            obj = await self.generate(builder)
            await store_call(store.put(self.rid, self.record(obj)))
            return obj
        gen = asyncio.create_task(self.generate(builder))
        cancelled = False
        try:
            while not gen.done():
                done, _ = await asyncio.wait({gen}, timeout=CANCEL_POLL_S)
                if done:
                    break
                try:
                    current = await store.get(self.rid)
                except StoreUnavailable:
                    continue  # keep generating; the result is written when the store is back
                gone = current is None and self.req.background
                if gone or (current is not None and current.get("status") == "cancelled"):
                    cancelled = True
                    gen.cancel()
                    break
            if cancelled:
                await asyncio.gather(gen, return_exceptions=True)
                log.info("response %s was %s through the store; generation stopped", self.rid,
                         "deleted" if current is None else "cancelled")
                return {**self.obj, "status": "cancelled", "usage": self.usage()}
            obj = await gen
        except BaseException as e:
            # The client went away (the handler is cancelled, or a stream write failed), the gateway
            # is stopping, or a bug: nobody will write this response's result, so end its record
            # rather than leave it in_progress until it expires.
            if not gen.done():
                gen.cancel()
            await self._abandon(e)
            raise
        ok, current = await store_call(store.transition(self.rid, LIVE, self.record(obj)))
        if not ok and current is not None:  # cancelled between the last poll and the end
            return current["response"]
        return obj

    async def _abandon(self, e: BaseException) -> None:
        gone = isinstance(e, (asyncio.CancelledError, ConnectionResetError))
        obj = {**self.obj, "status": "cancelled" if gone else "failed", "usage": self.usage(),
               "error": None if gone else {"code": "server_error", "message": "internal error"}}
        patch = {"status": obj["status"], "response": obj, "messages": None}
        try:  # shielded: a second cancellation must not leave the record half-decided
            await asyncio.shield(self.state.responses.transition(self.rid, LIVE, patch))
        except (asyncio.CancelledError, StoreUnavailable, ValueError) as err:
            log.warning("response %s stopped (%s) but its record could not be ended: %r", self.rid,
                        type(e).__name__, err)


async def _background(turn: Turn, served: Served | None) -> None:
    """Run a background response to its end; its tenant's concurrency slot (``served``, kept for it) is held until
    then, not only while the HTTP request that started it was open."""
    try:
        await turn.run(OutputBuilder(None))
    except Exception:  # noqa: BLE001 - a background response must never take the gateway down
        log.exception("background response %s failed", turn.rid)
        obj = {**turn.obj, "status": "failed", "error": {"code": "server_error", "message": "internal error"}}
        try:
            await turn.state.responses.transition(turn.rid, LIVE, turn.record(obj))
        except Exception:  # noqa: BLE001
            pass
    finally:
        if served is not None:
            served.ended()


async def _stream(request: web.Request, turn: Turn) -> web.StreamResponse:
    resp = await open_stream(request)
    seq = 0
    pending: list[bytes] = []

    async def emit(kind: str, fields: dict, flush: bool = False) -> None:
        # Events that frame the text (item added, part added, done events) travel in one write with
        # the next delta or the end: a third fewer writes per stream, and no delta waits for them.
        nonlocal seq
        pending.append(encode_event({"type": kind, "sequence_number": seq, **_public(fields)}, kind))
        seq += 1
        if flush or kind.endswith(".delta"):
            await resp.write(b"".join(pending))
            pending.clear()

    await emit("response.created", {"response": turn.obj})
    await emit("response.in_progress", {"response": turn.obj}, flush=True)
    try:
        obj = await turn.run(OutputBuilder(emit))
        final = {"completed": "response.completed", "incomplete": "response.incomplete",
                 "failed": "response.failed"}.get(obj["status"])
        if final is None:  # cancelled through another gateway
            await emit("error", {"code": "response_cancelled", "message": f"response {turn.rid} was cancelled",
                                 "param": None}, flush=True)
        else:
            await emit(final, {"response": obj}, flush=True)
    except APIError as e:
        await emit("error", {"code": e.code or e.type, "message": e.message, "param": e.param}, flush=True)
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client went away during %s; aborted its generation", turn.rid)
        raise
    await resp.write_eof()
    return resp


def _public(fields: dict) -> dict:
    """Event payloads without the builder's private accumulators."""
    item = fields.get("item")
    if isinstance(item, dict) and "_text" in item:
        fields = {**fields, "item": {k: v for k, v in item.items() if not k.startswith("_")}}
    return fields


# -- routes ---------------------------------------------------------------------------------------

@routes.post("/v1/responses")
@request_body(ResponsesRequest)
@response(200, JSON, SSE)
async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req: ResponsesRequest = parse(ResponsesRequest, await request.read())
    state = state.for_model(req.model, "generate")
    model = state.name
    if req.background and not req.store:
        raise bad_request("background responses must be stored (store: true)", param="background")
    if req.background and req.stream:
        raise bad_request("streaming a background response is not supported; poll GET /v1/responses/{id}",
                          param="stream")
    history = await conversation(state.gateway, req)
    turn = Turn(state, req, model, history)
    await structured.check(turn.constraint, state.tokenizer)
    admit(state)
    if req.store and turn.announced:
        await store_call(state.responses.put(turn.rid, turn.record(turn.obj)))
    if req.background:
        if (served := SERVED.get()) is not None:
            served.keep()
        task = asyncio.create_task(_background(turn, served))
        _background_tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(_background_tasks.discard)
        return json_body(turn.obj)
    if req.stream:
        return await _stream(request, turn)
    return json_body(await turn.run(OutputBuilder(None)))


@routes.get("/v1/responses/{response_id}")
async def get_response(request: web.Request) -> web.Response:
    record = await load_response(request.app[STATE], request.match_info["response_id"])
    return json_body(record["response"])


@routes.get("/v1/responses/{response_id}/input_items")
@query(InputItemsQuery)
async def list_input_items(request: web.Request) -> web.Response:
    """A stored response's input items, paged as OpenAI pages them (``order``, ``limit``, ``after``)."""
    q: InputItemsQuery = parse_query(InputItemsQuery, request.query)
    items = list((await load_response(request.app[STATE], request.match_info["response_id"])).get("input_items") or [])
    if q.order == "desc":
        items.reverse()
    if q.after is not None:
        ids = [i["id"] for i in items]
        if q.after not in ids:
            raise bad_request(f"no input item {q.after!r} in this response", param="after")
        items = items[ids.index(q.after) + 1:]
    page = items[:q.limit]
    return json_body({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                      "last_id": page[-1]["id"] if page else None, "has_more": len(items) > q.limit})


@routes.delete("/v1/responses/{response_id}")
async def delete_response(request: web.Request) -> web.Response:
    """Forget a stored response. An in-progress background one stops generating (its gateway sees the record gone
    within ``CANCEL_POLL_S``); a streamed one goes on to its client, and its result is not stored."""
    rid = request.match_info["response_id"]
    if not await store_call(request.app[STATE].responses.delete(rid)):
        raise APIError(404, f"Response with id '{rid}' not found.", code="response_not_found")
    return web.json_response({"id": rid, "object": "response", "deleted": True})


@routes.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: web.Request) -> web.Response:
    state = request.app[STATE]
    rid = request.match_info["response_id"]
    record = await load_response(state, rid)
    patch = {"status": "cancelled", "response": {**record["response"], "status": "cancelled"}, "messages": None}
    ok, current = await store_call(state.responses.transition(rid, LIVE, patch))
    if not ok:
        if current is None:
            raise APIError(404, f"Response with id '{rid}' not found.", code="response_not_found")
        if current.get("status") == "cancelled":
            return json_body(current["response"])
        raise bad_request(f"Cannot cancel a response with status '{current.get('status')}': only queued or "
                          "in-progress responses can be cancelled.")
    return json_body(current["response"])
