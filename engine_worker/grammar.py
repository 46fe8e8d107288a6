"""Structured output in the engine: grammars compiled off the step thread, token masks per step.

A request whose ``sampling.structured`` names a grammar gets a ``GrammarHandle`` when it is queued.
Compilation (llguidance: ``zserve/grammar.py`` says why that engine) runs on a worker thread and
releases the GIL, so the step loop keeps serving other requests meanwhile; the scheduler admits the
request once its handle is ready, or ends it with an error if the spec does not compile.
Compiled grammars are cached by spec (least recently used out), and each request works on its own
copy of the cached matcher, so a popular schema compiles once per engine.

Each step, the sampler asks ``fill_masks`` for the allowed tokens of every constrained row (one
bitmask row per request, computed in parallel by llguidance's executor) and sets the others to
-inf before anything else; after the step the scheduler feeds the chosen token to the matcher
(``GrammarHandle.accept``). A grammar that is complete ends the request ("stop") without waiting
for an end-of-sequence token; one that reaches a dead end ends it with an error, never a crash.

llguidance sees the model's vocabulary plus a placeholder token for each byte no token spells
(``zserve.grammar.every_byte_vocabulary`` says why); masks are cut to the model's vocabulary, so a row
left with no allowed token is a grammar that needs a byte the model cannot write: a dead end, seen
before the step samples (``GrammarHandle.stuck``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zserve.grammar import GrammarError, every_byte_vocabulary, llguidance_grammar

log = logging.getLogger("zserve.engine")

DEFAULT_MAX_CACHED = 256  # compiled grammars kept per engine


class GrammarHandle:
    """One request's grammar: compiling, then a matcher that follows the request's output."""

    def __init__(self, future: Future, mask_size: Callable[[], int]):
        self._future = future
        self._mask_size = mask_size
        self.matcher = None  # an llguidance.LLMatcher once ready
        self.error: str | None = None
        self.stuck = False  # the last mask allowed no token of the model's vocabulary (``fill_masks``)
        self.accepted = 0  # tokens fed so far

    @property
    def mask_size(self) -> int:
        """Tokens in the grammar engine's vocabulary (the model's and the placeholders): a mask row's bits."""
        return self._mask_size()

    @property
    def ready(self) -> bool:
        """Compiled (``matcher`` set) or failed (``error`` set); never blocks."""
        if self.matcher is None and self.error is None and self._future.done():
            try:
                self.matcher = self._future.result()
            except Exception as e:  # noqa: BLE001 - a bad grammar fails its request, not the engine
                self.error = f"structured output: {e}"
        return self.matcher is not None or self.error is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ``ready`` (tests and offline runs)."""
        try:
            self._future.exception(timeout)
        except TimeoutError:
            return False
        return self.ready

    def accept(self, token: int) -> str | None:
        """Feed the sampled token; return ``stop`` when the grammar is complete, ``error`` at a dead end."""
        m = self.matcher
        if self.stuck:
            needs = m.compute_ff_bytes()
            self.error = ("structured output: the model's vocabulary has no token that continues the grammar after "
                          f"{self.accepted} tokens" + (f" (it must write {needs[:64]!r} next)" if needs else ""))
            return "error"
        if not m.consume_token(token) or m.is_error():
            self.error = f"structured output: token {token} does not continue the grammar ({m.get_error()[:1000]})"
            return "error"
        self.accepted += 1
        if m.is_stopped():
            return "stop"
        return None


    def replay(self, tokens: Sequence[int]) -> None:
        """Feed tokens a request generated before it came here (a migration) to a fresh matcher; a token the grammar
        refuses, or one after the grammar completed, sets ``error`` (the request then fails as at a dead end)."""
        m = self.matcher
        for token in tokens:
            if m.is_stopped() or not m.consume_token(token) or m.is_error():
                self.error = (f"structured output: generated token {token} (number {self.accepted + 1}) does not "
                              f"continue the grammar ({m.get_error()[:1000]})")
                return
            self.accepted += 1


class Grammars:
    """Compiles structured-output specs for one engine's vocabulary and hands out matchers."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int],
                 max_cached: int = DEFAULT_MAX_CACHED):
        """``tokenizer_json`` returns the model's ``tokenizers`` JSON; it is called once, on the
        compile thread, the first time a request needs a grammar."""
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._max_cached = max_cached
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer = None
        self.mask_size = vocab_size  # the grammar engine's vocabulary, with the placeholders once it is built
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.compiled = 0  # compilations (cache misses) since start

    def start(self, spec: tuple[str, str]) -> GrammarHandle:
        """A handle for ``spec``: ready at once on a cache hit, else compiling on the worker thread."""
        with self._lock:
            template = self._compiled.get(spec)
            if template is not None:
                self._compiled.move_to_end(spec)
        if template is not None:
            done: Future = Future()
            done.set_result(template.deep_copy())
            return GrammarHandle(done, self._get_mask_size)
        return GrammarHandle(self._pool.submit(self._compile, spec), self._get_mask_size)

    def _get_mask_size(self) -> int:
        return self.mask_size

    def prepare(self) -> Future:
        """Build the grammar engine's view of the vocabulary now, on the compile thread (an engine
        calls this once it is ready, so the first structured request does not wait ~0.5 s for it)."""
        return self._pool.submit(self._llg_tokenizer)

    def _llg_tokenizer(self):
        import llguidance

        if self._tokenizer is None:
            tokenizer_json, size = every_byte_vocabulary(self._tokenizer_json(), self.vocab_size)
            self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=size, eos_token=self._eos)
            self.mask_size = size
        return self._tokenizer

    def _compile(self, spec: tuple[str, str]):
        import llguidance

        with self._lock:
            template = self._compiled.get(spec)
        if template is None:
            template = llguidance.LLMatcher(self._llg_tokenizer(), llguidance_grammar(*spec), log_level=0)
            if template.is_error():
                raise GrammarError(template.get_error())
            with self._lock:
                self.compiled += 1
                self._compiled[spec] = template
                while len(self._compiled) > self._max_cached:
                    self._compiled.popitem(last=False)
        return template.deep_copy()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_executor = None  # llguidance.LLExecutor (its threads compute masks of a batch in parallel), made on first use


