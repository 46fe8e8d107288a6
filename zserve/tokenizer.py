"""A model's tokenizer: text <-> token ids, built from a GGUF file or a Hugging Face directory.

The gateway tokenizes prompts and detokenizes generated ids, so it needs the model's exact
tokenizer without importing torch or transformers. Engines read it only for structured output:
the grammar engine needs every token's bytes to turn a grammar into token masks.

A GGUF file carries no ``tokenizer.json``, only llama.cpp metadata (vocabulary, merges, token
types, special ids), so ``Tokenizer.from_gguf`` turns that metadata into a ``tokenizers.Tokenizer``
(Rust) with the pre-tokenizer the model was trained with. Reading the metadata with
``gguf.GGUFReader`` costs ~2 s, so the built tokenizer can be cached on disk and later starts load
it in milliseconds.

Chat prompts repeat themselves: the system prompt, the role headers and, because clients resend the
whole conversation every turn, every earlier turn. ``Tokenizer.encode`` therefore splits a text at
its special tokens and keeps the ids of recently seen pieces in a bounded cache
(``_SegmentedEncoder``), for tokenizers where that provably gives the ids of the whole text.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

log = logging.getLogger(__name__)

# Bump when the way a GGUF becomes a tokenizer changes, so that stale cache files are rebuilt.
_CACHE_FORMAT = 2

# llama.cpp's token types (llama_token_type): 3 is CONTROL (<|im_start|> etc.), 4 is USER_DEFINED.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece byte-fallback tokens

# Bounds of the per-tokenizer cache of piece -> ids, in entries and in estimated bytes
# (``_piece_bytes``): 16 MiB holds ~1.5M characters of English (~4 characters a token) or ~400K of
# CJK (~1 a token), the system prompts, headers and turns of many live conversations. A piece over
# 1 MiB (~100K characters, a pasted document) would push out 1/16 of the cache at once and is
# rarely resent verbatim, so it is encoded but not kept.
PIECE_CACHE_ENTRIES = 8192
PIECE_CACHE_BYTES = 16 << 20
PIECE_CACHE_MAX_PIECE_BYTES = 1 << 20


def _piece_bytes(piece: str, ids: list[int]) -> int:
    """About what caching ``piece`` holds: the text (1 byte a character for ASCII), an int object and
    a list slot per id (28 + 8 bytes), and the entry itself."""
    return len(piece) + 36 * len(ids) + 150

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SizedLRU(Generic[K, V]):
    """A least-recently-used map bounded by its number of entries and by their total size.

    The size of an entry is whatever the caller says it is (characters of text, say), so that a
    flood of long unique inputs evicts older entries instead of growing memory. Entries larger than
    ``max_item_size`` are not kept. Safe to share between threads.
    """

    def __init__(self, max_entries: int, max_size: int, max_item_size: int | None = None) -> None:
        if max_entries < 1 or max_size < 1:
            raise ValueError("a SizedLRU needs max_entries >= 1 and max_size >= 1")
        self.max_entries = max_entries
        self.max_size = max_size
        self.max_item_size = max_size if max_item_size is None else min(max_item_size, max_size)
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def size(self) -> int:
        """The total size of the entries held."""
        return self._size

    def get(self, key: K) -> V | None:
        return self.get_many((key,))[0]

    def get_many(self, keys: Iterable[K]) -> list[V | None]:
        """The value of each key, None where it is not held (one lock round for all of them)."""
        out: list[V | None] = []
        with self._lock:
            items = self._items
            for key in keys:
                entry = items.get(key)
                if entry is None:
                    out.append(None)
                    self.misses += 1
                else:
                    items.move_to_end(key)
                    out.append(entry[0])
                    self.hits += 1
        return out

    def put(self, key: K, value: V, size: int) -> None:
        self.put_many(((key, value, size),))

    def put_many(self, entries: Iterable[tuple[K, V, int]]) -> None:
        with self._lock:
            items = self._items
            for key, value, size in entries:
                if size > self.max_item_size:
                    continue
                old = items.pop(key, None)
                if old is not None:
                    self._size -= old[1]
                items[key] = (value, size)
                self._size += size
            while len(items) > self.max_entries or self._size > self.max_size:
                _, (_, size) = items.popitem(last=False)
                self._size -= size

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._size = 0


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by every byte-level BPE.

    ``tokenizers`` applies it internally but does not expose the mapping, and we need it both
    ways: to respell odd GGUF tokens and to recover a token's raw bytes (OpenAI logprobs).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.cache
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer named by ``tokenizer.ggml.pre``, as in the model's own tokenizer.json.

    Merges only reproduce the reference ids when text is split the way it was at training time.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        # SmolLM/SmolLM2: every digit is its own pre-token, then GPT-2's byte-level split. This
        # differs from plain GPT-2 on e.g. "  1" (two spaces, digit): "ĠĠ" "1", not "Ġ" "Ġ" "1".
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default"):
        return byte_level
    raise ValueError(
        f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: smollm, gpt2, default"
    )


def _read_gguf_tokenizer(path: str) -> dict[str, Any]:
    """The tokenizer metadata of a GGUF file as plain Python values."""
    import gguf  # numpy-based, torch-free; imported here so that from_dir never pays for it

    reader = gguf.GGUFReader(path)

    def value(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    meta = {
        "model": value("tokenizer.ggml.model"),
        "pre": value("tokenizer.ggml.pre", "default"),
        "tokens": value("tokenizer.ggml.tokens"),
        "token_type": value("tokenizer.ggml.token_type") or [],
        "merges": value("tokenizer.ggml.merges") or [],
        "bos_token_id": value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": value("tokenizer.ggml.eos_token_id"),
        "unk_token_id": value("tokenizer.ggml.unknown_token_id"),
        "pad_token_id": value("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(value("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(value("tokenizer.ggml.add_eos_token", False)),
        "chat_template": value("tokenizer.chat_template"),
        "context_length": value(f"{value('general.architecture', '')}.context_length"),
    }
    if not meta["tokens"]:
        raise ValueError(f"{path}: GGUF file has no tokenizer.ggml.tokens")
    return meta


def _special_tokens_processor(
    backend: _Backend, bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool
) -> processors.PostProcessor | None:
    """What ``encode(add_special_tokens=True)`` adds: BOS/EOS only where the file asks for them."""
    single, specials = ["$A:0"], []
    if add_bos and bos_id is not None:
        bos = backend.id_to_token(bos_id)
        single.insert(0, f"{bos}:0")
        specials.append((bos, bos_id))
    if add_eos and eos_id is not None:
        eos = backend.id_to_token(eos_id)
        single.append(f"{eos}:0")
        specials.append((eos, eos_id))
    if not specials:
        return None
    return processors.TemplateProcessing(single=" ".join(single), special_tokens=specials)


def _build_from_gguf_metadata(meta: dict[str, Any]) -> _Backend:
    if meta["model"] != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {meta['model']!r} (tokenizer.ggml.model); only byte-level "
            "BPE ('gpt2') is supported"
        )
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens: list[str] = list(meta["tokens"])
    # A byte-level vocabulary spells every token in the byte alphabet. llama.cpp sometimes stores a
    # token in plain UTF-8 instead; respell it so that merges and lookups agree (transformers does too).
    vocab = {
        (tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(meta["pre"])
    backend.decoder = decoders.ByteLevel()

    # Control tokens become special tokens so that "<|im_start|>" in a rendered chat prompt is one id
    # and decode(skip_special_tokens=True) drops them. A "control" token outside the byte alphabet is
    # a llama.cpp mislabel; adding it would grow the vocabulary past the model's, so skip it.
    types = list(meta["token_type"])
    control = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, types)
        if kind == _TOKEN_TYPE_CONTROL and set(tok) <= alphabet
    ]
    user_defined = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(tokens, types)
        if kind == _TOKEN_TYPE_USER_DEFINED and tok in vocab
    ]
    backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)
    processor = _special_tokens_processor(
        backend, meta["bos_token_id"], meta["eos_token_id"], meta["add_bos_token"], meta["add_eos_token"]
    )
    if processor is not None:
        backend.post_processor = processor
    return backend


def _cache_file(cache_dir: str, gguf_path: Path) -> Path:
    digest = hashlib.sha256(str(gguf_path).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{gguf_path.stem}.{digest}.tokenizer.json"


def _cache_key(gguf_path: Path) -> dict[str, Any]:
    st = gguf_path.stat()
    return {"format": _CACHE_FORMAT, "path": str(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_atomically(target: Path, text: str) -> None:
    # Several gateways may start at once: write a private temp file and rename it into place so
    # that a reader never sees half a file.
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the cache from gateways run as another user
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _length(value: Any) -> int | None:
    """A context length from a model's files; None for a missing one or a placeholder (HF writes 1e30)."""
    return int(value) if isinstance(value, (int, float)) and 0 < value < 1 << 40 else None


