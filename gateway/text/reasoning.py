"""Reasoning parsers: split a reasoning model's thinking from its answer.

Reasoning models (DeepSeek-R1, Qwen3, QwQ) think inside ``<think>…</think>`` before answering;
clients of the OpenAI API want the thinking apart, as ``reasoning_content``. A parser splits the
whole output into (reasoning, content), and its stream does the same for text in deltas. Both
strip the reasoning and the content of surrounding whitespace (the answer usually starts with
"\\n\\n" after ``</think>``), and whatever the deltas, the stream's reasoning and content add up to
exactly what ``split`` returns ("" where ``split`` says None).

The streaming rule. Some chat templates open ``<think>`` themselves at the end of the prompt
(DeepSeek-R1, Qwen3-Thinking-2507), so the output starts inside the thinking and only ``</think>``
ever appears; others leave it to the model. Before any tag arrives a stream cannot tell which case
it is in, and holding text back until it can would hold back a whole answer that has no tags. So
the case is chosen up front, by ``starts_in_reasoning``:

- ``think`` (False): text is content until ``<think>`` opens. A ``</think>`` with no ``<think>``
  before it is left in the content as it stands (the text before it has already been streamed as
  content, so it cannot become reasoning afterwards; ``split`` does the same so that both agree).
- ``deepseek_r1`` (True): text is reasoning until ``</think>``; a ``<think>`` the model writes
  anyway at the very start (after whitespace only) is dropped. Output with no ``</think>`` at all
  is all reasoning (the model ran out of tokens while thinking).

Use ``deepseek_r1`` for models whose template opens the tag, or decide per request: the gateway
can build ``ThinkReasoningParser(starts_in_reasoning=True)`` when the rendered prompt ends with
``<think>`` (after whitespace). In both modes an opened ``<think>`` that never closes makes the rest
reasoning, and after ``</think>`` everything is content (a later ``<think>`` is plain text).
"""

from __future__ import annotations

from typing import ClassVar

from zserve.registry import Registry

from .streaming import Stripped, partial_tail

_OPEN = "<think>"
_CLOSE = "</think>"


class ReasoningStream:
    """Incremental splitter for one generated message (made by ``ReasoningParser.stream``)."""

    def push(self, text: str) -> tuple[str, str]:
        """Add generated text; return (reasoning to emit now, content to emit now)."""
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        """At the end of generation: what was held back, as (reasoning, content)."""
        raise NotImplementedError


class ReasoningParser:
    """Base class: one model family's way of marking its reasoning."""

    name: ClassVar[str]

    def split(self, text: str) -> tuple[str | None, str]:
        """Whole output -> (reasoning, or None when there is none; content)."""
        raise NotImplementedError

    def stream(self) -> ReasoningStream:
        """A fresh incremental splitter for one generated message."""
        raise NotImplementedError


REASONING_PARSERS: Registry[ReasoningParser] = Registry("reasoning parser")
_register = REASONING_PARSERS.register


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered under ``name``; ValueError naming the valid ones otherwise."""
    return REASONING_PARSERS.create(name)


@_register
class ThinkReasoningParser(ReasoningParser):
    """``<think>…</think>``; the model opens the tag itself (Qwen3, QwQ) unless told otherwise."""

    name = "think"
    default_starts_in_reasoning: ClassVar[bool] = False

    def __init__(self, starts_in_reasoning: bool | None = None) -> None:
        self.starts_in_reasoning = (
            self.default_starts_in_reasoning if starts_in_reasoning is None else starts_in_reasoning
        )

    def split(self, text: str) -> tuple[str | None, str]:
        if self.starts_in_reasoning:
            head, _, rest = text.partition(_CLOSE)
            head = head.lstrip()
            if head.startswith(_OPEN):
                head = head[len(_OPEN):]
            return head.strip() or None, rest.strip()
        before, opened, after = text.partition(_OPEN)
        if not opened:
            return None, text.strip()
        reasoning, _, rest = after.partition(_CLOSE)
        return reasoning.strip() or None, (before + rest).strip()

    def stream(self) -> ReasoningStream:
        return _ThinkStream(self.starts_in_reasoning)


@_register
class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """``<think>…</think>`` where the chat template has already opened the tag (DeepSeek-R1)."""

    name = "deepseek_r1"
    default_starts_in_reasoning = True


class _ThinkStream(ReasoningStream):
    def __init__(self, starts_in_reasoning: bool) -> None:
        # "before": content until <think>; "start": reasoning where a leading <think> is dropped;
        # "inside": reasoning until </think>; "after": content to the end.
        self._state = "start" if starts_in_reasoning else "before"
        self._held = ""  # a tail that may be the start of the tag looked for (at most a tag's length)
        self._reasoning = Stripped()
        self._content = Stripped()

    def push(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self._state == "after":
                content.append(self._content.add(text))
                break
            window = self._held + text
            self._held = ""
            if self._state == "start":
                # Leading whitespace would be stripped from the reasoning anyway, so drop it here.
                window = window.lstrip()
                if not window:
                    break
                if len(window) < len(_OPEN) and _OPEN.startswith(window):
                    self._held = window
                    break
                if window.startswith(_OPEN):
                    window = window[len(_OPEN):]
                self._state, text = "inside", window
                continue
            tag = _OPEN if self._state == "before" else _CLOSE
            out = content if self._state == "before" else reasoning
            sink = self._content if self._state == "before" else self._reasoning
            found = window.find(tag)
            if found < 0:
                keep = partial_tail(window, tag)
                out.append(sink.add(window[: len(window) - keep]))
                self._held = window[len(window) - keep:]
                break
            out.append(sink.add(window[:found]))
            self._state = "inside" if self._state == "before" else "after"
            text = window[found + len(tag):]
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "before":
            return "", self._content.add(held)
        if self._state in ("start", "inside"):
            return self._reasoning.add(held), ""
        return "", ""


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "ReasoningParser",
    "ReasoningStream",
    "ThinkReasoningParser",
    "get_reasoning_parser",
]
