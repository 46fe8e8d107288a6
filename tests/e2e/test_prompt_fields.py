"""vLLM's request fields of completions and chat completions, through the official openai SDK and httpx on the
tiny-random server (SmolLM2's tokenizer and template, random weights: only the plumbing is under test):
``truncate_prompt_tokens``, ``prompt_logprobs``, chat ``echo``, ``stop_reason``, completions' ``text_offset``
where characters span tokens, and the fields this server refuses rather than ignore."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "tiny-random"
EOS = 2  # <|im_end|>, the model's end of sequence
SPLIT_TEXT = "Emoji 🙂 and 日本語 é!"  # byte-level BPE splits 日 and 語 over several tokens
GRAMMAR_TEXT = "🙂日本語é🙂"


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def max_len(http) -> int:
    return http.get(f"/v1/models/{MODEL}").json()["max_model_len"]


def ids_of(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]


def text_of(http: httpx.Client, ids: list[int]) -> str:
    return http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]


def refused(http: httpx.Client, route: str, body: dict) -> str:
    """The ``param`` a 400 names."""
    r = http.post(route, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


# -- truncate_prompt_tokens ---------------------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_last_tokens_of_a_prompt_past_the_context(client, http, max_len):
    ids = [100 + i % 5000 for i in range(max_len + 50)]  # refused whole: longer than the context
    assert refused(http, "/v1/completions", {"prompt": ids, "max_tokens": 1}) == "prompt"
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True,
                                  extra_body={"truncate_prompt_tokens": 8})
    assert r.usage.prompt_tokens == 8
    assert r.choices[0].text.startswith(text_of(http, ids[-8:]))  # echo shows what the engine got
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True,
                                  extra_body={"truncate_prompt_tokens": 8, "truncation_side": "right"})
    assert r.usage.prompt_tokens == 8 and r.choices[0].text.startswith(text_of(http, ids[:8]))
    # -1: as much as the context leaves beside max_tokens.
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == max_len - 4
    # A prompt shorter than k is sent whole.
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, extra_body={"truncate_prompt_tokens": 8})
    assert r.usage.prompt_tokens == 1
    assert refused(http, "/v1/completions", {"prompt": ids, "max_tokens": 4,
                                             "truncate_prompt_tokens": max_len - 3}) == "truncate_prompt_tokens"
    assert refused(http, "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": -2}) == "truncate_prompt_tokens"


def test_truncate_prompt_tokens_cuts_the_rendered_chat_prompt(client, http, max_len):
    messages = [{"role": "system", "content": "word " * max_len}, {"role": "user", "content": "Hi"}]
    assert refused(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}) == "messages"
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                       extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5
    short = [{"role": "system", "content": "word " * 50}, {"role": "user", "content": "Hi"}]
    whole = http.post("/v1/chat/completions/render", json={"model": MODEL, "messages": short}).json()
    cut = http.post("/v1/chat/completions/render",
                    json={"model": MODEL, "messages": short, "truncate_prompt_tokens": 5}).json()
    assert cut["token_ids"] == whole["token_ids"][-5:]  # the end of the prompt: the generation prompt stays


# -- prompt_logprobs ----------------------------------------------------------------------------------

def check_prompt_logprobs(http: httpx.Client, entries: list, prompt_ids: list[int], prompt: str, k: int) -> None:
    """vLLM's shape: one entry per prompt token, the first None; the prompt token's entry first (its text, special
    tokens spelled out), then the top k ranked 1..k, best first; the values the native route gives."""
    r = http.post("/inference/v1/generate", json={"model": MODEL, "token_ids": prompt_ids,
                                                  "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}})
    reference = [e["logprob"] for e in r.json()["prompt_logprobs"][1:]]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for entry, tid, want in zip(entries[1:], prompt_ids[1:], reference):
        keys = list(entry)
        assert keys[0] == str(tid) and len(keys) in (k, k + 1)
        mine = entry[str(tid)]
        assert mine["logprob"] == pytest.approx(want, abs=1e-4) and mine["rank"] >= 1
        ranked = sorted((v["rank"], v["logprob"]) for key, v in entry.items() if key != str(tid) or len(keys) == k)
        assert [rank for rank, _ in ranked] == list(range(1, k + 1))
        assert [lp for _, lp in ranked] == sorted((lp for _, lp in ranked), reverse=True)
        if len(keys) == k + 1:  # not among the top k: ranked below them
            assert mine["rank"] > k and all(lp >= mine["logprob"] for _, lp in ranked)
    decoded = "".join(entry[str(tid)]["decoded_token"] for entry, tid in zip(entries[1:], prompt_ids[1:]))
    assert len(decoded) < len(prompt) and prompt.endswith(decoded)


def test_prompt_logprobs_on_completions_and_chat(client, http):
    prompt = "The capital of France is Paris"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 2})
    check_prompt_logprobs(http, r.choices[0].model_extra["prompt_logprobs"], ids_of(http, prompt), prompt, 2)

    messages = [{"role": "user", "content": "Hello there"}]
    rendered = http.post("/v1/chat/completions/render", json={"model": MODEL, "messages": messages}).json()
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, n=2,
                                       extra_body={"prompt_logprobs": 0})
    entries = r.model_extra["prompt_logprobs"]  # once per response: the choices share the prompt
    check_prompt_logprobs(http, entries, rendered["token_ids"], rendered["prompt"], 0)
    assert all(len(e) == 1 for e in entries[1:])
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert plain.model_extra["prompt_logprobs"] is None


def test_prompt_logprobs_are_refused_with_stream(http):
    assert refused(http, "/v1/completions", {"prompt": "x", "stream": True, "prompt_logprobs": 1}) == "prompt_logprobs"
    assert refused(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                                                  "prompt_logprobs": 0}) == "prompt_logprobs"
    assert refused(http, "/v1/completions", {"prompt": "x", "prompt_logprobs": 21}) == "prompt_logprobs"


# -- chat echo ----------------------------------------------------------------------------------------

def streamed_contents(stream) -> dict[int, str]:
    out: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            out[c.index] = out.get(c.index, "") + (c.delta.content or "")
    return out


def test_chat_echo_starts_the_answer_with_the_continued_message(client):
    messages = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": "Sure, here"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0, n=2,
              extra_body={"continue_final_message": True, "echo": True})
    r = client.chat.completions.create(**kw)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"continue_final_message": True})
    for c in r.choices:
        assert c.message.content == "Sure, here" + plain.choices[0].message.content
    assert streamed_contents(client.chat.completions.create(**kw, stream=True)) == \
        {c.index: c.message.content for c in r.choices}


def test_chat_echo_needs_the_answers_role(client):
    """vLLM's rule: the last message is echoed when its role is the answer's: the assistant's after a generation
    prompt, the last message's own without one."""
    user_last = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=MODEL, messages=user_last, max_tokens=3, temperature=0,
                                       extra_body={"echo": True})
    plain = client.chat.completions.create(model=MODEL, messages=user_last, max_tokens=3, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=user_last, max_tokens=3, temperature=0,
                                       extra_body={"echo": True, "add_generation_prompt": False})
    assert r.choices[0].message.content.startswith("Say something.")


