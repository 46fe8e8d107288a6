"""Tool calling and reasoning through the official openai SDK's chat completions, against the scripted
model served with ``--tool-call-parser hermes --reasoning-parser think`` (``scripted_server``)."""

from __future__ import annotations

import json
import subprocess

import openai
import pytest

from gateway.text.tool_parsers import TOOL_PARSERS
from tests.helpers import LAUNCH, ROOT
from zserve.catalog import TINY_RANDOM

from . import scripted_model as sm

TOOLS = [sm.WEATHER_TOOL]
WEATHER = sm.WEATHER_TOOL["function"]["name"]
NAMED = {"type": "function", "function": {"name": WEATHER}}


@pytest.fixture(scope="module")
def chat(scripted_server, scripted_model):
    """create(**kw) on the scripted server's chat completions, with its model name filled in."""
    client = openai.OpenAI(base_url=scripted_server.url + "/v1", api_key="x", max_retries=0, timeout=120)

    def create(**kw):
        return client.chat.completions.create(model=scripted_model.name, **kw)

    return create


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def calls_of(message) -> list[dict]:
    """A message's tool calls as the scripted model's EXPECTED_CALLS entries ({"name", "arguments": {...}})."""
    return [{"name": t.function.name, "arguments": json.loads(t.function.arguments)} for t in message.tool_calls or ()]


def accumulate(chunks) -> tuple[str, str, dict[int, dict], list[str]]:
    """(content, reasoning_content, calls by index, finish reasons) of a streamed chat completion;
    asserts that each call's first delta carries its id, type and name, and no later one does."""
    content, reasoning, finishes = [], [], []
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            d = ch.delta
            content.append(d.content or "")
            reasoning.append(getattr(d, "reasoning_content", None) or "")
            for t in d.tool_calls or ():
                if t.index not in calls:
                    assert t.id and t.id.startswith("call_") and t.type == "function" and t.function.name, t
                    calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": ""}
                else:
                    assert t.id is None and not t.function.name, t
                calls[t.index]["arguments"] += t.function.arguments or ""
            if ch.finish_reason is not None:
                finishes.append(ch.finish_reason)
    return "".join(content), "".join(reasoning), calls, finishes


# -- calls ----------------------------------------------------------------------------------------

