"""Helpers for parsers that see generated text piece by piece and must give the same answer
whatever the pieces are (tool-call and reasoning parsers)."""

from __future__ import annotations


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is the beginning of ``tag`` (but not all of it)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class Stripped:
    """Passes content through so that, all joined, it is the whole text stripped of surrounding whitespace.

    Leading whitespace is dropped; trailing whitespace is held until more text follows it (at the
    end it is dropped), so the stream emits exactly what ``str.strip`` of everything would keep.
    """

    def __init__(self) -> None:
        self._started = False
        self._space: list[str] = []  # whitespace seen after the last non-space character

    def add(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        kept = text.rstrip()
        if not kept:
            self._space.append(text)
            return ""
        out = "".join(self._space) + kept
        self._space = [text[len(kept):]] if len(kept) < len(text) else []
        return out
