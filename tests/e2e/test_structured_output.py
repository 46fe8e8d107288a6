"""Structured output through the official openai SDK, on real servers.

Mostly on tiny-random: random weights are the hardest case for a grammar, since nothing but the
token mask makes the output valid. Sampled at temperature 1.0, every answer must still parse and
validate, and end with finish_reason "stop" (the engine ends a request when its grammar is complete).
The schemas bound their size (maxLength, maxItems, integer bounds, additionalProperties false) so
that a random walk through them ends well within max_tokens; an unbounded one ({"type": "object"})
is tried on SmolLM2, whose real weights close what they open.

Forced tool calls: on the scripted model (hermes) with a schema its script breaks, and on
tiny-random with the json parser, where only the grammar makes a call at all.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.helpers import Server
from zserve.catalog import DEFAULT_CHAT_MODEL, TINY_RANDOM

from . import scripted_model as sm

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 10},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}, "maxItems": 2},
                   "minItems": 2, "maxItems": 2}},
        "required": ["tags", "matrix"], "additionalProperties": False},
    "enums_and_bounds": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": -5, "maximum": 100},
        "ok": {"type": "boolean"},
        "note": {"type": ["string", "null"], "maxLength": 4},
        "either": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 3}]}},
        "required": ["color", "count", "ok", "note", "either"], "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "label": {"type": "string", "maxLength": 5},
        "kind": {"const": "fixed"}},
        "required": ["id"], "additionalProperties": False},
    "top_level_array": {"type": "array", "items": {"type": "object", "properties": {
        "k": {"type": "string", "maxLength": 3}, "v": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["k", "v"], "additionalProperties": False}, "minItems": 2, "maxItems": 2},
}  # fmt: skip
MAX_TOKENS = 160  # the schemas above take at most ~40 tokens, whatever the sampler picks
# ASCII classes: Rust's \d is any Unicode digit, and Python's re (an older Unicode) knows fewer of them.
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
           r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6})?"]
CHAT = [{"role": "user", "content": "Answer in the requested format."}]


@pytest.fixture(scope="module")
def tiny(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# -- JSON schema --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SCHEMAS))
def test_chat_json_schema_answers_validate(tiny, name: str) -> None:
    schema = SCHEMAS[name]
    r = tiny.chat.completions.create(model=TINY_RANDOM, messages=CHAT, temperature=1.0, max_tokens=MAX_TOKENS, n=3,
                                     response_format=schema_format(name, schema))
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_completion_json_schema_answers_validate(tiny) -> None:
    schema = SCHEMAS["enums_and_bounds"]
    r = tiny.completions.create(model=TINY_RANDOM, prompt="JSON:", temperature=1.0, max_tokens=MAX_TOKENS, n=2,
                                extra_body={"response_format": schema_format("e", schema)})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), schema)
    # vLLM's spelling of the same thing, with the schema as JSON text
    r = tiny.completions.create(model=TINY_RANDOM, prompt="JSON:", temperature=1.0, max_tokens=MAX_TOKENS,
                                extra_body={"structured_outputs": {"json": json.dumps(schema)}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_streamed_json_schema_deltas_add_up_to_a_valid_answer(tiny) -> None:
    schema = SCHEMAS["nested"]
    stream = tiny.chat.completions.create(model=TINY_RANDOM, messages=CHAT, temperature=1.0, max_tokens=MAX_TOKENS,
                                          response_format=schema_format("n", schema), stream=True)
    text, finishes = [], []
    for chunk in stream:
        for ch in chunk.choices:
            text.append(ch.delta.content or "")
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    assert finishes == ["stop"]
    jsonschema.validate(json.loads("".join(text)), schema)


def test_json_object_is_an_object(smollm_server) -> None:
    # Any JSON object: unbounded, so on real weights (random ones would wander in a string for ever).
    client = openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model=DEFAULT_CHAT_MODEL, temperature=0, max_tokens=200, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat as a JSON object with a name and an age."}])
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


# -- regex, choice, grammar -------------------------------------------------------------------------

@pytest.mark.parametrize("regex", REGEXES)
def test_regex_output_fullmatches_on_completions_and_chat(tiny, regex: str) -> None:
    r = tiny.completions.create(model=TINY_RANDOM, prompt="Say:", temperature=1.0, max_tokens=64, n=3,
                                extra_body={"structured_outputs": {"regex": regex}})
    for choice in r.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(regex, choice.text), choice.text
    r = tiny.chat.completions.create(model=TINY_RANDOM, messages=CHAT, temperature=1.0, max_tokens=64,
                                     extra_body={"guided_regex": regex})  # vLLM's older name
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(regex, r.choices[0].message.content)


def test_choice_output_is_one_of_the_choices(tiny) -> None:
    choices = ["positive", "negative", "it is \"complicated\"", "ünïcode"]
    r = tiny.chat.completions.create(model=TINY_RANDOM, messages=CHAT, temperature=1.0, max_tokens=32, n=4,
                                     extra_body={"structured_outputs": {"choice": choices}})
    for choice in r.choices:
        assert choice.finish_reason == "stop" and choice.message.content in choices
    r = tiny.completions.create(model=TINY_RANDOM, prompt="Pick:", temperature=1.0, max_tokens=32,
                                extra_body={"guided_choice": choices})
    assert r.choices[0].text in choices


@pytest.mark.parametrize("grammar", [
    'start: "<" WORD ">" ("," "<" WORD ">")?\nWORD: /[a-z]{1,5}/',
    'root ::= "<" word ">"\nword ::= [a-z] [a-z]? [a-z]?',  # GBNF, converted to Lark
], ids=["lark", "gbnf"])  # fmt: skip
def test_grammar_output_is_in_the_language(tiny, grammar: str) -> None:
    r = tiny.completions.create(model=TINY_RANDOM, prompt="Tag:", temperature=1.0, max_tokens=32, n=3,
                                extra_body={"structured_outputs": {"grammar": grammar}})
    for choice in r.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(r"<[a-z]{1,5}>(,<[a-z]{1,5}>)?", choice.text), \
            choice.text


def test_native_generate_takes_structured_outputs(tiny_server) -> None:
    with httpx.Client(base_url=tiny_server.url, timeout=60) as http:
        ids = http.post("/tokenize", json={"prompt": "Number:"}).json()["tokens"]
        body = {"token_ids": ids, "sampling_params": {"temperature": 1.0, "max_tokens": 32, "n": 2,
                                                      "structured_outputs": {"regex": r"[0-9]{2,4}"}}}
        r = http.post("/inference/v1/generate", json=body)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop"
            text = http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
            assert re.fullmatch(r"[0-9]{2,4}", text), text
        body["sampling_params"]["structured_outputs"] = {"regex": "(unclosed"}
        r = http.post("/inference/v1/generate", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.structured_outputs.regex"


# -- mixed batches ----------------------------------------------------------------------------------

def test_constrained_and_free_requests_in_one_batch_keep_their_own_behaviour(tiny) -> None:
    def free() -> str:
        return tiny.completions.create(model=TINY_RANDOM, prompt="Once upon a time", temperature=1.0,
                                       max_tokens=24, seed=1234).choices[0].text

    def constrained(i: int) -> str:
        r = tiny.completions.create(model=TINY_RANDOM, prompt="Once upon a time", temperature=1.0, max_tokens=24,
                                    seed=i, extra_body={"structured_outputs": {"regex": r"[0-9]{3,6}"}})
        return r.choices[0].text

    alone = free()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        numbers = [pool.submit(constrained, i) for i in range(6)]
        frees = [pool.submit(free) for _ in range(2)]
        schema = SCHEMAS["arrays"]
        objects = [pool.submit(tiny.chat.completions.create, model=TINY_RANDOM, messages=CHAT, temperature=1.0,
                               max_tokens=MAX_TOKENS, response_format=schema_format("a", schema)) for _ in range(2)]
        for f in numbers:
            assert re.fullmatch(r"[0-9]{3,6}", f.result()), f.result()
        for f in objects:
            jsonschema.validate(json.loads(f.result().choices[0].message.content), schema)
        assert [f.result() for f in frees] == [alone, alone]
    assert not re.fullmatch(r"[0-9]{3,6}", alone)  # the free one was never constrained


# -- refusals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: missing_rule"}}}, "structured_outputs.grammar"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "structured_outputs"),
])  # fmt: skip
def test_invalid_specs_are_400_naming_the_field(tiny, kw: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        tiny.chat.completions.create(model=TINY_RANDOM, messages=CHAT, max_tokens=8, **kw)
    assert ei.value.body["param"] == param and ei.value.body["message"].startswith(param + ": ")
    if "response_format" in kw and "extra_body" not in kw:  # completions take response_format too
        with pytest.raises(openai.BadRequestError) as ei:
            tiny.completions.create(model=TINY_RANDOM, prompt="x", max_tokens=8,
                                    extra_body={"response_format": kw["response_format"]})
        assert ei.value.body["param"] == param


# -- outputs the model's vocabulary cannot write ------------------------------------------------------
# SmolLM2's vocabulary (tiny-random has the same) holds no token with byte 0xF1, the lead byte of U+40000..U+7FFFF,
# so U+6AA2B (F1 AA A8 AB) can never be written. The grammar engine used to force a token its matcher then refused.

UNWRITABLE = "\U0006AA2B"


def chat_or_completion(client: openai.OpenAI, route: str, **kw):
    if route == "chat":
        return client.chat.completions.create(model=TINY_RANDOM, messages=CHAT, **kw)
    return client.completions.create(model=TINY_RANDOM, prompt="Answer:", **kw)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_spec_the_vocabulary_cannot_write_is_a_400_before_generation(tiny, route: str, stream: bool) -> None:
    for so in ({"regex": UNWRITABLE}, {"regex": "x?" + UNWRITABLE}, {"json": {"const": UNWRITABLE}}):
        with pytest.raises(openai.BadRequestError) as ei:
            chat_or_completion(tiny, route, max_tokens=8, stream=stream, extra_body={"structured_outputs": so})
        body = ei.value.body
        assert body["param"] == f"structured_outputs.{next(iter(so))}" and body["code"] == "structured_output"
        assert "0xF1" in body["message"], body
    # Emoji, accents and CJK are written as ever.
    out = chat_or_completion(tiny, route, max_tokens=16, extra_body={"structured_outputs": {
        "regex": "\U0001F600|caf\u00e9|\u4e2d"}})
    text = out.choices[0].message.content if route == "chat" else out.choices[0].text
    assert text in ("\U0001F600", "caf\u00e9", "\u4e2d")


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_dead_end_during_generation_is_the_requests_error_not_the_servers(tiny, route: str) -> None:
    """After "a" or "b" the grammar needs U+6AA2B: the engine ends the request there (no wrong token, no 500)."""
    so = {"structured_outputs": {"regex": "(a|b)" + UNWRITABLE}}
    with pytest.raises(openai.BadRequestError) as ei:
        chat_or_completion(tiny, route, max_tokens=8, temperature=1.0, extra_body=so)
    assert ei.value.body["code"] == "structured_output"
    assert "no token that continues the grammar" in ei.value.body["message"]
    stream = chat_or_completion(tiny, route, max_tokens=8, temperature=1.0, stream=True, extra_body=so)
    with pytest.raises(openai.APIError) as ei:
        list(stream)  # the stream had begun: the error comes as its last event, in the route's shape
    assert ei.value.body["code"] == "structured_output" and ei.value.body["type"] == "invalid_request_error"
    out = chat_or_completion(tiny, route, max_tokens=4, extra_body={"structured_outputs": {"regex": "(a|b)c"}})
    assert (out.choices[0].message.content if route == "chat" else out.choices[0].text) in ("ac", "bc")


# -- forced tool calls --------------------------------------------------------------------------------

CITY_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 3}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
    "additionalProperties": False}}}
NO_PARAMS_TOOL = {"type": "function", "function": {"name": "ping"}}


def check_calls(message, tools: list[dict], names: set[str]) -> None:
    assert message.tool_calls, message
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    for call in message.tool_calls:
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        assert isinstance(args, dict)
        jsonschema.validate(args, schemas[call.function.name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_call_follows_the_schema_over_the_model(scripted_server, scripted_model, stream: bool) -> None:
    # The scripted model's named-call script writes {"city": "Paris"}: the schema allows Rome or Oslo only.
    client = openai.OpenAI(base_url=scripted_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model=scripted_model.name, messages=[{"role": "user", "content": "Weather?"}], tools=[CITY_TOOL],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64)
    if not stream:
        r = client.chat.completions.create(**kw).choices[0]
        assert r.finish_reason == "tool_calls" and r.message.content is None
        check_calls(r.message, [CITY_TOOL], {"get_weather"})
        return
    args, finishes = "", []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for t in ch.delta.tool_calls or ():
                assert t.index == 0
                args += t.function.arguments or ""
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    assert finishes == ["tool_calls"]
    jsonschema.validate(json.loads(args), CITY_TOOL["function"]["parameters"])


@pytest.fixture(scope="module")
def tiny_json_tools() -> Iterator[openai.OpenAI]:
    """tiny-random with the json tool-call parser: random weights never write a call by themselves."""
    s = Server("--count", "1", "--model", TINY_RANDOM, "--dtype", "float32", "--tool-call-parser", "json",
               log_name="tiny-json-tools")
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
    s.stop()


@pytest.mark.parametrize("tool_choice, names", [
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ("required", {"get_weather", "get_time"}),
], ids=["named", "required"])  # fmt: skip
def test_forced_calls_on_random_weights_validate(tiny_json_tools, tool_choice, names: set[str]) -> None:
    # (A tool without parameters takes any object, which random weights may fill past any max_tokens;
    # the unit tests check its grammar.)
    tools = [CITY_TOOL, CLOCK_TOOL, NO_PARAMS_TOOL] if tool_choice != "required" else [CITY_TOOL, CLOCK_TOOL]
    for seed in range(3):
        r = tiny_json_tools.chat.completions.create(model=TINY_RANDOM, messages=CHAT, tools=tools, seed=seed,
                                                    tool_choice=tool_choice, temperature=1.0, max_tokens=64)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message, tools, names)


def test_forced_call_with_response_format_is_refused(tiny_json_tools) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        tiny_json_tools.chat.completions.create(model=TINY_RANDOM, messages=CHAT, tools=[CITY_TOOL],
                                                tool_choice="required", response_format=schema_format("x", {}))
    assert ei.value.body["param"] == "response_format"


def test_scripted_model_story_is_unchanged_without_constraints(scripted_server, scripted_model) -> None:
    # The engine applies no mask to a request without one (the scripted model is exact).
    client = openai.OpenAI(base_url=scripted_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.completions.create(model=scripted_model.name, prompt="Hi " + sm.STORY_TRIGGER, max_tokens=32)
    assert r.choices[0].text == sm.EXPECTED_STORY
