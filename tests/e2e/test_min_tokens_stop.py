"""``min_tokens`` holds stop strings off as vLLM does: a stop string counts only where it ends in the text of
an output token after the first ``min_tokens`` (the engine holds EOS and ``stop_token_ids`` off the same way).

On the scripted model, whose story is ``" Once upon a time there was one small robot."``, one token a word:
the stop strings below end in its 2nd (" upon"), 3rd ("upon a", begun in the 2nd) and 7th (" one") tokens.
"""

from __future__ import annotations

import openai
import pytest

from . import scripted_model as sm

STORY = sm.EXPECTED_STORY  # ' Once upon a time there was one small robot.'
PROMPT = "Tell me a story. " + sm.STORY_TRIGGER


@pytest.fixture(scope="module")
def client(scripted_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=scripted_server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def complete(client: openai.OpenAI, route: str, stream: bool, **kw) -> tuple[str, str]:
    """(text, finish_reason) of one choice, streamed or not."""
    if route == "chat":
        call = client.chat.completions.create
        kw["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        call = client.completions.create
        kw["prompt"] = PROMPT
    r = call(model="scripted", max_tokens=32, stream=stream, **kw)
    if not stream:
        c = r.choices[0]
        return (c.message.content if route == "chat" else c.text) or "", c.finish_reason
    text, finish = "", None
    for chunk in r:
        for c in chunk.choices:
            text += (c.delta.content if route == "chat" else c.text) or ""
            finish = c.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("stop, min_tokens, expected", [
    ([" upon", " one"], 0, " Once"),  # without min_tokens the first stop string wins
    ([" upon", " one"], 1, " Once"),  # " upon" ends in token 2, after the first one
    ([" upon", " one"], 2, " Once upon a time there was"),  # " upon" ends in token 2: held off; " one" stops
    ([" upon", " one"], 7, STORY),  # both end within the first 7 tokens: the story ends with EOS
    (["upon a"], 2, " Once "),  # begins in token 2 but ends in token 3: it counts
    (["upon a"], 3, STORY),
])  # fmt: skip
def test_min_tokens_holds_stop_strings_off(client, route: str, stream: bool, stop: list[str], min_tokens: int,
                                           expected: str) -> None:
    text, finish = complete(client, route, stream, stop=stop, extra_body={"min_tokens": min_tokens})
    # (The chat route's reasoning parser strips the message text's ends.)
    assert (text, finish) == ((expected.strip() if route == "chat" else expected), "stop")
