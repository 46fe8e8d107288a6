"""What every generation family shares: model and prompt checks, sampling parameters, chat prompts
with tools, running a request's choices through ``generation.TextPipeline`` (``ChoiceRun``), engine errors.

A family module (openai, anthropic, responses, native) validates its own body, calls these to get
prompt ids, ``SamplingParams`` and deltas, and shapes the result in its own JSON. Nothing here
knows any family's wire format.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from protocol import RequestOutput, SamplingParams
from protocol.cluster import PAUSING_PHASES
from protocol.constants import ERR_STRUCTURED_OUTPUT

from ..admission import ScalingPaused
from ..engine_client import EngineRequestError, EnginesBusy, NoEngineAvailable
from ..errors import APIError, bad_request
from ..generation import Delta, TextOptions, TextPipeline, TokenLogprob
from ..openai_schemas import SEED_END, SamplingFields
from ..state import ModelState
from ..structured import StructuredSpec, sized
from ..text.chat_template import ChatTemplateError, content_text
from ..text.message import MessageParser, MessagePiece
from ..text.tool_parsers import TOOL_PARSERS, ToolCall, function_tools


def json_body(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """``web.json_response`` through orjson, its bytes as the body (no str in between); the same
    ``application/json; charset=utf-8``."""
    return web.Response(body=orjson.dumps(obj), status=status, headers=headers, content_type="application/json",
                        charset="utf-8")


def check_prompt_ids(state: ModelState, ids: list[int], max_tokens: int | None, param: str = "prompt",
                     max_tokens_param: str = "max_tokens") -> int:
    """Validate prompt length against the context; return the max_tokens to use."""
    if not ids:
        raise bad_request("the prompt is empty", param=param)
    vocab = state.tokenizer.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:  # in C: a long prompt costs no Python loop
        bad = next(t for t in ids if t < 0 or t >= vocab)
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
                          f"completion). Please reduce the prompt or {max_tokens_param}.", param=max_tokens_param,
                          code="context_length_exceeded")
    return max_tokens


def truncate_prompt(state: ModelState, ids: list[int], keep: int | None, side: str | None,
                    max_tokens: int | None, max_tokens_param: str = "max_tokens") -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` prompt ids (the first ones with ``truncation_side``
    "right"); -1 keeps as many as the context holds beside ``max_tokens`` (beside one token when it is not given).
    A ``keep`` past that room is a 400, as in vLLM: the prompt would be cut and still refused. ``ids`` itself comes
    back when nothing is cut."""
    if keep is None:
        return ids
    reserved = max_tokens or 1
    room = state.max_model_len - reserved
    if keep == -1:
        keep = max(room, 0)
    elif keep > room:
        raise bad_request(f"truncate_prompt_tokens={keep} cannot be greater than the model's maximum context length "
                          f"minus {max_tokens_param}: {state.max_model_len} - {reserved} = {room}. Please request a "
                          "smaller truncation size.", param="truncate_prompt_tokens")
    if keep >= len(ids):
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep:]


def build_sampling(state: ModelState, req: SamplingFields, max_tokens: int, logprobs: int | None,
                   choice: int, prompt_logprobs: int | None = None, where: str = "",
                   structured: tuple[str, str] | None = None) -> SamplingParams:
    """The engine's SamplingParams; ``where`` prefixes the field named in errors (e.g. ``sampling_params.``).
    ``structured`` is the checked constraint (``structured.check``) the output must follow."""
    vocab = state.tokenizer.vocab_size
    bias = []
    for k, v in (req.logit_bias or {}).items():
        if int(k) >= vocab:
            raise bad_request(f"logit_bias token id {k} is out of range", param=f"{where}logit_bias")
        bias.append((int(k), float(v)))
    stop_ids = tuple(req.stop_token_ids or ())
    if any(t >= vocab for t in stop_ids):
        raise bad_request("stop_token_ids holds an id outside the vocabulary", param=f"{where}stop_token_ids")
    if req.min_tokens > max_tokens:
        raise bad_request("min_tokens must not exceed max_tokens", param=f"{where}min_tokens")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k in (None, -1) else req.top_k,
        min_p=req.min_p,
        seed=None if req.seed is None else choice_seed(req.seed, choice),
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
        structured=structured,
    )


