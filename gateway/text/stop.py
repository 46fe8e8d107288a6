"""Stop strings: end a generation when its text contains one of the request's ``stop`` strings.

Text arrives in deltas, and a stop string can be split across them ("Hel" + "lo"). So the checker
holds back the tail of the text that could still become a stop string, and emits only what can no
longer be part of one; the client never sees any piece of a stop string (unless asked to).

``min_tokens`` holds stop strings off as vLLM does: a stop string counts only where it ends in the text
of an output token after the first ``min_tokens`` (it may begin before). The caller says how much of a
delta is the text of those first tokens (``push(delta, protected)``).
"""

from __future__ import annotations

from collections.abc import Iterable


class StopChecker:
    """Finds the first stop string in a stream of text deltas.

    "First" is the occurrence that ends earliest in the text (what a character-by-character check
    would meet first); among those ending at the same place, the one starting earliest. That makes
    the outcome independent of how the text is split into deltas.
    """

    def __init__(self, stop: Iterable[str], include_stop_str_in_output: bool = False) -> None:
        # "" would match everywhere; OpenAI clients send it by accident, so it is ignored.
        self._stops = sorted({s for s in stop if s}, key=len, reverse=True)
        self._include = include_stop_str_in_output
        self._held = ""  # received but not yet emitted: could be the start of a stop string
        self._held_protected = 0  # how much of _held is text of the first min_tokens tokens
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    @property
    def held_back(self) -> int:
        """How many characters received are not yet emitted (they may begin a stop string)."""
        return len(self._held)

    def push(self, delta: str, protected: int = 0) -> tuple[str, bool]:
        """Add generated text; return (text safe to emit now, whether a stop string ended it). No stop string
        ends in the first ``protected`` characters of ``delta`` (the text of the first ``min_tokens`` tokens)."""
        if self.matched is not None:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        # The protected text is a beginning of the whole output: with some of delta in it, all of _held is.
        floor = len(self._held) + protected if protected else self._held_protected
        match = self._first_match(text, floor)
        if match is not None:
            start, stop = match
            self.matched = stop
            self._held = ""
            return text[: start + len(stop)] if self._include else text[:start], True
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep:] if keep else ""
        self._held_protected = max(0, floor - (len(text) - keep))
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """At the end of generation without a stop: the held-back tail (it never became a stop string)."""
        held, self._held, self._held_protected = self._held, "", 0
        return held

    def _first_match(self, text: str, min_end: int = 0) -> tuple[int, str] | None:
        """The first stop string in ``text`` that ends after its first ``min_end`` characters: (start, stop)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop, max(0, min_end - len(stop) + 1))
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _partial_tail(self, text: str) -> int:
        """Length of the longest end of ``text`` that is the beginning of some stop string."""
        longest = min(len(text), max(len(s) for s in self._stops) - 1)
        for size in range(longest, 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0
