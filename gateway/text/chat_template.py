"""Chat templates: turn a list of chat messages into the model's prompt text.

Templates come with the model (GGUF metadata or tokenizer_config.json) and are untrusted Jinja
code, so they run in jinja2's immutable sandbox, set up the way transformers' apply_chat_template
sets it up (same whitespace options, helpers and ``tojson``) so that a prompt renders to the very
text the model was trained on. Anything wrong with the request's messages or the template ends as
``ChatTemplateError``, which the HTTP layer answers with a 400.

Rendering costs tens to hundreds of microseconds of gateway CPU per request, and identical requests
are common (retries, benchmarks, fixed few-shot prompts), so a template that gives the same text
for the same inputs keeps recent renders in a bounded cache keyed by the inputs' JSON, with their
token ids once the gateway has tokenized them (``render_ids``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import orjson
from jinja2.sandbox import ImmutableSandboxedEnvironment

from zserve.tokenizer import SizedLRU

from ..json_depth import TooDeep, check_depth

# Bounds of a template's render cache. An entry's size is its key (the inputs' JSON, bytes) plus
# the rendered text (characters), about twice the prompt; 2M holds ~1000 prompts of 1K characters
# in a few MB. A prompt over 128K would push out 1/16 of the cache at once and is not kept.
RENDER_CACHE_ENTRIES = 1024
RENDER_CACHE_SIZE = 1 << 21
RENDER_CACHE_MAX_ENTRY_SIZE = 1 << 17

# Globals a template may name and still give the same text for the same inputs; naming any other
# global (strftime_now, jinja's lipsum) turns the cache off for that template. Filters the other
# way round: jinja's are all deterministic but `random`.
_DETERMINISTIC_GLOBALS = frozenset({"range", "dict", "namespace", "cycler", "joiner", "raise_exception"})
_NONDETERMINISTIC_FILTERS = frozenset({"random"})


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with this model's chat template (a client error)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged.

    Some templates mark assistant text with it so that transformers can build training masks; a
    server has no use for the mask but must still parse those templates.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    # Templates call this to reject conversations they cannot express (e.g. roles out of order).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes ("<" -> "\u003c") which changes the prompt; templates are
    # written against transformers' plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # `dict(...)` for templates without handing them the `dict` type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # A namespace that refuses underscore names, so a template cannot reach CPython internals via it.
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any, where: str) -> Any:
    """A copy made of JSON types only, so the template can neither see nor mutate caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ChatTemplateError(f"{where}: unsupported value of type {type(value).__name__}")


def _deterministic(env: jinja2.Environment, source: str) -> bool:
    """Whether the template renders the same text whenever its variables are the same.

    Every name the template reads counts, even one it set itself first (jinja's
    ``meta.find_undeclared_variables`` leaves globals out, so it cannot answer this).
    """
    ast = env.parse(source)
    names = {node.name for node in ast.find_all(jinja2.nodes.Name) if node.ctx == "load"}
    if any(name in env.globals and name not in _DETERMINISTIC_GLOBALS for name in names):
        return False
    return not any(f.name in _NONDETERMINISTIC_FILTERS for f in ast.find_all(jinja2.nodes.Filter))


def _exact_json(value: Any) -> bool:
    """Whether ``value`` is built of exactly JSON's types (no subclasses) and finite floats.

    Only for those is orjson's text a key that tells different inputs apart: it writes NaN and
    infinities as null, an Enum as its value and a UUID as a string, all of which render (or fail)
    differently from what they collide with.
    """
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is float:
        return math.isfinite(value)
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or not _exact_json(item):
                return False
        return True
    if kind is list:
        for item in value:
            if not _exact_json(item):
                return False
        return True
    return False


def _render_key(messages: Any, add_generation_prompt: Any, tools: Any, extra: dict[str, Any]) -> bytes | None:
    """The render cache's key for these inputs; None when they cannot have one.

    Keys keep the inputs' own key order: a template may iterate a message's items or ``tojson`` a
    tool schema, and both follow insertion order.
    """
    inputs = [messages, add_generation_prompt, tools, extra]
    try:
        key = orjson.dumps(inputs)  # first: it rejects most odd values and nesting deeper than 255
    except orjson.JSONEncodeError:
        return None
    return key if _exact_json(inputs) else None


def content_text(content: Any, where: str = "content") -> str | None:
    """A message's content as one string: OpenAI text parts joined by newlines (as vLLM does).

    SmolLM2's template concatenates ``message['content']`` as a string, so parts must be flattened
    before rendering. Non-text parts (images, audio) have no meaning to a text model yet.
    """
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(f"{where}: content must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"{where}[{i}]: a content part must be an object")
        kind = part.get("type")
        if kind not in ("text", "input_text", "output_text"):
            raise ChatTemplateError(f"{where}[{i}]: content parts of type {kind!r} are not supported, only 'text'")
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where}[{i}]: a text part needs a string 'text'")
        texts.append(text)
    return "\n".join(texts)


