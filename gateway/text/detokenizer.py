"""Incremental detokenization: turn a stream of generated token ids into a stream of text.

Engines send token ids a few at a time; clients want text as it appears. Two things make this
harder than decoding each new id on its own: one UTF-8 character (emoji, CJK) is often split over
several byte-level tokens, and some decoders (sentencepiece) render a token differently at the
start of a text than after another token. So, like vLLM, each push decodes a short window that
starts a little before the new ids (the "prefix" offset, for context) and emits only the part
after what was already emitted (the "read" offset), holding back a trailing incomplete character.
Each push costs O(window), not O(sequence).

A byte-level BPE's decode is simpler: the UTF-8 of its tokens' bytes, concatenated (``Tokenizer.decodes_bytewise``).
For those, pushes go straight through an incremental UTF-8 decoder, which holds back at most the 3 bytes of an
unfinished character, with no decode calls at all.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from zserve.tokenizer import Tokenizer

_UTF8 = codecs.getincrementaldecoder("utf-8")

_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character

# A UTF-8 character is at most 4 bytes, so at most 3 trailing tokens can hold an unfinished one.
_MAX_INCOMPLETE_TOKENS = 3
# Past this many pending ids a trailing U+FFFD is invalid output (a model emitting stray bytes),
# not an unfinished character: emit it rather than re-decode a window that grows without bound.
_MAX_PENDING_TOKENS = 8


class IncrementalDetokenizer:
    """Decodes one sequence's generated ids piece by piece.

    The concatenation of everything ``push`` and ``flush`` return equals
    ``tokenizer.decode(token_ids, skip_special_tokens)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, bytewise: bool | None = None) -> None:
        """``bytewise`` (default: whenever the tokenizer allows it) decodes through token bytes, not windows."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # the decode window starts here (already-emitted context)
        self._read = 0  # text of ids before this has been emitted
        if bytewise is None:
            bytewise = tokenizer.decodes_bytewise
        self._utf8 = _UTF8("replace") if bytewise else None
        self._partial = False  # the UTF-8 decoder holds the start of a character
        self._token_bytes = tokenizer.token_bytes
        self._bytes = tokenizer.byte_table if bytewise else {}  # the bytes of the tokens seen so far, by id
        self._skipped = tokenizer.all_special_ids if skip_special_tokens else frozenset()

    @property
    def token_ids(self) -> list[int]:
        """All ids pushed so far (the detokenizer's own list: do not modify)."""
        return self._ids

    def push(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete (possibly "")."""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        if self._utf8 is not None:
            skipped = self._skipped
            if len(new_ids) == 1:  # (a streamed token: one engine output, one id)
                i = new_ids[0]
                return self._text(b"" if i in skipped else self._bytes.get(i) or self._token_bytes(i))
            token_bytes = self._token_bytes
            return self._text(b"".join([token_bytes(i) for i in new_ids if i not in skipped]))
        return self._advance(final=False)

    def _text(self, raw: bytes) -> str:
        """The text of the next ``raw`` bytes. While no character is left unfinished (most of the time) whole
        UTF-8 decodes in one C call; the incremental decoder takes over from an unfinished or invalid sequence
        on, until it has nothing held back (what it returns for bytes that do decode whole is the same)."""
        if not self._partial:
            try:
                return raw.decode()
            except UnicodeDecodeError:
                pass
        utf8 = self._utf8
        assert utf8 is not None  # (bytewise only)
        text = utf8.decode(raw)
        self._partial = bool(utf8.getstate()[0])
        return text

    def flush(self) -> str:
        """At the end of generation: the held-back text, incomplete characters included."""
        if self._utf8 is not None:
            self._partial = False
            return self._utf8.decode(b"", True)
        return self._advance(final=True)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        end = len(self._ids)
        text = self._decode(self._prefix, end)
        if not final:
            # Leave the trailing tokens of an unfinished character for a later push, but emit the
            # complete text before them now (a chunk of ids should not be delayed by its last byte).
            lowest = max(self._read + 1, end - _MAX_INCOMPLETE_TOKENS)
            while text.endswith(_REPLACEMENT) and end > lowest:
                end -= 1
                text = self._decode(self._prefix, end)
            if text.endswith(_REPLACEMENT) and len(self._ids) - self._read <= _MAX_PENDING_TOKENS:
                return ""  # wait for the character to complete (flush settles it at the end)
        if len(text) <= len(prefix_text):
            # Nothing visible (e.g. skipped special tokens): consume the ids, keep the context.
            self._read = end
            return ""
        self._prefix, self._read = self._read, end
        return text[len(prefix_text):]
