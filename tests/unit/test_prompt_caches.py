"""The prompt caches change nothing but speed.

``Tokenizer.encode`` splits text at added tokens and caches the pieces' ids; it must give exactly
the backend's ``encode(...).ids`` for any text, cold or cached, after evictions, and it must refuse
to split where the backend's own split would differ. ``ChatTemplate.render`` caches whole renders;
it must return exactly the uncached text, never cache a template that reads the clock or random,
raise every error on every call, and keep within its bounds.
"""

from __future__ import annotations

import enum
import math
import random

import pytest
from tokenizers import AddedToken, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from gateway.text.chat_template import ChatTemplate, ChatTemplateError
from zserve import catalog
from zserve.catalog import ModelNotFound
from zserve.tokenizer import SizedLRU, Tokenizer

CHATML_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)

# Text that stresses pre-tokenizers and normalizers: whitespace runs, digits, accents (NFD and
# NFC), CJK, emoji with modifiers and joiners, control characters, and near-misses of special tokens.
FRAGMENTS = [
    " ", "  ", "\n", "\n\n", "\t", "\r\n", " \u00a0", "a", "Hello", " world", "don't", "12", " 345", "3.14",
    "é", "e\u0301", "Å", "ß", "中文", "日本語", "한국어", "😀", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "\u200b", "\x00",
    "\x7f", "<", ">", "|", "<|", "|>", "<|im_st", "im_end|>", "<|im_end", "[CL", "S]", "[SEP", "[MASK", "##",
    "<s>", "</s", "user", "assistant", "<|endoftext|", "lowerUPPER", "ǅ", "ﬁ", "\u2581", "Ġ",
]


def random_text(rng: random.Random, specials: list[str], max_parts: int = 24) -> str:
    parts = []
    for _ in range(rng.randint(0, max_parts)):
        roll = rng.random()
        if roll < 0.25 and specials:
            parts.append(rng.choice(specials))  # adjacent specials, at the start and the end too
        elif roll < 0.6:
            parts.append(rng.choice(FRAGMENTS))
        else:
            parts.append("".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0xA0, 0x2FFF),
                                                 rng.randint(0x4E00, 0x9FFF), rng.randint(0x1F300, 0x1FAFF)]))
                                 for _ in range(rng.randint(1, 12))))
    return "".join(parts)


_TOKENIZER_CACHE: list[str] = []  # the session's tokenizer cache directory (set by ``tokenizer_cache``)


@pytest.fixture(scope="module", autouse=True)
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    _TOKENIZER_CACHE[:] = [str(tmp_path_factory.getbasetemp() / "tokenizer-cache")]


def load(name: str) -> Tokenizer:
    """A new tokenizer (its caches empty), built from the session's tokenizer cache as a gateway builds one: reading
    the GGUF's vocabulary takes seconds, once."""
    try:
        if name == "smollm2":
            return Tokenizer.from_gguf(catalog.resolve(catalog.TINY_RANDOM).tokenizer_path,
                                       cache_dir=_TOKENIZER_CACHE[0])
        return Tokenizer.from_dir(catalog.minilm_model_dir())
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=["smollm2", "minilm"])
def real_tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return load(request.param)


def special_contents(tok: Tokenizer) -> list[str]:
    return [t.content for t in tok.backend.get_added_tokens_decoder().values()]


def with_cache(tok: Tokenizer, cache: SizedLRU) -> Tokenizer:
    return Tokenizer(tok.backend, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, piece_cache=cache)


# -- tokenizer ---------------------------------------------------------------------------------


def test_both_shipped_tokenizers_take_the_piecewise_path(real_tokenizer: Tokenizer) -> None:
    assert real_tokenizer.piece_cache is not None
    for token in real_tokenizer.backend.get_added_tokens_decoder().values():
        assert not (token.lstrip or token.rstrip or token.single_word or token.normalized)


