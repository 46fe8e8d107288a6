"""Explicit nulls mean the default on the wire, as OpenAI's spec and vLLM accept them: every field the issue named,
through httpx (the exact bodies) and the official openai SDK (which sends None as null)."""

from __future__ import annotations

import httpx
import openai

CHAT = [{"role": "user", "content": "hi"}]
SAMPLING_NULLS = dict.fromkeys(["n", "stream", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty",
                                "echo"])


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_chat_and_completions_take_null_for_their_defaults(tiny_server):
    chat = _post(tiny_server.url, "/v1/chat/completions", {
        "model": "tiny-random", "messages": CHAT, "max_tokens": 2, **SAMPLING_NULLS, "logprobs": None,
        "parallel_tool_calls": None})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["object"] == "chat.completion" and len(body["choices"]) == 1
    assert body["choices"][0]["logprobs"] is None
    done = _post(tiny_server.url, "/v1/completions", {"model": "tiny-random", "prompt": "Once", "max_tokens": 2,
                                                      **SAMPLING_NULLS, "logprobs": None})
    assert done.status_code == 200, done.text
    assert done.json()["object"] == "text_completion" and len(done.json()["choices"]) == 1
    assert not done.json()["choices"][0]["text"].startswith("Once")  # echo null: no echo


def test_the_openai_sdk_sending_none_is_served_with_the_defaults(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
    got = client.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=2, n=None, stream=None,
                                         logprobs=None, presence_penalty=None, frequency_penalty=None,
                                         parallel_tool_calls=None)
    assert len(got.choices) == 1 and got.choices[0].logprobs is None


def test_responses_take_null_store_background_and_parallel_tool_calls(tiny_server):
    r = _post(tiny_server.url, "/v1/responses", {"model": "tiny-random", "input": "hi", "max_output_tokens": 2,
                                                 "store": None, "background": None, "parallel_tool_calls": None,
                                                 "stream": None})
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("completed", "incomplete")  # not background: answered when done
    stored = httpx.get(tiny_server.url + f"/v1/responses/{r.json()['id']}", timeout=30)
    assert stored.status_code == 200  # store null: stored, its default


def test_anthropic_messages_take_null_stream(tiny_server):
    r = _post(tiny_server.url, "/v1/messages", {"model": "tiny-random", "messages": CHAT, "max_tokens": 2,
                                                "stream": None})
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"
    required = _post(tiny_server.url, "/v1/messages", {"model": "tiny-random", "messages": CHAT, "max_tokens": None})
    assert required.status_code == 400 and "max_tokens" in required.text  # a required field still refuses null