# -- stop_reason --------------------------------------------------------------------------------------

def stop_reasons(client: openai.OpenAI, route: str, **kw) -> tuple[tuple, tuple]:
    """(finish_reason, stop_reason) of a greedy answer, whole and streamed."""
    create = client.completions.create if route == "completions" else client.chat.completions.create
    whole = create(model=MODEL, temperature=0, **kw).choices[0]
    last = [c.choices[0] for c in create(model=MODEL, temperature=0, stream=True, **kw)
            if c.choices and c.choices[0].finish_reason][-1]
    return tuple((c.finish_reason, c.model_extra["stop_reason"]) for c in (whole, last))


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stop_reason_names_the_stop_string_or_token(client, http, route):
    if route == "completions":
        ask = {"prompt": "Hello", "max_tokens": 6}
        text = client.completions.create(model=MODEL, temperature=0, **ask).choices[0].text
        prompt_ids = ids_of(http, "Hello")
    else:
        ask = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}
        text = client.chat.completions.create(model=MODEL, temperature=0, **ask).choices[0].message.content
        prompt_ids = http.post("/v1/chat/completions/render", json={"model": MODEL, **ask}).json()["token_ids"]
    assert len(text) >= 4
    stop = text[2:4]
    assert stop_reasons(client, route, stop=[stop], **ask) == (("stop", stop),) * 2
    gen = http.post("/inference/v1/generate", json={"model": MODEL, "token_ids": prompt_ids,
                                                    "sampling_params": {"max_tokens": 1, "temperature": 0}})
    token = gen.json()["choices"][0]["token_ids"][0]  # the greedy first token: generation stops right there
    assert stop_reasons(client, route, extra_body={"stop_token_ids": [token]}, **ask) == (("stop", token),) * 2
    assert stop_reasons(client, route, **ask) == (("length", None),) * 2
    # EOS ends with no stop_reason, even when listed as a stop token; ignoring EOS makes it one.
    eos = {"logit_bias": {str(EOS): 100}}
    assert stop_reasons(client, route, **eos, **ask) == (("stop", None),) * 2
    assert stop_reasons(client, route, extra_body={"stop_token_ids": [EOS]}, **eos, **ask) == (("stop", None),) * 2
    assert stop_reasons(client, route, extra_body={"stop_token_ids": [EOS], "ignore_eos": True}, **eos, **ask) \
        == (("stop", EOS),) * 2


