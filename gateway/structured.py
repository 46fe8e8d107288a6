"""Structured output requests: the fields each API offers, turned into ``SamplingParams.structured``.

Clients ask for constrained output in several dialects, all of which end as one ``(kind, spec)``
pair (``protocol.messages.STRUCTURED_KINDS``) that the engine compiles into token masks:

- OpenAI ``response_format`` (chat and completions): ``text`` | ``json_object`` | ``json_schema``;
- vLLM ``structured_outputs`` (chat, completions, ``/inference/v1/generate``): exactly one of
  ``json``, ``regex``, ``choice``, ``grammar`` (Lark, or GBNF converted to Lark), ``json_object``;
  and vLLM's older top-level ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``;
- the Responses API's ``text.format`` (``text`` | ``json_object`` | ``json_schema``, flat);
- a forced tool call, whose grammar the tool-call parser writes (``ToolParser.forced_grammar``).

Converting a field is pure and cheap (``from_*``); compiling the spec to find a bad schema or
regex before it reaches an engine is ``check`` (off the event loop for a large spec), which also
refuses a spec whose every output needs a byte that no token of the model's vocabulary holds
(``zserve.grammar.check_spec``): SmolLM2 cannot write U+40000..U+BFFFF at all. Every error is a 400
that names the field it came from, e.g. ``response_format.json_schema.schema``.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import orjson

from protocol.constants import ERR_STRUCTURED_OUTPUT, MAX_GRAMMAR_CHARS
from protocol.messages import STRUCTURED_KINDS
from zserve.grammar import GrammarError, Unwritable, bytes_no_token_holds, check_spec, choice_grammar
from zserve.tokenizer import Tokenizer

from .errors import APIError, bad_request
from .json_depth import TooDeep, check_depth, is_too_deep
from .openai_schemas import SamplingFields

MAX_CHOICES = 1024
# Specs up to this size compile in about a millisecond on the event loop; larger ones may take
# tens of milliseconds and go to the loop's default executor (llguidance releases the GIL).
INLINE_CHECK_CHARS = 16 * 1024
ANY_OBJECT = '{"type": "object"}'


def _bad(message: str, param: str) -> APIError:
    """A 400 whose message starts with the field, as ``openai_schemas.parse`` writes them."""
    return bad_request(f"{param}: {message}", param=param)


@dataclass(frozen=True)
class StructuredSpec:
    """One structured-output constraint and the request field it came from (named in errors)."""

    kind: str  # one of STRUCTURED_KINDS
    spec: str
    param: str  # the field that holds the spec, e.g. response_format.json_schema.schema
    source: str = ""  # the request field that asked for it, e.g. response_format (default: param)

    def __post_init__(self) -> None:
        if not self.source:
            object.__setattr__(self, "source", self.param)

    @property
    def pair(self) -> tuple[str, str]:
        """What ``SamplingParams.structured`` carries."""
        return (self.kind, self.spec)


def sized(kind: str, spec: str, param: str) -> StructuredSpec:
    if not spec:
        raise _bad("the structured output spec is empty", param=param)
    if len(spec) > MAX_GRAMMAR_CHARS:
        raise _bad(f"the structured output spec is {len(spec)} characters; at most {MAX_GRAMMAR_CHARS}",
                          param=param)
    return StructuredSpec(kind, spec, param)


def json_spec(schema: Any, param: str) -> StructuredSpec:
    """A JSON schema given as an object or as JSON text."""
    if isinstance(schema, str):
        try:
            value = orjson.loads(schema)
            check_depth(schema, value)
        except TooDeep as e:
            raise _bad(f"the schema is {e}", param=e.within(param)) from None
        except orjson.JSONDecodeError as e:
            if is_too_deep(e):
                raise _bad(f"the schema is {TooDeep('')}", param=param) from None
            raise _bad(f"the schema is not valid JSON: {e}", param=param) from None
        if not isinstance(value, dict):
            raise _bad("the schema must be a JSON object", param=param)
        return sized("json", schema, param)
    if not isinstance(schema, dict):
        raise _bad("the schema must be a JSON object", param=param)
    return sized("json", orjson.dumps(schema).decode(), param)


def regex_spec(regex: Any, param: str) -> StructuredSpec:
    if not isinstance(regex, str) or not regex:
        raise _bad("the regex must be a non-empty string", param=param)
    return sized("regex", regex, param)


def choice_spec(choices: Any, param: str) -> StructuredSpec:
    if not isinstance(choices, list) or not choices:
        raise _bad("must be a non-empty list of strings", param=param)
    if len(choices) > MAX_CHOICES:
        raise _bad(f"at most {MAX_CHOICES} choices", param=param)
    if not all(isinstance(c, str) and c for c in choices):
        raise _bad("every choice must be a non-empty string", param=param)
    return sized("lark", choice_grammar(choices), param)


def grammar_spec(grammar: Any, param: str) -> StructuredSpec:
    """A Lark grammar (llguidance's dialect), or a GBNF / EBNF one (``rule ::= ...``) converted to it."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise _bad("the grammar must be a non-empty string", param=param)
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    if "::=" in grammar and not is_lark_syntax(grammar):
        try:
            grammar = gbnf_to_lark(grammar)
        except Exception as e:  # noqa: BLE001 - the converter raises whatever its parser hits
            raise _bad(f"the GBNF grammar could not be read: {e}", param=param) from None
    return sized("lark", grammar, param)


def _format(fmt: Any, param: str, schema_at: str) -> StructuredSpec | None:
    """The part ``response_format`` and ``text.format`` share; ``schema_at`` is where the schema sits
    relative to ``fmt`` (``json_schema.schema`` for chat, ``schema`` for Responses)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("must be an object with a type", param=param)
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredSpec("json", ANY_OBJECT, param)
    if kind != "json_schema":
        raise _bad(f"type must be 'text', 'json_object' or 'json_schema', not {kind!r}", param=param)
    holder, key = fmt, schema_at
    if "." in schema_at:
        outer, key = schema_at.split(".", 1)
        holder = fmt.get(outer)
        if not isinstance(holder, dict):
            raise _bad(f"type 'json_schema' needs {outer} (an object with name and schema)",
                              param=f"{param}.{outer}")
    schema = holder.get(key)
    if schema is None:
        # OpenAI's schema field is optional; without one the answer is still a JSON object, as with
        # json_object. (vLLM refuses the request instead.) ``strict`` changes nothing: the answer
        # always follows the schema.
        return StructuredSpec("json", ANY_OBJECT, f"{param}.{schema_at}")
    return json_spec(schema, f"{param}.{schema_at}")


def _from(spec: StructuredSpec | None, source: str) -> StructuredSpec | None:
    return None if spec is None else replace(spec, source=source)


def from_response_format(fmt: Any, param: str = "response_format") -> StructuredSpec | None:
    """OpenAI's ``response_format`` of chat completions (and completions, as vLLM accepts it)."""
    return _from(_format(fmt, param, "json_schema.schema"), param)


def from_text_format(fmt: Any, param: str = "text.format") -> StructuredSpec | None:
    """The Responses API's ``text.format``: {"type": "json_schema", "name", "schema", "strict"}."""
    return _from(_format(fmt, param, "schema"), param)


_OUTPUT_KINDS = {"json": json_spec, "regex": regex_spec, "choice": choice_spec, "grammar": grammar_spec}
# vLLM's StructuredOutputsParams options that change nothing here: whitespace is already compact
# and there is one grammar engine, so nothing to fall back from.
_IGNORED_OPTIONS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                    "whitespace_pattern", "backend", "_backend", "_backend_was_auto"}