def fill_masks(handles: Sequence[GrammarHandle], vocab_size: int) -> torch.Tensor:
    """``[len(handles), vocab_size]`` bool: the tokens each request's matcher allows next. A handle whose row
    is empty (the grammar needs a byte only a placeholder spells) is marked ``stuck``."""
    global _executor
    import llguidance

    if _executor is None:
        _executor = llguidance.LLExecutor()
    words = (handles[0].mask_size + 31) // 32
    bits = torch.empty((len(handles), words), dtype=torch.int32)
    _executor.unsafe_compute_mask_ptr([(h.matcher, i) for i, h in enumerate(handles)], bits.data_ptr(), words * 4,
                                      len(handles))
    # Token 32w + i is bit i of word w; in little-endian bytes, bit j of byte k is token 8k + j.
    # Looking each byte up in a 256 x 8 table is ~10x faster than shifting every word 32 times.
    unpacked = torch.nn.functional.embedding(bits.view(torch.uint8).int(), _BYTE_BITS)
    allowed = unpacked.view(len(handles), words * 32)[:, :vocab_size].view(torch.bool)
    for h, some in zip(handles, allowed.any(dim=1).tolist()):
        h.stuck = not some
    return allowed


_mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")


def start_masks(handles: Sequence[GrammarHandle], vocab_size: int) -> Future:
    """``fill_masks`` on a worker thread: the runner starts it before the forward pass, which it
    overlaps (llguidance and torch both release the GIL), and the sampler takes the result."""
    return _mask_thread.submit(fill_masks, list(handles), vocab_size)


_BYTE_BITS = torch.tensor([[(b >> j) & 1 for j in range(8)] for b in range(256)], dtype=torch.uint8)


def tokenizer_json_loader(tokenizer_path: str) -> Callable[[], str]:
    """Read the model's tokenizer (the files the catalog names, as the gateway does) as JSON text."""

    def load() -> str:
        from zserve.paths import user_cache_dir
        from zserve.tokenizer import Tokenizer

        if tokenizer_path.endswith(".gguf"):
            tok = Tokenizer.from_gguf(tokenizer_path, cache_dir=user_cache_dir())
        else:
            tok = Tokenizer.from_dir(tokenizer_path)
        return tok.backend.to_str()

    return load