def choice_seed(seed: int, choice: int) -> int:
    """Choice j of n samples with seed + j, wrapped as 64-bit seeds wrap, so the wire's range holds any j."""
    s = seed + choice
    return s % (1 << 64) if s >= SEED_END else s


def text_options(req: SamplingFields) -> TextOptions:
    return TextOptions(stop=req.stop or [], include_stop_str_in_output=req.include_stop_str_in_output,
                       skip_special_tokens=req.skip_special_tokens)


# -- tools and chat prompts -----------------------------------------------------------------------

@dataclass(frozen=True)
class ToolUse:
    """How a request wants tools used: ``mode`` is none | auto | required | function (then ``function``)."""

    mode: str
    function: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


NO_TOOLS = ToolUse("none")


def tool_names(tools: list[dict] | None) -> list[str]:
    """Names of OpenAI-style function tools ({"type": "function", "function": {"name", ...}})."""
    return [name for name, _ in function_tools(tools)]


def tool_use(state: ModelState, tools: list[dict] | None, mode: str, function: str | None = None,
             parallel: bool = True, param: str = "tool_choice") -> ToolUse:
    """Check a request's tools against what this server can do; never drop tools silently."""
    if mode == "none" or (not tools and mode == "auto"):
        return NO_TOOLS
    if not tools:
        raise bad_request(f"tool_choice {mode!r} needs tools", param=param)
    if state.tool_parser is None:
        raise bad_request("tool calling is not enabled on this server: start it with --tool-call-parser NAME "
                          f"(one of: {TOOL_PARSERS.names()})", param="tools")
    if mode == "function" and function not in tool_names(tools):
        raise bad_request(f"tool_choice names the function {function!r}, which is not among the tools", param=param)
    return ToolUse(mode, function, parallel)


def chat_tool_use(state: ModelState, tools: list[dict] | None, choice: Any, parallel: bool = True) -> ToolUse:
    """OpenAI chat's tool_choice: "none" | "auto" (None) | "required" | {"type": "function", "function":
    {"name"}}; the chat route and /tokenize read it alike."""
    if choice is None:
        return tool_use(state, tools, "auto", parallel=parallel)
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        return tool_use(state, tools, choice, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        return tool_use(state, tools, "function", choice["function"]["name"], parallel)
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": ...}}', param="tool_choice")


def wants_generation_prompt(add_generation_prompt: bool, continue_final_message: bool, fields_set: set[str]) -> bool:
    """vLLM's rule: continue_final_message turns the generation prompt off unless it was asked for
    explicitly (then ``chat_prompt`` refuses the pair)."""
    return add_generation_prompt and not (continue_final_message and "add_generation_prompt" not in fields_set)


@dataclass
class ChatPrompt:
    ids: list[int]
    text: str
    prefill: str = ""  # opening of a forced tool call, appended after the generation prompt
    forced: StructuredSpec | None = None  # the grammar of the rest of a forced tool call (not yet checked)


def chat_prompt(state: ModelState, messages: list[dict], *, tools: list[dict] | None = None,
                use: ToolUse = NO_TOOLS, add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict | None = None, param: str = "messages") -> ChatPrompt:
    """Render messages with the model's chat template and tokenize them.

    ``continue_final_message`` renders the conversation up to the end of the last (assistant)
    message's text, without closing it, so the model continues that text (as vLLM does; Anthropic's
    assistant prefill). A forced tool call appends the parser's opening of a call, and ``forced``
    holds the grammar that makes the rest of the output a call whose arguments follow the tool's
    schema (``structured.check`` compiles it; it names ``tools`` when a schema cannot be compiled).
    """
    if state.chat_template is None:
        raise bad_request("this model has no chat template; use /v1/completions", param=param)
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          param="continue_final_message")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise bad_request("continue_final_message needs an assistant message last", param="continue_final_message")
    try:
        final = content_text(messages[-1].get("content")) or "" if continue_final_message else ""
    except ChatTemplateError as e:
        raise bad_request(str(e), param=param) from None
    if continue_final_message and not final:
        # Nothing to continue: the same prompt as a new assistant turn.
        messages, add_generation_prompt, continue_final_message = messages[:-1], True, False
    try:
        if not continue_final_message and not use.forced:  # the text as rendered is the prompt: ids cached too
            text, ids = state.chat_template.render_ids(messages, state.tokenizer.encode,
                                                       add_generation_prompt=add_generation_prompt, tools=tools,
                                                       **(template_kwargs or {}))
            return ChatPrompt(ids, text)
        text = state.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                          **(template_kwargs or {}))
    except ChatTemplateError as e:
        raise bad_request(str(e), param=param) from None
    if continue_final_message:
        cut = text.rfind(final)
        if cut < 0:
            raise bad_request("the chat template does not render the final message's text, so it cannot be "
                              "continued", param="continue_final_message")
        text = text[: cut + len(final)]
    prefill, forced = "", None
    if use.forced:
        assert state.tool_parser is not None
        prefill = state.tool_parser.forced_prefill(tools or [], use.function)
        text += prefill
        grammar = state.tool_parser.forced_grammar(tools or [], use.function, parallel=use.parallel)
        forced = sized("lark", grammar, "tools")
    return ChatPrompt(state.tokenizer.encode(text), text, prefill, forced)


