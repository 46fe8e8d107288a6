"""Structured-output specs (``SamplingParams.structured``) as llguidance grammars, for both tiers.

The gateway checks a spec here before a request reaches an engine (a bad schema is a 400 naming
the field); the engine turns the same spec into the grammar it compiles into token masks. One
function for both, so a spec the gateway accepts is exactly one the engine can compile.

Why llguidance (not xgrammar): its wheel has no dependencies (xgrammar's pulls in transformers and
triton), it takes a ``tokenizers`` JSON directly, compiles a schema in about a millisecond (lazily,
as the output grows) and computes a 49k-token mask in tens of microseconds; it reads JSON schema,
regular expressions and Lark grammars (with JSON schemas embedded), which covers every
structured-output form the APIs offer. vLLM and SGLang ship it as a backend.

A vocabulary need not spell every byte: SmolLM2's has no token holding 0xF1, 0xF2, 0xC0 or 0xF5-0xFF
(and a few control characters), so it can never write U+40000..U+BFFFF. Two consequences are handled
here. The grammar engine tokenizes the bytes a grammar forces with the model's tokenizer, which drops
a byte it has no token for, so it would force a token its own matcher then refuses:
``every_byte_vocabulary`` gives it a placeholder token for each such byte, never sampled, so that
its view of the vocabulary is exact and a grammar that needs such a byte leaves no token allowed (the
engine ends the request there). And ``check_spec``, given the bytes no token holds, refuses before
generation a grammar whose every output needs one.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import orjson

from protocol.messages import STRUCTURED_KINDS

# Compact separators (", " and ": ") as json.dumps writes them; a schema can still ask for others
# through its own "x-guidance" options.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A structured-output spec that cannot be compiled; the message says why."""


def llguidance_grammar(kind: str, spec: str) -> str:
    """The llguidance grammar (its JSON form) for one ``(kind, spec)``; GrammarError if malformed."""
    import llguidance

    if kind not in STRUCTURED_KINDS:
        raise GrammarError(f"unknown structured output kind {kind!r}")
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        return llguidance.LLMatcher.grammar_from_lark(spec)
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None


class Unwritable(GrammarError):
    """A spec that compiles but that no output of the model's vocabulary can follow."""


def check_spec(kind: str, spec: str, unwritable: frozenset[int] = frozenset()) -> None:
    """Raise GrammarError (with llguidance's message) unless ``spec`` compiles; Unwritable when every
    output it accepts needs one of the ``unwritable`` bytes (``bytes_no_token_holds``)."""
    import llguidance

    if kind == "json":
        try:
            orjson.loads(spec)
        except orjson.JSONDecodeError as e:
            raise GrammarError(f"the schema is not valid JSON: {e}") from None
    grammar = llguidance_grammar(kind, spec)
    # Compiled once, over a vocabulary of the 256 bytes: that compiles the grammar as validate_grammar
    # does and lets _needed_unwritable follow it byte by byte.
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise GrammarError(error.strip())
        return  # valid for a real vocabulary only (special tokens a byte vocabulary has not): nothing to follow
    needed = _needed_unwritable(matcher, unwritable) if unwritable else None
    if needed is not None:
        before, nexts = needed
        where = f"after {before.decode('utf-8', 'replace')!r}, " if before else ""
        raise Unwritable("the model's vocabulary cannot write any output this accepts: " + where + "the next byte "
                         f"must be {' or '.join(f'0x{b:02X}' for b in nexts)}, which no token of the vocabulary holds")


# The most bytes _needed_unwritable follows: a forced prefix (a schema's first keys, a literal) is rarely longer.
_FOLLOW_BYTES = 512


