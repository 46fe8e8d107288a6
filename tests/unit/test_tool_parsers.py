"""Tool-call parsers find the calls models write, keep malformed ones as content, and stream the same result."""

from __future__ import annotations

import json
import random
import re

import pytest

from gateway.text.tool_parsers import (
    TOOL_PARSERS,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStream,
    get_tool_parser,
)

CHUNK_SIZES = [1, 2, 3, 7]
ID = re.compile(r"call_[0-9a-f]{24}")


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def run_stream(parser: ToolParser, text: str, size: int, cut: bool = False
               ) -> tuple[str, list[ToolCallDelta], ToolStream]:
    stream = parser.stream()
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    for piece in pieces(text, size):
        c, d = stream.push(piece)
        content.append(c)
        deltas.extend(d)
    c, d = stream.finish(cut)
    content.append(c)
    deltas.extend(d)
    return "".join(content), deltas, stream


def assemble(deltas: list[ToolCallDelta]) -> list[dict[str, str]]:
    """Rebuild calls from streamed fragments the way an OpenAI client does, checking their shape."""
    calls: list[dict[str, str]] = []
    for delta in deltas:
        if delta.index == len(calls):
            assert delta.id is not None and delta.name is not None, "a call's first fragment names it"
            calls.append({"id": delta.id, "name": delta.name, "arguments": delta.arguments})
        else:
            assert delta.index == len(calls) - 1, "fragments come call by call, in order"
            assert delta.id is None and delta.name is None
            calls[-1]["arguments"] += delta.arguments
    return calls


def check(parser_name: str, text: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
    """parse(text, cut), after checking that every way of streaming text gives the same answer."""
    parser = get_tool_parser(parser_name)
    content, calls = parser.parse(text, cut)
    assert content == content.strip()
    for call in calls:
        assert ID.fullmatch(call.id)
        assert isinstance(json.loads(call.arguments), dict)
    for size in CHUNK_SIZES + [len(text) or 1]:
        streamed, deltas, stream = run_stream(parser, text, size, cut)
        assert streamed == content, f"chunk size {size}"
        got = assemble(deltas)
        assert [(c["name"], c["arguments"]) for c in got] == [(c.name, c.arguments) for c in calls], size
        assert [c["id"] for c in got] == [c.id for c in stream.calls]
        assert [(c.name, c.arguments) for c in stream.calls] == [(c.name, c.arguments) for c in calls]
    return content, calls


def names_args(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# --- hermes -----------------------------------------------------------------------------------------


def test_hermes_one_call() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    content, calls = check("hermes", text)
    assert content == ""
    assert len(calls) == 1
    assert calls[0].name == "get_weather"
    assert calls[0].arguments == '{"city": "Paris", "unit": "celsius"}'


def test_hermes_several_calls_with_text_before() -> None:
    text = (
        "I'll look up both cities.\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'
    )
    content, calls = check("hermes", text)
    assert content == "I'll look up both cities."
    assert names_args(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})]
    assert calls[0].id != calls[1].id


def test_hermes_text_after_calls_is_content() -> None:
    text = 'Sure.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone, waiting for results.'
    content, calls = check("hermes", text)
    assert content == "Sure.\n\nDone, waiting for results."
    assert names_args(calls) == [("f", {})]


def test_hermes_malformed_call_stays_content() -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
    good = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    content, calls = check("hermes", bad + "\n" + good)
    assert content == bad
    assert names_args(calls) == [("get_time", {"tz": "UTC"})]


@pytest.mark.parametrize(
    "body",
    [
        '{"arguments": {"x": 1}}',  # no name
        '{"name": 3, "arguments": {}}',  # name not a string
        '{"name": "f", "arguments": [1, 2]}',  # arguments not an object
        '{"name": "f", "arguments": "not json"}',  # a string that is not JSON
        '{"name": "f", "arguments": "[1]"}',  # a string holding JSON that is not an object
        '["f"]',
        "",
    ],
)
def test_hermes_invalid_calls_stay_content(body: str) -> None:
    text = f"Let me check.\n<tool_call>{body}</tool_call>"
    content, calls = check("hermes", text)
    assert calls == []
    assert content == text


def test_hermes_arguments_as_json_string() -> None:
    text = '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"zserve\\", \\"limit\\": 3}"}\n</tool_call>'
    content, calls = check("hermes", text)
    assert content == ""
    assert calls[0].arguments == '{"query": "zserve", "limit": 3}'


def test_hermes_missing_arguments_are_empty_object() -> None:
    _, calls = check("hermes", '<tool_call>{"name": "now"}</tool_call>')
    assert calls[0].arguments == "{}"


