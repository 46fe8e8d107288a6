"""From prompt ids to text deltas: engine tokens → incremental detokenizing → stop strings.

Both OpenAI routes (and later Anthropic, Responses) share this one pipeline; they only differ in
how they shape its ``Delta``s into JSON.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from protocol import RequestOutput, SamplingParams

from .metrics import IN_FLIGHT, PROMPT_TOKENS, TokenTimer
from .state import GatewayState
from .text.detokenizer import IncrementalDetokenizer
from .text.stop import StopChecker


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    num_output_tokens: int  # so far, for usage


@dataclass
class TextOptions:
    stop: list[str]
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


def _logprobs(out: RequestOutput) -> list[TokenLogprob] | None:
    if out.logprobs is None:
        return None
    top = out.top_logprobs
    res = []
    for i, (tid, lp) in enumerate(zip(out.new_token_ids, out.logprobs)):
        pairs: list[tuple[int, float]] = []
        if top is not None and top.k:
            pairs = list(zip(top.token_ids[i * top.k : (i + 1) * top.k], top.logprobs[i * top.k : (i + 1) * top.k]))
        res.append(TokenLogprob(tid, lp, pairs))
    return res


async def generate_text(state: GatewayState, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                        opts: TextOptions) -> AsyncIterator[Delta]:
    """Yield text deltas until the request finishes; closing early aborts it in the engine."""
    detok = IncrementalDetokenizer(state.tokenizer, skip_special_tokens=opts.skip_special_tokens)
    stopper = StopChecker(opts.stop, opts.include_stop_str_in_output) if opts.stop else None
    final_ids = state.eos_token_ids | set(sampling.stop_token_ids)
    n_out = 0
    timer = TokenTimer()
    PROMPT_TOKENS.inc(len(prompt_ids))
    with IN_FLIGHT.track_inprogress():
        async with aclosing(state.engines.generate(request_id, prompt_ids, sampling)) as outs:
            async for out in outs:
                ids = list(out.new_token_ids)
                n_out += len(ids)
                timer.tokens(len(ids))
                finish = out.finish_reason
                # The token that ended generation (EOS or a stop token id) counts as output but is not text.
                text_ids = ids[:-1] if finish == "stop" and ids and ids[-1] in final_ids else ids
                text = detok.push(text_ids)
                if finish is not None:
                    text += detok.flush()
                if stopper is not None:
                    text, stopped = stopper.push(text)
                    if stopped:
                        yield Delta(text, ids, _logprobs(out), "stop", n_out)
                        return  # leaving the engine stream aborts the request there
                    if finish is not None:
                        text += stopper.flush()
                yield Delta(text, ids, _logprobs(out), finish, n_out)
                if finish is not None:
                    return
