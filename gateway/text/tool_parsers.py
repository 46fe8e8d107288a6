"""Tool-call parsers: find the function calls a model wrote in its output text.

Models are trained to write calls in a format of their own (Hermes/Qwen2.5 wrap each call's JSON in
``<tool_call>`` tags; others answer with bare JSON), and the OpenAI API wants them as structured
``tool_calls``. A parser turns the whole output into (content, calls), and its stream does the same
for text that arrives in deltas. Whatever the deltas, the stream's content equals ``parse``'s and a
call's argument fragments add up to ``parse``'s arguments, so streamed and non-streamed answers of
one generation agree.

Models make mistakes: a call whose JSON is malformed (or has no name, or arguments that are not an
object) is not a call, and its text stays in the content where the client can see it; a parser
never raises on model output.

Streams emit content eagerly, holding back only a tail that could still become an opening tag
(like ``stop.py`` does for stop strings) and trailing whitespace (content is stripped, and the
stream must not emit what ``parse`` would strip). A call's deltas are emitted when its closing tag
arrives, in one piece: re-serialising arguments (``json.dumps``) differs from the model's raw text,
so fragments sent earlier could not be guaranteed to add up to the final arguments.

A forced call (tool_choice "required" or a named function) is opened in the prompt by the parser's
``forced_prefill`` and constrained by its ``forced_grammar``: a Lark grammar (llguidance's dialect)
for the rest of the call, with the arguments held to the tool's ``parameters`` schema.

Output cut by the request's own limits (max_tokens, a stop string: ``parse(cut=True)``,
``finish(cut=True)``) may end inside a call: the calls before it are calls, the cut one is dropped,
never returned as content (the client sees finish_reason "length" and the complete calls).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from zserve.grammar import json_in_lark, lark_string
from zserve.registry import Registry

from ..ids import random_hex
from .streaming import Stripped, partial_tail


@dataclass
class ToolCall:
    id: str  # "call_" + 24 hex digits, made when the call is recognised
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class ToolCallDelta:
    """One streamed fragment of a call, shaped like an entry of OpenAI's streamed ``tool_calls``."""

    index: int  # the call's position among this message's calls
    id: str | None  # only on the call's first fragment
    name: str | None  # only on the call's first fragment
    arguments: str  # a fragment of the arguments text


def _new_id() -> str:
    return "call_" + random_hex(12)


