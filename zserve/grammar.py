"""Structured-output specs (``SamplingParams.structured``) as llguidance grammars, for both tiers.

The gateway checks a spec here before a request reaches an engine (a bad schema is a 400 naming
the field); the engine turns the same spec into the grammar it compiles into token masks. One
function for both, so a spec the gateway accepts is exactly one the engine can compile.

Why llguidance (not xgrammar): its wheel has no dependencies (xgrammar's pulls in transformers and
triton), it takes a ``tokenizers`` JSON directly, compiles a schema in about a millisecond (lazily,
as the output grows) and computes a 49k-token mask in tens of microseconds; it reads JSON schema,
regular expressions and Lark grammars (with JSON schemas embedded), which covers every
structured-output form the APIs offer. vLLM and SGLang ship it as a backend.
"""

from __future__ import annotations

import orjson

from protocol.messages import STRUCTURED_KINDS

# Compact separators (", " and ": ") as json.dumps writes them; a schema can still ask for others
# through its own "x-guidance" options.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A structured-output spec that cannot be compiled; the message says why."""


def llguidance_grammar(kind: str, spec: str) -> str:
    """The llguidance grammar (its JSON form) for one ``(kind, spec)``; GrammarError if malformed."""
    import llguidance

    if kind not in STRUCTURED_KINDS:
        raise GrammarError(f"unknown structured output kind {kind!r}")
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        return llguidance.LLMatcher.grammar_from_lark(spec)
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None


def check_spec(kind: str, spec: str) -> None:
    """Raise GrammarError (with llguidance's message) unless ``spec`` compiles."""
    import llguidance

    if kind == "json":
        try:
            orjson.loads(spec)
        except orjson.JSONDecodeError as e:
            raise GrammarError(f"the schema is not valid JSON: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(llguidance_grammar(kind, spec))
    if error:
        raise GrammarError(error.strip())


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's)."""
    return orjson.dumps(text).decode()


def json_in_lark(schema: dict | bool) -> str:
    """A Lark expression that matches one JSON value ``schema`` accepts (llguidance's ``%json``)."""
    return "%json " + orjson.dumps(schema).decode()


def choice_grammar(choices: list[str]) -> str:
    """A Lark grammar whose output is exactly one of ``choices``."""
    return "start: " + " | ".join(lark_string(c) for c in choices)
