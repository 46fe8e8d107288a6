"""The OpenAI completions and chat-completions answers, whole or streamed, from a request's choices.

``respond`` runs a plan's choices and shapes what they write as the OpenAI API does (``CompletionShape``,
``ChatShape``): one JSON body, or an SSE stream written from the engine reader (``sse.EventWriter``). The
choices' deltas come from the engines, or from a ``/inference/v1/generate`` answer replayed through the
same text pipeline (``serving.replay``: the derender routes), so both answer with one shaping code.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from aiohttp import web

from ..errors import APIError
from ..generation import Delta, TextOptions
from ..openai_schemas import ChatCompletionRequest, CompletionRequest
from ..sse import ENGINE_HEADER, EventWriter, open_stream
from ..state import ModelState
from ..text.token_text import TextOffsets, TokenLogprob, TokenText, finite
from ..text.tool_parsers import ToolCall, ToolCallDelta
from .admission import admit
from .choices import Choice, ChoiceRun, collect
from .engine_errors import ENGINE_ERRORS, engine_error
from .plans import Plan
from .replay import Replay
from .shapes import json_body
from .tools import ToolUse, final_tool_calls

log = logging.getLogger("zserve.gateway.openai")


def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    completion_tokens = sum(c.completion_tokens for c in choices)
    per_prompt: dict[int, int] = {}  # choices of one prompt share its id list
    for c in choices:
        per_prompt[id(c.prompt_ids)] = max(per_prompt.get(id(c.prompt_ids), 0), c.cached_tokens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(per_prompt.values())}}


def chat_logprobs(tt: TokenText, lps: list[TokenLogprob]) -> dict:
    return {"content": tt.entries(lps), "refusal": None}


def prompt_logprobs(tt: TokenText, c: Choice) -> list | None:
    """vLLM's ``prompt_logprobs`` of a choice's prompt, when the engine scored it."""
    return None if c.prompt_logprobs is None else tt.prompt_logprobs(c.prompt_logprobs)


def echo_entries(c: Choice) -> list[TokenLogprob]:
    """The prompt's tokens as logprob entries (the first one unscored), for echo + logprobs."""
    return [TokenLogprob(c.prompt_ids[0], None, None), *(c.prompt_logprobs or [])]


