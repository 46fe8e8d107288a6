"""The official anthropic SDK against `launch api-server`: POST /v1/messages and /v1/messages/count_tokens.

SmolLM2 (``smollm_server``) checks text generation, usage, stop sequences, max_tokens
and streaming; the scripted model (``scripted_server``: hermes tool calls, think reasoning) checks
tool_use / tool_result, tool_choice, thinking blocks and assistant prefill exactly.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from zserve.catalog import DEFAULT_CHAT_MODEL, TINY_RANDOM

from . import scripted_model as sm

slow = pytest.mark.slow

QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful assistant."
GREEDY = {"temperature": 0}
WEATHER_TOOL = {"name": sm.WEATHER_TOOL["function"]["name"], "description": sm.WEATHER_TOOL["function"]["description"],
                "input_schema": sm.WEATHER_TOOL["function"]["parameters"]}
WEATHER = sm.WEATHER_TOOL["function"]["name"]


def _client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def smol(smollm_server) -> anthropic.Anthropic:
    return _client(smollm_server)


@pytest.fixture(scope="module")
def scripted(scripted_server, scripted_model) -> tuple[anthropic.Anthropic, str]:
    return _client(scripted_server), scripted_model.name


def _inputs(calls: list[dict]) -> list[dict]:
    return [c["arguments"] for c in calls]


def _tool_uses(message) -> list:
    return [b for b in message.content if b.type == "tool_use"]


def _sse_events(client: anthropic.Anthropic, **kw) -> list[tuple[str, dict]]:
    """Every SSE event of a streamed request as (event name, data), pings included (the SDK's own
    stream drops those)."""
    events: list[tuple[str, dict]] = []
    name = None
    with client.messages.with_streaming_response.create(stream=True, **kw) as resp:
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    return events


# -- SmolLM2: text --------------------------------------------------------------------------------

@slow
def test_system_prompt_as_string_or_text_blocks_and_usage_matching_count_tokens(smol):
    plain = dict(model=DEFAULT_CHAT_MODEL, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}])
    r = smol.messages.create(max_tokens=20, extra_body=GREEDY, **plain)
    assert r.type == "message" and r.role == "assistant" and r.model == DEFAULT_CHAT_MODEL
    assert r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and "Paris" in r.content[0].text
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    counted = smol.messages.count_tokens(**plain).input_tokens
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == counted
    assert r.usage.output_tokens > 0

    # The same conversation with a list of text blocks renders the same prompt: the same answer.
    blocks = smol.messages.create(model=DEFAULT_CHAT_MODEL, max_tokens=20, extra_body=GREEDY,
                                  system=[{"type": "text", "text": SYSTEM}],
                                  messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
    assert blocks.content[0].text == r.content[0].text
    assert blocks.usage.input_tokens + blocks.usage.cache_read_input_tokens == counted


@slow
def test_the_same_prompt_gives_the_same_answer_as_chat_completions(smol, smollm_server):
    messages = [{"role": "user", "content": QUESTION}]
    msg = smol.messages.create(model=DEFAULT_CHAT_MODEL, max_tokens=20, messages=messages, extra_body=GREEDY)
    chat = httpx.post(smollm_server.url + "/v1/chat/completions", timeout=120, json={
        "model": DEFAULT_CHAT_MODEL, "messages": messages, "max_tokens": 20, "temperature": 0}).json()
    assert msg.content[0].text == chat["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]


@slow
def test_multi_turn_with_block_content(smol):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "I am planning a trip to Europe."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "That sounds exciting! Which countries?"}]},
        {"role": "user", "content": [{"type": "text", "text": "France."}, {"type": "text", "text": QUESTION}]},
    ]
    r = smol.messages.create(model=DEFAULT_CHAT_MODEL, max_tokens=40, messages=messages, extra_body=GREEDY)
    assert "Paris" in r.content[0].text
    assert r.stop_reason == "end_turn"


@slow
def test_stop_sequence_cuts_the_text_before_it(smol):
    kw = dict(model=DEFAULT_CHAT_MODEL, max_tokens=20, messages=[{"role": "user", "content": QUESTION}],
              extra_body=GREEDY)
    full = smol.messages.create(**kw).content[0].text
    assert "Paris" in full
    r = smol.messages.create(stop_sequences=["Paris"], **kw)
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "Paris")
    assert r.content[0].text == full[: full.index("Paris")]


@slow
def test_max_tokens_stops_the_message(smol):
    kw = dict(model=DEFAULT_CHAT_MODEL, messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY)
    r = smol.messages.create(max_tokens=4, **kw)
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert r.usage.output_tokens == 4
    assert r.content[0].text and "Paris" not in r.content[0].text


@slow
def test_stream_sends_every_event_in_order_and_matches_the_message(smol):
    kw = dict(model=DEFAULT_CHAT_MODEL, max_tokens=20, messages=[{"role": "user", "content": QUESTION}],
              extra_body=GREEDY)
    events = _sse_events(smol, **kw)
    names = [n for n, _ in events]
    assert all(n == d["type"] for n, d in events)
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"} and len(names) > 7
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [d["delta"] for _, d in events[3:-3]]
    assert {d["type"] for d in deltas} == {"text_delta"}
    streamed_text = "".join(d["text"] for d in deltas)
    message_delta = events[-2][1]
    assert message_delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}

    full = smol.messages.create(**kw)
    assert streamed_text == full.content[0].text
    assert message_delta["usage"]["output_tokens"] == full.usage.output_tokens
    # The prompt is in the prefix cache now: message_start, message_delta and the non-streamed reply split the
    # input alike (input_tokens + cache_read_input_tokens), as Anthropic's usage does.
    again = _sse_events(smol, **kw)
    split = ("input_tokens", "cache_read_input_tokens")
    start_usage, delta_usage = again[0][1]["message"]["usage"], again[-2][1]["usage"]
    assert [start_usage[k] for k in split] == [delta_usage[k] for k in split] == [getattr(full.usage, k) for k in split]
    assert start_usage["cache_read_input_tokens"] > 0 and start_usage["output_tokens"] == 0
    with smol.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == full.content[0].text
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in full.content]
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens


def test_tools_without_a_tool_call_parser_are_refused(tiny_server):
    client = _client(tiny_server)  # tiny-random is served without a tool-call parser
    with pytest.raises(anthropic.BadRequestError) as ei:
        client.messages.create(model=TINY_RANDOM, max_tokens=8, tools=[WEATHER_TOOL],
                               messages=[{"role": "user", "content": QUESTION}])
    assert ei.value.body["type"] == "error"
    assert ei.value.body["error"]["type"] == "invalid_request_error"
    assert "--tool-call-parser" in ei.value.body["error"]["message"]
    # Counting needs no parser: the prompt is rendered with the tools, as /tokenize renders it.
    counted = client.messages.count_tokens(model=TINY_RANDOM, tools=[WEATHER_TOOL],
                                           messages=[{"role": "user", "content": QUESTION}]).input_tokens
    tokenized = httpx.post(tiny_server.url + "/tokenize", timeout=30, json={
        "messages": [{"role": "user", "content": QUESTION}], "tools": [sm.WEATHER_TOOL]}).json()
    assert counted == tokenized["count"]


# -- scripted model: tools, thinking, prefill -----------------------------------------------------

def test_tool_use_then_tool_result_round_trip(scripted):
    client, model = scripted
    question = {"role": "user", "content": "What is the weather in Paris? " + sm.WEATHER_TRIGGER}
    r = client.messages.create(model=model, max_tokens=64, tools=[WEATHER_TOOL], messages=[question])
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["tool_use"]  # no text around the call
    call = r.content[0]
    assert call.id.startswith("toolu_") and call.name == WEATHER
    assert [call.input] == _inputs(sm.EXPECTED_CALLS[sm.WEATHER_TRIGGER])

    result = {"type": "tool_result", "tool_use_id": call.id, "content": '{"sky": "clear"} ' + sm.TOOL_RESULT_TRIGGER}
    history = [question, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
               {"role": "user", "content": [result]}]
    answer = client.messages.create(model=model, max_tokens=64, tools=[WEATHER_TOOL], messages=history)
    assert [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text == sm.EXPECTED_TOOL_RESULT
    assert answer.stop_reason == "end_turn"

    # tool_result content as a list of text blocks works the same
    result["content"] = [{"type": "text", "text": '{"sky": "clear"} ' + sm.TOOL_RESULT_TRIGGER}]
    again = client.messages.create(model=model, max_tokens=64, tools=[WEATHER_TOOL], messages=history)
    assert again.content[0].text == sm.EXPECTED_TOOL_RESULT


def test_streamed_text_then_two_tool_uses(scripted):
    client, model = scripted
    with client.messages.stream(model=model, max_tokens=64, tools=[WEATHER_TOOL],
                                messages=[{"role": "user", "content": "Weather? " + sm.TWO_CALLS_TRIGGER}]) as s:
        events = list(s)
        final = s.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["text", "tool_use", "tool_use"]
    assert all(b.name == WEATHER and b.input == {} and b.id.startswith("toolu_") for b in starts[1:])
    partial: dict[int, str] = {}
    for e in events:
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
            partial[e.index] = partial.get(e.index, "") + e.delta.partial_json
    assert sorted(partial) == [1, 2]
    expected = _inputs(sm.EXPECTED_CALLS[sm.TWO_CALLS_TRIGGER])
    assert [json.loads(partial[i]) for i in (1, 2)] == expected

    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    assert final.content[0].text == sm.TWO_CALLS_CONTENT
    assert [b.input for b in final.content[1:]] == expected
    assert [b.id for b in final.content[1:]] == [b.id for b in starts[1:]]


# With a single tool, "any" opens the call to that tool just as naming it does (structured output
# then holds the arguments to its input_schema).
@pytest.mark.parametrize("tool_choice, expected", [
    ({"type": "any"}, sm.EXPECTED_CALLS[sm.NAMED_PREFILL]),
    ({"type": "any", "disable_parallel_tool_use": True}, sm.EXPECTED_CALLS[sm.NAMED_PREFILL]),
    ({"type": "tool", "name": WEATHER}, sm.EXPECTED_CALLS[sm.NAMED_PREFILL]),
], ids=["any", "any-one", "named"])
def test_forced_tool_choice(scripted, tool_choice, expected):
    client, model = scripted
    # The question ends in no trigger: only the forced call's prefill makes the model call.
    r = client.messages.create(model=model, max_tokens=64, tools=[WEATHER_TOOL], tool_choice=tool_choice,
                               messages=[{"role": "user", "content": "What is the weather?"}])
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["tool_use"] * len(expected)
    assert [(b.name, b.input) for b in r.content] == [(c["name"], c["arguments"]) for c in expected]


def test_tool_choice_none_leaves_the_call_as_text(scripted):
    client, model = scripted
    r = client.messages.create(model=model, max_tokens=64, tools=[WEATHER_TOOL], tool_choice={"type": "none"},
                               messages=[{"role": "user", "content": "Weather? " + sm.WEATHER_TRIGGER}])
    assert [(b.type, b.text) for b in r.content] == [("text", sm.EXPECTED_WEATHER)]
    assert r.stop_reason == "end_turn"


def test_thinking_blocks_streamed_and_not(scripted):
    client, model = scripted
    kw = dict(model=model, max_tokens=64, messages=[{"role": "user", "content": "Capital? " + sm.THINK_TRIGGER}])
    r = client.messages.create(**kw)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == sm.REASONING and r.content[1].text == sm.ANSWER
    assert r.stop_reason == "end_turn"

    with client.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == sm.REASONING
    assert "".join(d.text for d in deltas if d.type == "text_delta") == sm.ANSWER
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in r.content]
    assert final.stop_reason == r.stop_reason


def test_empty_output_has_the_same_content_streamed_and_not(scripted):
    client, model = scripted
    kw = dict(model=model, max_tokens=8, messages=[{"role": "user", "content": "Hello"}])  # no trigger: EOS at once
    r = client.messages.create(**kw)
    assert [(b.type, b.text) for b in r.content] == [("text", "")] and r.stop_reason == "end_turn"
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in r.content]


@pytest.mark.parametrize("as_blocks", [False, True], ids=["string", "blocks"])
def test_assistant_prefill_is_continued(scripted, as_blocks):
    client, model = scripted
    prefill = "Once" + "".join(sm.STORY_TOKENS[1:3])  # "Once upon a": the model goes on after " a"
    content = [{"type": "text", "text": prefill}] if as_blocks else prefill
    r = client.messages.create(model=model, max_tokens=64, messages=[
        {"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": content}])
    # Only the continuation comes back (stripped of its leading space by the reasoning parser).
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == sm.EXPECTED[sm.STORY_TOKENS[2]].strip()
    assert r.stop_reason == "end_turn"


# -- errors ---------------------------------------------------------------------------------------

def test_unknown_model_is_not_found_in_anthropic_shape(scripted):
    client, _ = scripted
    with pytest.raises(anthropic.NotFoundError) as ei:
        client.messages.create(model="claude-nope", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert ei.value.status_code == 404
    body = ei.value.body
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error" and "claude-nope" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope", messages=[{"role": "user", "content": "hi"}])


def _post(server, body: dict, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60,
                      headers={"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01"})


def _invalid(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


def test_missing_max_tokens_is_invalid_request(scripted_server, scripted_model):
    r = _post(scripted_server, {"model": scripted_model.name, "messages": [{"role": "user", "content": "hi"}]})
    assert "max_tokens" in _invalid(r)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "lots"),
    ("max_tokens", 0),
    ("messages", "hi"),
    ("messages", []),
    ("messages", [{"role": "system", "content": "hi"}]),
    ("messages", [{"role": "user", "content": [{"type": "video", "url": "x"}]}]),
    ("temperature", 1.5),
    ("stop_sequences", "STOP"),
    ("tool_choice", {"type": "sometimes"}),
    ("system", 7),
])
def test_wrong_types_are_invalid_requests(scripted_server, scripted_model, field, value):
    body = {"model": scripted_model.name, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    body[field] = value
    assert field in _invalid(_post(scripted_server, body))


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": WEATHER}])
def test_forced_tool_choice_without_tools_is_invalid_request(scripted_server, scripted_model, tool_choice):
    body = {"model": scripted_model.name, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "tool_choice": tool_choice}
    # named as the client wrote it, not as OpenAI's "required" / "function"
    assert f'tool_choice of type "{tool_choice["type"]}" needs tools' in _invalid(_post(scripted_server, body))


def test_headers_accepted_and_server_still_answers_after_bad_requests(scripted_server, scripted_model):
    body = {"model": scripted_model.name, "max_tokens": 64,
            "messages": [{"role": "user", "content": "Weather? " + sm.WEATHER_TRIGGER}], "tools": [WEATHER_TOOL]}
    for _ in range(3):  # new connections: both gateways get a turn
        r = _post(scripted_server, body)
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["input"] == sm.EXPECTED_CALLS[sm.WEATHER_TRIGGER][0]["arguments"]
    counted = _post(scripted_server, {k: v for k, v in body.items() if k != "max_tokens"},
                    "/v1/messages/count_tokens")
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