# -- text_offset --------------------------------------------------------------------------------------

def check_offsets(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Each token starts where its text is: its whole characters at its offset; a token whose first bytes finish or
    begin a character split over tokens (written U+FFFD) starts at that character."""
    assert len(tokens) == len(offsets) and offsets == sorted(offsets) and offsets[-1] <= len(text)
    for tok, off in zip(tokens, offsets):
        head = tok.split("\ufffd")[0]
        assert text[off:].startswith(head), (tok, off)
        if "\ufffd" in tok:
            assert ord(text[off + len(head)]) > 127, (tok, off)


def test_text_offset_counts_characters_split_over_tokens_streamed_or_not(client):
    kw = dict(model=MODEL, prompt=SPLIT_TEXT, max_tokens=24, temperature=0, echo=True, logprobs=1,
              extra_body={"structured_outputs": {"regex": GRAMMAR_TEXT}})
    r = client.completions.create(**kw).choices[0]
    assert r.text == SPLIT_TEXT + GRAMMAR_TEXT and r.finish_reason == "stop"
    lp = r.logprobs
    assert any("\ufffd" in t for t in lp.tokens)  # the prompt's characters really are split
    check_offsets(r.text, lp.tokens, lp.text_offset)
    text, tokens, offsets = "", [], []
    for chunk in client.completions.create(**kw, stream=True):
        if chunk.choices:
            c = chunk.choices[0]
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert (text, tokens, offsets) == (r.text, lp.tokens, lp.text_offset)
    # Without echo the offsets count from the start of the generated text.
    kw.pop("echo")
    alone = client.completions.create(**kw).choices[0]
    assert alone.text == GRAMMAR_TEXT
    check_offsets(alone.text, alone.logprobs.tokens, alone.logprobs.text_offset)


# -- refused, never ignored ---------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["x"]}, "bad_words"),
    ("/v1/completions", {"prompt": "x", "return_token_ids": True}, "return_token_ids"),
    ("/v1/completions", {"prompt": "x", "cache_salt": "salt"}, "cache_salt"),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {**CHAT, "include_reasoning": False}, "include_reasoning"),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions/render", {**CHAT, "logprob_token_ids": [3]}, "logprob_token_ids"),
])
def test_fields_this_server_does_not_implement_are_refused(http, route, body, param):
    assert refused(http, route, body) == param


def test_inert_values_of_those_fields_are_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=1, modalities=["text"],
                                       extra_body={"use_beam_search": False, "include_reasoning": True,
                                                   "bad_words": [], "reasoning_effort": "low",
                                                   "documents": [{"title": "t", "text": "d"}]})
    assert r.choices[0].finish_reason in ("stop", "length")