def _template_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Tool calls as templates expect them: OpenAI sends ``function.arguments`` as JSON text, but
    templates (Qwen2.5, Hermes, Llama 3.1) write ``arguments | tojson``, so they get the object."""
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{where}: tool_calls must be a list")
    out = []
    for i, call in enumerate(calls):
        if not isinstance(call, dict):
            raise ChatTemplateError(f"{where}[{i}]: a tool call must be an object")
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                check_depth(fn["arguments"])  # before json.loads, which a deep value exhausts the stack of
                args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
            except TooDeep as e:
                raise ChatTemplateError(f"{where}[{i}].function.arguments: {e}") from None
            except (ValueError, RecursionError):
                raise ChatTemplateError(f"{where}[{i}].function.arguments is not valid JSON") from None
            call = {**call, "function": {**fn, "arguments": args}}
        out.append(call)
    return out


def _normalise_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError("messages must be a list")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"{where}: a message must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"{where}: a message needs a string 'role'")
        plain = _plain(message, where)
        # Templates index message['content'] and concatenate it: an assistant turn that only calls
        # tools (content null or absent) renders as "" rather than failing.
        plain["content"] = content_text(plain.get("content"), f"{where}.content") or ""
        if "tool_calls" in plain:
            plain["tool_calls"] = _template_tool_calls(plain["tool_calls"], f"{where}.tool_calls")
        out.append(plain)
    return out


class ChatTemplate:
    """A compiled chat template, rendered the way transformers' apply_chat_template renders it.

    ``cache`` holds recent renders (a ``SizedLRU`` of inputs' JSON -> (text, its token ids or None));
    it is None for a template whose text can change between calls with the same inputs (one that
    reads the clock). Only successful renders are kept: a failing one fails again on every call.
    """

    def __init__(
        self,
        template: str,
        bos_token: str | None,
        eos_token: str | None,
        cache: SizedLRU[bytes, tuple[str, list[int] | None]] | None = None,
    ) -> None:
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = _environment()
        try:
            self._template = env.from_string(template)
            deterministic = _deterministic(env, template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e.message} (line {e.lineno})") from e
        if not deterministic:
            cache = None
        elif cache is None:
            cache = SizedLRU(RENDER_CACHE_ENTRIES, RENDER_CACHE_SIZE, RENDER_CACHE_MAX_ENTRY_SIZE)
        self.cache = cache

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for ``messages``; ``extra`` reaches the template as variables
        (e.g. ``documents``, ``enable_thinking``)."""
        return self._cached(messages, add_generation_prompt, tools, extra, None)[0]

    def render_ids(
        self,
        messages: list[dict],
        encode: Callable[[str], list[int]],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **extra: Any,
    ) -> tuple[str, list[int]]:
        """``render``'s text and ``encode`` of it (the model's tokenizer: a template serves one model), both
        kept in the cache, so that a conversation seen before is neither rendered nor tokenized again."""
        text, ids = self._cached(messages, add_generation_prompt, tools, extra, encode)
        return text, list(ids)  # a copy: lists held by the cache never reach callers

    def _cached(self, messages: Any, add_generation_prompt: Any, tools: Any, extra: dict[str, Any],
                encode: Callable[[str], list[int]] | None) -> tuple[str, list[int] | None]:
        """The text (and, given ``encode``, its ids) from the cache or made now; cache entries hold the text and
        the ids once some caller has asked for them (an entry's size counts 4 bytes an id)."""
        key = None if self.cache is None else _render_key(messages, add_generation_prompt, tools, extra)
        if key is not None:
            hit = self.cache.get(key)
            if hit is not None and (encode is None or hit[1] is not None):
                return hit
            text = hit[0] if hit is not None else self._render(messages, add_generation_prompt, tools, extra)
            ids = None if encode is None else encode(text)
            self.cache.put(key, (text, ids), len(key) + len(text) + (0 if ids is None else 4 * len(ids)))
            return text, ids
        text = self._render(messages, add_generation_prompt, tools, extra)
        return text, None if encode is None else encode(text)

    def _render(self, messages: Any, add_generation_prompt: Any, tools: Any, extra: dict[str, Any]) -> str:
        chat = _normalise_messages(messages)
        if tools is not None and not (
            isinstance(tools, (list, tuple)) and all(isinstance(t, Mapping) for t in tools)
        ):
            raise ChatTemplateError("tools must be a list of JSON schema objects")
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "documents": None,
            **_plain(extra, "chat_template_kwargs"),
            "messages": chat,
            "tools": _plain(tools, "tools"),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except jinja2.exceptions.TemplateError as e:
            # raise_exception(...) from the template, sandbox violations, undefined lookups.
            raise ChatTemplateError(f"chat template error: {e.message or e}") from e
        except Exception as e:  # noqa: BLE001
            # A message shape the template did not expect, e.g. content None where it adds strings;
            # whatever the template trips on, it must not become a 500 or kill the gateway.
            raise ChatTemplateError(f"the chat template cannot render these messages: {e}") from e