def test_benchmark_prompt_encodes_as_the_backend_does_cold_and_cached() -> None:
    tok = load("smollm2")
    expected = tok.backend.encode(CHATML_PROMPT, add_special_tokens=False).ids
    assert tok.encode(CHATML_PROMPT) == expected
    hits = tok.piece_cache.hits
    assert tok.encode(CHATML_PROMPT) == expected
    assert tok.piece_cache.hits > hits


def test_piecewise_encode_equals_backend_encode_on_random_text(real_tokenizer: Tokenizer) -> None:
    rng = random.Random(1234)
    backend = real_tokenizer.backend
    specials = special_contents(real_tokenizer)
    texts = ["", " ", *specials, "".join(specials), f" {specials[0]} ", CHATML_PROMPT]
    texts += [random_text(rng, specials) for _ in range(400)]
    for _ in range(2):  # the second round is served from the cache
        for text in texts:
            assert real_tokenizer.encode(text) == backend.encode(text, add_special_tokens=False).ids, repr(text)
            assert (real_tokenizer.encode(text, add_special_tokens=True)
                    == backend.encode(text, add_special_tokens=True).ids), repr(text)
    assert real_tokenizer.piece_cache.hits > 0


def test_returned_ids_are_fresh_lists() -> None:
    tok = load("smollm2")
    first = tok.encode("Hello there")
    first.append(-1)
    assert tok.encode("Hello there") == tok.backend.encode("Hello there").ids


def test_eviction_keeps_ids_exact_and_bounds_hold(real_tokenizer: Tokenizer) -> None:
    # Sizes are estimated bytes (~150 an entry plus the text and 36 an id): room for a few pieces.
    cache = SizedLRU(max_entries=8, max_size=3000, max_item_size=800)
    tok = with_cache(real_tokenizer, cache)
    rng = random.Random(99)
    specials = special_contents(real_tokenizer)
    texts = [random_text(rng, specials) for _ in range(60)]
    for text in texts * 3:
        assert tok.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids, repr(text)
        assert len(cache) <= 8 and cache.size <= 3000
    assert cache.hits > 0 and cache.misses > 0
    long_piece = "x " * 400
    assert tok.encode(long_piece) == tok.backend.encode(long_piece, add_special_tokens=False).ids
    assert cache.get(long_piece) is None  # over max_item_size: encoded, not kept


