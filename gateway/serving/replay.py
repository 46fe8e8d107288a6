"""A ``/inference/v1/generate`` answer replayed through the text pipeline, as if its engine were sending it now.

The generate route is token ids in, token ids out: a scale-out front-end renders a request on one server
(``/v1/chat/completions/render``), generates on another, and derenders the answer on a third
(``routers.derender``). Derendering must give exactly the answer the direct route gives, so it runs the very
code the direct route runs on engine outputs: ``Replay`` feeds each choice's tokens to the choice's own
``generation.TextPipeline`` (detokenizing, stop strings, min_tokens) and hands the deltas to the route's
shaping (tool calls, reasoning, logprobs: ``serving.completions``).

Tokens are replayed one engine output per token, as the engine writes them, whatever chunks the generate
stream merged them into: a stop string then ends the text after the same token as on the direct route (the
generate route knows no stop strings, so it ran on), and ``completion_tokens`` count the same tokens. A whole
answer and its streamed events replay alike; only their tokens, logprobs and finish reasons count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field

from protocol import RequestOutput, TopLogprobs
from protocol.messages import FINISH_REASONS

from ..errors import bad_request
from ..generation import Delta, TextOptions, TextPipeline
from ..openai_schemas import RequestBody
from ..state import ModelState
from .choices import Choice

YIELD_EVERY = 256  # replayed outputs between yields to the event loop: a long answer never holds it for long


class GenerateTop(RequestBody):
    token_id: Annotated[int, Field(ge=0)]
    logprob: float


class GenerateTokenLogprob(RequestBody):
    token_id: Annotated[int, Field(ge=0)]
    logprob: float
    top_logprobs: list[GenerateTop] = []


class GenerateLogprobs(RequestBody):
    content: list[GenerateTokenLogprob]


class GenerateChoice(RequestBody):
    index: Annotated[int, Field(ge=0)]
    token_ids: list[Annotated[int, Field(ge=0)]]
    finish_reason: str | None = None
    logprobs: GenerateLogprobs | None = None


class GenerateOutput(RequestBody):
    """One ``/inference/v1/generate`` body: its whole JSON answer, or one of its streamed events (``error``: the
    event a failed stream ends with)."""

    request_id: str | None = None
    choices: list[GenerateChoice] = []
    error: dict[str, Any] | None = None


# What the generate route answered: its JSON body, or the data of its streamed events in order (no [DONE]).
GenerateAnswer = GenerateOutput | list[GenerateOutput]


@dataclass
class _Track:
    """One choice's generated tokens, gathered from the answer's chunks."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[GenerateTokenLogprob] = field(default_factory=list)
    finish: str | None = None

    def output(self, i: int) -> RequestOutput:
        """Token ``i`` as the engine output that carried it (the last one with the finish reason)."""
        last = i >= len(self.ids) - 1
        ids = tuple(self.ids[i:i + 1])
        lps = tops = None
        if self.logprobs and ids:
            lp = self.logprobs[i]
            lps = (lp.logprob,)
            tops = TopLogprobs(len(lp.top_logprobs), tuple(t.token_id for t in lp.top_logprobs),
                               tuple(t.logprob for t in lp.top_logprobs))
        return RequestOutput("replay", ids, self.finish if last else None, lps, tops)

    @property
    def outputs(self) -> int:
        return max(1, len(self.ids))  # a choice that wrote nothing still ends, in one empty output