def from_structured_outputs(so: Any, param: str = "structured_outputs") -> StructuredSpec | None:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""
    if so is None:
        return None
    if not isinstance(so, dict):
        raise _bad("must be an object", param=param)
    unknown = sorted(k for k in so if k not in _OUTPUT_KINDS and k not in _IGNORED_OPTIONS and k != "json_object")
    if unknown:
        what = "structural_tag is not supported" if "structural_tag" in unknown else f"unknown field {unknown[0]!r}"
        raise _bad(f"{what}; use one of json, regex, choice, grammar, json_object",
                          param=f"{param}.{unknown[0]}")
    given = [k for k in _OUTPUT_KINDS if so.get(k) is not None]
    if so.get("json_object"):
        given.append("json_object")
    if len(given) != 1:
        raise _bad("give exactly one of json, regex, choice, grammar, json_object"
                          + (f"; got {', '.join(given)}" if given else ""), param=param)
    kind = given[0]
    if kind == "json_object":
        return StructuredSpec("json", ANY_OBJECT, f"{param}.json_object", param)
    return _from(_OUTPUT_KINDS[kind](so[kind], f"{param}.{kind}"), param)


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def from_guided(values: dict[str, Any], where: str = "") -> StructuredSpec | None:
    """vLLM's older top-level ``guided_*`` fields (``values`` by field name; None: not given)."""
    given = [name for name in GUIDED_FIELDS if values.get(name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise _bad(f"give at most one of {', '.join(GUIDED_FIELDS)}; got {', '.join(given)}",
                          param=f"{where}{given[1]}")
    name = given[0]
    return _OUTPUT_KINDS[GUIDED_FIELDS[name]](values[name], f"{where}{name}")


def from_fields(response_format: Any = None, structured_outputs: Any = None, guided: dict[str, Any] | None = None,
                where: str = "") -> StructuredSpec | None:
    """The one constraint a request's fields ask for; a 400 when they ask for more than one.
    ``where`` prefixes the field names in errors (e.g. ``sampling_params.``)."""
    specs = [s for s in (from_response_format(response_format, f"{where}response_format"),
                         from_structured_outputs(structured_outputs, f"{where}structured_outputs"),
                         from_guided(guided or {}, where)) if s is not None]
    if len(specs) > 1:
        first, second = specs[0].source, specs[1].source
        raise _bad(f"{first} and {second} both constrain the output; give one of them", param=second)
    return specs[0] if specs else None


def from_pair(pair: tuple[str, str] | None, param: str) -> StructuredSpec | None:
    """A constraint given as the engine's ``(kind, spec)`` pair, as the render routes show it in their
    ``sampling_params.structured``: what ``/inference/v1/generate`` takes back, so render → generate composes."""
    if pair is None:
        return None
    kind, spec = pair
    if kind not in STRUCTURED_KINDS:
        raise _bad(f"unknown kind {kind!r}; known: {', '.join(STRUCTURED_KINDS)}", param=param)
    return sized(kind, spec, param)


def with_forced_call(spec: StructuredSpec | None, forced: StructuredSpec | None) -> StructuredSpec | None:
    """A request's own constraint or its forced tool call's grammar; both at once is a 400."""
    if spec is not None and forced is not None:
        raise _bad("cannot be combined with a forced tool call (tool_choice required or a named function): the "
                   "call's arguments already follow the tool's schema", param=spec.source)
    return spec or forced


def check_now(spec: StructuredSpec, unwritable: frozenset[int] = frozenset()) -> None:
    """Compile ``spec`` (on this thread); a 400 naming its field when it does not compile, or when every output
    it accepts needs one of the ``unwritable`` bytes."""
    try:
        check_spec(spec.kind, spec.spec, unwritable)
    except Unwritable as e:
        raise bad_request(f"{spec.param}: {e}", param=spec.param, code=ERR_STRUCTURED_OUTPUT) from None
    except GrammarError as e:
        what = {"json": "invalid JSON schema", "regex": "invalid regex", "lark": "invalid grammar"}[spec.kind]
        raise _bad(f"{what}: {e}", param=spec.param) from None


async def check(spec: StructuredSpec | None, tokenizer: Tokenizer) -> tuple[str, str] | None:
    """``check_now`` against ``tokenizer``'s vocabulary, in the loop's default executor when the spec is large;
    the checked pair."""
    if spec is None:
        return None
    unwritable = _unwritable.get(tokenizer)
    loop = asyncio.get_running_loop()
    if unwritable is None:  # once per tokenizer: reading 50k tokens takes a few tenths of a second
        unwritable = await loop.run_in_executor(None, lambda: bytes_no_token_holds(_vocabulary_bytes(tokenizer)))
        _unwritable[tokenizer] = unwritable
    if len(spec.spec) <= INLINE_CHECK_CHARS:
        check_now(spec, unwritable)
    else:
        await loop.run_in_executor(None, check_now, spec, unwritable)
    return spec.pair


# The bytes no token of a tokenizer's vocabulary holds, per tokenizer (``check``).
_unwritable: weakref.WeakKeyDictionary[Tokenizer, frozenset[int]] = weakref.WeakKeyDictionary()


def _vocabulary_bytes(tokenizer: Tokenizer) -> Iterator[bytes]:
    for token_id in range(tokenizer.vocab_size):
        try:
            yield tokenizer.id_to_bytes(token_id)
        except ValueError:  # an id the vocabulary skips
            continue


def from_request(req: SamplingFields, where: str = "") -> StructuredSpec | None:
    """``from_fields`` over a completions / chat / generate request's sampling fields."""
    if req.response_format is None and req.structured_outputs is None and req.guided_json is None \
            and req.guided_regex is None and req.guided_choice is None and req.guided_grammar is None:
        return None  # what most requests send: no constraint, and nothing to build to find none
    return from_fields(req.response_format, req.structured_outputs,
                       {name: getattr(req, name, None) for name in GUIDED_FIELDS}, where)