def message_parser(state: ModelState, use: ToolUse, prefill: str = "") -> MessageParser | None:
    if state.reasoning_parser is None and (state.tool_parser is None or use.mode == "none"):
        return None  # the common case, without building a parser to find it inactive
    parser = MessageParser(state.reasoning_parser, state.tool_parser if use.mode != "none" else None, prefill,
                           single_call=not use.parallel)
    return parser if parser.active else None


def final_tool_calls(use: ToolUse, c: Choice) -> list[ToolCall]:
    """The calls a finished choice carries; a forced call that the model did not produce is a server error.

    The forced call's grammar (``ChatPrompt.forced``) lets the model end its turn only after a valid
    call, so a choice that the model ended without one had no grammar applied: a server error. A
    choice the request's limits cut (``Choice.cut``: max_tokens, a stop string) is no error: it
    carries the calls it completed, maybe none (finish_reason "length" says why)."""
    calls = c.msg.tool_calls if c.msg is not None else []
    if use.forced and not c.cut:
        if not calls:
            raise APIError(500, "the model did not produce a valid tool call although tool_choice requires one",
                           code="invalid_tool_call")
        if use.mode == "function" and any(c.name != use.function for c in calls):
            raise APIError(500, f"the model called a function other than {use.function!r}", code="invalid_tool_call")
    return calls


def arguments_dict(call: ToolCall) -> dict:
    """A call's arguments as an object (Anthropic's ``input``); the parsers guarantee a JSON object."""
    value = json.loads(call.arguments or "{}")
    return value if isinstance(value, dict) else {}


# -- running choices ------------------------------------------------------------------------------