def completion_logprobs(tt: TokenText, lps: list[TokenLogprob], offsets: list[int]) -> dict:
    tokens, token_lps, tops = [], [], []
    for lp in lps:
        tokens.append(tt(lp.token_id)[0])
        token_lps.append(None if lp.logprob is None else finite(lp.logprob))
        tops.append({tt(t)[0]: finite(v) for t, v in lp.top} if lp.top else None)  # None for an unscored token
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def respond(request: web.Request, state: ModelState, *, request_id: str, model: str, choices: list[Choice],
                  opts: TextOptions, prompt_tokens: int, stream: bool, shape: Shape, include_usage: bool = False,
                  continuous_usage: bool = False, replay: Replay | None = None) -> web.StreamResponse:
    """The answer of ``choices``, run on the engines, or with ``replay`` replayed from a generate answer (the
    derender routes: no engine, no admission)."""
    if replay is None:
        several_prompts = any(c.prompt_ids is not choices[0].prompt_ids for c in choices)  # prompt i's n share ids
        admit(state, parts=len(choices), param="prompt" if several_prompts else "n",
              what="choices (one per prompt and n)" if several_prompts else "choices (n)")
    created = int(time.time())
    if not stream:
        used = ""
        if replay is None:
            used = await collect(state, request_id, choices, opts)
        else:
            await replay.run(Choice.collect)
        body = shape.full(request_id, created, model, choices, usage(prompt_tokens, choices))
        return json_body(body, headers={ENGINE_HEADER: used} if used else None)

    head = shape.chunk_head(request_id, created, model)
    events: EventWriter | None = None
    early: list[bytes] = []  # what the engines wrote before the stream opened

    no_usage = b',"usage":null}' if include_usage else b"}"

    def chunk(entries: bytes, usage_: dict | None = None) -> bytes:
        """A chunk's JSON, from the bytes every chunk of the stream starts with and the JSON of its choices."""
        if continuous_usage:
            usage_ = usage(prompt_tokens, choices)
        if usage_ is None:
            return head + entries + no_usage
        return head + entries + b',"usage":' + orjson.dumps(usage_) + b"}"

    def on_delta(c: Choice, d: Delta) -> None:  # run by the engine reader, for each engine output
        c.take(d)
        entries = shape.delta_json(c, d)
        if entries is not None:
            if events is None:
                early.append(chunk(entries))
            else:
                events.data(chunk(entries))

    # The choices go to their engines before the stream opens, so its headers can say which (ENGINE_HEADER); a
    # failure to send them is still written as the stream's error event, as one that comes later is.
    run = failed = None
    if replay is None:
        run = ChoiceRun(state, request_id, choices, opts, on_delta)
        try:
            run.start()
        except (*ENGINE_ERRORS, APIError) as e:
            failed = e
    try:
        resp = await open_stream(request, {ENGINE_HEADER: run.engines_used} if run and run.engines_used else None)
        events = EventWriter(request, resp)
        for c in choices:
            first = shape.first_chunk(c)
            if first is not None:
                events.data(chunk(orjson.dumps([first])))
        for data in early:
            events.data(data)
        if failed is not None:
            raise failed
        if run is None:
            await replay.run(on_delta)  # type: ignore[union-attr]
        else:
            await events.until(run.done)
        if include_usage:
            events.data(chunk(b"[]", usage(prompt_tokens, choices)))
    except (*ENGINE_ERRORS, APIError) as e:
        events.send((e if isinstance(e, APIError) else engine_error(e)).body())  # type: ignore[union-attr]
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client went away during %s; aborted its generation", request_id)
        raise
    finally:
        if run is not None:
            run.cancel()
    await events.close()
    return resp


class Shape:
    """How one route lays out its response bodies and stream chunks."""

    object_full = ""
    object_chunk = ""

    def __init__(self, tt: TokenText, want_logprobs: bool):
        self.tt = tt
        self.want_logprobs = want_logprobs

    def chunk_head(self, rid: str, created: int, model: str) -> bytes:
        """The JSON every chunk of one stream starts with, up to its choices (made once per stream): a chunk is
        ``{"id", "object", "created", "model", "choices": [...]}`` and, when the client asked for usage,
        ``"usage"`` (null but in the last chunk, unless usage is continuous)."""
        return orjson.dumps({"id": rid, "object": self.object_chunk, "created": created, "model": model})[:-1] \
            + b',"choices":'

    def first_chunk(self, c: Choice) -> dict | None:
        return None

    def delta(self, c: Choice, d: Delta) -> dict | None:
        """One choice's entry of a stream chunk, or None when the delta adds nothing to send."""
        raise NotImplementedError

    def delta_json(self, c: Choice, d: Delta) -> bytes | None:
        """``delta``'s entry as the JSON of a chunk's ``choices`` list, or None. The shapes write the common chunk
        (a plain text delta in mid-stream: most of a stream's chunks, one per token) straight into a template,
        byte for byte what this makes of it (``tests/unit/test_stream_chunks.py``), without the dicts."""
        entry = self.delta(c, d)
        return None if entry is None else orjson.dumps([entry])

    def full(self, rid: str, created: int, model: str, choices: list[Choice], usage_: dict) -> dict:
        raise NotImplementedError


