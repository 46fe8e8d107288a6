"""How deeply a request's JSON nests, checked where JSON enters a gateway: request bodies
(``openai_schemas.json_object``) and the strings that hold JSON (a tool call's ``function.arguments``,
a schema given as text).

Every part downstream has a limit of its own, which a deep value used to reach as a 500 with a
traceback: orjson writes 254 levels at most (a schema is written again for the grammar engine),
llguidance reads 128, the chat templates' Jinja runs out of recursion near 500 and Python's json near
1,000 (orjson reads 1,024). One limit in front of them all, ``MAX_JSON_DEPTH``, refused with a 400 that
names where the JSON goes too deep.

Most bodies hold fewer brackets than the limit, so counting them settles it. Otherwise the depth is
measured on the text with a few byte-level passes (strings dropped, then innermost bracket pairs removed
once a round), which costs about what parsing does even for a body of a million token ids; only a body
that is too deep is walked in Python to find the path.
"""

from __future__ import annotations

from typing import Any

import orjson

from protocol.constants import MAX_JSON_DEPTH

_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')  # deleted: all but quotes and brackets
_TO_PARENS = bytes.maketrans(b"[{]}", b"(())")
_MAX_PARAM_CHARS = 120  # a path longer than this is cut ("a.b.c..."): it names where, the limit says how deep


class TooDeep(ValueError):
    """JSON nested deeper than ``MAX_JSON_DEPTH``; ``path`` locates the first value too deep, as
    ``"a.0.b"`` from the top of the JSON checked ("" when it is not known)."""

    def __init__(self, path: str):
        super().__init__(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        self.path = path

    def within(self, field: str) -> str:
        """The path from the request's top, for JSON found at ``field``."""
        return f"{field}.{self.path}" if self.path and field else (field or self.path)


_UNPARSED: Any = object()


def check_depth(text: bytes | str, value: Any = _UNPARSED) -> None:
    """Raise TooDeep when the JSON ``text`` nests deeper than ``MAX_JSON_DEPTH``. ``value`` is the text parsed
    when the caller has it; else the text is parsed here, once it is known to be too deep, to find where.
    Text that is not JSON passes unless it nests too deep before its error: the caller's parser reports it."""
    raw = text.encode() if isinstance(text, str) else text
    if not deeper_than(raw, MAX_JSON_DEPTH):
        return
    if value is _UNPARSED:
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            if is_too_deep(e):
                raise TooDeep("") from None
            return
    raise TooDeep(_path_below(value, MAX_JSON_DEPTH))


def is_too_deep(error: orjson.JSONDecodeError) -> bool:
    """Whether orjson refused JSON for nesting past its own limit (1,024 levels)."""
    message = str(error).lower()
    return "depth limit" in message or "recursion" in message


def deeper_than(raw: bytes, limit: int) -> bool:
    """Whether the JSON text ``raw`` has containers nested more than ``limit`` deep. Exact for valid JSON; for
    other text it may say so of unbalanced brackets, never miss a nesting its parser would enter."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    if b"\\" in raw:  # escaped backslashes, then escaped quotes: what is left of a string is between its quotes
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = raw.translate(None, _NOT_STRUCTURE)
    brackets = b"".join(structure.split(b'"')[::2]).translate(_TO_PARENS)  # outside strings only
    for _ in range(limit + 1):
        if not brackets:
            return False
        brackets = brackets.replace(b"()", b"")  # one level: every innermost pair
    return True


def _path_below(value: Any, limit: int) -> str:
    """The path of the first container nested below ``limit`` containers in ``value`` (depth-first)."""
    stack: list[tuple[Any, int, tuple]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if depth > limit:
            text = ".".join(str(p) for p in path)
            return text if len(text) <= _MAX_PARAM_CHARS else text[:_MAX_PARAM_CHARS] + "..."
        items = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend((child, depth + 1, (*path, key)) for key, child in reversed(list(items))
                     if isinstance(child, (dict, list)))
    return ""
