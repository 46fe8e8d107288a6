"""MessageParser: reasoning first, then tool calls, the same whole or streamed, with a forced-call prefill."""

from __future__ import annotations

import json

import pytest

from gateway.text.message import MessageParser
from gateway.text.reasoning import get_reasoning_parser
from gateway.text.tool_parsers import get_tool_parser

OUTPUT = ('<think>Two cities, two calls.</think>\n\nChecking both.'
          '<tool_call>{"name": "get_weather", "arguments": {"city": "Berlin"}}</tool_call>\n'
          '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')


def run(parser: MessageParser, text: str, size: int) -> tuple[str, str, list[tuple[str | None, str]]]:
    """Push ``text`` in pieces of ``size``; return (reasoning, content, [(name, arguments)]) as streamed."""
    reasoning, content, calls = "", "", []
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for piece in [parser.push(p) for p in pieces] + [parser.finish()]:
        reasoning += piece.reasoning
        content += piece.content
        for t in piece.tool_calls:
            if t.id is not None:
                calls.append((t.name, ""))
            calls[t.index] = (calls[t.index][0], calls[t.index][1] + t.arguments)
    return reasoning, content, calls


@pytest.mark.parametrize("size", [1, 2, 5, len(OUTPUT)])
def test_reasoning_text_and_calls_come_apart_the_same_at_any_chunking(size: int) -> None:
    parser = MessageParser(get_reasoning_parser("think"), get_tool_parser("hermes"))
    reasoning, content, calls = run(parser, OUTPUT, size)
    assert reasoning == "Two cities, two calls." == parser.reasoning_text()
    assert content == "Checking both." == parser.text()
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Berlin"}),
                                                      ("get_weather", {"city": "Rome"})]
    assert [(c.name, c.arguments) for c in parser.tool_calls] == calls


def test_without_parsers_the_message_is_inactive() -> None:
    assert not MessageParser(None, None).active


def test_a_forced_call_prefill_is_part_of_the_message_but_never_content() -> None:
    hermes = get_tool_parser("hermes")
    prefill = hermes.prefill("get_weather")
    parser = MessageParser(get_reasoning_parser("think"), hermes, prefill)
    _, content, calls = run(parser, '{"city": "Paris"}}\n</tool_call>', 3)
    assert content == "" and [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"})]


def test_tools_off_leaves_call_text_as_content() -> None:
    parser = MessageParser(get_reasoning_parser("think"), None)
    reasoning, content, calls = run(parser, OUTPUT, 4)
    assert reasoning == "Two cities, two calls." and "<tool_call>" in content and calls == []