@dataclass
class Choice:
    """One generation of a request (prompt i × sample j), fed to the engine on its own."""

    index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    prefix: str = ""  # echoed prompt text
    msg: MessageParser | None = None  # reasoning / tool-call parsing, when the request uses them
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_str: str | None = None
    stop_token: int | None = None
    completion_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0

    def take(self, d: Delta) -> None:
        """Fold one delta's bookkeeping into the choice (text is handled by the caller)."""
        self.completion_tokens = d.num_output_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.cached_tokens = max(self.cached_tokens, d.cached_tokens)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            self.stop_str, self.stop_token = d.stop_str, d.stop_token

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's ``stop_reason``: the stop string or stop token id that ended the choice (None: EOS, length)."""
        return self.stop_str if self.stop_str is not None else self.stop_token

    @property
    def cut(self) -> bool:
        """Whether the request's own limits ended the output (max_tokens, a stop string or stop token)
        rather than the model: a tool call it ends in is cut, dropped rather than shown as text."""
        return self.finish_reason == "length" or self.stop_reason is not None

    def piece(self, d: Delta) -> MessagePiece:
        """Streamed, after ``take(d)``: what this delta adds to the message (at the end, with what the
        parsers held back)."""
        if self.msg is None:
            return MessagePiece(content=d.text)
        piece = self.msg.push(d.text)
        return piece + self.msg.finish(self.cut) if d.finish_reason is not None else piece

    def collect(self, d: Delta) -> None:
        """Non-streamed: keep the whole output."""
        self.take(d)
        self.text.append(d.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if self.msg is not None:
            self.msg.push(d.text)
            if d.finish_reason is not None:
                self.msg.finish(self.cut)


RENDER_ONLY = ("this is a render-only server (launch render): it has no engine to run requests on; "
               "/v1/chat/completions/render and /v1/completions/render take the same bodies and answer what the "
               "engine would get")


def admit(state: ModelState, task: str = "generate", parts: int = 1, param: str = "n", what: str = "choices") -> None:
    """Refuse new work before any byte is sent: a render-only server, paused cluster (by a resize: held by the
    middleware, ``admission.ScalingPaused``), no engine, a model that does not do ``task`` (generate, embed,
    classify), or a request of more ``parts`` than an engine queues (a 400 naming ``param``).

    Every generation and pooling route comes through here after validating its body, so a render
    server answers a valid request with this clear 400 in the route's own error shape (not retried by
    SDKs: retrying cannot help), and an invalid one with the same 400 the api-server gives.

    Each part of a request (a choice, a pooled input) waits in an engine's queue as a request of its own, and a
    request is served whole or refused whole (``ChoiceRun``, ``pooling``: the first part every engine refuses
    ends it, and its other parts are aborted, so it is one 429). One with more parts than an engine queues
    (``--max-waiting``, which engines announce) could only ever be refused, so it is a 400 that says the limit."""
    if state.render_only:
        raise bad_request(RENDER_ONLY, code="render_only")
    if state.paused:
        if state.scaling in PAUSING_PHASES:  # a resize, which ends by itself: held (``admission.ScalingPaused``)
            raise ScalingPaused(state.scaling)
        raise APIError(503, "the server is paused and admits no new requests; retry later",
                       code="server_paused", headers={"Retry-After": "1"})
    if not state.engines.has_ready:
        raise engine_error(NoEngineAvailable("no engine is ready"))
    state.check_task(task)
    limit = state.engines.max_waiting
    if limit is not None and parts > limit:
        raise bad_request(f"this request makes {parts} {what}, each of which waits in an engine's queue; the engines "
                          f"of this model queue at most {limit} (--max-waiting) and a request is admitted whole, so "
                          f"it may make at most {limit}", param=param)


def engine_error(e: Exception) -> APIError:
    if isinstance(e, EnginesBusy):
        return APIError(429, "every engine of the model has a full queue (--max-waiting); retry shortly",
                        code="too_many_requests", headers={"Retry-After": "1"})
    if isinstance(e, NoEngineAvailable):
        return APIError(503, "no engine is available to serve the request; retry shortly", headers={"Retry-After": "1"})
    if isinstance(e, EngineRequestError) and e.code == ERR_STRUCTURED_OUTPUT:
        return bad_request(str(e), code=ERR_STRUCTURED_OUTPUT)  # the request's grammar, not the server, failed
    return APIError(500, f"generation failed: {e}")


ENGINE_ERRORS = (EngineRequestError, NoEngineAvailable)


class ChoiceRun:
    """A request's choices on the engines, driven by the engine reader: each engine output goes through its
    choice's ``TextPipeline`` and each delta to ``on_delta(choice, delta)`` at once, with no task woken in
    between (``EngineClient.submit``). ``wait`` returns once every choice has finished and raises the first
    failure: an engine error, or whatever ``on_delta`` raised (the other choices are then cancelled).
    ``cancel`` (also on leaving ``wait`` early) aborts whatever still runs."""

    def __init__(self, state: ModelState, request_id: str, choices: list[Choice], opts: TextOptions,
                 on_delta: Callable[[Choice, Delta], None]):
        self.engines = state.engines
        self.on_delta = on_delta
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._left = len(choices)
        self._sinks = [_ChoiceSink(self, f"{request_id}-{c.index}", c, TextPipeline(state, c.prompt_ids, c.sampling,
                                                                                     opts)) for c in choices]

    def start(self) -> None:
        """Send every choice to an engine (``NoEngineAvailable`` if one cannot go: nothing is left running)."""
        try:
            for s in self._sinks:
                self.engines.submit(s.rid, s.choice.prompt_ids, s.choice.sampling, s)
                s.live = True
        except BaseException:
            self.cancel()
            raise

    async def wait(self) -> None:
        try:
            await self.done
        finally:
            self.cancel()

    def cancel(self) -> None:
        for s in self._sinks:
            if s.live:
                s.live = False
                self.engines.cancel(s.rid)
            s.pipe.close()
        if self.done.done() and not self.done.cancelled():
            self.done.exception()  # seen: a failure after the consumer left is not an unretrieved one

    def _finished(self, sink: _ChoiceSink) -> None:
        sink.live = False
        sink.pipe.close()
        self._left -= 1
        if not self._left and not self.done.done():
            self.done.set_result(None)

    def _failed(self, sink: _ChoiceSink, error: BaseException) -> None:
        # Every live choice is aborted, the failing one included: when ``on_delta`` failed (a write to a client
        # that went away) its engine is still generating, and only this abort stops it. (One the engine ended
        # is forgotten by the engine client already; cancelling it again does nothing.)
        self.cancel()
        if not self.done.done():
            self.done.set_exception(error)


class _ChoiceSink:
    """One choice's ``OutputSink``: engine outputs → its ``TextPipeline`` → the run's ``on_delta``."""

    __slots__ = ("run", "rid", "choice", "pipe", "live")

    def __init__(self, run: ChoiceRun, rid: str, choice: Choice, pipe: TextPipeline):
        self.run, self.rid, self.choice, self.pipe = run, rid, choice, pipe
        self.live = False  # sent to an engine and not yet ended

    def output(self, out: RequestOutput) -> None:
        if not self.live:
            return
        d = self.pipe.push(out)
        if d is None:
            return
        last = d.finish_reason is not None
        if last and self.pipe.ended_early:  # a stop string ended the text: the engine is still at it
            self.live = False
            self.run.engines.cancel(self.rid)
        try:
            self.run.on_delta(self.choice, d)
        except Exception as e:  # an APIError from the shaping, a write to a client that went away
            self.run._failed(self, e)
            return
        if last:
            self.run._finished(self)

    def fail(self, error: Exception) -> None:
        if self.live:
            self.run._failed(self, error)


async def run_choices(state: ModelState, request_id: str, choices: list[Choice], opts: TextOptions
                      ) -> AsyncIterator[tuple[Choice, Delta]]:
    """Generate all choices concurrently and yield their deltas as they come, for a handler that awaits between
    them (a stream written with awaits). Deltas of one choice that queued up while the handler was busy come
    merged (``Delta.then``): one stream event for them, as vLLM's output collector does."""
    queue: deque[tuple[Choice, Delta]] = deque()
    wake: list[asyncio.Future] = []

    def put(c: Choice, d: Delta) -> None:
        queue.append((c, d))
        if wake and not wake[0].done():
            wake[0].set_result(None)

    run = ChoiceRun(state, request_id, choices, opts, put)
    run.done.add_done_callback(lambda _: wake and not wake[0].done() and wake[0].set_result(None))
    run.start()
    try:
        while True:
            while queue:
                c, d = queue.popleft()
                while d.finish_reason is None and queue and queue[0][0] is c:
                    d = d.then(queue.popleft()[1])
                yield c, d
            if run.done.done():
                run.done.result()  # the first failure, raised
                return
            wake[:] = [asyncio.get_running_loop().create_future()]
            await wake[0]
    finally:
        run.cancel()


async def collect(state: ModelState, request_id: str, choices: list[Choice], opts: TextOptions) -> None:
    """Run every choice to its end (non-streamed responses); engine failures become API errors."""
    run = ChoiceRun(state, request_id, choices, opts, Choice.collect)
    try:
        run.start()
        await run.wait()
    except ENGINE_ERRORS as e:
        raise engine_error(e) from None