def _dir_context_length(directory: Path, tokenizer_config: dict[str, Any]) -> int | None:
    """An HF directory's context: config.json's ``max_position_embeddings``, else tokenizer_config.json's
    ``model_max_length``."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    found = _length(config.get("max_position_embeddings")) if isinstance(config, dict) else None
    return found or _length(tokenizer_config.get("model_max_length"))


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _config_chat_template(config: dict[str, Any], directory: Path) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


# Normalizers, pre-tokenizers and models that see one piece of text (between added tokens) at a
# time and do not care where in the text it sits, so that encoding a piece alone gives the ids it
# gets inside the whole text. Metaspace(prepend_scheme="first") is the exception that shows why the
# list is explicit: it prefixes "▁" only to the piece at offset 0.
_PIECEWISE_NORMALIZERS = frozenset({
    "BertNormalizer", "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "StripAccents", "Replace", "Prepend",
    "Precompiled", "Nmt", "ByteLevel",
})
_PIECEWISE_PRE_TOKENIZERS = frozenset({
    "ByteLevel", "Digits", "BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Punctuation", "Split",
    "CharDelimiterSplit", "UnicodeScripts", "Metaspace",
})
_PIECEWISE_MODELS = frozenset({"BPE", "WordPiece", "WordLevel", "Unigram"})
# Post-processors that, with add_special_tokens=False, change offsets at most and never ids.
_IDS_NEUTRAL_PROCESSORS = frozenset({"TemplateProcessing", "BertProcessing", "RobertaProcessing", "ByteLevel"})


def _flat_components(component: Any) -> list[dict[str, Any]] | None:
    """A normalizer/pre-tokenizer/post-processor as its list of configs, Sequences flattened."""
    if component is None:
        return []
    try:
        config = json.loads(component.__getstate__())
    except Exception:  # noqa: BLE001 - a component we cannot read is one we cannot vouch for
        return None
    out: list[dict[str, Any]] = []
    stack = [config]
    while stack:
        part = stack.pop()
        if part.get("type") == "Sequence":
            children = part.get("normalizers", part.get("pretokenizers", part.get("processors")))
            if not isinstance(children, list):
                return None
            stack.extend(children)
        else:
            out.append(part)
    return out


def _piecewise_refusal(backend: _Backend) -> str | None:
    """Why encoding ``backend``'s text piece by piece could differ from encoding it whole; None if it cannot.

    ``tokenizers`` first cuts a text at its added tokens that match unnormalized text
    (leftmost-longest), then normalizes, pre-tokenizes and models every other piece on its own;
    with add_special_tokens=False nothing joins the pieces again. That makes the ids of the text the
    ids of its pieces and tokens in order, as long as: no added token reaches outside its own text
    (lstrip, rstrip, single_word), all are matched before normalization (so that our split and
    theirs agree), special tokens are not switched off (``encode_special_tokens``), no stage looks
    at where its piece sits or is random, and nothing truncates or pads the whole.
    """
    if backend.encode_special_tokens:
        return "encode_special_tokens is on"
    if backend.truncation is not None or backend.padding is not None:
        return "truncation or padding is on"
    for token in backend.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or token.single_word:
            return f"added token {token.content!r} has lstrip, rstrip or single_word"
        if token.normalized:
            return f"added token {token.content!r} is matched after normalization"
        if not token.content:
            return "an added token is empty"
    stages = (
        ("normalizer", backend.normalizer, _PIECEWISE_NORMALIZERS),
        ("pre-tokenizer", backend.pre_tokenizer, _PIECEWISE_PRE_TOKENIZERS),
        ("post-processor", backend.post_processor, _IDS_NEUTRAL_PROCESSORS),
    )
    for stage, component, allowed in stages:
        parts = _flat_components(component)
        if parts is None:
            return f"unreadable {stage}"
        for part in parts:
            if part.get("type") not in allowed:
                return f"{stage} {part.get('type')!r} is not known to work piece by piece"
            if part.get("type") == "Metaspace" and part.get("prepend_scheme") not in ("always", "never"):
                return "Metaspace pre-tokenizer prepends only to the first piece"
    model = type(backend.model).__name__
    if model not in _PIECEWISE_MODELS:
        return f"model {model!r} is not known to work piece by piece"
    if getattr(backend.model, "dropout", None):
        return "BPE dropout makes encoding random"
    return None


class _PiecewiseEncoder:
    """Encodes text as the concatenation of its pieces between added tokens, remembering pieces.

    Only built for a backend that ``_piecewise_refusal`` accepts; the backend must not be
    reconfigured afterwards.
    """

    def __init__(self, backend: _Backend, cache: SizedLRU[str, list[int]]) -> None:
        self._backend = backend
        self.cache = cache
        self._token_ids = {token.content: i for i, token in backend.get_added_tokens_decoder().items()}
        if self._token_ids:
            # Longest first, so that at any position the longest token wins: the same
            # leftmost-longest match as tokenizers' own split.
            alternatives = "|".join(re.escape(t) for t in sorted(self._token_ids, key=len, reverse=True))
            self._split = re.compile(f"({alternatives})").split
        else:
            self._split = lambda text: [text]

    def encode(self, text: str) -> list[int]:
        parts = self._split(text)  # piece, token, piece, ..., piece
        pieces = parts[0::2]
        found = self.cache.get_many(pieces)
        if None in found:
            missing = list(dict.fromkeys(p for p, ids in zip(pieces, found) if ids is None))
            # One call for all misses: encode_batch_fast skips offsets and spreads a long batch
            # over threads (measured ~20% faster than encode for one piece, 2x for 20 on 2 cores).
            encodings = self._backend.encode_batch_fast(missing, add_special_tokens=False)
            encoded = {piece: enc.ids for piece, enc in zip(missing, encodings)}
            self.cache.put_many((piece, ids, _piece_bytes(piece, ids)) for piece, ids in encoded.items())
            found = [encoded[p] if ids is None else ids for p, ids in zip(pieces, found)]
        out = list(found[0])  # a copy: lists held by the cache never reach callers
        token_ids = self._token_ids
        for token, ids in zip(parts[1::2], found[1:]):
            out.append(token_ids[token])
            out.extend(ids)
        return out


class Tokenizer:
    """A model's tokenizer: a ``tokenizers.Tokenizer`` plus the special tokens and chat template.

    ``encode`` recognises special tokens written in the text (a rendered chat prompt contains
    "<|im_start|>"), as Hugging Face tokenizers do. Where the backend allows it, it encodes the
    pieces between them through ``piece_cache`` (a ``SizedLRU``; None where it encodes text whole).
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        piece_cache: SizedLRU[str, list[int]] | None = None,
        model_max_length: int | None = None,
    ) -> None:
        self._backend = backend
        # The model's own context (GGUF ``<arch>.context_length``, HF ``max_position_embeddings``): what requests
        # are checked against where no engine reports its context (a render server). None: not known.
        self.model_max_length = model_max_length
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self._byte_level = _uses_byte_level(backend)
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)  # read per request: asked once
        # Token id -> the bytes decode gives it, for a tokenizer whose decode is bytewise (``decodes_bytewise``).
        self._token_bytes: dict[int, bytes] | None = {} if _decodes_bytewise(backend) else None
        refusal = _piecewise_refusal(backend)
        self._piecewise: _PiecewiseEncoder | None = None
        if refusal is None:
            if piece_cache is None:
                piece_cache = SizedLRU(PIECE_CACHE_ENTRIES, PIECE_CACHE_BYTES, PIECE_CACHE_MAX_PIECE_BYTES)
            self._piecewise = _PiecewiseEncoder(backend, piece_cache)
        else:
            log.info("tokenizer encodes every text whole, without the piece cache: %s", refusal)
        # Without a post-processor add_special_tokens adds nothing (SmolLM2 adds no BOS).
        self._plain_with_specials = backend.post_processor is None

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], cache_dir: str | None = None) -> Tokenizer:
        """Build the tokenizer a GGUF file describes; with ``cache_dir``, reuse an earlier build.

        The cache entry is valid while the GGUF's path, size and mtime are unchanged.
        """
        gguf_path = Path(path).resolve()
        cache = _cache_file(cache_dir, gguf_path) if cache_dir else None
        key = _cache_key(gguf_path) if cache is not None else {}
        if cache is not None:
            cached = _load_cache(cache, key)
            if cached is not None:
                return cached

        meta = _read_gguf_tokenizer(str(gguf_path))
        backend = _build_from_gguf_metadata(meta)
        config = {
            "bos_token_id": meta["bos_token_id"],
            "eos_token_id": meta["eos_token_id"],
            "pad_token_id": meta["pad_token_id"],
            "unk_token_id": meta["unk_token_id"],
            "chat_template": meta["chat_template"],
            "model_max_length": _length(meta["context_length"]),
        }
        if cache is not None:
            try:
                entry = {"key": key, "config": config, "tokenizer": backend.to_str()}
                _write_atomically(cache, json.dumps(entry, ensure_ascii=False))
            except OSError as e:
                # The cache only speeds up the next start; serving works without it.
                log.warning("could not cache the tokenizer of %s in %s (%s); next start rebuilds it", path, cache, e)
        return cls(backend, **config)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json)."""
        directory = Path(path)
        backend = _Backend.from_file(str(directory / "tokenizer.json"))
        # Some tokenizer.json files fix padding and truncation (all-MiniLM-L6-v2's pad and cut every
        # input at 128): ids must be exactly the text's, and limits are the server's business.
        backend.no_padding()
        backend.no_truncation()
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}

        def token_id(name: str) -> int | None:
            content = _token_content(config.get(name))
            return backend.token_to_id(content) if content is not None else None

        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            pad_token_id=token_id("pad_token"),
            unk_token_id=token_id("unk_token"),
            chat_template=_config_chat_template(config, directory),
            model_max_length=_dir_context_length(directory, config),
        )

    # -- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in it are matched whole.

        The same ids as ``backend.encode(text, add_special_tokens=...).ids``, from the piece cache
        where possible.
        """
        if self._piecewise is not None and (not add_special_tokens or self._plain_with_specials):
            return self._piecewise.encode(text)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def piece_cache(self) -> SizedLRU[str, list[int]] | None:
        """The cache of text pieces' ids ``encode`` uses; None where it encodes every text whole."""
        return None if self._piecewise is None else self._piecewise.cache

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self._token(i) for i in ids]

    def id_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` stands for (may be part of a UTF-8 character).

        OpenAI's logprobs report these in the ``bytes`` field.
        """
        token = self._token(token_id)
        if token_id in self._special_ids:
            return token.encode("utf-8")
        if self._byte_level:
            table = _unicode_to_bytes()
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
            return token.encode("utf-8")  # an added token written in plain text
        match = _BYTE_TOKEN.match(token)
        if match:
            return bytes([int(match.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")  # sentencepiece spells spaces as U+2581

    @property
    def decodes_bytewise(self) -> bool:
        """Whether ``decode(ids)`` is the (lossy) UTF-8 of the concatenated ``token_bytes`` of ``ids``: a lone
        byte-level decoder, as GPT-2-style BPEs (SmolLM2's) have. Text can then be decoded incrementally with no
        window of context (``gateway.text.detokenizer``)."""
        return self._token_bytes is not None

    @property
    def byte_table(self) -> dict[int, bytes]:
        """``token_bytes`` of the ids asked for so far, by id (the cache it fills; a lookup is cheaper than the
        call, for a caller that does one per streamed token)."""
        table = self._token_bytes
        assert table is not None, "byte_table needs a bytewise decoder"
        return table

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the byte-level decoder makes of one token (``decodes_bytewise`` tokenizers only): its
        characters through the byte table, or its own UTF-8 when one is outside it (an added token in plain
        text), as ``tokenizers``' ByteLevel decoder does."""
        table = self._token_bytes
        assert table is not None, "token_bytes needs a bytewise decoder"
        raw = table.get(token_id)
        if raw is None:
            token = self._token(token_id)
            chars = _unicode_to_bytes()
            raw = bytes(chars[c] for c in token) if all(c in chars for c in token) else token.encode("utf-8")
            table[token_id] = raw
        return raw

    def _token(self, token_id: int) -> str:
        token = self._backend.id_to_token(int(token_id))
        if token is None:
            raise ValueError(f"token id {token_id} is out of range for a vocabulary of {self.vocab_size}")
        return token

    # -- special tokens and sizes -------------------------------------------------------------

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._backend.id_to_token(self.eos_token_id)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer`` (for batch encoding and offsets)."""
        return self._backend


def _decodes_bytewise(backend: _Backend) -> bool:
    """A decoder that is ByteLevel alone (no Sequence with replacements, strips or byte fallback after it)."""
    if backend.decoder is None:
        return False
    return json.loads(backend.decoder.__getstate__()).get("type") == "ByteLevel"


def _uses_byte_level(backend: _Backend) -> bool:
    if backend.decoder is None:
        return False
    decoder = json.loads(backend.decoder.__getstate__())
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)


def _load_cache(cache: Path, key: dict[str, Any]) -> Tokenizer | None:
    try:
        entry = json.loads(cache.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable tokenizer cache %s (%s); rebuilding it", cache, e)
        return None
    if entry.get("key") != key:
        return None  # the GGUF changed (or moved): rebuild
    try:
        return Tokenizer(_Backend.from_str(entry["tokenizer"]), **entry["config"])
    except Exception as e:  # noqa: BLE001 - a bad cache entry must never stop a start
        log.warning("ignoring corrupt tokenizer cache %s (%s); rebuilding it", cache, e)
        return None
