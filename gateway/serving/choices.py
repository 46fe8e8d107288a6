"""Running a request's choices (prompt i × sample j) on the engines.

Each choice goes to an engine as a request of its own; the engine reader feeds its outputs through the
choice's ``generation.TextPipeline`` and hands each delta on at once (``ChoiceRun``). A streamed route awaits
them as they come (``run_choices``) or writes them from the reader itself; a whole answer waits for every
choice to end (``collect``). A request is served whole or not at all: the first failure aborts the rest.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from protocol import RequestOutput, SamplingParams

from ..generation import Delta, TextOptions, TextPipeline
from ..state import ModelState
from ..text.message import MessageParser, MessagePiece
from ..text.token_text import TokenLogprob
from .engine_errors import ENGINE_ERRORS, engine_error


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

    def pieces(self, d: Delta) -> list[tuple[MessagePiece, list[TokenLogprob] | None]]:
        """Streamed, after ``take(d)``: what this delta adds to the message, each part with the logprobs of the
        tokens that wrote it, for a consumer that files logprobs under reasoning, content or a call (Responses'
        output text). A delta of several tokens can hold the end of the reasoning and the start of the answer
        (deltas merge when the consumer falls behind, or by ``--stream-interval``), so its tokens go through the
        parser one at a time (``Delta.texts``); without logprobs, or parsing, the delta is one part."""
        texts, lps = d.texts, d.logprobs
        if self.msg is None or texts is None or lps is None or len(texts) < 2 or len(texts) != len(lps):
            return [(self.piece(d), lps)]
        out = [(self.msg.push(text), [lp]) for text, lp in zip(texts, lps)]
        if d.finish_reason is not None:
            last, lp = out[-1]
            out[-1] = (last + self.msg.finish(self.cut), lp)
        return out

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
        self._timers = [s.pipe.timer for s in self._sinks]

    def start(self) -> None:
        """Send every choice to an engine (``NoEngineAvailable`` if one cannot go: nothing is left running)."""
        try:
            for s in self._sinks:
                self.engines.submit(s.rid, s.choice.prompt_ids, s.choice.sampling, s)
                s.live = True
                s.placed()
        except BaseException:
            self.cancel()
            raise

    @property
    def engines_used(self) -> str:
        """The ranks of the engines the choices went to, as placed (the X-Zserve-Engine header)."""
        return ",".join(dict.fromkeys(t.engine for t in self._timers if t.engine is not None))

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
        # The sinks point back at the run: dropping them here leaves no reference cycle, so the request's objects
        # are freed the moment it ends rather than by the cycle collector, whose passes cost a busy gateway a
        # fifth of its CPU.
        self._sinks = []
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

    def placed(self) -> None:
        """Tell the choice's metrics which engine it went to (vLLM's ``engine`` label); a request that waits for
        an engine to start learns it with its first output instead."""
        rank = self.run.engines.rank_of(self.rid)
        if rank is not None:
            self.pipe.timer.engine = str(rank)

    def output(self, out: RequestOutput) -> None:
        if not self.live:
            return
        if self.pipe.timer.engine is None:
            self.placed()
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


async def collect(state: ModelState, request_id: str, choices: list[Choice], opts: TextOptions) -> str:
    """Run every choice to its end (non-streamed responses); engine failures become API errors. The ranks of the
    engines they went to (``ChoiceRun.engines_used``)."""
    run = ChoiceRun(state, request_id, choices, opts, Choice.collect)
    try:
        run.start()
        await run.wait()
    except ENGINE_ERRORS as e:
        raise engine_error(e) from None
    return run.engines_used