def test_encode_batch_fast_gives_the_ids_of_encode(real_tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    texts = [random_text(rng, special_contents(real_tokenizer)) for _ in range(200)]
    fast = real_tokenizer.backend.encode_batch_fast(texts, add_special_tokens=False)
    assert [e.ids for e in fast] == [real_tokenizer.backend.encode(t, add_special_tokens=False).ids for t in texts]


def toy_backend(special: AddedToken, pre: pre_tokenizers.PreTokenizer | None = None) -> Backend:
    vocab = {c: i for i, c in enumerate(["[UNK]", *"abcdexyz", " ", "\u2581", "ab", "<s>"])}
    backend = Backend(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre or pre_tokenizers.Split("", "isolated")
    backend.add_special_tokens([special])
    return backend


REFUSED = {
    "lstrip": lambda: toy_backend(AddedToken("<s>", special=True, normalized=False, lstrip=True)),
    "rstrip": lambda: toy_backend(AddedToken("<s>", special=True, normalized=False, rstrip=True)),
    "single_word": lambda: toy_backend(AddedToken("<s>", special=True, normalized=False, single_word=True)),
    "normalized": lambda: toy_backend(AddedToken("<S>", special=True, normalized=True)),
    "metaspace first": lambda: toy_backend(AddedToken("<s>", special=True, normalized=False),
                                           pre_tokenizers.Metaspace(prepend_scheme="first")),
}


@pytest.mark.parametrize("kind", REFUSED)
def test_tokenizers_whose_split_differs_are_encoded_whole(kind: str) -> None:
    backend = REFUSED[kind]()
    tok = Tokenizer(backend, bos_token_id=None, eos_token_id=None)
    assert tok.piece_cache is None
    rng = random.Random(5)
    contents = special_contents(tok)
    for _ in range(200):
        text = "".join(rng.choice(["a", "b", "x ", " ", "  ", "AB", "<s>", "<S>", "<", "s>", *contents])
                       for _ in range(rng.randint(0, 12)))
        assert tok.encode(text) == backend.encode(text, add_special_tokens=False).ids, repr(text)


def test_refusing_lstrip_matters() -> None:
    # What a naive split would get wrong: lstrip makes "<s>" swallow the space before it.
    backend = REFUSED["lstrip"]()
    whole = backend.encode("ab <s>", add_special_tokens=False).ids
    naive = backend.encode("ab ", add_special_tokens=False).ids + [backend.token_to_id("<s>")]
    assert whole != naive


def test_refusing_metaspace_first_matters() -> None:
    backend = REFUSED["metaspace first"]()
    sid = backend.token_to_id("<s>")
    whole = backend.encode("ab<s>ab", add_special_tokens=False).ids
    naive = backend.encode("ab", add_special_tokens=False).ids + [sid] + backend.encode("ab").ids
    assert whole != naive


def test_toy_tokenizer_with_plain_special_is_split_and_exact() -> None:
    backend = toy_backend(AddedToken("<s>", special=True, normalized=False))
    backend.add_special_tokens([AddedToken("<s><s>x", special=True, normalized=False)])  # overlaps "<s>"
    tok = Tokenizer(backend, bos_token_id=None, eos_token_id=None)
    assert tok.piece_cache is not None
    rng = random.Random(11)
    for _ in range(300):
        text = "".join(rng.choice(["a", "b", "x", " ", "AB", "<s>", "<s><s>", "<s", "s>", "<s><s>x"])
                       for _ in range(rng.randint(0, 12)))
        assert tok.encode(text) == backend.encode(text, add_special_tokens=False).ids, repr(text)


def test_sized_lru_evicts_least_recent_first() -> None:
    lru: SizedLRU[str, int] = SizedLRU(max_entries=3, max_size=10)
    for key in "abc":
        lru.put(key, ord(key), 1)
    assert lru.get("a") == ord("a")  # "b" is now the least recent
    lru.put("d", 4, 1)
    assert lru.get("b") is None and lru.get("a") is not None
    lru.put("e", 5, 9)  # 1 + 1 + 9 > 10: older entries go until it fits
    assert lru.size <= 10 and len(lru) <= 3 and lru.get("e") == 5
    lru.put("e", 6, 2)  # replacing an entry replaces its size
    assert lru.get("e") == 6 and lru.size == 3 and len(lru) == 2  # "a" (1) and "e" (2) are left
    lru.put("huge", 0, 11)
    assert lru.get("huge") is None


# -- chat template ----------------------------------------------------------------------------

TOOLS_TEMPLATE = """{{ bos_token }}
{%- if tools %}TOOLS {{ tools | tojson }}
{% endif -%}
{%- for message in messages -%}
  {%- if message['role'] == 'forbidden' %}{{ raise_exception('forbidden role') }}{% endif -%}
  <{{ message['role'] }}>{% for k, v in message.items() %}{% if k != 'role' %}{{ k }}={{ v }};{% endif %}{% endfor %}
  {%- if message.tool_calls is defined %}{{ message.tool_calls | tojson }}{% endif %}
{% endfor -%}
{%- if enable_thinking is defined %}think={{ enable_thinking }}
{% endif -%}
{%- if documents %}docs={{ documents | tojson }}
{% endif -%}
{%- if add_generation_prompt %}<assistant>{{ add_generation_prompt }}{% endif %}"""

ROLES = ["system", "user", "assistant", "tool"]


def random_messages(rng: random.Random) -> list[dict]:
    messages = []
    for _ in range(rng.randint(0, 6)):
        message: dict = {"role": rng.choice(ROLES), "content": rng.choice(["hi", "", "Paris.", "😀 中文", " x "])}
        if rng.random() < 0.3:
            message = {"content": message["content"], "role": message["role"]}  # other key order
        if rng.random() < 0.2:
            message["content"] = [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]
        if rng.random() < 0.2:
            message["tool_calls"] = [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
        if rng.random() < 0.1:
            message["weight"] = rng.choice([0, 1, 1.0, 0.5, True, None, -0.0])
        messages.append(message)
    return messages


def random_kwargs(rng: random.Random) -> dict:
    kwargs: dict = {"add_generation_prompt": rng.choice([True, False])}
    if rng.random() < 0.4:
        kwargs["tools"] = rng.choice([
            [], [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}],
            [{"type": "function", "function": {"name": "f", "parameters": {"a": 2, "b": 1}}}],
        ])
    if rng.random() < 0.3:
        kwargs["enable_thinking"] = rng.choice([True, False, 1, "yes"])
    if rng.random() < 0.2:
        kwargs["documents"] = [{"title": "t", "text": rng.choice(["d1", "d2"])}]
    return kwargs


def uncached(template: ChatTemplate) -> ChatTemplate:
    plain = ChatTemplate(template.source, template.bos_token, template.eos_token)
    plain.cache = None
    return plain


def smollm2_template() -> ChatTemplate:
    tok = load("smollm2")
    return ChatTemplate(tok.chat_template, bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")


@pytest.mark.parametrize("source", ["tools", "smollm2"])
def test_cached_render_equals_uncached_render(source: str) -> None:
    cached = smollm2_template() if source == "smollm2" else ChatTemplate(TOOLS_TEMPLATE, "<s>", "</s>")
    plain = uncached(cached)
    assert cached.cache is not None
    rng = random.Random(2024)
    cases = [(random_messages(rng), random_kwargs(rng)) for _ in range(300)]
    for _ in range(2):  # the second round hits
        for messages, kwargs in cases:
            assert cached.render(messages, **kwargs) == plain.render(messages, **kwargs)
    assert cached.cache.hits >= len(cases)


def test_render_ids_equals_render_then_encode_cold_cached_and_mixed() -> None:
    """``render_ids`` (text and ids from one cache entry) gives what rendering and tokenizing without any cache give,
    whether the entry is new, was made by ``render`` (text only) or by ``render_ids`` before; the ids it returns
    are the caller's to change."""
    tok = load("smollm2")
    cached = smollm2_template()
    plain = uncached(cached)
    rng = random.Random(7)
    cases = [(random_messages(rng), random_kwargs(rng)) for _ in range(80)]
    for i, (messages, kwargs) in enumerate(cases):
        if i % 3 == 0:
            cached.render(messages, **kwargs)  # an entry with the text only
    for _ in range(2):
        for messages, kwargs in cases:
            text = plain.render(messages, **kwargs)
            ids = tok.backend.encode(text, add_special_tokens=False).ids
            got_text, got_ids = cached.render_ids(messages, tok.encode, **kwargs)
            assert (got_text, got_ids) == (text, ids)
            got_ids.append(-1)  # the cache keeps its own list
            assert cached.render_ids(messages, tok.encode, **kwargs)[1] == ids
            assert cached.render(messages, **kwargs) == text


def test_render_ids_tokenizes_a_conversation_once(monkeypatch: pytest.MonkeyPatch) -> None:
    template = smollm2_template()
    calls: list[str] = []
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    for _ in range(3):
        text, ids = template.render_ids(messages, lambda t: calls.append(t) or [1, 2, 3])
    assert calls == [text] and ids == [1, 2, 3]


def test_a_repeated_render_does_not_run_jinja(monkeypatch: pytest.MonkeyPatch) -> None:
    template = ChatTemplate(TOOLS_TEMPLATE, "<s>", "</s>")
    calls = []
    real = template._template.render
    monkeypatch.setattr(template._template, "render", lambda **ctx: calls.append(1) or real(**ctx))
    messages = [{"role": "user", "content": "hi"}]
    first = template.render(messages, tools=[{"type": "function"}], enable_thinking=True)
    assert template.render(messages, tools=[{"type": "function"}], enable_thinking=True) == first
    assert len(calls) == 1 and template.cache.hits == 1
    template.render(messages, tools=[{"type": "function"}], enable_thinking=False)
    template.render(messages, add_generation_prompt=False, tools=[{"type": "function"}], enable_thinking=True)
    assert len(calls) == 3


@pytest.mark.parametrize("source", [
    "{{ strftime_now('%H:%M:%S.%f') }}{{ messages[0]['content'] }}",
    "{% set now = strftime_now %}{{ now('%f') }}",
    "{{ lipsum(1) }}",
    "{{ messages | random }}",
    "{% filter random %}abc{% endfilter %}",
])
def test_templates_that_read_the_clock_or_random_are_never_cached(source: str) -> None:
    assert ChatTemplate(source, "", "").cache is None


def test_a_clock_template_renders_anew_every_call() -> None:
    template = ChatTemplate("{{ strftime_now('%Y') }}|{{ messages[0]['content'] }}", "", "")
    ticks = iter(range(100))
    template._template.globals["strftime_now"] = lambda fmt: str(next(ticks))
    messages = [{"role": "user", "content": "hi"}]
    assert [template.render(messages) for _ in range(3)] == ["0|hi", "1|hi", "2|hi"]


def test_errors_are_raised_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    template = ChatTemplate(TOOLS_TEMPLATE, "<s>", "</s>")
    calls = []
    real = template._template.render
    monkeypatch.setattr(template._template, "render", lambda **ctx: calls.append(1) or real(**ctx))
    bad = [{"role": "forbidden", "content": "x"}]
    for _ in range(3):
        with pytest.raises(ChatTemplateError, match="forbidden role"):
            template.render(bad)
        with pytest.raises(ChatTemplateError, match="content must be a string"):
            template.render([{"role": "user", "content": 5}])
    assert len(calls) == 3 and len(template.cache) == 0


class Role(enum.StrEnum):
    USER = "user"


def test_inputs_that_json_would_blur_are_not_confused() -> None:
    template = ChatTemplate(TOOLS_TEMPLATE, "<s>", "</s>")
    plain = uncached(template)
    tool_none = [{"type": "function", "x": None}]
    tool_nan = [{"type": "function", "x": math.nan}]
    tool_inf = [{"type": "function", "x": math.inf}]
    assert template.render([], tools=tool_none) == plain.render([], tools=tool_none)
    assert template.render([], tools=tool_nan) == plain.render([], tools=tool_nan)  # NaN is not null
    assert template.render([], tools=tool_inf) == plain.render([], tools=tool_inf)
    assert "NaN" in template.render([], tools=tool_nan)
    template.render([{"role": "user", "content": "hi"}])  # cached with a plain str role
    with pytest.raises(ChatTemplateError, match="unsupported value"):
        template.render([{"role": Role.USER, "content": "hi"}])  # an Enum is not a str to _plain
    # Key order is part of the input: tojson keeps it.
    a = template.render([], tools=[{"a": 1, "b": 2}])
    b = template.render([], tools=[{"b": 2, "a": 1}])
    assert a != b and b == plain.render([], tools=[{"b": 2, "a": 1}])
    # 1, 1.0 and True render differently.
    renders = {template.render([], add_generation_prompt=v) for v in (1, 1.0, True)}
    assert len(renders) == 3
    # Tuples are not cached but still render.
    assert template.render(({"role": "user", "content": "t"},)) == plain.render([{"role": "user", "content": "t"}])


def test_render_cache_bounds_hold() -> None:
    template = ChatTemplate(TOOLS_TEMPLATE, "<s>", "</s>", cache=SizedLRU(max_entries=4, max_size=2000,
                                                                          max_item_size=600))
    plain = uncached(template)
    rng = random.Random(3)
    for _ in range(200):
        messages = [{"role": "user", "content": f"message {rng.randint(0, 12)}"}]
        assert template.render(messages) == plain.render(messages)
        assert len(template.cache) <= 4 and template.cache.size <= 2000
    assert template.cache.hits > 0
    big = [{"role": "user", "content": "x" * 700}]
    template.render(big)
    template.render(big)
    assert all(len(text) < 600 for text, _ in template.cache._items.values())