def _needed_unwritable(matcher, unwritable: frozenset[int]) -> tuple[bytes, list[int]] | None:
    """Follow ``matcher`` (over ``_byte_tokenizer``) while one writable byte at most can come next: the bytes
    written so far and the unwritable bytes one of which must come then, or None once the output may end or
    choose between writable bytes (an output may then exist: deciding more would take a search)."""
    written = bytearray()
    for _ in range(_FOLLOW_BYTES):
        mask = matcher.compute_bitmask()
        allowed = [b for b in range(_BYTE_EOS + 1) if mask[b >> 3] >> (b & 7) & 1]
        if not allowed or _BYTE_EOS in allowed or matcher.is_error():
            return None
        writable = [b for b in allowed if b not in unwritable]
        if not writable:
            return bytes(written), allowed
        if len(writable) > 1:
            return None
        written.append(writable[0])
        if not matcher.consume_token(writable[0]):
            return None
    return None


_BYTE_EOS = 256  # the end-of-output token of _byte_tokenizer


@functools.cache
def _byte_tokenizer():
    """An llguidance vocabulary of one token per byte and an end token (built in ~20 ms, once)."""
    import llguidance

    return llguidance.LLTokenizer.from_tiktoken(encoder={bytes([b]): b for b in range(256)},
                                                special_tokens={"<|end|>": _BYTE_EOS}, pattern=r"[\s\S]",
                                                eos_token=_BYTE_EOS)


def bytes_no_token_holds(token_bytes: Iterable[bytes]) -> frozenset[int]:
    """The bytes that occur in none of ``token_bytes`` (a vocabulary's tokens as bytes): no output can hold them."""
    seen: set[int] = set()
    for raw in token_bytes:
        seen.update(raw)
        if len(seen) == 256:
            break
    return frozenset(range(256)) - seen


def every_byte_vocabulary(tokenizer_json: str, first_free_id: int) -> tuple[str, int]:
    """``tokenizer_json`` (a ``tokenizers`` JSON) with a placeholder token, numbered from ``first_free_id`` on,
    for every byte a byte-level BPE has no one-byte token for; and the vocabulary size that then holds it all.

    llguidance turns the bytes a grammar forces into tokens with this tokenizer, and a byte-level BPE drops
    a character it has no token for: SmolLM2 encodes "\\U0006AA2B" (F1 AA A8 AB) as the tokens of AA A8 AB, so
    llguidance forced the token of AA and then refused it. With every byte spelled its tokenization is exact.
    The placeholders lie past the model's logits, so the engine never samples one: a grammar that needs one
    leaves no real token allowed, a dead end. Other tokenizers are returned as they are.

    ``tokenizers`` numbers an added token that its model's vocabulary lacks from the vocabulary's size on,
    whatever id the JSON gives it; so that placeholders shift no such token (the scripted test model's
    ``\\n</tool_call>``), each one is entered in the vocabulary under its own id first."""
    data = orjson.loads(tokenizer_json)
    model = data.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not _is_byte_level(data):
        return tokenizer_json, first_free_id
    from zserve.tokenizer import _bytes_to_unicode  # GPT-2's byte -> character table, as the vocabulary spells bytes

    added = [t for t in data.get("added_tokens") or () if isinstance(t.get("id"), int)]
    for token in added:
        vocab.setdefault(token["content"], token["id"])
    next_id = max(first_free_id, max(vocab.values(), default=-1) + 1)
    for byte, char in _bytes_to_unicode().items():
        if char not in vocab and byte != 0xFF:  # 0xFF, never in UTF-8, is llguidance's mark of a special token
            vocab[char] = next_id
            next_id += 1
    return orjson.dumps(data).decode(), next_id


def _is_byte_level(data: dict) -> bool:
    """Whether a ``tokenizers`` JSON decodes with GPT-2's byte-level table (its decoder, or one of a Sequence's)."""
    decoder = data.get("decoder") or {}
    parts = decoder.get("decoders") or [] if decoder.get("type") == "Sequence" else [decoder]
    return any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's)."""
    return orjson.dumps(text).decode()


def json_in_lark(schema: dict | bool) -> str:
    """A Lark expression that matches one JSON value ``schema`` accepts (llguidance's ``%json``)."""
    return "%json " + orjson.dumps(schema).decode()


def choice_grammar(choices: list[str]) -> str:
    """A Lark grammar whose output is exactly one of ``choices``."""
    return "start: " + " | ".join(lark_string(c) for c in choices)
