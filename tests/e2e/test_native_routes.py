"""vLLM-shaped token routes on real servers: ``/tokenize``, ``/detokenize``, ``/inference/v1/generate``.

On SmolLM2 (slow): ``/tokenize`` of chat messages gives exactly the ids the chat route feeds the
engine, and ``/inference/v1/generate`` decodes greedily exactly as ``/v1/completions`` does. The rest
runs on tiny-random, where real weights add nothing.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.routers.native import MAX_IDS
from tests.helpers import pinned_client
from zserve.catalog import DEFAULT_CHAT_MODEL

TINY = "tiny-random"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GENERATE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def tiny(tiny_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        yield c


def post_ok(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed response, checked to end with ``data: [DONE]``."""
    datas = []
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                datas.append(line[len("data: "):])
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


# -- SmolLM2: the ids are the ones the OpenAI routes use ----------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm_server) -> Iterator[tuple[httpx.Client, openai.OpenAI]]:
    with httpx.Client(base_url=smollm_server.url, timeout=120) as http:
        yield http, openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="unused", http_client=http,
                                  max_retries=0)


@pytest.mark.slow
def test_tokenize_messages_gives_the_chat_routes_ids(smol) -> None:
    http, client = smol
    tok = post_ok(http, "/tokenize", {"model": DEFAULT_CHAT_MODEL, "messages": QUESTION})
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 2048 and tok["token_strs"] is None
    chat = client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=QUESTION, temperature=0, max_tokens=8)
    assert chat.usage.prompt_tokens == tok["count"]
    # The same ids as a raw prompt continue exactly as the chat did.
    comp = client.completions.create(model=DEFAULT_CHAT_MODEL, prompt=tok["tokens"], temperature=0, max_tokens=8)
    assert comp.choices[0].text == chat.choices[0].message.content
    assert comp.choices[0].finish_reason == chat.choices[0].finish_reason
    assert comp.usage.prompt_tokens == tok["count"]
    assert comp.usage.completion_tokens == chat.usage.completion_tokens
    # Without the generation prompt the ids are a strict prefix.
    bare = post_ok(http, "/tokenize", {"messages": QUESTION, "add_generation_prompt": False})["tokens"]
    assert len(bare) < tok["count"] and tok["tokens"][:len(bare)] == bare


@pytest.mark.slow
def test_generate_decodes_greedily_like_completions(smol) -> None:
    http, client = smol
    ids = post_ok(http, "/tokenize", {"prompt": "Once upon a time"})["tokens"]
    gen = post_ok(http, GENERATE, {"model": DEFAULT_CHAT_MODEL, "token_ids": ids,
                                   "sampling_params": {"temperature": 0, "max_tokens": 12}})
    (choice,) = gen["choices"]
    comp = client.completions.create(model=DEFAULT_CHAT_MODEL, prompt=ids, temperature=0, max_tokens=12)
    assert post_ok(http, "/detokenize", {"tokens": choice["token_ids"]})["prompt"] == comp.choices[0].text
    assert len(choice["token_ids"]) == comp.usage.completion_tokens
    assert choice["finish_reason"] == comp.choices[0].finish_reason
    # And a chat prompt's ids: the chat answer, EOS included in the ids, dropped from the text.
    chat_ids = post_ok(http, "/tokenize", {"messages": QUESTION})["tokens"]
    gen = post_ok(http, GENERATE, {"token_ids": chat_ids, "sampling_params": {"temperature": 0, "max_tokens": 20}})
    chat = client.chat.completions.create(model=DEFAULT_CHAT_MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    (choice,) = gen["choices"]
    assert post_ok(http, "/detokenize", {"tokens": choice["token_ids"]})["prompt"] == chat.choices[0].message.content
    assert len(choice["token_ids"]) == chat.usage.completion_tokens
    assert choice["finish_reason"] == chat.choices[0].finish_reason == "stop"


# -- tiny-random ---------------------------------------------------------------------------------------

def test_tokenize_prompt_and_detokenize(tiny) -> None:
    text = "Hello world, how are you?"
    tok = post_ok(tiny, "/tokenize", {"model": TINY, "prompt": text, "return_token_strs": True})
    ids, strs = tok["tokens"], tok["token_strs"]
    assert tok["count"] == len(ids) == len(strs) > 1
    assert strs[0] == "Hello" and strs[1] == "Ġworld"  # byte-level BPE spellings, as vLLM returns them
    assert post_ok(tiny, "/detokenize", {"model": TINY, "tokens": ids}) == {"prompt": text}
    assert post_ok(tiny, "/detokenize", {"tokens": ids[:2]}) == {"prompt": "Hello world"}
    # The completions route tokenizes a string prompt the same way.
    comp = post_ok(tiny, "/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0})
    assert comp["usage"]["prompt_tokens"] == tok["count"]


def test_generate_n_seed_and_logprobs(tiny) -> None:
    ids = post_ok(tiny, "/tokenize", {"prompt": "Once upon a time"})["tokens"]
    body = {"token_ids": ids, "sampling_params": {"n": 2, "seed": 7, "temperature": 1.0, "max_tokens": 8,
                                                  "logprobs": 2, "prompt_logprobs": 1}}
    first, again = post_ok(tiny, GENERATE, body), post_ok(tiny, GENERATE, body)
    assert first["choices"] == again["choices"]  # seeded: reproducible
    assert [c["index"] for c in first["choices"]] == [0, 1]
    a, b = (c["token_ids"] for c in first["choices"])
    assert len(a) == len(b) == 8 and a != b  # each choice has its own seed
    for c in first["choices"]:
        assert c["finish_reason"] == "length"
        lps = c["logprobs"]["content"]
        assert [lp["token_id"] for lp in lps] == c["token_ids"]
        for lp in lps:
            assert lp["logprob"] <= 0 and len(lp["top_logprobs"]) == 2
            assert lp["top_logprobs"][0]["logprob"] >= lp["top_logprobs"][1]["logprob"] >= -1e9
    prompt_lps = first["prompt_logprobs"]
    assert len(prompt_lps) == len(ids) and [lp["token_id"] for lp in prompt_lps] == ids
    assert prompt_lps[0]["logprob"] is None and all(lp["logprob"] <= 0 for lp in prompt_lps[1:])
    # Greedy: the chosen token is the most likely one.
    greedy = post_ok(tiny, GENERATE, {"token_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": 4,
                                                                            "logprobs": 1}})
    (c,) = greedy["choices"]
    assert c["logprobs"]["content"] and all(lp["top_logprobs"][0]["token_id"] == lp["token_id"]
                                            for lp in c["logprobs"]["content"])
    assert greedy["prompt_logprobs"] is None
    plain = post_ok(tiny, GENERATE, {"token_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": 4}})
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["token_ids"] == c["token_ids"]