def _gather(answer: GenerateAnswer, n: int, where: str) -> list[_Track]:
    """One prompt's ``n`` choices from its generate answer; a 400 naming ``where`` for an error, a choice out of
    range, tokens after a choice's finish, or a choice the answer never finished."""
    tracks = [_Track() for _ in range(n)]
    for event in answer if isinstance(answer, list) else [answer]:
        if event.error is not None:
            raise bad_request(f"{where}: the generate answer is an error, which has nothing to derender: "
                              f"{event.error.get('message', event.error)}", param=where)
        for ch in event.choices:
            if ch.index >= n:
                raise bad_request(f"{where}: choice {ch.index} is out of range: the request makes n={n}", param=where)
            t = tracks[ch.index]
            if t.finish is not None and (ch.token_ids or ch.finish_reason):
                raise bad_request(f"{where}: choice {ch.index} goes on after its finish_reason", param=where)
            t.ids += ch.token_ids
            if ch.logprobs is not None:
                t.logprobs += ch.logprobs.content
            if ch.finish_reason is not None:
                if ch.finish_reason not in FINISH_REASONS:
                    raise bad_request(f"{where}: choice {ch.index} has an unknown finish_reason "
                                      f"{ch.finish_reason!r}; known: {', '.join(FINISH_REASONS)}", param=where)
                t.finish = ch.finish_reason
    for j, t in enumerate(tracks):
        if t.finish is None:
            raise bad_request(f"{where}: choice {j} has no finish_reason: the generate answer is incomplete "
                              "(a stream must be given up to its last event)", param=where)
    return tracks


class Replay:
    """A request's choices (``serving.plans.Plan.choices``, ``n`` to a prompt) replayed from its generate answers,
    one per prompt. Built from the answers, it checks them against the plan (400s): every choice finished, its
    token ids in the vocabulary and no more than its ``max_tokens``, one logprob per token when the request asks
    for logprobs. ``run`` then feeds them through the text pipeline."""

    def __init__(self, state: ModelState, choices: list[Choice], n: int, opts: TextOptions,
                 answers: list[GenerateAnswer], want_logprobs: bool, where: str = "generate"):
        prompts = len(choices) // n
        if len(answers) != prompts:
            raise bad_request(f"{where}: {len(answers)} generate answers for {prompts} prompts: give one per "
                              "rendered prompt, in order", param=where)
        self.state, self.choices, self.opts = state, choices, opts
        self.tracks: list[_Track] = []
        for i, answer in enumerate(answers):
            self.tracks += _gather(answer, n, f"{where}.{i}" if prompts > 1 else where)
        vocab = state.tokenizer.vocab_size
        for c, t in zip(choices, self.tracks):
            bad = next((x for x in t.ids if x >= vocab), None)
            if bad is not None:
                raise bad_request(f"{where}: token id {bad} is out of range [0, {vocab})", param=where)
            if len(t.ids) > c.sampling.max_tokens:
                raise bad_request(f"{where}: choice {c.index} has {len(t.ids)} tokens, more than the request's "
                                  f"max_tokens ({c.sampling.max_tokens}): not the answer to this request", param=where)
            if want_logprobs and len(t.logprobs) != len(t.ids):
                raise bad_request(f"{where}: the request asks for logprobs, and choice {c.index} has "
                                  f"{len(t.logprobs)} for {len(t.ids)} tokens: generate with the rendered "
                                  "sampling_params (their logprobs)", param=where)
            if not want_logprobs:
                t.logprobs = []

    async def run(self, on_delta: Callable[[Choice, Delta], None]) -> None:
        """Feed every choice's outputs through its pipeline, the choices in step as an engine runs them, and each
        delta to ``on_delta`` (as ``serving.choices.ChoiceRun`` does); a choice ends at its finish reason's delta
        (a stop string's may come before its last token). What ``on_delta`` raises ends the replay."""
        pipes = [TextPipeline(self.state, c.prompt_ids, c.sampling, self.opts, metered=False) for c in self.choices]
        live = [(c, t, p) for c, t, p in zip(self.choices, self.tracks, pipes)]
        step = 0
        while live:
            still = []
            for c, t, pipe in live:
                d = pipe.push(t.output(step))
                if d is not None:
                    on_delta(c, d)
                if (d is None or d.finish_reason is None) and step + 1 < t.outputs:
                    still.append((c, t, pipe))
            live = still
            step += 1
            if step % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a yield, not a wait: other requests' work runs between long replays
