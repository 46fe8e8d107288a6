"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each handler validates its body, turns it into prompt ids and SamplingParams, runs every choice
through ``generation.generate_text`` concurrently, and shapes the deltas as the OpenAI API does,
as one JSON body or as an SSE stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from protocol import SamplingParams

from ..engine_client import EngineRequestError, NoEngineAvailable
from ..errors import APIError, bad_request
from ..generation import Delta, TextOptions, TokenLogprob, generate_text
from ..openai_schemas import ChatCompletionRequest, CompletionRequest, SamplingFields, parse
from ..sse import open_stream, send_done, send_event
from ..state import STATE, GatewayState
from ..text.chat_template import ChatTemplateError

log = logging.getLogger("zserve.gateway.openai")
routes = web.RouteTableDef()


# -- shared helpers ---------------------------------------------------------------------------

def check_model(state: GatewayState, model: str | None) -> str:
    if model is None or model in state.served_model_names:
        return state.model_id if model is None else model
    raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def check_prompt_ids(state: GatewayState, ids: list[int], max_tokens: int | None, param: str = "prompt") -> int:
    """Validate prompt length against the context; return the max_tokens to use."""
    if not ids:
        raise bad_request("the prompt is empty", param=param)
    vocab = state.tokenizer.vocab_size
    bad = next((t for t in ids if t < 0 or t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range [0, {vocab})", param=param)
    limit = state.max_model_len
    room = limit - len(ids)
    if room <= 0:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                          f"{len(ids)} tokens.", param=param, code="context_length_exceeded")
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                          "completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                          code="context_length_exceeded")
    return max_tokens


def build_sampling(state: GatewayState, req: SamplingFields, max_tokens: int, logprobs: int | None,
                   choice: int, prompt_logprobs: int | None = None) -> SamplingParams:
    vocab = state.tokenizer.vocab_size
    bias = []
    for k, v in (req.logit_bias or {}).items():
        if int(k) >= vocab:
            raise bad_request(f"logit_bias token id {k} is out of range", param="logit_bias")
        bias.append((int(k), float(v)))
    stop_ids = tuple(req.stop_token_ids or ())
    if any(t >= vocab for t in stop_ids):
        raise bad_request("stop_token_ids holds an id outside the vocabulary", param="stop_token_ids")
    if req.min_tokens > max_tokens:
        raise bad_request("min_tokens must not exceed max_tokens", param="min_tokens")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k in (None, -1) else req.top_k,
        min_p=req.min_p,
        seed=None if req.seed is None else req.seed + choice,
        min_tokens=req.min_tokens,
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=tuple(bias),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        priority=req.priority,
    )


@dataclass
class Choice:
    """One generation of a request (prompt i × sample j), fed to the engine on its own."""

    index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    prefix: str = ""  # echoed prompt text
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0

    def take(self, d: Delta) -> None:
        """Fold one delta's bookkeeping into the choice (text is handled by the shape)."""
        self.completion_tokens = d.num_output_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.cached_tokens = max(self.cached_tokens, d.cached_tokens)


async def run_choices(state: GatewayState, request_id: str, choices: list[Choice], opts: TextOptions
                      ) -> AsyncIterator[tuple[Choice, Delta]]:
    """Generate all choices concurrently and yield their deltas as they come."""
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(c: Choice) -> None:
        try:
            async with aclosing(generate_text(state, f"{request_id}-{c.index}", c.prompt_ids, c.sampling, opts)) as it:
                async for d in it:
                    await q.put((c, d))
        except BaseException as e:  # handed to the consumer, which raises it
            await q.put((c, e))
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            await q.put((c, done))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    remaining = len(tasks)
    try:
        while remaining:
            c, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield c, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def engine_error(e: Exception) -> APIError:
    if isinstance(e, NoEngineAvailable):
        return APIError(503, "no engine is available to serve the request; retry shortly", headers={"Retry-After": "1"})
    return APIError(500, f"generation failed: {e}")


def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    completion_tokens = sum(c.completion_tokens for c in choices)
    per_prompt: dict[int, int] = {}  # choices of one prompt share its id list
    for c in choices:
        per_prompt[id(c.prompt_ids)] = max(per_prompt.get(id(c.prompt_ids), 0), c.cached_tokens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(per_prompt.values())}}


class TokenText:
    """Token id → (text, bytes) for logprobs, cached per gateway."""

    def __init__(self, state: GatewayState):
        self.tok = state.tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        hit = self.cache.get(tid)
        if hit is None:
            raw = self.tok.id_to_bytes(tid)
            hit = (raw.decode("utf-8", errors="replace"), list(raw))
            if len(self.cache) < 200_000:
                self.cache[tid] = hit
        return hit


_TOKEN_TEXT: web.AppKey[TokenText] = web.AppKey("zserve_token_text", TokenText)


