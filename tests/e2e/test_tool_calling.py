"""Tool calling and reasoning through the official openai SDK's chat completions, against the scripted
model served with ``--tool-call-parser hermes --reasoning-parser think`` (``scripted_server``); output
cut inside a call on every family (openai and anthropic SDKs); forced calls of the real SmolLM2
(``smollm_server``, hermes), which depend on what the model writes."""

from __future__ import annotations

import json
import subprocess

import anthropic
import httpx
import openai
import pytest

from gateway.text.tool_parsers import TOOL_PARSERS
from tests.helpers import LAUNCH, ROOT
from zserve.catalog import DEFAULT_CHAT_MODEL, TINY_RANDOM

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


def accumulate(chunks, choice: int | None = None) -> tuple[str, str, dict[int, dict], list[str]]:
    """(content, reasoning_content, calls by index, finish reasons) of a streamed chat completion (of its
    choice ``choice`` when given); asserts that each call's first delta carries its id, type and name, and
    no later one does."""
    content, reasoning, finishes = [], [], []
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            if choice is not None and ch.index != choice:
                continue
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


# -- output cut inside a call: never an error, never text ------------------------------------------

# The named-call script writes {"city": "Paris"}; a tool that takes Rome or Oslo only makes the grammar, not the
# script, choose every token, so two tokens leave the forced call cut inside its arguments.
ROME_OR_OSLO = {"type": "function", "function": {"name": WEATHER, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Rome", "Oslo"]}}, "required": ["city"]}}}
TWO_CALLS = ask("Weather in Berlin and Rome? " + sm.TWO_CALLS_TRIGGER)
# The two-calls script's first four tokens: its text, "<tool_call>\n", the Berlin call, and the tag that closes
# it and opens the Rome call, which max_tokens then cuts; two tokens: the text and the first call's opening.
CUT_AFTER = {4: ["Berlin"], 2: []}


def cities(calls) -> list[str]:
    return [json.loads(args)["city"] for args in calls]


@pytest.mark.parametrize("n", [1, 3])
def test_call_cut_by_max_tokens_keeps_the_whole_calls_and_drops_the_cut_one(chat, n):
    for max_tokens, whole in CUT_AFTER.items():
        kw = dict(messages=TWO_CALLS, tools=TOOLS, n=n, max_tokens=max_tokens)
        for c in chat(**kw).choices:
            assert (c.finish_reason, c.message.content) == ("length", sm.TWO_CALLS_CONTENT)
            assert cities(t.function.arguments for t in c.message.tool_calls or ()) == whole
        chunks = list(chat(stream=True, **kw))
        for i in range(n):
            content, _, calls, finishes = accumulate(chunks, i)
            assert (content, finishes) == (sm.TWO_CALLS_CONTENT, ["length"])
            assert cities(calls[k]["arguments"] for k in sorted(calls)) == whole


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_call_cut_by_max_tokens_is_a_length_finish_not_an_error(chat, tool_choice):
    kw = dict(messages=ask("Weather?"), tools=[ROME_OR_OSLO], tool_choice=tool_choice, max_tokens=2, temperature=0,
              n=3)
    for c in chat(**kw).choices:
        assert (c.finish_reason, c.message.content, c.message.tool_calls) == ("length", "", [])
    chunks = list(chat(stream=True, **kw))
    for i in range(3):
        assert accumulate(chunks, i) == ("", "", {}, ["length"])


def test_forced_call_cut_by_a_stop_string_is_no_error(chat):
    c = chat(messages=ask("Weather?"), tools=TOOLS, tool_choice=NAMED, stop=['"Paris"']).choices[0]
    assert (c.finish_reason, c.message.content, c.message.tool_calls) == ("stop", "", [])


def anthropic_tool(tool: dict) -> dict:
    fn = tool["function"]
    return {"name": fn["name"], "input_schema": fn["parameters"]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_tool_use_cut_by_max_tokens(scripted_server, scripted_model, stream):
    client = anthropic.Anthropic(base_url=scripted_server.url, api_key="x", max_retries=0, timeout=120)

    def create(**kw):
        kw = dict(model=scripted_model.name, **kw)
        if not stream:
            return client.messages.create(**kw)
        with client.messages.stream(**kw) as s:
            return s.get_final_message()

    for tool_choice in ({"type": "any"}, {"type": "tool", "name": WEATHER}):
        r = create(max_tokens=2, tools=[anthropic_tool(ROME_OR_OSLO)], tool_choice=tool_choice,
                   messages=ask("Weather?"), extra_body={"temperature": 0})
        assert (r.stop_reason, [(b.type, b.text) for b in r.content]) == ("max_tokens", [("text", "")])
    for max_tokens, whole in CUT_AFTER.items():
        r = create(max_tokens=max_tokens, tools=[anthropic_tool(sm.WEATHER_TOOL)], messages=TWO_CALLS)
        assert r.stop_reason == "max_tokens"
        assert [b.text for b in r.content if b.type == "text"] == [sm.TWO_CALLS_CONTENT]
        assert [b.input["city"] for b in r.content if b.type == "tool_use"] == whole


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_function_call_cut_by_max_output_tokens_is_incomplete(scripted_server, scripted_model, stream):
    client = openai.OpenAI(base_url=scripted_server.url + "/v1", api_key="x", max_retries=0, timeout=120)

    def create(**kw):
        kw = dict(model=scripted_model.name, store=False, **kw)
        if not stream:
            return client.responses.create(**kw)
        events = list(client.responses.create(stream=True, **kw))
        assert events[-1].type == "response.incomplete"
        return events[-1].response

    def flat(tool: dict) -> dict:
        return {"type": "function", **tool["function"]}

    r = create(input="Weather?", tools=[flat(ROME_OR_OSLO)], tool_choice="required", max_output_tokens=2,
               temperature=0)
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert [(o.type, "".join(p.text for p in o.content)) for o in r.output] == [("message", "")]
    for max_tokens, whole in CUT_AFTER.items():
        r = create(input=TWO_CALLS, tools=[flat(sm.WEATHER_TOOL)], max_output_tokens=max_tokens)
        assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
        assert ["".join(p.text for p in o.content) for o in r.output if o.type == "message"] == \
            [sm.TWO_CALLS_CONTENT]
        assert cities(o.arguments for o in r.output if o.type == "function_call") == whole


@pytest.mark.parametrize("tool_choice", [None, "required", NAMED], ids=["auto", "required", "named"])
def test_tokenize_renders_the_forced_call_opening_the_chat_route_feeds(scripted_server, scripted_model, tool_choice):
    body: dict = {"model": scripted_model.name, "messages": ask("Weather?"), "tools": TOOLS}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    tokenized = httpx.post(scripted_server.url + "/tokenize", json=body, timeout=30).json()
    rendered = httpx.post(scripted_server.url + "/v1/chat/completions/render", json=body, timeout=30).json()
    assert tokenized["tokens"] == rendered["token_ids"]
    assert rendered["prompt"].endswith(sm.NAMED_PREFILL) == (tool_choice is not None)


# -- forced calls of the real SmolLM2 --------------------------------------------------------------

SMOL_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol(smollm_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def check_weather_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    assert name == "get_weather" and isinstance(args["city"], str), (name, arguments)
    assert set(args) <= {"city", "unit"} and args.get("unit", "celsius") in ("celsius", "fahrenheit"), arguments


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_smollm2_forced_call_to_a_plain_request_is_one_valid_call(smol, tool_choice, stream):
    # SmolLM2 knows nothing of tools (its template drops them): it wrote "\n" after </tool_call>, which opened
    # another call until max_tokens, and properties the tool does not list ("description": "The weather in
    # Paris is ...") until max_tokens: HTTP 500. Now it ends its turn after the call, greedy or sampled.
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "n": 3, "seed": 1}):
        kw = dict(model=DEFAULT_CHAT_MODEL, messages=PARIS, tools=[SMOL_WEATHER], tool_choice=tool_choice,
                  max_tokens=64, **sampling)
        if not stream:
            choices = smol.chat.completions.create(**kw).choices
            assert len(choices) == sampling.get("n", 1)
            for c in choices:
                assert (c.finish_reason, c.message.content, len(c.message.tool_calls)) == ("tool_calls", None, 1)
                check_weather_call(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)
            continue
        chunks = list(smol.chat.completions.create(stream=True, **kw))
        for i in range(sampling.get("n", 1)):
            content, _, calls, finishes = accumulate(chunks, i)
            assert (content, finishes, sorted(calls)) == ("", ["tool_calls"], [0])
            check_weather_call(calls[0]["name"], calls[0]["arguments"])


@pytest.mark.slow
def test_smollm2_forced_tool_use_cut_by_max_tokens_is_no_text(smollm_server):
    # Anthropic's tool_choice "any" answered a text block '<tool_call>\n{"name": "get_weather", ...' beside the calls.
    client = anthropic.Anthropic(base_url=smollm_server.url, api_key="x", max_retries=0, timeout=120)
    kw = dict(model=DEFAULT_CHAT_MODEL, max_tokens=5, tools=[anthropic_tool(SMOL_WEATHER)], tool_choice={"type": "any"},
              messages=PARIS, extra_body={"temperature": 0})  # (the SDK's stream() takes no temperature)
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    for r in (client.messages.create(**kw), streamed):
        assert (r.stop_reason, [(b.type, b.text) for b in r.content]) == ("max_tokens", [("text", "")])


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
