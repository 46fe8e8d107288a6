"""The official cohere SDK (``ClientV2``) against `launch api-server`: Cohere's v2 chat (``/v2/chat``, where the SDK
sends it, and vLLM's ``/cohere/v2/chat``), its stream events, its render route, and ``/v2/embed``.

The session's two-model server (``rag_server``: tiny-random for chat, all-MiniLM-L6-v2 for embeddings) serves them;
every answer is checked against what the OpenAI routes of the same server answer for the same request, since a
Cohere request is planned and run by the same serving code. Tool calls, their results and reasoning depend on what
the model writes: the scripted model (``scripted_server``: hermes tool calls, think reasoning) writes them exactly.
"""

from __future__ import annotations

import base64
import json
from array import array

import cohere
import httpx
import pytest

from zserve.catalog import DEFAULT_EMBEDDING_MODEL, TINY_RANDOM

from . import scripted_model as sm

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
TEXTS = ["A man is eating food.", "A monkey is playing drums.", "hi"]


@pytest.fixture(scope="module")
def sdk(rag_server) -> cohere.ClientV2:
    return cohere.ClientV2(base_url=rag_server.url, api_key="unused", timeout=120)


def openai_chat(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": TINY_RANDOM, "messages": MESSAGES, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_sdk_chat_answers_what_the_chat_completion_answers(rag_server, sdk):
    """Greedy, the same text, token counts and logprobs as /v1/chat/completions; on both paths."""
    want = openai_chat(rag_server.url, max_tokens=12, temperature=0, logprobs=True)
    got = sdk.chat(model=TINY_RANDOM, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True)
    assert got.message.role == "assistant" and got.message.content[0].type == "text"
    assert got.message.content[0].text == want["choices"][0]["message"]["content"]
    assert got.finish_reason == {"length": "MAX_TOKENS", "stop": "COMPLETE"}[want["choices"][0]["finish_reason"]]
    assert got.usage.tokens.input_tokens == want["usage"]["prompt_tokens"]
    assert got.usage.tokens.output_tokens == want["usage"]["completion_tokens"] == len(got.logprobs)
    want_lps = [e["logprob"] for e in want["choices"][0]["logprobs"]["content"]]
    assert [lp.logprobs[0] for lp in got.logprobs] == pytest.approx(want_lps, abs=1e-5)
    assert "".join(lp.text for lp in got.logprobs) == got.message.content[0].text
    vllm_path = cohere.ClientV2(base_url=f"{rag_server.url}/cohere", api_key="unused", timeout=120)
    again = vllm_path.chat(model=TINY_RANDOM, messages=MESSAGES, max_tokens=12, temperature=0)
    assert again.message.content[0].text == got.message.content[0].text


def test_sdk_stream_is_cohere_events_that_add_up_to_the_answer(sdk):
    whole = sdk.chat(model=TINY_RANDOM, messages=MESSAGES, max_tokens=10, temperature=0)
    events = list(sdk.chat_stream(model=TINY_RANDOM, messages=MESSAGES, max_tokens=10, temperature=0))
    kinds = [e.type for e in events]
    assert kinds[0] == "message-start" and kinds[1] == "content-start" and kinds[-2:] == ["content-end", "message-end"]
    assert set(kinds[2:-2]) == {"content-delta"}
    text = "".join(e.delta.message.content.text for e in events if e.type == "content-delta")
    assert text == whole.message.content[0].text
    end = events[-1].delta
    assert end.finish_reason == whole.finish_reason and end.usage.tokens.output_tokens == 10


def test_render_shows_what_the_chat_completion_render_shows(rag_server):
    """Cohere's body, its sampling names translated (p, k, stop_sequences), renders to the same engine request."""
    cohere_body = {"model": TINY_RANDOM, "messages": MESSAGES, "max_tokens": 7, "p": 0.5, "k": 20,
                   "stop_sequences": ["."], "seed": 3}
    openai_body = {"model": TINY_RANDOM, "messages": MESSAGES, "max_tokens": 7, "top_p": 0.5, "top_k": 20,
                   "stop": ["."], "seed": 3}
    got = httpx.post(f"{rag_server.url}/cohere/v2/chat/render", json=cohere_body, timeout=60).json()
    want = httpx.post(f"{rag_server.url}/v1/chat/completions/render", json=openai_body, timeout=60).json()
    assert got["token_ids"] == want["token_ids"] and got["prompt"] == want["prompt"]
    assert got["sampling_params"] == want["sampling_params"] and got["text_options"] == want["text_options"]


def test_sdk_embed_gives_the_embeddings_in_float_and_base64(rag_server, sdk):
    got = sdk.embed(model=DEFAULT_EMBEDDING_MODEL, texts=TEXTS, input_type="search_document",
                    embedding_types=["float", "base64"])
    r = httpx.post(f"{rag_server.url}/v1/embeddings", json={"model": DEFAULT_EMBEDDING_MODEL, "input": TEXTS},
                   timeout=60)
    want = [d["embedding"] for d in r.json()["data"]]
    # Two requests' vectors agree to float32 rounding, not bit for bit: on this shared server an input may share its
    # engine step with other inputs (another test's, arriving meanwhile), which changes the shapes the kernels see and
    # with them the last bits (seen once in a full run, at 'hi'; alone against batched with these texts, it is exact).
    assert got.texts == TEXTS and len(got.embeddings.float_) == len(want)
    assert all(v == pytest.approx(w, abs=1e-5) for v, w in zip(got.embeddings.float_, want, strict=True))
    assert [list(array("f", base64.b64decode(b))) for b in got.embeddings.base64] == [
        pytest.approx(v, rel=1e-6) for v in got.embeddings.float_]  # one response: the same vectors
    assert got.meta.billed_units.input_tokens == r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v2/chat", {"model": TINY_RANDOM, "messages": []}, "messages"),
    ("/v2/chat", {"model": TINY_RANDOM, "messages": MESSAGES, "p": 5}, "p"),
    ("/cohere/v2/chat", {"model": TINY_RANDOM, "messages": MESSAGES, "tool_choice": "REQUIRED"}, "tool_choice"),
    ("/v2/chat", {"model": TINY_RANDOM, "messages": [{"role": "tool", "content": "42"}]}, "tool_call_id"),
    ("/v2/embed", {"model": DEFAULT_EMBEDDING_MODEL, "texts": TEXTS, "embedding_types": ["int8"]}, "int8"),
    ("/v2/embed", {"model": DEFAULT_EMBEDDING_MODEL, "texts": ["hi " * 600], "truncate": "NONE"}, "tokens"),
])
def test_bad_input_is_400_in_cohere_shape(rag_server, path, body, param):
    r = httpx.post(rag_server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"message"} and param in r.json()["message"]


