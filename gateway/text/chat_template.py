"""Chat templates: turn a list of chat messages into the model's prompt text.

Templates come with the model (GGUF metadata or tokenizer_config.json) and are untrusted Jinja
code, so they run in jinja2's immutable sandbox, set up the way transformers' apply_chat_template
sets it up (same whitespace options, helpers and ``tojson``) so that a prompt renders to the very
text the model was trained on. Anything wrong with the request's messages or the template ends as
``ChatTemplateError``, which the HTTP layer answers with a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


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
                args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
            except ValueError:
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
    """A compiled chat template, rendered the way transformers' apply_chat_template renders it."""

    def __init__(self, template: str, bos_token: str | None, eos_token: str | None) -> None:
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e.message} (line {e.lineno})") from e

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for ``messages``; ``extra`` reaches the template as variables
        (e.g. ``documents``, ``enable_thinking``)."""
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
