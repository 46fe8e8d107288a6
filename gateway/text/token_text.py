"""Token id → (text, UTF-8 bytes), as logprobs report each token; one cache per served model. And the shapes
logprobs take on the wire that more than one route family shares: OpenAI's per-token entries (chat completions,
Responses), vLLM's ``prompt_logprobs``, and the character offsets of completions' ``text_offset``."""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from dataclasses import dataclass

from zserve.tokenizer import Tokenizer

MAX_CACHED = 200_000
MIN_LOGPROB = -9999.0  # what vLLM reports for -inf (JSON has no infinity; orjson would write null)


@dataclass
class TokenLogprob:
    """One token's logprob as the engine reported it (and its top alternatives), before it is shaped for the wire."""

    token_id: int
    logprob: float | None  # None for a prompt's first token, which has no context to be scored in
    top: list[tuple[int, float]] | None
    rank: int | None = None  # prompt tokens: the token's rank in its distribution (1 = most likely)


_UTF8 = codecs.getincrementaldecoder("utf-8")


def finite(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


class TokenText:
    """Token id → (text, bytes) for logprobs, cached (a model's vocabulary is bounded, so is the cache)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        hit = self.cache.get(tid)
        if hit is None:
            raw = self.tok.id_to_bytes(tid)
            hit = (raw.decode("utf-8", errors="replace"), list(raw))
            if len(self.cache) < MAX_CACHED:
                self.cache[tid] = hit
        return hit

    def entries(self, lps: Iterable[TokenLogprob]) -> list[dict]:
        """OpenAI's logprob entries (chat completions' ``logprobs.content``, Responses' ``output_text.logprobs``):
        ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}``."""
        out = []
        for lp in lps:
            text, raw = self(lp.token_id)
            top = []
            for t, v in lp.top or ():
                t_text, t_raw = self(t)
                top.append({"token": t_text, "logprob": finite(v), "bytes": t_raw})
            out.append({"token": text, "logprob": finite(lp.logprob if lp.logprob is not None else 0.0),
                        "bytes": raw, "top_logprobs": top})
        return out

    def prompt_logprobs(self, lps: Iterable[TokenLogprob]) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: one entry per prompt token, the first ``None`` (nothing to score it in),
        then ``{"<id>": {"logprob", "rank", "decoded_token"}}`` for the prompt token followed by the top k
        (ranked 1..k; the prompt token's entry is the top one's when it is among them, as vLLM's dict has it).
        ``lps`` are the engine's scores of prompt tokens 1..."""
        out: list[dict | None] = [None]
        for lp in lps:
            entry = {str(lp.token_id): {"logprob": finite(lp.logprob if lp.logprob is not None else 0.0),
                                        "rank": lp.rank, "decoded_token": self(lp.token_id)[0]}}
            for rank, (t, v) in enumerate(lp.top or (), 1):
                entry[str(t)] = {"logprob": finite(v), "rank": rank, "decoded_token": self(t)[0]}
            out.append(entry)
        return out


class TextOffsets:
    """Completions' ``text_offset``: where each token's text starts in a choice's text, in characters.

    A choice's text is its tokens' bytes decoded as UTF-8, so a token starts at the number of characters the
    bytes before it complete. A token that finishes a character another token began (an emoji or CJK character
    split over byte-level tokens) starts at that character, as the token that began it does: offsets never pass
    the text, and they depend only on the tokens, so a streamed choice (fed delta by delta) gets the same offsets
    as a whole one. Special tokens the text skips add nothing. Tokens after a stop string keep the offsets they
    would have in the uncut text."""

    def __init__(self, tt: TokenText, skipped: frozenset[int] = frozenset()):
        self.tt = tt
        self.skipped = skipped
        self.chars = 0  # characters completed so far
        self._utf8 = _UTF8("replace")  # as the detokenizer decodes: a bad byte is one U+FFFD

    def starts(self, ids: Iterable[int], skipped: frozenset[int] | None = None) -> list[int]:
        """The offsets of the next tokens, ``skipped`` (default: the choice's) adding no text."""
        skip = self.skipped if skipped is None else skipped
        out = []
        for tid in ids:
            out.append(self.chars)
            if tid not in skip:
                self.chars += len(self._utf8.decode(bytes(self.tt(tid)[1])))
        return out

    def restart_at(self, chars: int) -> None:
        """Continue after a text of ``chars`` characters (the echoed prompt, whose text the client sees whole)."""
        self._utf8.reset()
        self.chars = chars
