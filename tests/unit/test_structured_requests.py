"""Structured-output request fields become one (kind, spec) pair, and every bad one is a 400 naming its field."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway import structured
from gateway.errors import APIError
from gateway.openai_schemas import ChatCompletionRequest, CompletionRequest
from gateway.structured import (
    ANY_OBJECT,
    MAX_CHOICES,
    StructuredSpec,
    check,
    check_now,
    from_fields,
    from_request,
    from_response_format,
    from_structured_outputs,
    from_text_format,
    with_forced_call,
)
from protocol.constants import MAX_GRAMMAR_CHARS

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def bad(fn, *args, **kw) -> APIError:
    """The 400 that ``fn(*args, **kw)`` raises."""
    with pytest.raises(APIError) as ei:
        fn(*args, **kw)
    assert ei.value.status == 400
    return ei.value


def pair(spec: StructuredSpec | None) -> tuple[str, str] | None:
    return None if spec is None else spec.pair


# -- response_format ------------------------------------------------------------------------------

def test_response_format_text_or_absent_constrains_nothing() -> None:
    assert from_response_format(None) is None
    assert from_response_format({"type": "text"}) is None


def test_response_format_json_object_is_any_object() -> None:
    spec = from_response_format({"type": "json_object"})
    assert spec == StructuredSpec("json", ANY_OBJECT, "response_format", "response_format")
    assert json.loads(spec.spec) == {"type": "object"}


def test_response_format_json_schema_carries_the_schema() -> None:
    spec = from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert spec.kind == "json" and json.loads(spec.spec) == SCHEMA
    assert spec.param == "response_format.json_schema.schema"


def test_response_format_json_schema_without_schema_is_any_object() -> None:
    spec = from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    assert pair(spec) == ("json", ANY_OBJECT)


@pytest.mark.parametrize("fmt, param", [
    ({"type": "yaml"}, "response_format"),
    ("json", "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": "{nope"}}, "response_format.json_schema.schema"),
])  # fmt: skip
def test_malformed_response_format_is_400(fmt, param: str) -> None:
    assert bad(from_response_format, fmt).param == param


def test_text_format_is_flat_and_named_text_format() -> None:
    assert from_text_format({"type": "text"}) is None
    assert pair(from_text_format({"type": "json_object"})) == ("json", ANY_OBJECT)
    spec = from_text_format({"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True})
    assert json.loads(spec.spec) == SCHEMA and spec.param == "text.format.schema"
    assert bad(from_text_format, {"type": "xml"}).param == "text.format"


# -- structured_outputs and guided_* ---------------------------------------------------------------

def test_structured_outputs_kinds() -> None:
    assert json.loads(from_structured_outputs({"json": SCHEMA}).spec) == SCHEMA
    assert from_structured_outputs({"json": json.dumps(SCHEMA)}).spec == json.dumps(SCHEMA)  # JSON text, kept
    assert pair(from_structured_outputs({"regex": r"\d+"})) == ("regex", r"\d+")
    assert pair(from_structured_outputs({"choice": ["yes", "no"]})) == ("lark", 'start: "yes" | "no"')
    assert pair(from_structured_outputs({"grammar": 'start: "a"+'})) == ("lark", 'start: "a"+')
    assert pair(from_structured_outputs({"json_object": True})) == ("json", ANY_OBJECT)
    # options that change nothing here are accepted alongside
    assert from_structured_outputs({"regex": "a", "disable_any_whitespace": True}).kind == "regex"


def test_structured_outputs_gbnf_grammar_becomes_lark() -> None:
    spec = from_structured_outputs({"grammar": 'root ::= "yes" | "no"'})
    assert spec.kind == "lark" and "start:" in spec.spec and "::=" not in spec.spec
    check_now(spec)


def test_choice_escapes_quotes_and_backslashes() -> None:
    spec = from_structured_outputs({"choice": ['say "hi"', "a\\b", "naïve"]})
    check_now(spec)


@pytest.mark.parametrize("so, param", [
    ({}, "structured_outputs"),
    ({"json_object": False}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"json": SCHEMA, "json_object": True}, "structured_outputs"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"regex": 5}, "structured_outputs.regex"),
    ({"json": 5}, "structured_outputs.json"),
    ({"json": "[1, 2]"}, "structured_outputs.json"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"choice": "a"}, "structured_outputs.choice"),
    ({"grammar": "  "}, "structured_outputs.grammar"),
    ({"structural_tag": "{}"}, "structured_outputs.structural_tag"),
    ({"regexp": "a"}, "structured_outputs.regexp"),
    ([1], "structured_outputs"),
])  # fmt: skip
def test_malformed_structured_outputs_is_400(so, param: str) -> None:
    assert bad(from_structured_outputs, so).param == param


def test_too_many_choices_is_400() -> None:
    assert from_structured_outputs({"choice": ["x"] * MAX_CHOICES}).kind == "lark"
    err = bad(from_structured_outputs, {"choice": ["x"] * (MAX_CHOICES + 1)})
    assert err.param == "structured_outputs.choice" and str(MAX_CHOICES) in err.message


def test_spec_over_the_protocol_limit_is_400() -> None:
    err = bad(from_structured_outputs, {"regex": "a" * (MAX_GRAMMAR_CHARS + 1)})
    assert err.param == "structured_outputs.regex"
    assert from_structured_outputs({"regex": "a" * MAX_GRAMMAR_CHARS}).kind == "regex"


def test_guided_fields_are_aliases() -> None:
    assert pair(from_fields(guided={"guided_regex": "a+"})) == ("regex", "a+")
    assert pair(from_fields(guided={"guided_choice": ["x"]})) == ("lark", 'start: "x"')
    assert json.loads(from_fields(guided={"guided_json": SCHEMA}).spec) == SCHEMA
    assert from_fields(guided={"guided_grammar": 'start: "a"'}).param == "guided_grammar"
    err = bad(from_fields, guided={"guided_regex": "a", "guided_choice": ["b"]})
    assert err.param == "guided_choice"


def test_two_sources_at_once_is_400_naming_the_second() -> None:
    err = bad(from_fields, {"type": "json_object"}, {"regex": "a"})
    assert err.param == "structured_outputs" and "response_format" in err.message
    err = bad(from_fields, None, {"regex": "a"}, {"guided_regex": "b"})
    assert err.param == "guided_regex"
    # a text response_format is no constraint, so it combines with anything
    assert from_fields({"type": "text"}, {"regex": "a"}).kind == "regex"


def test_where_prefixes_every_param() -> None:
    spec = from_fields(None, {"regex": "a"}, where="sampling_params.")
    assert spec.param == "sampling_params.structured_outputs.regex"
    assert bad(from_fields, {"type": "nope"}, where="sampling_params.").param == "sampling_params.response_format"
    err = bad(from_fields, {"type": "json_object"}, {"regex": "a"}, where="sampling_params.")
    assert err.param == "sampling_params.structured_outputs" and "sampling_params.response_format" in err.message


def test_from_request_reads_completion_and_chat_bodies() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
    assert pair(from_request(req)) == ("lark", 'start: "a" | "b"')
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "response_format": {"type": "json_object"}})
    assert pair(from_request(chat)) == ("json", ANY_OBJECT)
    old = CompletionRequest.model_validate({"prompt": "x", "guided_regex": "[ab]"})
    assert pair(from_request(old)) == ("regex", "[ab]")
    assert from_request(CompletionRequest.model_validate({"prompt": "x"})) is None


# -- forced tool calls ------------------------------------------------------------------------------

def test_forced_call_and_a_format_cannot_combine() -> None:
    forced = StructuredSpec("lark", 'start: "x"', "tools")
    assert with_forced_call(None, forced) is forced
    spec = from_response_format({"type": "json_object"})
    assert with_forced_call(spec, None) is spec
    assert with_forced_call(None, None) is None
    err = bad(with_forced_call, spec, forced)
    assert err.param == "response_format" and "tool" in err.message
    err = bad(with_forced_call, from_text_format({"type": "json_schema", "schema": SCHEMA}), forced)
    assert err.param == "text.format"


# -- compiling ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    (StructuredSpec("json", '{"type": "nope"}', "response_format.json_schema.schema"), "invalid JSON schema"),
    (StructuredSpec("json", '{"properties": {"a": {"$ref": "#/nowhere"}}}', "structured_outputs.json"),
     "invalid JSON schema"),
    (StructuredSpec("regex", "[a-", "structured_outputs.regex"), "invalid regex"),
    (StructuredSpec("regex", "(a", "guided_regex"), "invalid regex"),
    (StructuredSpec("lark", "start: nothing_here", "structured_outputs.grammar"), "invalid grammar"),
    (StructuredSpec("lark", 'start: "a" %json {"type": "nope"}', "tools"), "invalid grammar"),
])  # fmt: skip
def test_specs_that_do_not_compile_are_400_naming_their_field(spec: StructuredSpec, message: str) -> None:
    err = bad(check_now, spec)
    prefix = f"{spec.param}: {message}: "
    assert err.param == spec.param and err.message.startswith(prefix)
    assert len(err.message) > len(prefix)  # llguidance's reason follows


def test_good_specs_compile() -> None:
    for spec in (from_response_format({"type": "json_object"}),
                 from_structured_outputs({"json": SCHEMA}),
                 from_structured_outputs({"regex": r"[a-z]{1,8}@example\.com"}),
                 from_structured_outputs({"choice": ["red", "green"]}),
                 from_structured_outputs({"grammar": 'start: "(" start ")" | ""'})):
        check_now(spec)


def test_check_runs_large_specs_off_the_loop_with_the_same_answer(smollm2_tokenizer) -> None:
    props = {f"field_{i}": {"type": "string", "maxLength": 8} for i in range(800)}
    big = from_structured_outputs({"json": {"type": "object", "properties": props}})
    assert len(big.spec) > structured.INLINE_CHECK_CHARS
    assert asyncio.run(check(big, smollm2_tokenizer)) == big.pair
    broken = StructuredSpec("json", big.spec.replace('"string"', '"strong"', 1), "structured_outputs.json")
    with pytest.raises(APIError) as ei:
        asyncio.run(check(broken, smollm2_tokenizer))
    assert ei.value.param == "structured_outputs.json"
    assert asyncio.run(check(None, smollm2_tokenizer)) is None


# SmolLM2's vocabulary holds no token with byte 0xF1 or 0xF2 (the lead bytes of U+40000..U+BFFFF) or 0x04.
@pytest.mark.parametrize("so", [
    {"regex": "\U0006AA2B"},
    {"regex": "x?\U0006AA2B"},  # the x is writable, but what must follow it is not
    {"regex": "[\U00040000-\U000BFFFF]+"},
    {"json": {"type": "string", "pattern": "^\U0006AA2B$"}},
    {"choice": ["\U00080000", "\x04"]},
])  # fmt: skip
def test_a_spec_no_output_of_the_vocabulary_can_follow_is_a_400_before_generation(smollm2_tokenizer, so) -> None:
    spec = from_structured_outputs(so)
    with pytest.raises(APIError) as ei:
        asyncio.run(check(spec, smollm2_tokenizer))
    err = ei.value
    assert err.status == 400 and err.param == spec.param and err.code == "structured_output"
    assert "no token of the vocabulary holds" in err.message


@pytest.mark.parametrize("so", [
    {"regex": "(a|\U0006AA2B)"},  # an output without the unwritable character exists
    {"regex": "\U0001F600|\u00e9|\u4e2d"},  # emoji, accents and CJK are all writable
    {"regex": "(a|b)\U0006AA2B"},  # undecided without a search: the engine finds the dead end
])  # fmt: skip
def test_a_spec_with_writable_outputs_passes_the_check(smollm2_tokenizer, so) -> None:
    spec = from_structured_outputs(so)
    assert asyncio.run(check(spec, smollm2_tokenizer)) == spec.pair
