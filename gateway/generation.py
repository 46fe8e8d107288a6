"""From prompt ids to text deltas: engine tokens → incremental detokenizing → stop strings.

Every generation route (OpenAI completions and chat, Anthropic Messages, Responses) shares this
one pipeline (``TextPipeline``, run for each choice by ``serving.choices.ChoiceRun``); they only
differ in how they shape its ``Delta``s into JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol import RequestOutput, SamplingParams

from .metrics import IN_FLIGHT, TokenTimer
from .state import ModelState
from .text.detokenizer import IncrementalDetokenizer
from .text.stop import StopChecker
from .text.token_text import TokenLogprob


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    num_output_tokens: int  # so far, for usage
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (first delta, when asked)
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache (first delta)
    stop_str: str | None = None  # the stop string that ended the text (last delta)
    stop_token: int | None = None  # the request's stop token id that ended it, when not an EOS (last delta)
    # With logprobs: each token's share of ``text`` (they add up to it), so that a consumer that files logprobs
    # under the parts of a message (Responses' output text) can tell which tokens wrote reasoning, content or a
    # call however many tokens a delta holds (``serving.choices.Choice.pieces``).
    texts: list[str] | None = None

    def then(self, later: Delta) -> Delta:
        """This delta and the one after it as one (``--stream-interval``, a consumer that fell behind)."""
        lps = self.logprobs + later.logprobs if self.logprobs is not None and later.logprobs is not None \
            else self.logprobs or later.logprobs
        texts = None
        if self.texts is not None and later.texts is not None:
            texts = self.texts + later.texts
            if later.text and not later.texts:  # text of no token (a finish's flush): the last token's
                texts = texts[:-1] + [texts[-1] + later.text] if texts else None
        return Delta(self.text + later.text, self.token_ids + later.token_ids, lps, later.finish_reason,
                     later.num_output_tokens,
                     self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
                     max(self.cached_tokens, later.cached_tokens), later.stop_str, later.stop_token, texts)


@dataclass
class TextOptions:
    stop: list[str]
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (the native generate route)


def _logprobs(out: RequestOutput) -> list[TokenLogprob] | None:
    return _pair_logprobs(out.new_token_ids, out.logprobs, out.top_logprobs)


def _prompt_logprobs(out: RequestOutput, prompt_ids: list[int]) -> list[TokenLogprob] | None:
    if out.prompt_logprobs is None:  # every output but the first: no copy of the prompt per token
        return None
    return _pair_logprobs(prompt_ids[1:], out.prompt_logprobs, out.prompt_top_logprobs, out.prompt_ranks)


def _pair_logprobs(ids, lps, top, ranks=None) -> list[TokenLogprob] | None:
    if lps is None:
        return None
    res = []
    for i, (tid, lp) in enumerate(zip(ids, lps)):
        pairs: list[tuple[int, float]] = []
        if top is not None and top.k:
            pairs = list(zip(top.token_ids[i * top.k : (i + 1) * top.k], top.logprobs[i * top.k : (i + 1) * top.k]))
        res.append(TokenLogprob(tid, lp, pairs, None if ranks is None else ranks[i]))
    return res


def _shares(text: str, parts: list[str], n: int, skip: int) -> list[str]:
    """The ``n`` tokens' shares of a delta's ``text`` (``Delta.texts``), from what each token's detokenizer push
    wrote (``parts``; the ending token writes none). The stop-string check lets text out later than it was written:
    the ``skip`` characters it held back from earlier deltas open the first share, and what it holds back now (or
    cut at a stop string) is no token's; whatever was written at the finish (flushes) closes the last."""
    if n < 2:
        return [text] * n
    shares: list[str] = []
    at, end = 0, skip
    for part in parts[:n - 1]:
        end += len(part)
        cut = min(end, len(text))
        shares.append(text[at:cut])
        at = cut
    shares += [""] * (n - 1 - len(shares))
    shares.append(text[at:])
    return shares


class _Unmetered:
    """The token timer of a pipeline that counts nothing (``TextPipeline(metered=False)``)."""

    __slots__ = ()
    engine = ""  # (known: nothing to look up)

    def tokens(self, n: int) -> None:
        pass

    def finished(self, reason: str) -> None:
        pass

    def end(self) -> None:
        pass


UNMETERED = _Unmetered()


