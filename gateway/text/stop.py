"""Stop strings: end a generation when its text contains one of the request's ``stop`` strings.

Text arrives in deltas, and a stop string can be split across them ("Hel" + "lo"). So the checker
holds back the tail of the text that could still become a stop string, and emits only what can no
longer be part of one; the client never sees any piece of a stop string (unless asked to).
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
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, delta: str) -> tuple[str, bool]:
        """Add generated text; return (text safe to emit now, whether a stop string ended it)."""
        if self.matched is not None:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self.matched = stop
            self._held = ""
            return text[: start + len(stop)] if self._include else text[:start], True
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """At the end of generation without a stop: the held-back tail (it never became a stop string)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
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
