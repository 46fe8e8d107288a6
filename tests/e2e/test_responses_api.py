"""The OpenAI Responses API (`/v1/responses`) through the official `openai` SDK, on real servers.

The scripted model (tests/e2e/scripted_model.py) makes outputs exact: reasoning + message, function
calls, a ten-token story. Stored responses live in a store every gateway process shares, so the
cross-gateway tests pin one SDK client to each of two *different* gateway processes (a keep-alive
connection stays on the process that accepted it) and create, retrieve, chain and cancel through
both: with the default SQLite store, and with Redis (``--state-url redis://...``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests.helpers import Server, pinned_client, wait_until

from . import scripted_model as sm

WEATHER_FUNCTION = {"type": "function", **sm.WEATHER_TOOL["function"]}  # the Responses API's flat tool shape
TINY = "tiny-random"


# -- clients pinned to gateway processes -----------------------------------------------------------

@dataclass
class Gateway:
    """One keep-alive connection to one gateway process: raw HTTP and the SDK share it."""

    http: httpx.Client
    sdk: openai.OpenAI
    index: int

    def load(self) -> dict:
        body = self.http.get("/load").json()
        assert body["gateway"] == self.index, "the keep-alive connection moved to another gateway process"
        return body

    def close(self) -> None:
        self.http.close()


def _connect(url: str) -> Gateway:
    http = pinned_client(url, timeout=120)
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", http_client=http, max_retries=0)
    return Gateway(http, sdk, http.get("/load").json()["gateway"])


def two_gateways(url: str, timeout: float = 30.0) -> tuple[Gateway, Gateway]:
    """Clients on two different gateway processes: new connections until one lands elsewhere."""
    a = _connect(url)
    deadline = time.monotonic() + timeout
    while True:
        b = _connect(url)
        if b.index != a.index:
            return a, b
        b.close()
        if time.monotonic() > deadline:
            a.close()
            raise AssertionError(f"no connection reached a second gateway process within {timeout}s")


@pytest.fixture(scope="module")
def model(scripted_model) -> str:
    return scripted_model.name


@pytest.fixture(scope="module")
def gws(scripted_server) -> Iterator[tuple[Gateway, Gateway]]:
    a, b = two_gateways(scripted_server.url)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def client(gws) -> openai.OpenAI:
    return gws[0].sdk


@pytest.fixture(scope="module")
def tiny_gws(tiny_server) -> Iterator[tuple[Gateway, Gateway]]:
    a, b = two_gateways(tiny_server.url)
    yield a, b
    a.close()
    b.close()


def prompt_tokens(http: httpx.Client, messages: list[dict], tools: list[dict] | None = None) -> int:
    """How many tokens the chat route's rendering of ``messages`` has (POST /tokenize)."""
    body: dict = {"messages": messages}
    if tools:
        body["tools"] = tools
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def message_text(item) -> str:
    return "".join(p.text for p in item.content)


# -- one response ------------------------------------------------------------------------------------

