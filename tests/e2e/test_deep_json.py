"""JSON nested past the limit (``protocol.constants.MAX_JSON_DEPTH``) is a 400 in the route's own error shape
naming where, on every route it enters by: schemas in each of their fields, template variables, tools,
Anthropic's input_schema and the strings that hold JSON (a tool call's arguments, a schema as text). Each was
a 500 with a traceback (orjson writes 254 levels, Jinja and Python's json run out of recursion)."""

from __future__ import annotations

import json

import httpx
import pytest

from protocol.constants import MAX_JSON_DEPTH
from zserve.catalog import TINY_RANDOM

DEEP = 150  # levels: past the limit, short of what Python's json can write


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def deep_value(levels: int):
    value = 1
    for _ in range(levels):
        value = {"a": value}
    return value


ARGS = "[" * 5000 + "]" * 5000  # valid JSON, 5,000 levels, in a string
USER = [{"role": "user", "content": "hi"}]
SCHEMA = deep_schema(DEEP)
NAMED = {"type": "function", "function": {"name": "f"}}

# (path, body, the param it must name: the field, or its start for a value too deep inside one)
CASES = {
    "chat response_format": ("/v1/chat/completions", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "response_format.json_schema.schema."),
    "chat structured_outputs": ("/v1/chat/completions", {"messages": USER, "structured_outputs": {"json": SCHEMA}},
                                "structured_outputs.json."),
    "completions structured_outputs": ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": SCHEMA}},
                                       "structured_outputs.json."),
    "schema as text": ("/v1/chat/completions", {"messages": USER, "structured_outputs": {"json": json.dumps(SCHEMA)}},
                       "structured_outputs.json."),
    "responses text.format": ("/v1/responses", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": SCHEMA}}}, "text.format.schema."),
    "named tool's parameters": ("/v1/chat/completions", {"messages": USER, "tool_choice": NAMED, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]}, "tools.0.function.parameters."),
    "generate structured_outputs": ("/inference/v1/generate", {"token_ids": [1, 2, 3], "sampling_params": {
        "max_tokens": 4, "structured_outputs": {"json": SCHEMA}}}, "sampling_params.structured_outputs.json."),
    "chat_template_kwargs": ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {
        "x": deep_value(500)}}, "chat_template_kwargs.x."),
    "tools": ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": deep_value(500)}}]}, "tools.0.function.parameters."),
    "anthropic input_schema": ("/v1/messages", {"messages": USER, "tools": [{"name": "f", "input_schema":
                                                                              deep_value(500)}]}, None),
    "chat tool_calls arguments": ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, "messages"),
    "responses function_call arguments": ("/v1/responses", {"input": [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": ARGS},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}, "input"),
}


def post(server, path: str, body: dict) -> httpx.Response:
    limit = {"/v1/responses": "max_output_tokens", "/inference/v1/generate": None}.get(path, "max_tokens")
    full = {"model": TINY_RANDOM, **({limit: 4} if limit else {}), **body}
    return httpx.post(server.url + path, content=json.dumps(full), headers={"Content-Type": "application/json"},
                      timeout=60)


@pytest.mark.parametrize("case", list(CASES))
def test_json_nested_too_deep_is_a_400_naming_where(tiny_server, case: str) -> None:
    path, body, param = CASES[case]
    r = post(tiny_server, path, body)
    assert r.status_code == 400, r.text
    expected = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
    if path == "/v1/messages":  # Anthropic's error shape (no param): the message names the field
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"].startswith("tools.0.input_schema.a.a") and expected in err["error"]["message"]
    else:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and expected in err["message"]
        assert err["param"].startswith(param) if param.endswith(".") else err["param"] == param
        if "arguments" in case:
            assert "tool_calls[0].function.arguments: JSON nested deeper" in err["message"]
    # The server goes on serving, on the same route.
    ok = post(tiny_server, "/v1/chat/completions", {"messages": USER})
    assert ok.status_code == 200, ok.text


def test_json_as_deep_as_the_limit_is_served(tiny_server) -> None:
    # The body is the first level: chat_template_kwargs' value nested MAX_JSON_DEPTH - 1 levels reaches it.
    r = post(tiny_server, "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {
        "x": deep_value(MAX_JSON_DEPTH - 2)}})
    assert r.status_code == 200, r.text
    r = post(tiny_server, "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {
        "x": deep_value(MAX_JSON_DEPTH - 1)}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("chat_template_kwargs.x.a")