class CompletionShape(Shape):
    """Completions' choices: ``text`` (after the echoed prompt), ``logprobs`` in the legacy shape whose
    ``text_offset`` comes from ``TextOffsets`` (streamed, one per choice across its chunks: the same offsets as a
    whole answer), vLLM's ``stop_reason`` and, not streamed, ``prompt_logprobs``."""

    object_full = object_chunk = "text_completion"

    def __init__(self, tt: TokenText, want_logprobs: bool, skipped: frozenset[int] = frozenset()):
        super().__init__(tt, want_logprobs)
        self.skipped = skipped  # special tokens the text leaves out (skip_special_tokens)
        self.offsets: dict[int, TextOffsets] = {}

    def logprobs(self, c: Choice, at: TextOffsets, lps: list[TokenLogprob], echo: bool) -> dict | None:
        """The legacy logprobs of ``lps`` (after the prompt's, echoed), their offsets continuing ``at``."""
        entries: list[TokenLogprob] = []
        offsets: list[int] = []
        if echo:
            entries = echo_entries(c)
            offsets = at.starts([e.token_id for e in entries], frozenset())  # the prompt's text keeps them all
            at.restart_at(len(c.prefix))
        entries += lps
        offsets += at.starts(lp.token_id for lp in lps)
        return completion_logprobs(self.tt, entries, offsets) if entries else None

    def delta(self, c: Choice, d: Delta) -> dict | None:
        if not (d.text or d.finish_reason or d.logprobs or c.prefix):
            return None
        text = c.prefix + d.text
        lp = None
        if self.want_logprobs:
            at = self.offsets.get(c.index)
            if at is None:
                at = self.offsets[c.index] = TextOffsets(self.tt, self.skipped)
            lp = self.logprobs(c, at, d.logprobs or [], bool(c.prefix))
        c.prefix = ""  # echoed once, in the choice's first chunk
        entry = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason}
        if d.finish_reason is not None:
            entry["stop_reason"] = c.stop_reason
        return entry

    def delta_json(self, c: Choice, d: Delta) -> bytes | None:
        if d.text and d.finish_reason is None and not self.want_logprobs and not c.prefix:
            return b'[{"index":%d,"text":%b,"logprobs":null,"finish_reason":null}]' % (c.index, orjson.dumps(d.text))
        return super().delta_json(c, d)

    def full(self, rid, created, model, choices, usage_):
        out = []
        for c in choices:
            lp = None
            if self.want_logprobs:
                lp = self.logprobs(c, TextOffsets(self.tt, self.skipped), c.logprobs, bool(c.prefix))
            out.append({"index": c.index, "text": c.prefix + "".join(c.text), "logprobs": lp,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                        "prompt_logprobs": prompt_logprobs(self.tt, c)})
        return {"id": rid, "object": self.object_full, "created": created, "model": model, "choices": out,
                "usage": usage_}


def chat_tool_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_tool_deltas(deltas: list[ToolCallDelta]) -> list[dict]:
    """Streamed ``tool_calls`` entries: a call's first entry carries its id and name; fragments of
    one call that arrive together are merged, as clients expect one entry per index per chunk."""
    out: list[dict] = []
    for t in deltas:
        if out and out[-1]["index"] == t.index:
            out[-1]["function"]["arguments"] += t.arguments
            continue
        entry: dict = {"index": t.index, "function": {"arguments": t.arguments}}
        if t.id is not None:
            entry["id"], entry["type"] = t.id, "function"
            entry["function"]["name"] = t.name
        out.append(entry)
    return out


