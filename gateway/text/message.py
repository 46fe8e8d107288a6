"""One assistant message out of generated text: reasoning, answer and tool calls, whole or streamed.

Generated text goes through the server's reasoning parser first (``<think>…</think>`` becomes
reasoning), then what is left through the tool-call parser (``<tool_call>…</tool_call>`` becomes
calls). Every API family (chat completions, Anthropic Messages, Responses) shapes the same
``MessagePiece``s into its own JSON, so the parsing is written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .reasoning import ReasoningParser
from .tool_parsers import ToolCall, ToolCallDelta, ToolParser


@dataclass
class MessagePiece:
    """What one push (or the final flush) added to the message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __add__(self, other: MessagePiece) -> MessagePiece:
        return MessagePiece(self.reasoning + other.reasoning, self.content + other.content,
                            self.tool_calls + other.tool_calls)


class MessageParser:
    """Splits one generated message; ``prefill`` is text the server already put in the model's mouth
    (the opening of a forced tool call), which is part of the message but was never generated."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, prefill: str = "",
                 single_call: bool = False) -> None:
        # A forced call skips reasoning: the prompt already ends inside the call.
        self._reasoning = reasoning.stream() if reasoning is not None and not prefill else None
        self._tools = tools.stream() if tools is not None else None
        self.single_call = single_call  # parallel_tool_calls false: only the first call counts
        self.reasoning: list[str] = []
        self.content: list[str] = []
        if prefill and self._tools is not None:
            self._tools.push(prefill)  # the opening of a call: held back, never content

    @property
    def active(self) -> bool:
        return self._reasoning is not None or self._tools is not None

    @property
    def tool_calls(self) -> list[ToolCall]:
        calls = self._tools.calls if self._tools is not None else []
        return calls[:1] if self.single_call else calls

    def push(self, text: str) -> MessagePiece:
        return self._step(text, final=False)

    def finish(self, cut: bool = False) -> MessagePiece:
        """The end of the message; ``cut``: the request's limits (max_tokens, a stop string) ended it,
        so a tool call it ends in is dropped (``ToolStream.finish``)."""
        return self._step("", final=True, cut=cut)

    def _step(self, text: str, final: bool, cut: bool = False) -> MessagePiece:
        reasoning, content = "", text
        if self._reasoning is not None:
            r1, c1 = self._reasoning.push(text) if text else ("", "")
            if final:
                r2, c2 = self._reasoning.finish()
                r1, c1 = r1 + r2, c1 + c2
            reasoning, content = r1, c1
        calls: list[ToolCallDelta] = []
        if self._tools is not None:
            content, calls = self._tools.push(content) if content else ("", [])
            if final:
                more, more_calls = self._tools.finish(cut)
                content += more
                calls = calls + more_calls
        if self.single_call:
            calls = [t for t in calls if t.index == 0]
        self.reasoning.append(reasoning)
        self.content.append(content)
        return MessagePiece(reasoning, content, calls)

    def text(self) -> str:
        return "".join(self.content)

    def reasoning_text(self) -> str | None:
        r = "".join(self.reasoning)
        return r or None