def chat_logprobs(tt: TokenText, lps: list[TokenLogprob]) -> dict:
    content = []
    for lp in lps:
        text, raw = tt(lp.token_id)
        content.append({
            "token": text, "logprob": lp.logprob, "bytes": raw,
            "top_logprobs": [{"token": tt(t)[0], "logprob": v, "bytes": tt(t)[1]} for t, v in lp.top or ()],
        })
    return {"content": content, "refusal": None}


def echo_entries(c: Choice) -> list[TokenLogprob]:
    """The prompt's tokens as logprob entries (the first one unscored), for echo + logprobs."""
    return [TokenLogprob(c.prompt_ids[0], None, None), *(c.prompt_logprobs or [])]


def completion_logprobs(tt: TokenText, lps: list[TokenLogprob], offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        text = tt(lp.token_id)[0]
        tokens.append(text)
        token_lps.append(lp.logprob)
        tops.append({tt(t)[0]: v for t, v in lp.top} if lp.top else None)  # None for an unscored token
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def respond(request: web.Request, *, request_id: str, model: str, choices: list[Choice], opts: TextOptions,
                  prompt_tokens: int, stream: bool, include_usage: bool, shape: "Shape") -> web.StreamResponse:
    state = request.app[STATE]
    if state.paused:
        raise APIError(503, "the server is paused and admits no new requests; retry later",
                       code="server_paused", headers={"Retry-After": "1"})
    if not state.engines.ready_engines:  # fail fast with 503 before any byte is sent
        raise engine_error(NoEngineAvailable("no engine is ready"))
    created = int(time.time())
    if not stream:
        try:
            async for c, d in run_choices(state, request_id, choices, opts):
                c.take(d)
                c.text.append(d.text)
                if d.logprobs:
                    c.logprobs.extend(d.logprobs)
                c.finish_reason = d.finish_reason or c.finish_reason
        except (EngineRequestError, NoEngineAvailable) as e:
            raise engine_error(e) from None
        body = shape.full(request_id, created, model, choices, usage(prompt_tokens, choices))
        return web.json_response(body, dumps=_dumps)

    resp = await open_stream(request)
    try:
        for c in choices:
            first = shape.first_chunk(c)
            if first is not None:
                await send_event(resp, shape.chunk(request_id, created, model, [first], include_usage))
        async for c, d in run_choices(state, request_id, choices, opts):
            c.take(d)
            if d.text or d.finish_reason or d.logprobs:
                await send_event(resp, shape.chunk(request_id, created, model, [shape.delta(c, d)], include_usage))
        if include_usage:
            await send_event(resp, shape.chunk(request_id, created, model, [], include_usage,
                                               usage(prompt_tokens, choices)))
    except (EngineRequestError, NoEngineAvailable) as e:
        await send_event(resp, engine_error(e).body())
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client went away during %s; aborted its generation", request_id)
        raise
    await send_done(resp)
    await resp.write_eof()
    return resp


def _dumps(obj) -> str:
    return orjson.dumps(obj).decode()


class Shape:
    """How one route lays out its response bodies and stream chunks."""

    object_full = ""
    object_chunk = ""

    def __init__(self, tt: TokenText):
        self.tt = tt

    def chunk(self, rid: str, created: int, model: str, choices: list[dict], include_usage: bool,
              usage_: dict | None = None) -> dict:
        body = {"id": rid, "object": self.object_chunk, "created": created, "model": model, "choices": choices}
        if include_usage:
            body["usage"] = usage_
        return body

    def first_chunk(self, c: Choice) -> dict | None:
        return None

    def delta(self, c: Choice, d: Delta) -> dict:
        raise NotImplementedError

    def full(self, rid: str, created: int, model: str, choices: list[Choice], usage_: dict) -> dict:
        raise NotImplementedError


class CompletionShape(Shape):
    object_full = object_chunk = "text_completion"

    def __init__(self, tt: TokenText, want_logprobs: bool):
        super().__init__(tt)
        self.want_logprobs = want_logprobs
        self.offsets: dict[int, int] = {}

    def delta(self, c: Choice, d: Delta) -> dict:
        text = d.text
        entries = list(d.logprobs or [])
        if c.prefix:
            text, c.prefix = c.prefix + text, ""
            if self.want_logprobs:
                entries = echo_entries(c) + entries
        lp = None
        if self.want_logprobs and entries:
            lp = completion_logprobs(self.tt, entries, self.offsets.get(c.index, 0))
        self.offsets[c.index] = self.offsets.get(c.index, 0) + len(text)
        return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason}

    def full(self, rid, created, model, choices, usage_):
        out = []
        for c in choices:
            lp = None
            if self.want_logprobs:
                entries = (echo_entries(c) if c.prefix else []) + c.logprobs
                lp = completion_logprobs(self.tt, entries, 0)
            out.append({"index": c.index, "text": c.prefix + "".join(c.text), "logprobs": lp,
                        "finish_reason": c.finish_reason})
        return {"id": rid, "object": self.object_full, "created": created, "model": model, "choices": out,
                "usage": usage_}