def test_hermes_unicode_arguments() -> None:
    args = '{"text": "Grüße aus Zürich 🌧", "to": "日本語"}'
    text = '<tool_call>{"name": "translate", "arguments": ' + args + "}</tool_call>"
    _, calls = check("hermes", text)
    assert calls[0].arguments == args
    escaped = '<tool_call>{"name": "t", "arguments": {"s": "\\u00e9t\\u00e9"}}</tool_call>'
    assert check("hermes", escaped)[1][0].arguments == '{"s": "été"}'


def test_hermes_unclosed_call_at_end_is_parsed() -> None:
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    content, calls = check("hermes", text)
    assert content == "Checking."
    assert names_args(calls) == [("get_weather", {"city": "Oslo"})]


def test_hermes_unclosed_malformed_call_stays_content() -> None:
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    content, calls = check("hermes", text)
    assert calls == []
    assert content == text


@pytest.mark.parametrize("text, content, cities", [
    ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci', "Checking.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><tool_call>\n{"name": "ge',
     "", ["Oslo"]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>', "", ["Oslo"]),
    ("Checking. <tool_ca", "Checking.", []),
    ("Checking. <", "Checking.", []),
    # Whole JSON whose closing tag was cut is a whole call.
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool', "", ["Oslo"]),
    ("Just text, cut mid-wo", "Just text, cut mid-wo", []),
])  # fmt: skip
def test_hermes_call_cut_by_the_request_is_dropped_not_content(text: str, content: str, cities: list[str]) -> None:
    # max_tokens or a stop string ended the output: the cut call is neither a call nor text.
    got, calls = check("hermes", text, cut=True)
    assert (got, [json.loads(c.arguments)["city"] for c in calls]) == (content, cities)


def test_hermes_partial_tags_and_look_alikes() -> None:
    # Text that starts like a tag but is not one must come out as content, wherever the cut falls.
    prefix = "a < b and <tool_ and <tool_call without the bracket "
    content, calls = check("hermes", prefix + '<tool_call>{"name": "f"}</tool_call> <tool_cal')
    assert content == prefix + " <tool_cal"
    assert names_args(calls) == [("f", {})]
    assert check("hermes", "x </tool_call> y") == ("x </tool_call> y", [])


def test_hermes_plain_text_and_empty() -> None:
    assert check("hermes", "  Hello there!\n ") == ("Hello there!", [])
    assert check("hermes", "") == ("", [])


def test_hermes_stream_emits_content_eagerly() -> None:
    stream = get_tool_parser("hermes").stream()
    assert stream.push("Hello wor") == ("Hello wor", [])
    assert stream.push("ld <tool") == ("ld", [])  # " <tool" may open a call
    content, deltas = stream.push('_call>{"name": "f", "arguments": {"a": 1}}</tool_')
    assert (content, deltas) == ("", [])
    content, deltas = stream.push("call>")
    assert content == ""
    assert [(d.index, d.id, d.name, d.arguments) for d in deltas] == [
        (0, stream.calls[0].id, "f", ""),
        (0, None, None, '{"a": 1}'),
    ]
    assert stream.finish() == ("", [])


def test_hermes_prefill_is_parsed_with_the_output() -> None:
    parser = get_tool_parser("hermes")
    prefill = parser.prefill("get_weather")
    assert prefill == '<tool_call>\n{"name": "get_weather", "arguments": '
    _, calls = check("hermes", prefill + '{"city": "Rome"}}\n</tool_call>')
    assert names_args(calls) == [("get_weather", {"city": "Rome"})]
    required = parser.prefill(None)
    _, calls = check("hermes", required + '{"name": "now", "arguments": {}}')  # stopped before the tag
    assert names_args(calls) == [("now", {})]


def test_hermes_long_call_streams_without_rescanning() -> None:
    # One character at a time through a long call: the stream must finish promptly (no O(n^2)).
    args = {"items": list(range(20000))}
    text = '<tool_call>{"name": "bulk", "arguments": ' + json.dumps(args) + "}</tool_call>"
    _, deltas, stream = run_stream(get_tool_parser("hermes"), text, 1)
    assert json.loads(assemble(deltas)[0]["arguments"]) == args


# --- json -------------------------------------------------------------------------------------------


def test_json_one_call() -> None:
    content, calls = check("json", '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert content == ""
    assert names_args(calls) == [("get_weather", {"city": "Paris"})]


def test_json_parameters_alias_and_array() -> None:
    text = '\n[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "arguments": "{\\"y\\": 2}"}, {"name": "c"}]\n'
    content, calls = check("json", text)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}'), ("b", '{"y": 2}'), ("c", "{}")]