def _make_call(obj: Any) -> ToolCall | None:
    """The call a decoded JSON value describes, or None if it is not a well-formed call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    # Llama-style models write "parameters"; "arguments" wins when both are there.
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if args is None:
        arguments = "{}"
    elif isinstance(args, dict):
        arguments = json.dumps(args, ensure_ascii=False)
    elif isinstance(args, str):
        # Some models double-encode: the arguments are a string holding JSON. Keep the model's text
        # (it is already JSON) once it is known to be an object.
        try:
            decoded = json.loads(args)
        except ValueError:
            return None
        if not isinstance(decoded, dict):
            return None
        arguments = args
    else:
        return None
    return ToolCall(id=_new_id(), name=obj["name"], arguments=arguments)


def _call_from_text(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:  # json.JSONDecodeError, and UnicodeDecodeError on lone surrogates
        return None
    return _make_call(obj)


def _call_deltas(index: int, call: ToolCall) -> list[ToolCallDelta]:
    # The first fragment names the call, as OpenAI's streams do; the arguments follow whole.
    return [
        ToolCallDelta(index=index, id=call.id, name=call.name, arguments=""),
        ToolCallDelta(index=index, id=None, name=None, arguments=call.arguments),
    ]


class ToolStream:
    """Incremental parser for one generated message (made by ``ToolParser.stream``)."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []  # complete calls so far; after finish(), all of them

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Add generated text; return (content to emit now, call fragments to emit now)."""
        raise NotImplementedError

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """At the end of generation: settle and emit whatever was held back (``cut``: the output was cut
        by max_tokens or a stop string, so an unfinished call is dropped, as ``parse(cut=True)`` does)."""
        raise NotImplementedError

    def _add_call(self, call: ToolCall) -> list[ToolCallDelta]:
        self.calls.append(call)
        return _call_deltas(len(self.calls) - 1, call)


# How forced calls write their arguments: compact JSON, as json.dumps and the prefills do (a model
# with random or weak weights could otherwise pad with whitespace forever). Tool schemas are written
# for models, not for grammar engines: a keyword llguidance does not implement is ignored (lenient)
# rather than refusing the request.
_ARGUMENTS_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


def arguments_schema(parameters: Any) -> dict:
    """The JSON schema a forced call's arguments follow: the tool's ``parameters``, always an object
    (a tool without parameters takes any object), its objects closed (``closed_objects``)."""
    schema = closed_objects(parameters) if isinstance(parameters, dict) and parameters else {"type": "object"}
    schema.setdefault("type", "object")
    schema["x-guidance"] = _ARGUMENTS_OPTIONS
    return schema


# Where a schema holds the schemas of the values inside it: a dict of them, a list of them, or one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties")


def closed_objects(schema: Any) -> Any:
    """``schema`` (a copy) with every object that lists its ``properties`` closed to others
    (``additionalProperties: false``) where it does not say, as OpenAI's strict mode requires.

    Why: JSON schema lets an object hold any property it does not list, and a model held to the
    schema uses that: SmolLM2 asked for the weather in Paris writes ``{"city": "Paris", "description":
    "The weather in Paris is...`` until max_tokens. The properties a tool lists are those its code
    reads. An object that names ``allOf`` or ``$ref`` beside its properties is left open (its other
    properties are listed elsewhere, and closing it would refuse them), and so is what ``allOf`` and
    ``not`` hold.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in _SCHEMA_ONES:
        if key in out:
            out[key] = [closed_objects(sub) for sub in out[key]] if isinstance(out[key], list) \
                else closed_objects(out[key])
    if isinstance(out.get("properties"), dict) and not any(
            k in out for k in ("additionalProperties", "unevaluatedProperties", "allOf", "$ref")):
        out["additionalProperties"] = False
    return out


def function_tools(tools: list[dict] | None) -> list[tuple[str, Any]]:
    """(name, parameters) of OpenAI-style function tools ({"type": "function", "function": {...}})."""
    out = []
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.append((fn["name"], fn.get("parameters")))
    return out


class ToolParser:
    """Base class: one model family's way of writing tool calls."""

    name: ClassVar[str]
    # What ends a call after its arguments object (the call object's own closing brace included).
    call_close: ClassVar[str]
    # What stands between one call's close and the next call's prefill in a forced call's grammar, for
    # formats that write several calls in a row; None: a message holds one call. It must not start with
    # whitespace: the first token after a call decides between ending the turn and another call, and
    # models write a newline after a closing tag when they mean to go on with text (SmolLM2 does, 81%),
    # which a separator "\n" would turn into another call, and the next, until max_tokens.
    call_separator: ClassVar[str | None] = None

    def prefill(self, function: str | None) -> str:
        """Text to put after the generation prompt so the model must answer with a call.

        ``function`` None (tool_choice "required"): the opening of any call; a name: the opening of
        a call to that function. The caller prepends it to the output before parsing.
        """
        raise NotImplementedError

    def forced_prefill(self, tools: list[dict], function: str | None) -> str:
        """The prefill of a forced call: ``prefill(function)``, and for tool_choice "required" with a
        single tool, the opening of a call to that tool (the only call there is to make).

        Why the single tool gets its whole opening: text the grammar leaves no choice about is
        written by the grammar engine in its own (canonical) tokens, whatever the model prefers;
        in the prompt it is simply read, as with a named function.
        """
        names = {name for name, _ in function_tools(tools)}
        if function is None and len(names) == 1:
            function = names.pop()
        return self.prefill(function)

    def forced_grammar(self, tools: list[dict], function: str | None, parallel: bool = True) -> str:
        """A Lark grammar for the output that follows ``forced_prefill(tools, function)``: the rest
        of a call to ``function`` (None: to any of ``tools``) whose arguments follow that tool's
        ``parameters`` (``arguments_schema``), then the call's closing text. With ``function`` None and
        ``parallel``, more calls (each to any tool) may follow where the format allows several
        (``call_separator``). The turn may end after every complete call: the model's end-of-sequence
        token is allowed there, and is what models write after a call.

        A call to NAME reads ``prefill(NAME)``, arguments, ``call_close``; ``prefill(None)`` is the
        start of every such opening, so the grammar covers the rest of the opening too.
        ValueError when ``function`` is not among ``tools``.
        """
        any_call = self.prefill(None)
        opening = self.forced_prefill(tools, function)
        calls: list[str] = []  # the rest of a call after prefill(None), one alternative per tool
        first: list[str] = []  # the rest of the first call after ``opening``
        for name, parameters in function_tools(tools):
            if function is not None and name != function:
                continue
            lead = self.prefill(name)
            assert lead.startswith(any_call), (self.name, lead, any_call)
            rest = [json_in_lark(arguments_schema(parameters)), lark_string(self.call_close)]
            calls.append(" ".join([lark_string(lead[len(any_call):]), *rest]))
            if lead == opening:
                first.append(" ".join(rest))
        if not calls:
            raise ValueError(f"no function tool named {function!r}" if function else "no function tools")
        repeat = function is None and parallel and self.call_separator is not None
        rules = ["start: first" + (f" ({lark_string(self.call_separator + any_call)} call)*" if repeat else ""),
                 "first: " + ("call" if opening == any_call else "\n     | ".join(first))]
        if repeat or opening == any_call:
            rules.append("call: " + "\n    | ".join(calls))
        return "\n".join(rules) + "\n"

    def parse(self, text: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """Whole output -> (content outside calls, stripped of surrounding whitespace; the calls).
        ``cut``: the output was cut by max_tokens or a stop string; a call it ends in is dropped."""
        raise NotImplementedError

    def stream(self) -> ToolStream:
        """A fresh incremental parser for one generated message."""
        raise NotImplementedError


TOOL_PARSERS: Registry[ToolParser] = Registry("tool-call parser")
_register = TOOL_PARSERS.register


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under ``name``; ValueError naming the valid ones otherwise."""
    return TOOL_PARSERS.create(name)


# ---------------------------------------------------------------------------------------------------
# hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (Hermes 2/3, Qwen2.5, Qwen3)

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"


def _unclosed_call(body: str) -> ToolCall | None:
    """The call an unclosed body at the end of the output holds (its closing tag maybe begun), if any."""
    return _call_from_text(body[: len(body) - partial_tail(body, _CLOSE)])


@_register
class HermesToolParser(ToolParser):
    name = "hermes"
    call_close = "}\n" + _CLOSE
    call_separator = ""  # <tool_call>…</tool_call><tool_call>…: see ToolParser.call_separator

    def prefill(self, function: str | None) -> str:
        if function is None:
            return _OPEN + "\n"
        return _OPEN + '\n{"name": ' + json.dumps(function, ensure_ascii=False) + ', "arguments": '

    def parse(self, text: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = text.find(_OPEN, pos)
            if start < 0:
                rest = text[pos:]
                # Cut in the middle of an opening tag: a cut call too.
                content.append(rest[: len(rest) - partial_tail(rest, _OPEN)] if cut else rest)
                break
            content.append(text[pos:start])
            body_start = start + len(_OPEN)
            end = text.find(_CLOSE, body_start)
            # An unclosed call at the end is still tried: models often stop (EOS) before the tag.
            call = _unclosed_call(text[body_start:]) if end < 0 else _call_from_text(text[body_start:end])
            if call is not None:
                calls.append(call)
            elif not (cut and end < 0):
                content.append(text[start:] if end < 0 else text[start : end + len(_CLOSE)])
            if end < 0:
                break
            pos = end + len(_CLOSE)
        return "".join(content).strip(), calls

    def stream(self) -> ToolStream:
        return _HermesStream()


class _HermesStream(ToolStream):
    def __init__(self) -> None:
        super().__init__()
        self._content = Stripped()
        self._held = ""  # outside a call: a tail that may be the start of <tool_call>
        self._body: list[str] | None = None  # inside a call: its text so far (None: outside)
        self._tail = ""  # inside a call: the body's last characters, where </tool_call> may have begun

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while text:
            if self._body is None:
                window = self._held + text
                start = window.find(_OPEN)
                if start < 0:
                    keep = partial_tail(window, _OPEN)
                    content.append(self._content.add(window[: len(window) - keep]))
                    self._held = window[len(window) - keep :]
                    break
                content.append(self._content.add(window[:start]))
                self._held = ""
                self._body, self._tail = [], ""
                text = window[start + len(_OPEN) :]
            else:
                # Search only the new text and the few characters before it, not the whole body.
                window = self._tail + text
                end = window.find(_CLOSE)
                if end < 0:
                    self._body.append(text)
                    self._tail = window[-(len(_CLOSE) - 1) :]
                    break
                body = "".join(self._body)
                cut = end - len(self._tail)  # where the tag starts in ``text`` (< 0: in the old body)
                body = body + text[:cut] if cut >= 0 else body[: len(body) + cut]
                text = window[end + len(_CLOSE) :]
                self._body, self._tail = None, ""
                call = _call_from_text(body)
                if call is not None:
                    deltas.extend(self._add_call(call))
                else:
                    content.append(self._content.add(_OPEN + body + _CLOSE))
        return "".join(content), deltas

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        if self._body is None:
            held, self._held = self._held, ""  # at most the start of an opening tag
            return self._content.add("" if cut else held), []
        body, self._body, self._tail = "".join(self._body), None, ""
        call = _unclosed_call(body)
        if call is not None:
            return "", self._add_call(call)
        return self._content.add("" if cut else _OPEN + body), []


# ---------------------------------------------------------------------------------------------------
# json: the whole output is one call object, or an array of them, maybe in a ```json fence

_FENCE = "```"
_FENCED = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.DOTALL)
_CALL_KEYS = ('"name"', '"arguments"', '"parameters"')


def _starts_a_call(text: str) -> bool:
    """Whether cut text is the start of a call: an object (maybe in an array, maybe fenced) whose
    first key is, or begins, one that calls have. Any other cut text stays content."""
    head = text[:64]
    if head.startswith(_FENCE):
        head = head[len(_FENCE):].removeprefix("json")
    head = head.lstrip()
    if head.startswith("["):
        head = head[1:].lstrip()
    if not head.startswith("{"):
        return False
    head = head[1:].lstrip()
    if not head:
        return True
    end = head.find('"', 1)
    key = head if end < 0 else head[: end + 1]
    return key.startswith('"') and any(k.startswith(key) for k in _CALL_KEYS)


@_register
class JsonToolParser(ToolParser):
    name = "json"
    call_close = "}"  # several calls would be an array, which the prefill has already ruled out

    def prefill(self, function: str | None) -> str:
        if function is None:
            return '{"name": "'
        return '{"name": ' + json.dumps(function, ensure_ascii=False) + ', "arguments": '

    def parse(self, text: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
        stripped = text.strip()
        body = stripped
        fenced = _FENCED.match(stripped)
        if fenced is not None:
            body = fenced.group(1)
        try:
            value = json.loads(body) if body.startswith(("{", "[")) else None
        except ValueError:
            value = None
        if value is None:  # not one JSON value: a cut call is dropped, anything else is content
            return ("" if cut and _starts_a_call(stripped) else stripped), []
        items = value if isinstance(value, list) else [value]
        calls = [_make_call(item) for item in items]
        # The output is one JSON value: either all of it is calls, or none of it is.
        if not calls or any(call is None for call in calls):
            return stripped, []
        return "", [call for call in calls if call is not None]

    def stream(self) -> ToolStream:
        return _JsonStream(self)


class _JsonStream(ToolStream):
    """Holds the output back while it may be a JSON call; decides at the end.

    Nothing short of the whole value says whether it is a call, so an output that starts like JSON
    (or a code fence) is held entirely; any other output is content from its first character on.
    """

    def __init__(self, parser: JsonToolParser) -> None:
        super().__init__()
        self._parser = parser
        self._content = Stripped()
        self._held: list[str] = []
        self._head = ""  # the held text without leading whitespace, while undecided (a few chars)
        self._mode = "undecided"  # -> "hold" (may be JSON) or "content"

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._mode == "content":
            return self._content.add(text), []
        self._held.append(text)
        if self._mode == "hold":
            return "", []
        self._head = self._head + text if self._head else text.lstrip()
        if not self._head or (len(self._head) < len(_FENCE) and _FENCE.startswith(self._head)):
            return "", []  # only whitespace or the start of a fence so far
        if self._head.startswith(("{", "[", _FENCE)):
            self._mode = "hold"
            return "", []
        self._mode = "content"
        held, self._held = "".join(self._held), []
        return self._content.add(held), []

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        if self._mode == "content":
            return "", []  # only trailing whitespace can be left, and it is stripped
        held, self._held = "".join(self._held), []
        content, calls = self._parser.parse(held, cut)
        deltas: list[ToolCallDelta] = []
        for call in calls:
            deltas.extend(self._add_call(call))
        return content, deltas


__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "JsonToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStream",
    "arguments_schema",
    "closed_objects",
    "function_tools",
    "get_tool_parser",
]
