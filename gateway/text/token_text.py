"""Token id → (text, UTF-8 bytes), as logprobs report each token; one cache per served model."""

from __future__ import annotations

from zserve.tokenizer import Tokenizer

MAX_CACHED = 200_000


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