class TextPipeline:
    """One request's engine outputs turned into text deltas, one output at a time and synchronously (so the
    engine reader can run it: ``serving.choices.ChoiceRun``): incremental detokenizing, stop strings,
    ``--stream-interval`` and the request's token metrics.

    With ``--stream-interval N`` (N > 1) the first delta comes at once and later ones at least N tokens at a
    time (and the last one at the finish), as vLLM's option does: fewer, larger stream chunks for less CPU
    per token. Stop strings are still checked on every engine output. The delta with a finish reason is the
    last; when a stop string ended the text, the engine is still generating and its request must be cancelled
    (``ended_early``). ``close`` (idempotent) ends the in-flight gauge's count of the request.

    With logprobs, an output of several tokens is detokenized one token at a time, so that its delta says which
    text each token wrote (``Delta.texts``); without, in one push.

    ``metered=False`` (a generate answer replayed by the derender routes, ``serving.replay``) counts nothing: its
    tokens were counted where they were generated, and its timing is not the engine's."""

    __slots__ = ("detok", "stopper", "final_ids", "stop_ids", "prompt_ids", "n_out", "interval", "held", "sent_at",
                 "timer", "ended_early", "_open", "min_tokens", "plain")

    def __init__(self, state: ModelState, prompt_ids: list[int], sampling: SamplingParams, opts: TextOptions,
                 metered: bool = True):
        self.detok = IncrementalDetokenizer(state.tokenizer, skip_special_tokens=opts.skip_special_tokens) \
            if opts.detokenize else None
        self.stopper = StopChecker(opts.stop, opts.include_stop_str_in_output) if opts.stop and self.detok else None
        self.min_tokens = sampling.min_tokens  # no stop string ends in the text of this many first tokens (vLLM)
        self.final_ids = state.eos_token_ids | set(sampling.stop_token_ids) if sampling.stop_token_ids \
            else state.eos_token_ids
        # The ids that end a choice with a stop_reason (vLLM's): the request's stop tokens, but an EOS is not one
        # unless the request ignores EOS (then only its stop_token_ids can end it).
        self.stop_ids = frozenset() if not sampling.stop_token_ids else frozenset(sampling.stop_token_ids) \
            - (frozenset() if sampling.ignore_eos else state.eos_token_ids)
        self.prompt_ids = prompt_ids
        self.n_out = 0
        self.interval = state.stream_interval
        self.held: Delta | None = None  # what --stream-interval has not yet let out
        self.sent_at = 0  # output tokens when a delta was last let out
        self.timer = TokenTimer(lora=state.lora, prompt_tokens=len(prompt_ids), model=state.model.model_id) \
            if metered else UNMETERED
        self.ended_early = False
        self.plain = self.stopper is None and self.interval <= 1  # (push's short way)
        if metered:
            IN_FLIGHT.inc()
        self._open = metered

    def push(self, out: RequestOutput) -> Delta | None:
        """The delta of one engine output, or None while ``--stream-interval`` holds it back."""
        ids = list(out.new_token_ids)
        self.n_out += len(ids)
        self.timer.tokens(len(ids))
        finish = out.finish_reason
        if self.plain and finish is None and out.logprobs is None and out.prompt_logprobs is None:
            # Mid-stream, no stop strings, no logprobs, nothing held back: what the rest does for such an output
            # (it runs for every streamed token).
            return Delta("" if self.detok is None else self.detok.push(ids), ids, None, None, self.n_out, None,
                         out.num_cached_tokens)
        # The token that ended generation (EOS or a stop token id) counts as output but is not text.
        text_ids = ids[:-1] if finish == "stop" and ids and ids[-1] in self.final_ids else ids
        detok = self.detok
        stopper = self.stopper
        first = self.min_tokens - (self.n_out - len(ids))  # of ids, how many are among the first min_tokens
        shielded = stopper is not None and first > 0
        protected = 0  # characters of text that are those tokens' (no stop string may end there)
        parts: list[str] | None = None  # with logprobs: the text each token's push wrote
        if detok is None:
            text = ""
        elif out.logprobs is not None and len(ids) > 1:
            parts = [detok.push((i,)) for i in text_ids]
            text = "".join(parts)
            if shielded:
                protected = sum(len(p) for p in parts[:first])
        elif shielded:
            text = detok.push(text_ids[:first])
            protected = len(text)
            if first < len(text_ids):
                text += detok.push(text_ids[first:])
        else:
            text = detok.push(text_ids)
        if finish is not None and detok is not None:
            text += detok.flush()
            if shielded and first >= len(ids):
                protected = len(text)
        skip = 0 if stopper is None else stopper.held_back  # text of earlier tokens, let out now
        if stopper is not None:
            text, stopped = stopper.push(text, protected)
            if stopped:
                finish = "stop"
                self.ended_early = out.finish_reason is None
            elif finish is not None:
                text += stopper.flush()
        if finish is not None:
            self.timer.finished(finish)
        d = Delta(text, ids, None if out.logprobs is None else _logprobs(out), finish, self.n_out,
                  None if out.prompt_logprobs is None else _prompt_logprobs(out, self.prompt_ids),
                  out.num_cached_tokens, stopper.matched if stopper is not None else None,
                  texts=None if out.logprobs is None or detok is None else _shares(text, parts or [], len(ids), skip))
        if finish == "stop" and d.stop_str is None and ids and ids[-1] in self.stop_ids:
            d.stop_token = ids[-1]
        if self.interval > 1:
            if self.held is not None:
                d = self.held.then(d)
            if finish is None and self.sent_at and self.n_out - self.sent_at < self.interval:
                self.held = d
                return None
            self.held, self.sent_at = None, self.n_out
        return d

    def close(self) -> None:
        if self._open:
            self._open = False
            IN_FLIGHT.dec()
            self.timer.end()
