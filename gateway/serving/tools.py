"""How a request uses tools (``ToolUse``, checked against what this server can do), the parser of the model's
reasoning and tool calls for a choice (``message_parser``), and the calls a finished choice carries."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import APIError, bad_request
from ..state import ModelState
from ..text.message import MessageParser
from ..text.tool_parsers import TOOL_PARSERS, ToolCall, function_tools
from .choices import Choice


@dataclass(frozen=True)
class ToolUse:
    """How a request wants tools used: ``mode`` is none | auto | required | function (then ``function``)."""

    mode: str
    function: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


NO_TOOLS = ToolUse("none")


def tool_names(tools: list[dict] | None) -> list[str]:
    """Names of OpenAI-style function tools ({"type": "function", "function": {"name", ...}})."""
    return [name for name, _ in function_tools(tools)]


def tool_use(state: ModelState, tools: list[dict] | None, mode: str, function: str | None = None,
             parallel: bool = True, param: str = "tool_choice") -> ToolUse:
    """Check a request's tools against what this server can do; never drop tools silently."""
    if mode == "none" or (not tools and mode == "auto"):
        return NO_TOOLS
    if not tools:
        raise bad_request(f"tool_choice {mode!r} needs tools", param=param)
    if state.tool_parser is None:
        raise bad_request("tool calling is not enabled on this server: start it with --tool-call-parser NAME "
                          f"(one of: {TOOL_PARSERS.names()})", param="tools")
    if mode == "function" and function not in tool_names(tools):
        raise bad_request(f"tool_choice names the function {function!r}, which is not among the tools", param=param)
    return ToolUse(mode, function, parallel)


def chat_tool_use(state: ModelState, tools: list[dict] | None, choice: Any, parallel: bool = True) -> ToolUse:
    """OpenAI chat's tool_choice: "none" | "auto" (None) | "required" | {"type": "function", "function":
    {"name"}}; the chat route and /tokenize read it alike."""
    if choice is None:
        return tool_use(state, tools, "auto", parallel=parallel)
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        return tool_use(state, tools, choice, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        return tool_use(state, tools, "function", choice["function"]["name"], parallel)
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": ...}}', param="tool_choice")


def message_parser(state: ModelState, use: ToolUse, prefill: str = "") -> MessageParser | None:
    if state.reasoning_parser is None and (state.tool_parser is None or use.mode == "none"):
        return None  # the common case, without building a parser to find it inactive
    parser = MessageParser(state.reasoning_parser, state.tool_parser if use.mode != "none" else None, prefill,
                           single_call=not use.parallel)
    return parser if parser.active else None


def final_tool_calls(use: ToolUse, c: Choice) -> list[ToolCall]:
    """The calls a finished choice carries; a forced call that the model did not produce is a server error.

    The forced call's grammar (``ChatPrompt.forced``) lets the model end its turn only after a valid
    call, so a choice that the model ended without one had no grammar applied: a server error. A
    choice the request's limits cut (``Choice.cut``: max_tokens, a stop string) is no error: it
    carries the calls it completed, maybe none (finish_reason "length" says why)."""
    calls = c.msg.tool_calls if c.msg is not None else []
    if use.forced and not c.cut:
        if not calls:
            raise APIError(500, "the model did not produce a valid tool call although tool_choice requires one",
                           code="invalid_tool_call")
        if use.mode == "function" and any(c.name != use.function for c in calls):
            raise APIError(500, f"the model called a function other than {use.function!r}", code="invalid_tool_call")
    return calls


def arguments_dict(call: ToolCall) -> dict:
    """A call's arguments as an object (Anthropic's ``input``); the parsers guarantee a JSON object."""
    value = json.loads(call.arguments or "{}")
    return value if isinstance(value, dict) else {}
