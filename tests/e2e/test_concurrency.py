"""Continuous batching through the whole stack: concurrent streams stay independent; aborts free slots."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.helpers import wait_until
from zserve.catalog import DEFAULT_CHAT_MODEL

PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "def fibonacci(n):",
    "My favourite animal is the",
    "Water boils at",
    "The quick brown fox",
    "In 1969, humans",
    "Translate 'hello' to Spanish:",
]


@pytest.mark.slow
def test_eight_concurrent_streams_match_their_solo_runs(smollm_server):
    kw = dict(model=DEFAULT_CHAT_MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    sync = openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    solo = [sync.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]

    async def stream(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, int]:
        parts, n_chunks = [], 0
        async for c in await client.completions.create(prompt=prompt, stream=True, **kw):
            n_chunks += 1
            parts.append(c.choices[0].text)
        return "".join(parts), n_chunks

    async def all_together():
        client = openai.AsyncOpenAI(base_url=smollm_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        return await asyncio.gather(*(stream(client, p) for p in PROMPTS))

    together = asyncio.run(all_together())
    assert [t for t, _ in together] == solo
    assert all(n >= 2 for _, n in together)  # really streamed, not one lump
    assert len(set(solo)) == len(solo)


def _engine_running(url: str) -> int:
    engines = httpx.get(url + "/load").json()["engines"]
    return sum(e["running"] or 0 for e in engines)


def test_aborted_stream_frees_its_slot(tiny_server):
    url = tiny_server.url
    body = {"model": "tiny-random", "prompt": "hello", "max_tokens": 100000, "stream": True, "ignore_eos": True,
            "temperature": 0}
    body["max_tokens"] = 4000
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            wait_until(lambda: _engine_running(url) >= 1, 10, what="the request to run")
        # leaving the block closes the connection mid-stream
    wait_until(lambda: _engine_running(url) == 0, 5, what="the engine to drop the aborted request")
    # and the engine still serves
    r = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_priority_is_accepted_and_validated(tiny_server):
    body = {"model": "tiny-random", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(tiny_server.url + "/v1/completions", json={**body, "priority": -5}, timeout=30).status_code == 200
    bad = httpx.post(tiny_server.url + "/v1/completions", json={**body, "priority": 1 << 40}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