def test_json_fenced_block() -> None:
    text = '```json\n{"name": "search", "arguments": {"q": "café"}}\n```'
    content, calls = check("json", text)
    assert content == ""
    assert calls[0].arguments == '{"q": "café"}'


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        '{"name": "f", "arguments": {"x": 1}',  # malformed
        '{"city": "Paris"}',  # an object, but not a call
        '[{"name": "a"}, {"nom": "b"}]',  # one bad item: none of it is a call
        "[]",
        '{"name": "f"} and then some text',
        "```python\nprint('hi')\n```",
        "``not a fence",
        "`code` first",
        "   \n",
    ],
)
def test_json_anything_else_is_content(text: str) -> None:
    assert check("json", text) == (text.strip(), [])


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "arguments": {"ci', "", 0),
    ('```json\n{"na', "", 0),
    ('[{"name": "f", "arguments": {}}, {"name": "g", "argu', "", 0),
    ("{", "", 0),
    ('{"name": "f", "arguments": {"a": 1}}', "", 1),  # whole: a call
    ('{"answer": "a long JSON answer that is no ca', '{"answer": "a long JSON answer that is no ca', 0),
    ("Plain text, cut", "Plain text, cut", 0),
])  # fmt: skip
def test_json_call_cut_by_the_request_is_dropped_not_content(text: str, content: str, calls: int) -> None:
    got, parsed = check("json", text, cut=True)
    assert (got, len(parsed)) == (content, calls)


def test_json_stream_holds_json_and_streams_text() -> None:
    parser = get_tool_parser("json")
    stream = parser.stream()
    assert stream.push("  ") == ("", [])
    assert stream.push("Hel") == ("Hel", [])
    assert stream.push("lo {") == ("lo {", [])
    stream = parser.stream()
    assert stream.push('\n{"name": "f", ') == ("", [])
    assert stream.push('"arguments": {}}') == ("", [])
    content, deltas = stream.finish()
    assert content == "" and [d.name for d in deltas] == ["f", None]


def test_json_prefill() -> None:
    parser = get_tool_parser("json")
    _, calls = check("json", parser.prefill("lookup") + '{"id": 7}}')
    assert names_args(calls) == [("lookup", {"id": 7})]
    _, calls = check("json", parser.prefill(None) + 'now", "arguments": {}}')
    assert names_args(calls) == [("now", {})]


# --- forced calls: grammars -------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}},
    "required": ["city"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: any object
FORCED_TOOLS = [WEATHER, NOW]


@pytest.fixture(scope="module")
def matcher(smollm2_tokenizer):
    """accepts(grammar, text): whether llguidance, on SmolLM2's tokens, takes ``text`` as a whole output
    of ``grammar`` (the check the engine makes token by token)."""
    llguidance = pytest.importorskip("llguidance")
    ll = llguidance.LLTokenizer(smollm2_tokenizer.backend.to_str())

    def accepts(grammar: str, text: str, prefix: bool = False) -> bool:
        """``prefix``: whether ``text`` may start an output (not necessarily a whole one)."""
        assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) == ""
        m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        assert not m.is_error(), m.get_error()
        return m.consume_tokens(smollm2_tokenizer.encode(text)) and (prefix or m.is_accepting())

    return accepts


def call_text(parser: ToolParser, name: str, arguments: dict) -> str:
    """A correct call as the parser's format writes it (compact JSON, as the grammar wants)."""
    return parser.prefill(name) + json.dumps(arguments) + parser.call_close


@pytest.mark.parametrize("parser_name", ["hermes", "json"])
def test_forced_named_grammar_accepts_the_call_and_parses_back(matcher, parser_name: str) -> None:
    parser = get_tool_parser(parser_name)
    prefill = parser.prefill("get_weather")
    grammar = parser.forced_grammar(FORCED_TOOLS, "get_weather")
    output = call_text(parser, "get_weather", {"city": "Rome", "days": 3})[len(prefill):]
    assert matcher(grammar, output)
    _, calls = check(parser_name, prefill + output)
    assert names_args(calls) == [("get_weather", {"city": "Rome", "days": 3})]
    # Arguments outside the schema, loose whitespace and an unclosed call are not outputs of the grammar.
    for bad in ({"days": 3}, {"city": "Rome", "days": 9}, {"city": 5}, {"city": "Rome", "extra": 1}):
        assert not matcher(grammar, call_text(parser, "get_weather", bad)[len(prefill):]), bad
    assert not matcher(grammar, '{"city":"Rome"}' + parser.call_close)
    assert not matcher(grammar, output[: -len(parser.call_close)])


