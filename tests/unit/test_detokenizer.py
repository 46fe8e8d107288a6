"""Incremental detokenization yields, piece by piece, exactly the text of a full decode."""

from __future__ import annotations

import random

import pytest

from gateway.text.detokenizer import IncrementalDetokenizer
from zserve.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "Emoji 😀🎉👍🏽🇫🇷 and a family 👨‍👩‍👧‍👦 in a row",
    "中文文本，日本語のテキスト、한국어 텍스트 — mixed with English.",
    "Ångström café naïve 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 ∑∫√",
    "def f(x):\n    return x ** 2\n\n\n12345 and 3.14159\t\ttabs",
    "<|im_start|>assistant\nHi 😀<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.fixture(autouse=True, params=["bytewise", "windows"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs both ways of decoding: through token bytes (SmolLM2's byte-level BPE allows it) and through
    decode windows (what other tokenizers get)."""
    monkeypatch.setattr(Tokenizer, "decodes_bytewise", property(lambda self: request.param == "bytewise"))
    return request.param


def stream(tok: Tokenizer, ids: list[int], chunks: list[int], skip_special_tokens: bool = True) -> list[str]:
    """Push ``ids`` in chunks of the given sizes; return every piece of text, flush last."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces, start = [], 0
    for size in chunks:
        pieces.append(detok.push(ids[start:start + size]))
        start += size
    assert start == len(ids)
    pieces.append(detok.flush())
    assert detok.token_ids == ids
    return pieces


def random_chunks(n: int, rng: random.Random) -> list[int]:
    sizes = []
    while n > 0:
        size = min(n, rng.choice([1, 1, 2, 3, 5, 8]))
        sizes.append(size)
        n -= size
    return sizes


def test_texts_really_split_characters_across_tokens(tok: Tokenizer) -> None:
    # Guards the tests below: a token that is not valid UTF-8 on its own must occur.
    ids = tok.encode(TEXTS[1])
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tok: Tokenizer, text: str, skip_special_tokens: bool) -> None:
    ids = tok.encode(text)
    pieces = stream(tok, ids, [1] * len(ids), skip_special_tokens)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[-1] == ""  # valid text: nothing is left for flush


@pytest.mark.parametrize("seed", range(20))
def test_random_chunkings_equal_full_decode(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.sample(TEXTS, k=len(TEXTS)))
    ids = tok.encode(text)
    pieces = stream(tok, ids, random_chunks(len(ids), rng))
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_a_chunk_ending_mid_character_emits_its_complete_text_now(tok: Tokenizer) -> None:
    ids = tok.encode("Hi 😀")
    emoji_start = next(i for i, t in enumerate(ids) if "\ufffd" in tok.decode(ids[: i + 1]))
    detok = IncrementalDetokenizer(tok)
    first = detok.push(ids[: emoji_start + 1])
    # All but the emoji: the token that starts it (" " and its first byte) is held back whole by the window
    # path, and up to the byte by the bytewise one.
    assert first in (tok.decode(ids[:emoji_start]), tok.decode(ids[:emoji_start]) + " ")
    rest = detok.push(ids[emoji_start + 1:])
    assert rest.endswith("😀") and first + rest == tok.decode(ids)


def test_flush_returns_an_unfinished_character_as_full_decode_does(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")[:-1]  # generation stopped inside the emoji
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push([i]) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tok.decode(ids)
    assert detok.flush() == ""


def test_special_tokens_are_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("Paris.<|im_end|>")
    assert "".join(stream(tok, ids, [1] * len(ids))) == "Paris."
    assert "".join(stream(tok, ids, [1] * len(ids), skip_special_tokens=False)) == "Paris.<|im_end|>"


def test_empty_push_and_flush_of_nothing(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    assert detok.push([]) == ""
    assert detok.flush() == ""
    assert detok.token_ids == []


def test_stray_bytes_do_not_stall_the_stream(tok: Tokenizer) -> None:
    # A model can emit byte tokens that never form a character; text after them must still flow.
    stray = tok.encode("😀")[1]  # a lone continuation byte
    ids = [stray] * 3 + tok.encode(" and then words that keep coming for a while")
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push([i]) for i in ids)
    assert streamed.endswith("for a while")
    assert streamed + detok.flush() == tok.decode(ids)


def test_endless_stray_bytes_are_emitted_with_a_bounded_window(tok: Tokenizer) -> None:
    stray = tok.encode("😀")[1]
    ids = [stray] * 40
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push([i]) for i in ids)
    assert streamed.count("\ufffd") >= 30  # not all held back until the end
    assert streamed + detok.flush() == tok.decode(ids)


def test_each_push_decodes_a_short_window(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tok.encode(" ".join(TEXTS) * 20)
    longest = 0
    decode = tok.decode

    def measuring_decode(window, skip_special_tokens=True):
        nonlocal longest
        longest = max(longest, len(window))
        return decode(window, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tok, "decode", measuring_decode)
    detok = IncrementalDetokenizer(tok, bytewise=False)
    for i in ids:
        detok.push([i])
    detok.flush()
    assert len(ids) > 1000
    assert longest <= 8  # O(new tokens), never the whole sequence


def test_bytewise_is_chosen_for_a_lone_byte_level_decoder_only(tok: Tokenizer) -> None:
    from zserve.tokenizer import _decodes_bytewise

    assert _decodes_bytewise(tok.backend)
    from zserve import catalog

    try:
        minilm = Tokenizer.from_dir(catalog.minilm_model_dir())
    except catalog.ModelNotFound as e:
        pytest.skip(str(e))
    assert not _decodes_bytewise(minilm.backend)  # WordPiece: "##" pieces join, others get spaces


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(10))
def test_bytewise_equals_decode_on_any_ids(tok: Tokenizer, seed: int, skip_special_tokens: bool) -> None:
    """Arbitrary ids (stray bytes, halves of characters, special and added tokens): the bytewise path's text is
    the backend's decode, whose lossy UTF-8 it must reproduce to the last replacement character."""
    rng = random.Random(seed)
    specials = sorted(tok.all_special_ids)
    ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tok.vocab_size) for _ in range(300)]
    ids += tok.encode("😀")[:1]  # end inside a character
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens, bytewise=True)
    text = "".join(detok.push(ids[i:i + n]) for i, n in zip(range(0, len(ids), 3), [3] * len(ids)))
    assert text + detok.flush() == tok.decode(ids, skip_special_tokens=skip_special_tokens)