def test_generate_stream_equals_non_streamed(tiny) -> None:
    ids = post_ok(tiny, "/tokenize", {"prompt": "The quick brown fox"})["tokens"]
    sp = {"n": 2, "seed": 3, "temperature": 1.0, "max_tokens": 10, "logprobs": 0, "prompt_logprobs": 0}
    full = post_ok(tiny, GENERATE, {"token_ids": ids, "request_id": "stream-me", "sampling_params": sp})
    assert full["request_id"] == "stream-me"
    events = sse(tiny, GENERATE, {"token_ids": ids, "request_id": "stream-me", "stream": True, "sampling_params": sp})
    assert {e["request_id"] for e in events} == {"stream-me"}
    got: dict[int, list[int]] = {0: [], 1: []}
    lps: dict[int, list[dict]] = {0: [], 1: []}
    finish: dict[int, list[str]] = {0: [], 1: []}
    for e in events:
        (c,) = e["choices"]
        got[c["index"]] += c["token_ids"]
        lps[c["index"]] += c["logprobs"]["content"]
        if c["finish_reason"] is not None:
            finish[c["index"]].append(c["finish_reason"])
    assert len(events) > 2  # really streamed
    # The prompt's logprobs come once, in the first chunk, as the non-streamed body has them once.
    assert [e["prompt_logprobs"] for e in events if "prompt_logprobs" in e] == [full["prompt_logprobs"]]
    assert len(full["prompt_logprobs"]) == len(ids)
    for c in full["choices"]:
        i = c["index"]
        assert got[i] == c["token_ids"] and finish[i] == [c["finish_reason"]] == ["length"]
        assert lps[i] == c["logprobs"]["content"]


def test_generate_default_request_id_and_max_tokens(tiny) -> None:
    r = post_ok(tiny, GENERATE, {"token_ids": [1, 2, 3]})
    assert r["request_id"].startswith("gen-") and len(r["choices"][0]["token_ids"]) == 16  # vLLM's default
    assert post_ok(tiny, GENERATE, {"token_ids": [1, 2, 3]})["request_id"] != r["request_id"]


def _pinned(url: str, timeout: float = 30.0) -> tuple[httpx.Client, httpx.Client, httpx.Client]:
    """Two keep-alive clients on one gateway process and a third on another."""
    by_gateway: dict[int, list[httpx.Client]] = {}
    deadline = time.monotonic() + timeout
    while True:
        c = pinned_client(url, timeout=30)
        by_gateway.setdefault(c.get("/load").json()["gateway"], []).append(c)
        pair = next((cs[:2] for cs in by_gateway.values() if len(cs) >= 2), None)
        other = next((cs[0] for cs in by_gateway.values() if cs[0] not in (pair or ())), None)
        if pair and other:
            for cs in by_gateway.values():
                for extra in cs:
                    if extra not in (*pair, other):
                        extra.close()
            return pair[0], pair[1], other
        if time.monotonic() > deadline:
            raise AssertionError("could not reach two gateway processes")


