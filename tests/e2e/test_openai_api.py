"""The official openai SDK against `launch api-server --count 2` serving the real SmolLM2."""

from __future__ import annotations

import httpx
import openai
import pytest

from zserve.catalog import DEFAULT_CHAT_MODEL

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smollm_server):
    return openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [DEFAULT_CHAT_MODEL]


def test_greedy_chat_answers_paris(client):
    r = client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    # The reference greedy answer is "The capital of France is Paris." + EOS: 8 tokens.
    assert choice.message.content == "The capital of France is Paris."
    assert r.usage.prompt_tokens == 37 and r.usage.completion_tokens == 8
    assert r.usage.total_tokens == 45


def test_streamed_chat_equals_the_full_answer_and_reports_usage(client):
    stream = client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=QUESTION, temperature=0,
                                            max_tokens=20, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert len({c.id for c in chunks}) == 1


def test_completion_respects_max_tokens(client):
    r = client.completions.create(model=DEFAULT_CHAT_MODEL, prompt="The capital of France is", max_tokens=5,
                                  temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.choices[0].text.strip()


def test_streamed_completion_matches_non_streamed(client):
    kw = dict(model=DEFAULT_CHAT_MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(parts) == full


def test_stop_string_cuts_the_text(client):
    r = client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=QUESTION, temperature=0, max_tokens=20,
                                       stop=["Paris"])
    assert r.choices[0].message.content == "The capital of France is "
    assert r.choices[0].finish_reason == "stop"


def test_chat_logprobs_are_returned(client):
    r = client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=QUESTION, temperature=0, max_tokens=3,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == ["The", " capital", " of"]
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token  # greedy picks the most likely token


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="gpt-nope", messages=QUESTION)
    assert ei.value.body["code"] == "model_not_found"


def test_bad_field_is_400_naming_the_param(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=QUESTION, temperature=7)
    assert ei.value.body["param"] == "temperature"
    assert ei.value.body["type"] == "invalid_request_error"


def test_invalid_json_is_400_in_openai_shape(smollm_server):
    r = httpx.post(smollm_server.url + "/v1/chat/completions", content=b"{nope",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "JSON" in err["message"]


def test_prompt_beyond_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=DEFAULT_CHAT_MODEL, prompt="hello " * 3000, max_tokens=4)
    assert "maximum context length" in ei.value.body["message"]
    assert ei.value.body["param"] == "prompt" and ei.value.body["code"] == "context_length_exceeded"


def test_echo_with_logprobs_scores_the_prompt(client):
    prompt = "The capital of France is"
    r = client.completions.create(model=DEFAULT_CHAT_MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                  logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 2
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] < len(r.choices[0].text)
    # " Paris" should be far likelier after this prompt than most tokens: its logprob is high
    assert lp.tokens[n_prompt].strip() == "Paris" and lp.token_logprobs[n_prompt] > -2


def test_repeated_long_prompt_reports_cached_tokens(client):
    messages = [{"role": "system", "content": "You answer briefly. " * 40}, *QUESTION]
    first = client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=messages, temperature=0, max_tokens=8)
    second = client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=messages, temperature=0, max_tokens=8)
    assert second.usage.prompt_tokens_details.cached_tokens > 100
    assert second.choices[0].message.content == first.choices[0].message.content


def test_chat_batch_answers_each_conversation_as_a_chat_completion_would(smollm_server, client):
    """vLLM's /v1/chat/completions/batch: choice i is the greedy answer to conversation i alone; stream is refused."""
    other = [{"role": "user", "content": "Name a primary colour."}]
    body = {"model": DEFAULT_CHAT_MODEL, "messages": [QUESTION, other], "temperature": 0, "max_tokens": 12}
    r = httpx.post(f"{smollm_server.url}/v1/chat/completions/batch", json=body, timeout=120)
    assert r.status_code == 200, r.text
    batch = r.json()
    assert batch["object"] == "chat.completion" and [c["index"] for c in batch["choices"]] == [0, 1]
    alone = [client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=m, temperature=0, max_tokens=12)
             for m in (QUESTION, other)]
    assert [c["message"]["content"] for c in batch["choices"]] == [a.choices[0].message.content for a in alone]
    assert batch["usage"]["prompt_tokens"] == sum(a.usage.prompt_tokens for a in alone)
    refused = httpx.post(f"{smollm_server.url}/v1/chat/completions/batch", json={**body, "stream": True}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"