@pytest.mark.parametrize("parser_name", ["hermes", "json"])
def test_forced_required_grammar_accepts_any_tool_and_no_other_name(matcher, parser_name: str) -> None:
    parser = get_tool_parser(parser_name)
    prefill = parser.prefill(None)
    grammar = parser.forced_grammar(FORCED_TOOLS, None)
    for name, args in (("get_weather", {"city": "Oslo"}), ("now", {}), ("now", {"tz": ["UTC", 1]})):
        output = call_text(parser, name, args)[len(prefill):]
        assert matcher(grammar, output), (name, args)
        _, calls = check(parser_name, prefill + output)
        assert names_args(calls) == [(name, args)]
    assert not matcher(grammar, call_text(parser, "get_time", {})[len(prefill):])
    assert not matcher(grammar, call_text(parser, "get_weather", {})[len(prefill):])  # city is required
    assert not matcher(grammar, call_text(parser, "now", [])[len(prefill):])  # arguments are an object


def test_forced_required_hermes_grammar_allows_parallel_calls_unless_told_not_to(matcher) -> None:
    parser = get_tool_parser("hermes")
    prefill = parser.prefill(None)
    one = call_text(parser, "get_weather", {"city": "Oslo"})[len(prefill):]
    two = one + call_text(parser, "now", {})
    grammar = parser.forced_grammar(FORCED_TOOLS, None)
    assert matcher(grammar, one) and matcher(grammar, two)  # the turn may end after each call
    assert not matcher(parser.forced_grammar(FORCED_TOOLS, None, parallel=False), two)
    _, calls = check("hermes", prefill + two)
    assert [c.name for c in calls] == ["get_weather", "now"]
    # A named function is one call, whatever parallel says.
    named = parser.prefill("now")
    again = (call_text(parser, "now", {}) + call_text(parser, "now", {}))[len(named):]
    assert not matcher(parser.forced_grammar(FORCED_TOOLS, "now"), again)


def test_forced_hermes_grammar_does_not_turn_a_newline_after_a_call_into_another_call(matcher) -> None:
    # SmolLM2 writes "\n" after </tool_call> when it means to go on with text: with "\n" as the start of the
    # next call it wrote calls until max_tokens. Only the next call's own tag (or the end) may follow a call.
    parser = get_tool_parser("hermes")
    prefill = parser.forced_prefill([WEATHER], None)
    one = call_text(parser, "get_weather", {"city": "Oslo"})[len(prefill):]
    grammar = parser.forced_grammar([WEATHER], None)
    assert matcher(grammar, one)
    assert not matcher(grammar, one + "\n" + call_text(parser, "get_weather", {"city": "Rome"}), prefix=True)
    assert not matcher(grammar, one + "\n", prefix=True)


@pytest.mark.parametrize("parser_name", ["hermes", "json"])
def test_forced_required_with_one_tool_opens_that_call_in_the_prompt(matcher, parser_name: str) -> None:
    parser = get_tool_parser(parser_name)
    assert parser.forced_prefill(FORCED_TOOLS, None) == parser.prefill(None)
    assert parser.forced_prefill(FORCED_TOOLS, "now") == parser.prefill("now")
    prefill = parser.forced_prefill([WEATHER], None)
    assert prefill == parser.prefill("get_weather")
    grammar = parser.forced_grammar([WEATHER], None)
    output = call_text(parser, "get_weather", {"city": "Oslo"})[len(prefill):]
    assert matcher(grammar, output)
    _, calls = check(parser_name, prefill + output)
    assert names_args(calls) == [("get_weather", {"city": "Oslo"})]
    if parser.call_separator is not None:  # more calls may follow, each whole
        more = output + parser.call_separator + call_text(parser, "get_weather", {"city": "Rome"})
        assert matcher(grammar, more)
        assert not matcher(parser.forced_grammar([WEATHER], None, parallel=False), more)
        _, calls = check(parser_name, prefill + more)
        assert [json.loads(c.arguments)["city"] for c in calls] == ["Oslo", "Rome"]


def test_forced_grammar_of_json_parser_is_one_call() -> None:
    parser = get_tool_parser("json")
    assert parser.call_separator is None
    assert "call)*" not in parser.forced_grammar(FORCED_TOOLS, None)


def test_forced_grammar_needs_the_named_function() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        get_tool_parser("hermes").forced_grammar(FORCED_TOOLS, "nope")
    with pytest.raises(ValueError):
        get_tool_parser("json").forced_grammar([], None)