def test_one_tool_call(chat):
    r = chat(messages=ask("What is the weather in Paris? " + sm.WEATHER_TRIGGER), tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == sm.EXPECTED_CALLS[sm.WEATHER_TRIGGER][0]["arguments"]
    assert calls_of(choice.message) == sm.EXPECTED_CALLS[sm.WEATHER_TRIGGER]


def test_parallel_calls_after_text_streamed_and_not(chat):
    kw = dict(messages=ask("Weather in Berlin and Rome? " + sm.TWO_CALLS_TRIGGER), tools=TOOLS)
    full = chat(**kw).choices[0]
    assert full.finish_reason == "tool_calls"
    assert full.message.content == sm.TWO_CALLS_CONTENT
    assert calls_of(full.message) == sm.EXPECTED_CALLS[sm.TWO_CALLS_TRIGGER]
    assert len({t.id for t in full.message.tool_calls}) == 2

    chunks = list(chat(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    content, reasoning, calls, finishes = accumulate(chunks)
    assert (content, reasoning, finishes) == (sm.TWO_CALLS_CONTENT, "", ["tool_calls"])
    assert sorted(calls) == [0, 1]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in (0, 1)] == \
        [(t.function.name, t.function.arguments) for t in full.message.tool_calls]


def test_parallel_tool_calls_false_keeps_the_first_call(chat):
    kw = dict(messages=ask("Weather in Berlin and Rome? " + sm.TWO_CALLS_TRIGGER), tools=TOOLS,
              parallel_tool_calls=False)
    first = sm.EXPECTED_CALLS[sm.TWO_CALLS_TRIGGER][:1]
    full = chat(**kw).choices[0]
    assert (full.finish_reason, full.message.content) == ("tool_calls", sm.TWO_CALLS_CONTENT)
    assert calls_of(full.message) == first
    content, _, calls, finishes = accumulate(chat(stream=True, **kw))
    assert (content, finishes, sorted(calls)) == (sm.TWO_CALLS_CONTENT, ["tool_calls"], [0])
    assert json.loads(calls[0]["arguments"]) == first[0]["arguments"]


@pytest.mark.parametrize("tool_choice, start", [("required", sm.NAMED_PREFILL), (NAMED, sm.NAMED_PREFILL)],
                         ids=["required", "named"])
def test_forced_tool_choice_streamed_and_not(chat, tool_choice, start):
    # The question ends in no trigger: only the forced call's prefill makes the model call. With a
    # single tool, "required" opens the call to that tool just as naming it does.
    kw = dict(messages=ask("What is the weather?"), tools=TOOLS, tool_choice=tool_choice)
    full = chat(**kw).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content is None
    assert calls_of(full.message) == sm.EXPECTED_CALLS[start]
    content, _, calls, finishes = accumulate(chat(stream=True, **kw))
    assert (content, finishes) == ("", ["tool_calls"])
    assert [{"name": calls[i]["name"], "arguments": json.loads(calls[i]["arguments"])} for i in sorted(calls)] == \
        sm.EXPECTED_CALLS[start]


def test_tool_choice_none_parses_nothing(chat):
    r = chat(messages=ask("Weather? " + sm.WEATHER_TRIGGER), tools=TOOLS, tool_choice="none").choices[0]
    assert r.finish_reason == "stop"
    assert r.message.content == sm.EXPECTED_WEATHER
    assert not r.message.tool_calls


def test_tool_result_round_trip(chat):
    question = ask("What is the weather in Paris? " + sm.WEATHER_TRIGGER)
    first = chat(messages=question, tools=TOOLS).choices[0].message
    [call] = first.tool_calls
    history = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"} ' + sm.TOOL_RESULT_TRIGGER},
    ]
    r = chat(messages=history, tools=TOOLS).choices[0]
    assert (r.message.content, r.finish_reason) == (sm.EXPECTED_TOOL_RESULT, "stop")
    assert not r.message.tool_calls


# -- reasoning, continuation, usage ---------------------------------------------------------------

def test_reasoning_content_streamed_and_not(chat):
    kw = dict(messages=ask("What is the capital? " + sm.THINK_TRIGGER))
    full = chat(**kw).choices[0]
    assert full.message.reasoning_content == sm.REASONING
    assert (full.message.content, full.finish_reason) == (sm.ANSWER, "stop")
    content, reasoning, calls, finishes = accumulate(chat(stream=True, **kw))
    assert (reasoning, content, calls, finishes) == (sm.REASONING, sm.ANSWER, {}, ["stop"])


def test_continue_final_message(chat):
    partial = "Once" + "".join(sm.STORY_TOKENS[1:3])  # "Once upon a": the model goes on after " a"
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": partial}]
    r = chat(messages=messages, extra_body={"continue_final_message": True}).choices[0]
    # Only the continuation comes back (stripped of its leading space by the reasoning parser).
    assert (r.message.content, r.finish_reason) == (sm.EXPECTED[sm.STORY_TOKENS[2]].strip(), "stop")
    with pytest.raises(openai.BadRequestError) as ei:
        chat(messages=messages, extra_body={"continue_final_message": True, "add_generation_prompt": True})
    assert ei.value.body["param"] == "continue_final_message"
    # An empty final assistant message has nothing to continue: it is a new assistant turn.
    empty = [{"role": "user", "content": "Tell me a story. " + sm.STORY_TRIGGER}, {"role": "assistant", "content": ""}]
    r = chat(messages=empty, extra_body={"continue_final_message": True}).choices[0]
    assert r.message.content == sm.EXPECTED_STORY.strip()


def test_continuous_usage_stats_on_every_chunk(chat):
    chunks = list(chat(messages=ask("Tell me a story. " + sm.STORY_TRIGGER), stream=True,
                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    content, _, _, finishes = accumulate(chunks)
    assert (content, finishes) == (sm.EXPECTED_STORY.strip(), ["stop"])
    completion = [c.usage.completion_tokens for c in chunks]
    assert completion == sorted(completion) and completion[0] < completion[-1]
    # each chunk with new text counts more tokens than the one before
    text_counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(text_counts) > 2 and all(a < b for a, b in zip(text_counts, text_counts[1:]))
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(sm.STORY_TOKENS) + 1  # + EOS
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


# -- refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_response_format_with_a_forced_tool_call_is_refused(chat, tool_choice):
    # The forced call has its own grammar (the tool's schema); a second constraint cannot apply too.
    with pytest.raises(openai.BadRequestError) as ei:
        chat(messages=ask("Weather?"), tools=TOOLS, tool_choice=tool_choice, response_format={"type": "json_object"})
    assert ei.value.body["param"] == "response_format" and "forced tool call" in ei.value.body["message"]


def test_forced_tool_call_with_a_schema_that_does_not_compile_is_refused(chat):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}
    with pytest.raises(openai.BadRequestError) as ei:
        chat(messages=ask("Weather?"), tools=[tool], tool_choice="required")
    assert ei.value.body["param"] == "tools"


def test_unknown_named_function_is_refused(chat):
    with pytest.raises(openai.BadRequestError) as ei:
        chat(messages=ask("Weather?"), tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert ei.value.body["param"] == "tool_choice" and "'nope'" in ei.value.body["message"]


def test_tools_without_a_tool_call_parser_are_refused(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=TINY_RANDOM, messages=ask("Weather?"), tools=TOOLS)
    assert ei.value.body["param"] == "tools"
    assert "--tool-call-parser" in ei.value.body["message"]


def test_unknown_tool_call_parser_fails_at_launch():
    proc = subprocess.run([*LAUNCH, "api-server", "--port", "0", "--tool-call-parser", "nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    assert "--tool-call-parser" in proc.stderr and "'nope'" in proc.stderr
    for name in TOOL_PARSERS:
        assert name in proc.stderr