class ChatShape(Shape):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, tt: TokenText, want_logprobs: bool):
        super().__init__(tt)
        self.want_logprobs = want_logprobs

    def first_chunk(self, c: Choice) -> dict:
        return {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, c: Choice, d: Delta) -> dict:
        lp = chat_logprobs(self.tt, d.logprobs) if self.want_logprobs and d.logprobs else None
        delta = {"content": d.text} if d.text else {}
        return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}

    def full(self, rid, created, model, choices, usage_):
        out = []
        for c in choices:
            lp = chat_logprobs(self.tt, c.logprobs) if self.want_logprobs else None
            out.append({"index": c.index, "message": {"role": "assistant", "content": "".join(c.text), "refusal": None,
                                                      "tool_calls": []},
                        "logprobs": lp, "finish_reason": c.finish_reason})
        return {"id": rid, "object": self.object_full, "created": created, "model": model, "choices": out,
                "usage": usage_, "system_fingerprint": None}


def _token_text(app: web.Application) -> TokenText:
    if _TOKEN_TEXT not in app:
        app[_TOKEN_TEXT] = TokenText(app[STATE])
    return app[_TOKEN_TEXT]


def _text_options(req: SamplingFields) -> TextOptions:
    return TextOptions(stop=req.stop or [], include_stop_str_in_output=req.include_stop_str_in_output,
                       skip_special_tokens=req.skip_special_tokens)


# -- routes -----------------------------------------------------------------------------------

@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = [{"id": name, "object": "model", "created": int(state.started_at), "owned_by": "zserve",
             "root": state.source.model_id, "parent": None, "max_model_len": state.max_model_len}
            for name in state.served_model_names]
    return web.json_response({"object": "list", "data": data}, dumps=_dumps)


@routes.get("/v1/models/{model:.+}")
async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = check_model(state, request.match_info["model"])
    return web.json_response({"id": name, "object": "model", "created": int(state.started_at), "owned_by": "zserve"},
                             dumps=_dumps)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req: CompletionRequest = parse(CompletionRequest, await request.read())
    model = check_model(state, req.model)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported", param="best_of")
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    p = req.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    else:
        prompts = list(p)  # type: ignore[arg-type]
    if not prompts:
        raise bad_request("prompt must not be empty", param="prompt")
    choices: list[Choice] = []
    prompt_tokens = 0
    for i, pr in enumerate(prompts):
        ids = state.tokenizer.encode(pr) if isinstance(pr, str) else list(pr)
        max_tokens = check_prompt_ids(state, ids, req.max_tokens if req.max_tokens else None)
        if req.max_tokens == 0:
            raise bad_request("max_tokens must be at least 1", param="max_tokens")
        prompt_tokens += len(ids)
        prefix = (pr if isinstance(pr, str) else state.tokenizer.decode(ids)) if req.echo else ""
        for j in range(req.n):
            sp = build_sampling(state, req, max_tokens, req.logprobs, j, prompt_logprobs)
            choices.append(Choice(i * req.n + j, ids, sp, prefix))
    rid = f"cmpl-{uuid.uuid4().hex}"
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    shape = CompletionShape(_token_text(request.app), req.logprobs is not None)
    return await respond(request, request_id=rid, model=model, choices=choices, opts=_text_options(req),
                         prompt_tokens=prompt_tokens, stream=req.stream, include_usage=include_usage, shape=shape)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req: ChatCompletionRequest = parse(ChatCompletionRequest, await request.read())
    model = check_model(state, req.model)
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise bad_request("response_format other than text is not supported yet", param="response_format")
    if req.continue_final_message:
        raise bad_request("continue_final_message is not supported yet", param="continue_final_message")
    if state.chat_template is None:
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        text = state.chat_template.render(messages, add_generation_prompt=req.add_generation_prompt,
                                          tools=req.tools, **(req.chat_template_kwargs or {}))
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from None
    ids = state.tokenizer.encode(text)
    max_tokens = check_prompt_ids(state, ids, req.max_completion_tokens or req.max_tokens, param="messages")
    top = req.top_logprobs if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (top or 0) if req.logprobs else None
    choices = [Choice(j, ids, build_sampling(state, req, max_tokens, logprobs, j)) for j in range(req.n)]
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    shape = ChatShape(_token_text(request.app), req.logprobs)
    return await respond(request, request_id=rid, model=model, choices=choices, opts=_text_options(req),
                         prompt_tokens=len(ids), stream=req.stream,
                         include_usage=include_usage, shape=shape)