def test_reasoning_then_message(client, gws, model) -> None:
    question = "What is the capital of France? " + sm.THINK_TRIGGER
    r = client.responses.create(model=model, input=question)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert (r.status, r.error, r.incomplete_details) == ("completed", None, None)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    reasoning, message = r.output
    assert [c.text for c in reasoning.content] == [sm.REASONING]
    assert (message.role, message.status, message_text(message)) == ("assistant", "completed", sm.ANSWER)
    assert r.output_text == sm.ANSWER
    # <think>, the reasoning, </think>, the answer, then EOS.
    assert r.usage.output_tokens == len(sm.SCRIPTS[sm.THINK_TRIGGER]) + 1
    assert r.usage.input_tokens == prompt_tokens(gws[0].http, [{"role": "user", "content": question}])
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_function_call_items(client, gws, model) -> None:
    question = "What is the weather in Paris? " + sm.WEATHER_TRIGGER
    r = client.responses.create(model=model, input=question, tools=[WEATHER_FUNCTION])
    assert r.status == "completed"
    assert [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.call_id and call.id and call.id != call.call_id and call.status == "completed"
    expected = sm.EXPECTED_CALLS[sm.WEATHER_TRIGGER][0]
    assert (call.name, json.loads(call.arguments)) == (expected["name"], expected["arguments"])
    assert r.output_text == ""
    assert [t.name for t in r.tools] == ["get_weather"]
    assert r.usage.input_tokens == prompt_tokens(gws[0].http, [{"role": "user", "content": question}],
                                                 tools=[sm.WEATHER_TOOL])


def test_streamed_text_events(client, model) -> None:
    kw = dict(model=model, input="Tell me a story. " + sm.STORY_TRIGGER)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    # (One delta is allowed: a gateway that falls behind its engine merges the outputs queued for a stream into one
    # event, engine_client.take_outputs, and the story is 10 tokens. Streaming token by token is shown by the
    # longer generations of test_concurrency.py and test_native_routes.py.)
    assert deltas and all(deltas)
    seq = [e.sequence_number for e in events]
    assert all(x < y for x, y in zip(seq, seq[1:]))
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and final.status == "completed" and created.id == final.id
    # One message item, the same id in every event that names it.
    item_id = events[2].item.id
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {item_id} and events[-2].item.id == item_id
    text = "".join(deltas)
    assert text == sm.EXPECTED_STORY.strip()  # the reasoning parser strips message text
    assert events[-4].text == text and events[-3].part.text == text
    assert final.output_text == text
    assert client.responses.create(**kw).output_text == text
    assert client.responses.retrieve(final.id).output_text == text


def test_streamed_reasoning_events(client, model) -> None:
    events = list(client.responses.create(model=model, input="Capital? " + sm.THINK_TRIGGER, stream=True))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, answer) == (sm.REASONING, sm.ANSWER)
    assert events[-1].type == "response.completed"
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]


LOGPROBS = ["message.output_text.logprobs"]


def logprob_bytes(lps) -> str:
    return b"".join(bytes(lp.bytes) for lp in lps).decode()


