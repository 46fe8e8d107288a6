"""A request is admitted whole or refused whole (gateway/serving/admission.py ``admit``): one with more parts (choices,
pooled inputs) than an engine queues is a 400 that says the limit, and one that finds the queues full is one 429
that leaves nothing queued. This module's own server: a queue of 4 (``--max-waiting 4``) and one sequence at a
time, so that a few long streams fill it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.helpers import Server, stream_body, wait_until
from zserve.catalog import DEFAULT_EMBEDDING_MODEL, ModelNotFound, resolve

QUEUE = 4


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    try:
        resolve(DEFAULT_EMBEDDING_MODEL)
    except ModelNotFound as e:
        pytest.skip(str(e))
    s = Server("--count", "1", "--model", "tiny-random", "--model", DEFAULT_EMBEDDING_MODEL, "--dtype", "float32",
               "--max-num-seqs", "1", "--max-waiting", str(QUEUE), log_name="admission")
    yield s
    s.stop()


def _queues(url: str) -> tuple[int, int]:
    """(running, waiting) on tiny-random's engine, as the gateway last heard."""
    eng = next(e for e in httpx.get(url + "/load", timeout=10).json()["engines"] if e["model"] == "tiny-random")
    return eng["running"] or 0, eng["waiting"] or 0


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/embeddings", {"model": DEFAULT_EMBEDDING_MODEL, "input": [f"text {i}" for i in range(QUEUE + 1)]}, "input"),
    ("/v1/embeddings", {"model": "tiny-random", "input": [f"text {i}" for i in range(QUEUE + 1)]}, "input"),
    ("/v1/rerank", {"model": DEFAULT_EMBEDDING_MODEL, "query": "q", "documents": [f"d {i}" for i in range(QUEUE)]},
     "documents"),  # the query is embedded too: 5 inputs
    ("/v1/completions", {"model": "tiny-random", "prompt": ["a", "b"], "n": 3, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "n": QUEUE + 1,
                              "max_tokens": 1}, "n"),
    ("/inference/v1/generate", {"model": "tiny-random", "token_ids": [1, 2],
                                "sampling_params": {"n": QUEUE + 1, "max_tokens": 1}}, "sampling_params.n"),
])
def test_a_request_with_more_parts_than_an_engine_queues_is_a_400_naming_the_field_and_the_limit(server, path, body,
                                                                                                 param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and f"at most {QUEUE}" in err["message"] and "--max-waiting" in err["message"]


def test_a_request_of_as_many_parts_as_an_engine_queues_is_served(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    got = client.embeddings.create(model=DEFAULT_EMBEDDING_MODEL, input=[f"text {i}" for i in range(QUEUE)])
    assert len(got.data) == QUEUE
    # three documents and the query: four inputs, each counted once
    r = httpx.post(server.url + "/v1/rerank", json={"model": DEFAULT_EMBEDDING_MODEL, "query": "q",
                                                    "documents": ["a", "b", "c"]}, timeout=60)
    assert r.status_code == 200 and len(r.json()["results"]) == 3
    chat = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                          n=QUEUE, max_tokens=1)
    assert len(chat.choices) == QUEUE


def test_a_request_that_finds_the_queues_full_is_one_429_and_leaves_nothing_queued(server):
    url = server.url
    log_before = len(server.tail(1 << 30))
    with contextlib.ExitStack() as streams:
        # One stream runs (one sequence at a time) and the others fill the queue.
        http = streams.enter_context(httpx.Client(timeout=60, limits=httpx.Limits(max_connections=QUEUE + 2)))
        for n in range(QUEUE + 1):
            r = streams.enter_context(http.stream("POST", url + "/v1/completions", json=stream_body(4000)))
            assert r.status_code == 200
            if n == 0:  # running before the others arrive (an engine counts what it has not yet started as waiting)
                wait_until(lambda: _queues(url) == (1, 0), 30, what="one request running")
        wait_until(lambda: _queues(url) == (1, QUEUE), 30, what="one running and a full queue")
        refused = [httpx.post(url + "/v1/embeddings", json={"model": "tiny-random", "input": ["a", "b", "c"]},
                              timeout=30),
                   httpx.post(url + "/v1/chat/completions", json={
                       "model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "n": 3,
                       "max_tokens": 1}, timeout=30)]
        for r in refused:
            assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
            assert "--max-waiting" in r.json()["error"]["message"]
    # Closing the streams aborts them: nothing is left, the refused requests' parts included.
    wait_until(lambda: _queues(url) == (0, 0), 30, what="the engine to drop the aborted streams")
    # One refusal each, in the response, and no line per refused part in the log.
    log = server.tail(1 << 30)[log_before:]
    assert "engine_busy" not in log and "WARNING" not in log, log[-3000:]
