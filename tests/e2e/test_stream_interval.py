"""``--stream-interval N``: after the first chunk, streamed text comes at least N tokens at a time, and says the
same as without it (gateway/generation.py ``TextPipeline``)."""

from __future__ import annotations

import openai
import pytest

from tests.helpers import Server

INTERVAL = 4


@pytest.fixture(scope="module")
def client():
    s = Server("--count", "1", "--model", "tiny-random", "--dtype", "float32", "--stream-interval", str(INTERVAL),
               log_name="stream-interval")
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    s.stop()


# Seeded sampling: the same text streamed or not (greedy tiny-random only repeats one token).
SAMPLED = {"temperature": 1.0, "seed": 11}
MESSAGES = [{"role": "user", "content": "Count slowly from one to twenty."}]


def _stream(client, **kw) -> tuple[list[int], str, int]:
    """Tokens per content chunk (from their logprobs), the text, and the usage's completion tokens."""
    sizes, text, used = [], "", 0
    for chunk in client.chat.completions.create(model="tiny-random", stream=True, logprobs=True, **SAMPLED,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                sizes.append(len(c.logprobs.content))
            text += c.delta.content or ""
    return sizes, text, used


def test_chunks_after_the_first_hold_the_interval_and_say_the_same(client):
    sizes, text, used = _stream(client, messages=MESSAGES, max_tokens=23, extra_body={"ignore_eos": True})
    assert sum(sizes) == used == 23
    assert all(n >= INTERVAL for n in sizes[1:-1]), sizes  # the first goes at once, the last at the finish
    assert len(sizes) <= 1 + -(-22 // INTERVAL)
    full = client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=23, **SAMPLED,
                                          extra_body={"ignore_eos": True})
    assert text == full.choices[0].message.content


def test_a_stop_string_still_ends_the_text_where_it_occurs(client):
    full = client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=40, **SAMPLED,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    stop = next(full[i:i + 3] for i in range(len(full) // 2, len(full) - 3) if full[i:i + 3].strip())
    cut = full.index(stop)
    _, text, _ = _stream(client, messages=MESSAGES, max_tokens=40, stop=[stop], extra_body={"ignore_eos": True})
    assert text == full[:cut]
