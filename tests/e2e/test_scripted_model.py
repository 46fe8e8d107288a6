"""The scripted model (scripted_model.py) served end to end: the last prompt token picks a fixed
script, greedy or sampled, so tool-call and reasoning text can be asserted exactly."""

from __future__ import annotations

import openai
import pytest

from . import scripted_model as sm

pytestmark = pytest.mark.slow

# Every script start a prompt can end in (triggers and forced-call prefills).
STARTS = [*sm.TRIGGERS, sm.REQUIRED_PREFILL, sm.NAMED_PREFILL]


@pytest.fixture(scope="module")
def scripted(scripted_server, scripted_model):
    client = openai.OpenAI(base_url=scripted_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    return client, scripted_model.name


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completions_follow_every_script(scripted, temperature: float) -> None:
    client, model = scripted
    prompts = ["Please: " + start for start in STARTS]
    r = client.completions.create(model=model, prompt=prompts, max_tokens=64, temperature=temperature)
    assert len(r.choices) == len(STARTS)
    for choice in r.choices:
        start = STARTS[choice.index]
        assert (choice.text, choice.finish_reason) == (sm.EXPECTED[start], "stop"), start


def test_streamed_completions_give_the_same_text(scripted) -> None:
    client, model = scripted
    texts: dict[int, list[str]] = {i: [] for i in range(len(STARTS))}
    finish: dict[int, str | None] = {}
    stream = client.completions.create(model=model, prompt=list(STARTS), max_tokens=64, temperature=1.0,
                                       stream=True)
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index].append(c.text)
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    for i, start in enumerate(STARTS):
        assert "".join(texts[i]) == sm.EXPECTED[start], start
        assert finish[i] == "stop"
    # (How many chunks is not asserted: a gateway that falls behind its engine merges a stream's queued outputs into
    # one chunk, engine_client.take_outputs, and these texts are a few tokens.)


def test_story_obeys_stop_sequences_and_max_tokens(scripted) -> None:
    client, model = scripted
    r = client.completions.create(model=model, prompt=sm.STORY_TRIGGER, max_tokens=64, temperature=0,
                                  stop=[" time"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (" Once upon a", "stop")
    r = client.completions.create(model=model, prompt=sm.STORY_TRIGGER, max_tokens=3, temperature=1.0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (" Once upon a", "length")


def test_chat_user_message_ending_in_a_trigger(scripted) -> None:
    client, model = scripted
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the weather in Paris? " + sm.WEATHER_TRIGGER}],
        max_tokens=64, temperature=0)
    # No tools in the request, so nothing is parsed as a call: the scripted text arrives as the content.
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (sm.EXPECTED[sm.WEATHER_TRIGGER], "stop")


def test_chat_history_with_a_tool_call_and_its_result(scripted) -> None:
    client, model = scripted
    messages = [
        {"role": "user", "content": "What is the weather in Paris? " + sm.WEATHER_TRIGGER},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": sm.PARIS_ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"} ' + sm.TOOL_RESULT_TRIGGER},
    ]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=1.0)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (sm.EXPECTED_TOOL_RESULT, "stop")