def chat_finish_reason(finish: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and finish == "stop" else finish


class ChatShape(Shape):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, tt: TokenText, want_logprobs: bool, use: ToolUse):
        super().__init__(tt, want_logprobs)
        self.use = use

    def first_chunk(self, c: Choice) -> dict:
        # With echo, the echoed message's text comes first (vLLM sends it in a chunk of its own, right after).
        return {"index": c.index, "delta": {"role": "assistant", "content": c.prefix}, "logprobs": None,
                "finish_reason": None}

    def delta_json(self, c: Choice, d: Delta) -> bytes | None:
        if d.text and d.finish_reason is None and c.msg is None and not self.want_logprobs:
            return b'[{"index":%d,"delta":{"content":%b},"logprobs":null,"finish_reason":null}]' % (
                c.index, orjson.dumps(d.text))
        return super().delta_json(c, d)

    def delta(self, c: Choice, d: Delta) -> dict | None:
        finish = d.finish_reason
        if c.msg is None and not self.want_logprobs:  # plain text: what the rest makes of it, for every token
            text = d.text
            if not (text or finish):
                return None
            entry = {"index": c.index, "delta": {"content": text} if text else {}, "logprobs": None,
                     "finish_reason": finish}
            if finish is not None:
                entry["stop_reason"] = c.stop_reason
            return entry
        lp = chat_logprobs(self.tt, d.logprobs) if self.want_logprobs and d.logprobs else None
        piece = c.piece(d)
        if c.msg is not None and finish is not None:
            calls = final_tool_calls(self.use, c)  # raises if a forced call is missing
            finish = chat_finish_reason(finish, calls)
        if not (piece or finish or lp):
            return None
        delta: dict = {}
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.content:
            delta["content"] = piece.content
        if piece.tool_calls:
            delta["tool_calls"] = chat_tool_deltas(piece.tool_calls)
        entry = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if finish is not None:
            entry["stop_reason"] = c.stop_reason
        return entry

    def message(self, c: Choice) -> tuple[dict, str | None]:
        """The whole assistant message of a non-streamed choice, and its finish reason."""
        if c.msg is None:
            return {"role": "assistant", "content": c.prefix + "".join(c.text), "refusal": None,
                    "tool_calls": []}, c.finish_reason
        calls = final_tool_calls(self.use, c)
        content = c.msg.text()
        if calls:
            content = content.strip()
        content = c.prefix + content  # echo: the last message's text first, as vLLM prepends it
        msg = {"role": "assistant", "content": content or (None if calls else ""), "refusal": None,
               "tool_calls": [chat_tool_call(t) for t in calls]}
        reasoning = c.msg.reasoning_text()
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        return msg, chat_finish_reason(c.finish_reason, calls)

    def full(self, rid, created, model, choices, usage_):
        out = []
        for c in choices:
            lp = chat_logprobs(self.tt, c.logprobs) if self.want_logprobs else None
            msg, finish = self.message(c)
            out.append({"index": c.index, "message": msg, "logprobs": lp, "finish_reason": finish,
                        "stop_reason": c.stop_reason})
        # vLLM's: the prompt's scores once per response (every choice has the same prompt).
        return {"id": rid, "object": self.object_full, "created": created, "model": model, "choices": out,
                "usage": usage_, "system_fingerprint": None, "prompt_logprobs": prompt_logprobs(self.tt, choices[0])}


def stream_usage(req) -> tuple[bool, bool]:
    """(usage on a final chunk, usage on every chunk) as stream_options asks."""
    opts = req.stream_options if req.stream else None
    include = bool(opts and opts.include_usage)
    return include, include and bool(opts and opts.continuous_usage_stats)


def plan_shape(plan: Plan, req: CompletionRequest | ChatCompletionRequest) -> Shape:
    """How the answer to ``req`` is laid out: the chat or the completions shape, with what the request asks."""
    if isinstance(req, ChatCompletionRequest):
        return ChatShape(plan.state.token_text, req.logprobs, plan.use)
    skipped = plan.state.tokenizer.all_special_ids if req.skip_special_tokens else frozenset()
    return CompletionShape(plan.state.token_text, req.logprobs is not None, skipped)


async def answer(request: web.Request, plan: Plan, req: CompletionRequest | ChatCompletionRequest,
                 replay: Replay | None = None, request_id: str | None = None) -> web.StreamResponse:
    """The OpenAI answer to ``req`` from its plan: its choices generated (the completions and chat routes), or
    replayed from a generate answer (the derender routes, which may name the answer's id)."""
    include, continuous = stream_usage(req)
    return await respond(request, plan.state, request_id=request_id or plan.request_id, model=plan.model,
                         choices=plan.choices, opts=plan.opts, prompt_tokens=plan.prompt_tokens, stream=req.stream,
                         shape=plan_shape(plan, req), include_usage=include, continuous_usage=continuous,
                         replay=replay)
