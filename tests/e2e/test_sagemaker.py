"""SageMaker's contract on a tiny-random server: ``/ping`` and ``/invocations``, which answers with the
route the payload's shape names (chat completions, completions, embeddings, rerank), streamed or not."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

MODEL = "tiny-random"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
CUSTOM = {"X-Amzn-SageMaker-Custom-Attributes": "accept_eula=true, trace_id=abc;x=1"}


@pytest.fixture(scope="module")
def http(tiny_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        yield c


def sse(http: httpx.Client, body: dict, headers: dict | None = None) -> list[dict]:
    """The JSON events of a streamed /invocations answer, checked to end with ``data: [DONE]``."""
    datas = []
    with http.stream("POST", "/invocations", json=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                datas.append(line[len("data: "):])
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def test_ping_answers_get_and_post_as_health_does(http):
    health = http.get("/health")
    assert health.status_code == 200
    for r in (http.get("/ping"), http.post("/ping"), http.post("/ping", headers=CUSTOM)):
        assert r.status_code == 200 and r.json() == health.json()


@pytest.mark.parametrize("headers", [None, CUSTOM], ids=["plain", "custom-attributes"])
def test_invocations_with_messages_is_a_chat_completion(http, headers):
    r = http.post("/invocations", json=CHAT, headers=headers)
    assert r.status_code == 200, r.text
    body = r.json()
    direct = http.post("/v1/chat/completions", json=CHAT).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == MODEL
    assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["finish_reason"] == "length"
    assert {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens")} == \
        {k: direct["usage"][k] for k in ("prompt_tokens", "completion_tokens")}


@pytest.mark.parametrize("headers", [None, CUSTOM], ids=["plain", "custom-attributes"])
def test_invocations_with_prompt_is_a_completion(http, headers):
    r = http.post("/invocations", json=COMPLETION, headers=headers)
    assert r.status_code == 200, r.text
    body = r.json()
    direct = http.post("/v1/completions", json=COMPLETION).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 4


def test_invocations_streams_a_chat_completion(http):
    events = sse(http, {**CHAT, "stream": True, "stream_options": {"include_usage": True}}, CUSTOM)
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4


def test_invocations_streams_a_completion(http):
    events = sse(http, {**COMPLETION, "stream": True})
    assert {e["object"] for e in events} == {"text_completion"}
    assert events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body", [
    {**CHAT, "messages": []},
    {**CHAT, "model": "nope"},
    {**COMPLETION, "max_tokens": 100000},
    {"model": MODEL, "input": "embed me"},
    {"model": MODEL, "query": "capital of France", "documents": ["Paris", "Berlin"]},
], ids=["chat-invalid", "unknown-model", "too-long", "embeddings", "rerank"])
def test_invocations_answers_exactly_as_the_route_it_names(http, body):
    """Errors included: the first three are refusals. The tiny decoder embeds by last-token pooling, so
    embeddings and rerank succeed, deterministically: the same answer but for rerank's fresh id."""
    path = {"messages": "/v1/chat/completions", "prompt": "/v1/completions", "input": "/v1/embeddings",
            "query": "/v1/rerank"}[next(k for k in ("messages", "prompt", "input", "query") if k in body)]
    direct = http.post(path, json=body)
    via = http.post("/invocations", json=body)
    assert via.status_code == direct.status_code, via.text
    assert (via.status_code >= 400) == ("input" not in body and "query" not in body)
    assert {k: v for k, v in via.json().items() if k != "id"} == {k: v for k, v in direct.json().items() if k != "id"}


@pytest.mark.parametrize("content, fragment", [
    (b'{"model": "tiny-random", "text": "hi"}', "matches no invocation"),
    (b'{"query": "only a query"}', "matches no invocation"),
    (b"[1, 2]", "must be a JSON object"),
    (b"{not json", "not valid JSON"),
])
def test_invocations_refuses_a_payload_of_no_known_shape(http, content, fragment):
    r = http.post("/invocations", content=content, headers={"Content-Type": "application/json", **CUSTOM})
    assert r.status_code == 400
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error"
    if "no invocation" in fragment:  # it names the fields each shape needs
        for name in ("'messages'", "'prompt'", "'input'", "'query' and 'documents'"):
            assert name in err["message"]