def test_arguments_schema_is_always_an_object_in_compact_json() -> None:
    from gateway.text.tool_parsers import arguments_schema

    assert arguments_schema(None)["type"] == "object"
    assert arguments_schema({})["type"] == "object"
    schema = arguments_schema({"properties": {"a": {"type": "string"}}})
    assert schema["type"] == "object" and schema["properties"] == {"a": {"type": "string"}}
    assert schema["x-guidance"]["whitespace_flexible"] is False
    original = {"type": "object"}
    arguments_schema(original)
    assert original == {"type": "object"}  # the request's tool is left as it was


def test_arguments_schema_closes_objects_the_schema_leaves_open() -> None:
    from gateway.text.tool_parsers import arguments_schema

    place = {"type": "object", "properties": {"lat": {"type": "number"}}}
    tool = {"type": "object", "properties": {
        "city": {"type": "string"}, "place": place, "stops": {"type": "array", "items": place},
        "either": {"anyOf": [place, {"type": "string"}]}, "open": {"type": "object", "additionalProperties": True},
        "any": {"type": "object"}, "parts": {"allOf": [place, {"properties": {"lon": {"type": "number"}}}]},
        "ref": {"$ref": "#/$defs/p"}}, "$defs": {"p": place}}
    schema = arguments_schema(tool)
    props = schema["properties"]
    assert schema["additionalProperties"] is False
    assert props["place"]["additionalProperties"] is False and props["stops"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert schema["$defs"]["p"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True  # said by the schema: kept
    assert "additionalProperties" not in props["any"]  # no properties listed: any object
    assert props["parts"] == tool["properties"]["parts"]  # allOf splits one object's properties: left open
    assert "additionalProperties" not in tool and "additionalProperties" not in place  # the request's own: untouched


def test_forced_call_has_no_properties_the_tool_does_not_list(matcher) -> None:
    # SmolLM2 asked for the weather in Paris wrote {"city": "Paris", "description": "The weather in Paris is ...
    # until max_tokens: a tool's parameters that do not say additionalProperties take none.
    parser = get_tool_parser("hermes")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}}
    prefill = parser.prefill("get_weather")
    grammar = parser.forced_grammar([tool], "get_weather")
    assert matcher(grammar, call_text(parser, "get_weather", {"city": "Paris", "unit": "c"})[len(prefill):])
    assert not matcher(grammar, '{"city": "Paris", "description', prefix=True)


# --- registry ---------------------------------------------------------------------------------------


def test_registry_names_match() -> None:
    assert {"hermes", "json"} <= set(TOOL_PARSERS)
    for name, cls in TOOL_PARSERS.items():
        assert cls.name == name
        assert get_tool_parser(name).name == name


def test_unknown_parser_lists_the_valid_names() -> None:
    with pytest.raises(ValueError) as excinfo:
        get_tool_parser("mistral-ish")
    message = str(excinfo.value)
    assert message.startswith("unknown tool-call parser 'mistral-ish'; choose one of: ")
    assert "hermes" in message and "json" in message


def test_streams_are_independent() -> None:
    parser = get_tool_parser("hermes")
    first, second = parser.stream(), parser.stream()
    first.push('<tool_call>{"name": "f"}</tool_call>')
    assert len(first.calls) == 1 and second.calls == []


@pytest.mark.parametrize("parser_name", ["hermes", "json"])
def test_random_outputs_stream_like_they_parse(parser_name: str) -> None:
    # Outputs glued from tag pieces, calls and junk, streamed in random cuts: always the same answer.
    rng = random.Random(7)
    atoms = [
        "<tool_call>", "</tool_call>", "<tool_", "</tool", "call>", '{"name": "f", "arguments": {"a": "é"}}',
        '{"name": "g"}', "{bad", " ", "\n", "x", "```", "```json\n", "[", "]", ",", "<", ">",
    ]  # fmt: skip
    parser = get_tool_parser(parser_name)
    for _ in range(2000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 8)))
        cut = rng.random() < 0.5  # ended by max_tokens or a stop string
        content, calls = parser.parse(text, cut)
        stream = parser.stream()
        streamed: list[str] = []
        deltas: list[ToolCallDelta] = []
        i = 0
        while i < len(text):
            size = rng.randint(1, 6)
            c, d = stream.push(text[i : i + size])
            streamed.append(c)
            deltas.extend(d)
            i += size
        c, d = stream.finish(cut)
        assert "".join(streamed) + c == content, text
        got = assemble(deltas + d)
        assert [(g["name"], g["arguments"]) for g in got] == [(c.name, c.arguments) for c in calls], text