def test_output_text_logprobs_are_included(client, model) -> None:
    kw = dict(model=model, input="Tell me a story. " + sm.STORY_TRIGGER, include=LOGPROBS, top_logprobs=2)
    r = client.responses.create(**kw)
    lps = r.output[0].content[0].logprobs
    # Every generated token, EOS included (the message text itself is stripped by the reasoning parser).
    assert logprob_bytes(lps) == sm.EXPECTED_STORY + sm.EOS_TOKEN and len(lps) == r.usage.output_tokens
    assert r.top_logprobs == 2
    for lp in lps:
        assert lp.token == bytes(lp.bytes).decode() and lp.logprob <= 0 and len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0].token == lp.token  # the scripted model writes its most likely token
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
    assert client.responses.retrieve(r.id).output[0].content[0].logprobs == lps
    # Streamed: the deltas carry them; the done event and the final response carry them all.
    events = list(client.responses.create(**kw, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response.output[0].content[0].logprobs
    for got in (streamed, done.logprobs, final):
        assert [(lp.token, lp.logprob) for lp in got] == [(lp.token, lp.logprob) for lp in lps]
    assert client.responses.create(model=model, input=kw["input"]).output[0].content[0].logprobs == []


def test_output_text_logprobs_leave_out_reasoning_tokens(client, model) -> None:
    kw = dict(model=model, input="Capital? " + sm.THINK_TRIGGER, include=LOGPROBS)
    r = client.responses.create(**kw)
    message = r.output[-1]
    assert logprob_bytes(message.content[0].logprobs) == sm.ANSWER + sm.EOS_TOKEN
    events = list(client.responses.create(**kw, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in message.content[0].logprobs]


def test_max_output_tokens_makes_it_incomplete(client, model) -> None:
    kw = dict(model=model, input="Tell me a story. " + sm.STORY_TRIGGER, max_output_tokens=3)
    expected = "".join(sm.STORY_TOKENS[:3]).strip()
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == expected and r.usage.output_tokens == 3 and r.max_output_tokens == 3
    events = list(client.responses.create(**kw, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected


def test_instructions_are_this_turns_system_prompt(client, gws, model) -> None:
    http = gws[0].http
    first = "Tell me a story. " + sm.STORY_TRIGGER
    system = "You are a storyteller."
    r1 = client.responses.create(model=model, input=first, instructions=system)
    assert r1.instructions == system and r1.output_text == sm.EXPECTED_STORY.strip()
    assert r1.usage.input_tokens == prompt_tokens(http, [{"role": "system", "content": system},
                                                         {"role": "user", "content": first}])
    # A chained turn does not inherit the previous turn's instructions (OpenAI's rule).
    second = "And the weather? " + sm.TOOL_RESULT_TRIGGER
    r2 = client.responses.create(model=model, input=second, previous_response_id=r1.id)
    assert r2.instructions is None and r2.output_text == sm.EXPECTED_TOOL_RESULT
    assert r2.usage.input_tokens == prompt_tokens(http, [{"role": "user", "content": first},
                                                         {"role": "assistant", "content": r1.output_text},
                                                         {"role": "user", "content": second}])


def test_function_call_output_round_trip(client, gws, model) -> None:
    question = {"role": "user", "content": "What is the weather in Paris? " + sm.WEATHER_TRIGGER}
    r1 = client.responses.create(model=model, input=[question], tools=[WEATHER_FUNCTION])
    (call,) = r1.output
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": '{"sky": "clear"} ' + sm.TOOL_RESULT_TRIGGER}
    # The whole conversation as input items (the SDK's `input += response.output` idiom) ...
    r2 = client.responses.create(model=model, input=[question, *r1.output, result], tools=[WEATHER_FUNCTION])
    assert r2.status == "completed" and [o.type for o in r2.output] == ["message"]
    assert r2.output_text == sm.EXPECTED_TOOL_RESULT
    rendered = [question,
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]}]
    assert r2.usage.input_tokens == prompt_tokens(gws[0].http, rendered, tools=[sm.WEATHER_TOOL])
    # ... or only the result, chained onto the stored call: the same prompt.
    r3 = client.responses.create(model=model, input=[result], previous_response_id=r1.id, tools=[WEATHER_FUNCTION])
    assert r3.output_text == sm.EXPECTED_TOOL_RESULT
    assert r3.usage.input_tokens == r2.usage.input_tokens
    # A result for a call that neither the input nor the chain made is refused, as OpenAI refuses it.
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model=model, input=[{**result, "call_id": "call_unknown"}], previous_response_id=r1.id,
                                tools=[WEATHER_FUNCTION])
    assert ei.value.body["param"] == "input.0.call_id" and "call_unknown" in ei.value.body["message"]


def test_input_items_are_listed_from_any_gateway(gws, model) -> None:
    a, b = gws
    question = {"role": "user", "content": "What is the weather in Paris? " + sm.WEATHER_TRIGGER}
    r1 = a.sdk.responses.create(model=model, input=[question], tools=[WEATHER_FUNCTION])
    (call,) = r1.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny " + sm.TOOL_RESULT_TRIGGER}
    r2 = a.sdk.responses.create(model=model, input=[question, *r1.output, result], tools=[WEATHER_FUNCTION])
    listed = b.sdk.responses.input_items.list(r2.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "function_call", "function_call_output"]
    assert listed.data[0].content[0].text == question["content"]
    assert (listed.data[1].call_id, listed.data[1].name) == (call.call_id, call.name)
    assert listed.data[2].output == result["output"]
    newest_first = b.sdk.responses.input_items.list(r2.id)  # OpenAI's default order: desc
    assert [i.id for i in newest_first.data] == [i.id for i in reversed(listed.data)]
    page = b.http.get(f"/v1/responses/{r2.id}/input_items", params={"order": "asc", "limit": 1,
                                                                    "after": listed.data[0].id}).json()
    assert [i["id"] for i in page["data"]] == [listed.data[1].id] and page["has_more"] is True
    assert b.http.get(f"/v1/responses/{r2.id}/input_items", params={"limit": 0}).status_code == 400
    text_input = a.sdk.responses.create(model=model, input="Story? " + sm.STORY_TRIGGER)
    (only,) = b.sdk.responses.input_items.list(text_input.id).data
    assert (only.role, only.content[0].text) == ("user", "Story? " + sm.STORY_TRIGGER)


def test_store_false_is_not_kept(client, gws, model) -> None:
    r = client.responses.create(model=model, input="Story? " + sm.STORY_TRIGGER, store=False)
    assert r.status == "completed" and r.store is False and r.output_text == sm.EXPECTED_STORY.strip()
    for gw in gws:
        with pytest.raises(openai.NotFoundError):
            gw.sdk.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.create(model=model, input="more", previous_response_id=r.id)
    assert ei.value.body["param"] == "previous_response_id"


def test_delete_through_another_gateway(gws, model) -> None:
    a, b = gws
    r = a.sdk.responses.create(model=model, input="Story? " + sm.STORY_TRIGGER)
    b.sdk.responses.delete(r.id)
    for gw in gws:
        with pytest.raises(openai.NotFoundError):
            gw.sdk.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        a.sdk.responses.delete(r.id)


# -- across gateway processes ------------------------------------------------------------------------

def check_chain_across(a: Gateway, b: Gateway, model: str) -> None:
    """Create on A; retrieve on B; chain on B; chain that on A; each turn's prompt holds the ones before."""
    assert a.index != b.index
    story = sm.EXPECTED_STORY.strip()  # the reasoning parser strips message text
    first = "Tell me a story. " + sm.STORY_TRIGGER
    r1 = a.sdk.responses.create(model=model, input=first)
    assert r1.output_text == story
    got = b.sdk.responses.retrieve(r1.id)
    assert got.model_dump() == r1.model_dump()

    second = "Now the weather. " + sm.TOOL_RESULT_TRIGGER
    r2 = b.sdk.responses.create(model=model, input=second, previous_response_id=r1.id)
    assert (r2.status, r2.previous_response_id, r2.output_text) == ("completed", r1.id, sm.EXPECTED_TOOL_RESULT)
    history = [{"role": "user", "content": first}, {"role": "assistant", "content": r1.output_text},
               {"role": "user", "content": second}]
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    assert r2.usage.input_tokens == prompt_tokens(b.http, history)

    third = "Think about it. " + sm.THINK_TRIGGER
    r3 = a.sdk.responses.create(model=model, input=third, previous_response_id=r2.id)
    assert r3.output_text == sm.ANSWER
    history += [{"role": "assistant", "content": r2.output_text}, {"role": "user", "content": third}]
    assert r3.usage.input_tokens == prompt_tokens(a.http, history)
    assert a.sdk.responses.retrieve(r2.id).model_dump() == r2.model_dump()
    assert b.sdk.responses.retrieve(r3.id).model_dump() == r3.model_dump()
    a.load(), b.load()  # both connections stayed on their processes throughout


def test_chain_across_gateways(gws, model) -> None:
    check_chain_across(*gws, model)


def test_cancel_background_response_through_another_gateway(tiny_gws) -> None:
    a, b = tiny_gws
    # Random weights almost never write EOS: thousands of tokens, far longer than this test waits.
    r = a.sdk.responses.create(model=TINY, input="Write a very long story.", max_output_tokens=4000,
                               background=True)
    assert r.background is True and r.status in ("queued", "in_progress") and r.output == []
    assert b.sdk.responses.retrieve(r.id).status in ("queued", "in_progress")
    wait_until(lambda: a.load()["in_flight"] == 1, 10, what="A generating the background response")

    cancelled = b.sdk.responses.cancel(r.id)
    assert (cancelled.id, cancelled.status) == (r.id, "cancelled")
    # A notices through the store and stops: its request ends and the engine runs nothing.
    wait_until(lambda: a.load()["in_flight"] == 0, 5, what="A to stop generating")
    wait_until(lambda: all(e["running"] == 0 for e in a.load()["engines"]), 5, what="the engine to go idle")
    for gw in (a, b):
        assert gw.sdk.responses.retrieve(r.id).status == "cancelled"
    assert b.sdk.responses.cancel(r.id).status == "cancelled"  # cancelling again changes nothing
    with pytest.raises(openai.BadRequestError) as ei:
        a.sdk.responses.create(model=TINY, input="go on", previous_response_id=r.id)
    assert ei.value.body["param"] == "previous_response_id"
    assert a.sdk.responses.retrieve(r.id).status == "cancelled"  # A never overwrote it


def test_deleting_an_in_progress_background_response_stops_its_generation(tiny_gws) -> None:
    a, b = tiny_gws
    r = a.sdk.responses.create(model=TINY, input="Write a very long story.", max_output_tokens=4000,
                               background=True)
    wait_until(lambda: a.load()["in_flight"] == 1, 10, what="A generating the background response")
    b.sdk.responses.delete(r.id)
    # A notices the record gone and stops: its request ends, and the engine frees the slot long before 4000 tokens.
    wait_until(lambda: a.load()["in_flight"] == 0, 5, what="A to stop generating")
    wait_until(lambda: all(e["running"] == 0 for e in a.load()["engines"]), 5, what="the engine to go idle")
    for gw in (a, b):
        with pytest.raises(openai.NotFoundError):
            gw.sdk.responses.retrieve(r.id)


def test_cancel_streamed_response_through_another_gateway(tiny_gws) -> None:
    a, b = tiny_gws
    body = {"model": TINY, "input": "Write a very long story.", "max_output_tokens": 4000, "stream": True}
    with a.http.stream("POST", "/v1/responses", json=body) as resp:
        assert resp.status_code == 200
        events = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 5:  # created, in_progress, item added, part added, a first delta
                    assert b.sdk.responses.cancel(events[0]["response"]["id"]).status == "cancelled"
    assert events[0]["type"] == "response.created" and events[4]["type"] == "response.output_text.delta"
    assert events[-1]["type"] == "error" and events[-1]["code"] == "response_cancelled"
    assert not any(e["type"] == "response.completed" for e in events)
    wait_until(lambda: a.load()["in_flight"] == 0, 5, what="A to stop generating")
    assert b.sdk.responses.retrieve(events[0]["response"]["id"]).status == "cancelled"


def test_client_leaving_a_stored_stream_ends_its_record(tiny_server, tiny_gws) -> None:
    # Nobody will write this response's result: its record must not stay in_progress until it expires.
    leaving = _connect(tiny_server.url)
    body = {"model": TINY, "input": "Write a very long story.", "max_output_tokens": 4000, "stream": True}
    with leaving.http.stream("POST", "/v1/responses", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                rid = json.loads(line[6:])["response"]["id"]
                break
    leaving.close()
    same = next(gw for gw in tiny_gws if gw.index == leaving.index)
    other = next(gw for gw in tiny_gws if gw.index != leaving.index)
    wait_until(lambda: same.load()["in_flight"] == 0, 5, what="the abandoned generation to stop")
    wait_until(lambda: other.sdk.responses.retrieve(rid).status == "cancelled", 5, what="the record to end")


def test_cancel_finished_or_unknown(gws, model) -> None:
    a, b = gws
    r = a.sdk.responses.create(model=model, input="Story? " + sm.STORY_TRIGGER)
    with pytest.raises(openai.BadRequestError):
        b.sdk.responses.cancel(r.id)
    assert a.sdk.responses.retrieve(r.id).status == "completed"
    with pytest.raises(openai.NotFoundError) as ei:
        b.sdk.responses.cancel("resp_" + "0" * 32)
    assert ei.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        b.sdk.responses.retrieve("resp_" + "0" * 32)


# -- the Redis store -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def redis_gws(redis_port, scripted_model) -> Iterator[tuple[Gateway, Gateway]]:
    s = Server("--model", str(scripted_model), "--count", "2", "--dtype", "float32", "--max-model-len", "1024",
               "--tool-call-parser", "hermes", "--reasoning-parser", "think",
               "--state-url", f"redis://127.0.0.1:{redis_port}/0", log_name="responses-redis")
    try:
        a, b = two_gateways(s.url)
        yield a, b
        a.close()
        b.close()
    finally:
        s.stop()


def test_chain_across_gateways_with_redis(redis_gws, redis_port, model) -> None:
    a, b = redis_gws
    check_chain_across(a, b, model)

    import redis
    r = a.sdk.responses.create(model=model, input="Story? " + sm.STORY_TRIGGER, background=True)
    done = wait_until(lambda: (x := b.sdk.responses.retrieve(r.id)).status == "completed" and x, 30,
                      what="the background response to complete")
    assert done.output_text == sm.EXPECTED_STORY.strip()
    with redis.Redis(port=redis_port) as db:  # the record really is in Redis
        assert any(r.id.encode() in key for key in db.scan_iter(count=1000))


# -- structured output ---------------------------------------------------------------------------------

VERDICT = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}, "score": {"type": "integer",
           "minimum": 0, "maximum": 9}}, "required": ["verdict", "score"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_format_json_schema_is_followed_and_echoed(client, model, stream) -> None:
    # The scripted model would stop at once here; only the grammar makes it write this object.
    fmt = {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}
    if stream:
        events = list(client.responses.create(model=model, input="Is it?", text={"format": fmt}, stream=True))
        assert events[0].response.text.format.type == "json_schema"
        r = events[-1].response
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == r.output_text
    else:
        r = client.responses.create(model=model, input="Is it?", text={"format": fmt})
    assert r.status == "completed", r
    answer = json.loads(r.output_text)
    assert set(answer) == {"verdict", "score"} and answer["verdict"] in ("yes", "no") and 0 <= answer["score"] <= 9
    echoed = r.text.format
    assert (echoed.type, echoed.name, echoed.schema_, echoed.strict) == ("json_schema", "verdict", VERDICT, True)
    assert client.responses.retrieve(r.id).text.format.name == "verdict"


def test_text_format_json_object_and_text(client, model) -> None:
    r = client.responses.create(model=model, input="Story? " + sm.STORY_TRIGGER, text={"format": {"type": "text"}})
    assert r.output_text == sm.EXPECTED_STORY.strip() and r.text.format.type == "text"
    r = client.responses.create(model=model, input="Anything", max_output_tokens=64,
                                text={"format": {"type": "json_object"}})
    assert r.text.format.type == "json_object"
    if r.status == "completed":  # uniform over every JSON object: usually short, but not bounded
        assert isinstance(json.loads(r.output_text), dict)


# -- bad input -----------------------------------------------------------------------------------------

BAD = [
    ({"input": 123}, 400, "input"),
    ({}, 400, "input"),
    ({"input": [{"type": "nope", "text": "x"}]}, 400, None),
    ({"input": "x", "model": "gpt-nope"}, 404, "model"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": "x", "background": True, "store": False}, 400, "background"),
    ({"input": "x", "background": True, "stream": True}, 400, "stream"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}}},
     400, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}, "tools": [WEATHER_FUNCTION],
      "tool_choice": "required"}, 400, "text.format"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "call_nope",
                                                   "output": "x"}]}, 400, "input.1.call_id"),
    ({"input": "x", "max_output_tokens": 100_000}, 400, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, 400, "temperature"),
    ({"input": "x", "tools": [{"type": "function"}]}, 400, None),
    ({"input": "x", "tools": [WEATHER_FUNCTION], "tool_choice": {"type": "function", "name": "other"}},
     400, "tool_choice"),
    # What this server does not implement is refused, never ignored.
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, 400, "include"),
    ({"input": "x", "top_logprobs": 2}, 400, "top_logprobs"),
    ({"input": "x", "top_logprobs": 21, "include": ["message.output_text.logprobs"]}, 400, "top_logprobs"),
    ({"input": "x", "conversation": "conv_123"}, 400, "conversation"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation"),
    ({"input": "x", "prompt": {"id": "pmpt_123"}}, 400, "prompt"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD, ids=[f"{i}-{b[1]}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_refused_in_openai_shape(gws, model, body, status, param) -> None:
    a, b = gws
    r = a.http.post("/v1/responses", json={"model": model, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param
        assert param in err["message"] or status == 404
    # Both gateways keep serving.
    for gw in gws:
        assert gw.sdk.responses.create(model=model, input=sm.TOOL_RESULT_TRIGGER).output_text == \
            sm.EXPECTED_TOOL_RESULT


def test_bad_json_and_sdk_errors(gws, model) -> None:
    a, _ = gws
    r = a.http.post("/v1/responses", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as ei:
        a.sdk.responses.create(model="gpt-nope", input="x")
    assert ei.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as ei:
        a.sdk.responses.create(model=model, input="x", text={"format": {"type": "json_schema", "name": "a",
                                                                         "schema": {"type": "object", "required": 1}}})
    assert ei.value.body["param"] == "text.format.schema"