def test_concurrent_requests_may_share_a_request_id(tiny_server, tiny) -> None:
    # vLLM's request_id is the client's label: requests reusing one, at once, on one gateway process
    # or on two, must each get their own answer (not a hang, not "already running").
    body = {"token_ids": [1, 2, 3], "request_id": "same-id", "sampling_params": {"temperature": 0, "max_tokens": 200}}
    solo = post_ok(tiny, GENERATE, body)
    clients = _pinned(tiny_server.url)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
            replies = list(pool.map(lambda c: c.post(GENERATE, json=body), clients))
        for r in replies:
            assert r.status_code == 200, r.text
            assert r.json() == solo
    finally:
        for c in clients:
            c.close()


# -- bad input ----------------------------------------------------------------------------------------

BAD = [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": QUESTION}, 400, "prompt"),
    ("/tokenize", {"prompt": 123}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
    ("/tokenize", {"messages": [{"content": "no role"}]}, 400, None),
    ("/tokenize", {"prompt": "a", "model": "gpt-nope"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [10**7]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-nope"}, 404, "model"),
    (GENERATE, {}, 400, "token_ids"),
    (GENERATE, {"token_ids": []}, 400, "token_ids"),
    (GENERATE, {"token_ids": ["a"]}, 400, "token_ids.0"),
    (GENERATE, {"token_ids": [-5]}, 400, "token_ids.0"),
    (GENERATE, {"token_ids": [10**7]}, 400, "token_ids"),
    (GENERATE, {"token_ids": [1] * (MAX_IDS + 1)}, 400, "token_ids"),
    (GENERATE, {"token_ids": [1] * 9000}, 400, "token_ids"),  # beyond tiny-random's 8192 context
    (GENERATE, {"token_ids": [1], "sampling_params": {"max_tokens": 10**6}}, 400, "sampling_params.max_tokens"),
    (GENERATE, {"token_ids": [1], "sampling_params": {"max_tokens": 0}}, 400, "sampling_params.max_tokens"),
    (GENERATE, {"token_ids": [1], "sampling_params": {"stop": ["x"]}}, 400, "sampling_params.stop"),
    (GENERATE, {"token_ids": [1], "sampling_params": {"stop": "x"}}, 400, "sampling_params.stop"),
    (GENERATE, {"token_ids": [1], "sampling_params": {"n": 0}}, 400, "sampling_params.n"),
    (GENERATE, {"token_ids": [1], "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature"),
    (GENERATE, {"token_ids": [1], "sampling_params": {"logprobs": 99}}, 400, "sampling_params.logprobs"),
    (GENERATE, {"token_ids": [1], "sampling_params": "greedy"}, 400, "sampling_params"),
    (GENERATE, {"token_ids": [1], "request_id": ""}, 400, "request_id"),
    (GENERATE, {"token_ids": [1], "stream": [1]}, 400, "stream"),
    (GENERATE, {"token_ids": [1], "model": "gpt-nope"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{i}-{param}" for i, (p, _, _, param) in enumerate(BAD)])
def test_bad_input_is_refused_in_openai_shape(tiny, path, body, status, param) -> None:
    r = tiny.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param
    if "beyond" in err["message"] or "context length" in err["message"]:
        assert err["code"] == "context_length_exceeded"


def test_invalid_json_and_the_server_keeps_serving(tiny) -> None:
    for path in ("/tokenize", "/detokenize", GENERATE):
        r = tiny.post(path, content=b"{nope", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], path
        r = tiny.post(path, json=[1, 2])
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", path
    ids = post_ok(tiny, "/tokenize", {"prompt": "still here"})["tokens"]
    assert post_ok(tiny, "/detokenize", {"tokens": ids})["prompt"] == "still here"
    assert len(post_ok(tiny, GENERATE, {"token_ids": ids, "sampling_params": {"max_tokens": 3}})
               ["choices"][0]["token_ids"]) == 3
    events = sse(tiny, GENERATE, {"token_ids": ids, "stream": True, "sampling_params": {"max_tokens": 3}})
    assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 3


def test_sampling_errors_name_the_nested_field(tiny) -> None:
    r = tiny.post(GENERATE, json={"token_ids": [1], "sampling_params": {"stop_token_ids": [10**7]}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "sampling_params.stop_token_ids"