def test_sdk_raises_its_own_errors(sdk):
    with pytest.raises(cohere.errors.NotFoundError):
        sdk.chat(model="no-such-model", messages=MESSAGES)
    with pytest.raises(cohere.errors.BadRequestError) as e:
        sdk.embed(model=DEFAULT_EMBEDDING_MODEL, texts=TEXTS, input_type="search_query", embedding_types=["float"],
                  truncate="START")
    assert "truncate" in e.value.body["message"]
    # A long text is cut to what the model takes (truncate END, the default), and embeds.
    assert len(sdk.embed(model=DEFAULT_EMBEDDING_MODEL, texts=["hi " * 600], input_type="search_query",
                         embedding_types=["float"]).embeddings.float_[0]) == 384


def test_tool_calls_their_results_and_reasoning_take_cohere_shapes(scripted_server, scripted_model):
    co = cohere.ClientV2(base_url=scripted_server.url, api_key="unused", timeout=120)
    model, ask = scripted_model.name, [{"role": "user", "content": f"Weather in Paris? {sm.WEATHER_TRIGGER}"}]
    called = co.chat(model=model, messages=ask, tools=[sm.WEATHER_TOOL], max_tokens=64)
    assert called.finish_reason == "TOOL_CALL" and called.message.content is None
    call = called.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    events = list(co.chat_stream(model=model, messages=ask, tools=[sm.WEATHER_TOOL], max_tokens=64))
    kinds = [e.type for e in events if e.type.startswith("tool-call-")]
    assert kinds[0] == "tool-call-start" and kinds[-1] == "tool-call-end" and set(kinds[1:-1]) == {"tool-call-delta"}
    assert "".join(e.delta.message.tool_calls.function.arguments for e in events if e.type == "tool-call-delta") \
        == sm.PARIS_ARGUMENTS
    assert events[-2].type == "tool-call-end" and events[-1].delta.finish_reason == "TOOL_CALL"
    # The call and its result go back as Cohere's assistant and tool messages.
    sent_call = {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                 "arguments": call.function.arguments}}
    result = [{"type": "text", "text": f"Sunny {sm.TOOL_RESULT_TRIGGER}"}]
    answered = co.chat(model=model, tools=[sm.WEATHER_TOOL], max_tokens=64, messages=[
        *ask, {"role": "assistant", "tool_calls": [sent_call]}, {"role": "tool", "tool_call_id": call.id,
                                                                  "content": result}])
    assert answered.finish_reason == "COMPLETE" and answered.message.content[0].text == sm.TOOL_RESULT_ANSWER
    thought = co.chat(model=model, max_tokens=64,
                      messages=[{"role": "user", "content": f"Capital? {sm.THINK_TRIGGER}"}])
    assert [(c.type, c.thinking if c.type == "thinking" else c.text) for c in thought.message.content] == [
        ("thinking", sm.REASONING), ("text", sm.ANSWER)]
