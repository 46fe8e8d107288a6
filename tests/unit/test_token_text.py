"""Logprob shapes shared by the route families (``gateway/text/token_text.py``): completions' ``text_offset`` where
characters span tokens, vLLM's ``prompt_logprobs`` and OpenAI's entries, on SmolLM2's byte-level tokenizer."""

from __future__ import annotations

import random

import pytest

from gateway.text.token_text import MIN_LOGPROB, TextOffsets, TokenLogprob, TokenText
from zserve.tokenizer import Tokenizer

TEXT = "Emoji 🙂🙂 and 日本語, é, 𝔘 — done."


@pytest.fixture(scope="module")
def tt(smollm2_tokenizer: Tokenizer) -> TokenText:
    return TokenText(smollm2_tokenizer)


def complete_chars(tt: TokenText, ids: list[int]) -> int:
    """Characters the bytes of ``ids`` complete (the text is valid UTF-8, so only its end can be cut)."""
    return len(b"".join(bytes(tt(t)[1]) for t in ids).decode("utf-8", errors="ignore"))


def test_offsets_count_the_characters_before_each_token(tt: TokenText, smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode(TEXT)
    assert any("\ufffd" in tt(t)[0] for t in ids)  # characters really are split over tokens
    offsets = TextOffsets(tt).starts(ids)
    assert offsets == [complete_chars(tt, ids[:i]) for i in range(len(ids))]
    assert offsets[-1] < len(TEXT) and offsets == sorted(offsets)


@pytest.mark.parametrize("seed", range(5))
def test_offsets_do_not_depend_on_how_the_tokens_arrive(tt: TokenText, smollm2_tokenizer: Tokenizer,
                                                         seed: int) -> None:
    ids = smollm2_tokenizer.encode(TEXT * 3)
    whole = TextOffsets(tt).starts(ids)
    rng, at, pieces = random.Random(seed), TextOffsets(tt), []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4)
        pieces += at.starts(ids[i : i + n])
        i += n
    assert pieces == whole


def test_skipped_special_tokens_add_no_text_and_an_echoed_prompt_restarts_the_count(
        tt: TokenText, smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("ab") + [2] + smollm2_tokenizer.encode("cd")  # 2: <|im_end|>
    skipping = TextOffsets(tt, frozenset({2})).starts(ids)
    keeping = TextOffsets(tt).starts(ids)
    end = ids.index(2)
    assert skipping[end + 1] == skipping[end] and keeping[end + 1] == keeping[end] + len("<|im_end|>")
    at = TextOffsets(tt)
    at.starts(smollm2_tokenizer.encode("日")[:1])  # a prompt ending inside a character
    at.restart_at(5)
    assert at.starts(smollm2_tokenizer.encode("x") + smollm2_tokenizer.encode("y")) == [5, 6]


def test_prompt_logprobs_take_vllms_shape(tt: TokenText) -> None:
    lps = [TokenLogprob(10, -0.5, [(10, -0.5), (11, -1.0)], rank=1),  # the prompt token is the best one
           TokenLogprob(12, -7.0, [(10, -0.25), (11, -2.0)], rank=40),  # not among the top 2
           TokenLogprob(13, float("-inf"), [], rank=49152)]
    got = tt.prompt_logprobs(lps)
    assert got[0] is None and len(got) == 4
    assert list(got[1]) == ["10", "11"] and got[1]["10"] == {"logprob": -0.5, "rank": 1, "decoded_token": tt(10)[0]}
    assert [(k, v["rank"]) for k, v in got[2].items()] == [("12", 40), ("10", 1), ("11", 2)]
    assert got[3] == {"13": {"logprob": MIN_LOGPROB, "rank": 49152, "decoded_token": tt(13)[0]}}


def test_openai_entries_have_bytes_and_finite_logprobs(tt: TokenText) -> None:
    [entry] = tt.entries([TokenLogprob(10, float("-inf"), [(11, -1.5)])])
    assert entry == {"token": tt(10)[0], "logprob": MIN_LOGPROB, "bytes": tt(10)[1],
                     "top_logprobs": [{"token": tt(11)[0], "logprob": -1.5, "bytes": tt(11)[1]}]}
