"""Paged KV bookkeeping: fixed-size blocks, a free list, and automatic prefix caching.

The KV cache is a pool of ``num_blocks`` blocks of ``block_size`` token positions each; a request
holds an ordered *block table* (block ids) that covers its tokens. This module only counts and
hashes; the tensors live in ``kv_cache.PagedKVCache``.

Prefix caching: once a block is full, its content is identified by a hash chained with the
hash of the block before it, ``h_i = block_hash(h_{i-1}, tokens_i)`` (``protocol.kv_events``: stable across
processes, so a gateway computes the same), so one hash names a whole prefix. The first block's parent is the
chain's *root*: the model's (``chain_root(model)``), an adapter's own for a LoRA request
(``chain_root(model, adapter)``; forgotten when the adapter is unloaded: ``forget_adapter``), since the same
tokens computed through other weights are other keys and values.
With an ``events`` list, every block registered, evicted or forgotten is told there as a KV event
(``protocol.kv_events``), which the engine publishes after each step. A prompt's blocks are told stored when its
request arrives (``announce``), not a step or a queue later when they are computed: a router then sends the same
prefix here from the start (the engine computes it once and shares it), and every gateway knows before the next
request of that prefix comes; a request that ends before computing them takes them back (``retract``: BlockRemoved).
Blocks a request finds cached are told stored again (a touch), so a router knows which ones this engine used last.
Full blocks stay registered under their hash after their request ends; a later request whose prompt starts with
the same tokens takes those blocks (reference-counted, shared, never written again) and skips their prefill. Free
blocks wait in one LRU queue; a cached block is evicted (its hash forgotten) only when the queue reaches it and a
block is needed. Hash keys hold the full ``(parent, tokens)`` tuple, so two different prefixes
never share a block even if their 64-bit hashes collide.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    adapter_id,
    block_hash,
    prefix_hashes,
)


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``."""
    return prefix_hashes(token_ids, block_size, parent)


class BlockManager:
    """Allocates blocks to requests and keeps full blocks findable by content."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: list[KvEvent] | None = None, medium: str | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        # Unreferenced blocks, least recently used first; cached ones among them keep their hash.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._key_of: dict[int, tuple] = {}  # block -> (parent hash, tokens) it is registered under
        self._block_of: dict[tuple, int] = {}  # (parent hash, tokens) -> block
        self._hash_of: dict[int, int] = {}  # block -> its chained hash (what a BlockRemoved names)
        self._lora_of: dict[int, str] = {}  # block -> the adapter that computed it (registered blocks only)
        self._by_hash: dict[int, int] = {}  # chained hash -> the block registered under it
        self._announced: Counter[int] = Counter()  # hashes told stored before computed -> requests telling them
        self.events = events  # where KV events go (None: nobody listens)
        self.medium = medium  # vLLM's name of where these blocks live ("GPU"; None: the engine's own memory)
        # Stats: prompt tokens looked up / found in the cache since start.
        self.queries = 0
        self.hits = 0

    # -- capacity ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ------------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], max_tokens: int, root: int | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of ``token_ids`` (at most ``max_tokens``
        tokens, whole blocks only) in the chain that starts at ``root``. Does not take references;
        ``allocate`` does."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        parent = root
        bs = self.block_size
        for i in range(max_tokens // bs):
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
            parent = self._hash_of[block]
        return found

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit

    # -- allocation --------------------------------------------------------------------------

    def can_allocate(self, num_new_blocks: int, shared: Sequence[int] = ()) -> bool:
        # Shared blocks that sit in the free queue stop being free once referenced.
        reclaimed = sum(1 for b in shared if self.ref_count[b] == 0)
        return num_new_blocks + reclaimed <= len(self._free)

    def take(self, shared: Sequence[int]) -> None:
        """Reference cached blocks found by ``lookup``."""
        for b in shared:
            if self.ref_count[b] == 0:
                del self._free[b]
            self.ref_count[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (evicting least recently used cached blocks); caller checks room."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            if b in self._key_of:
                self._unregister(b)
            self.ref_count[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. The table's tail goes first into the queue, so a
        request's last blocks are evicted before its first ones (prefixes are the useful part)."""
        for b in reversed(blocks):
            if self.ref_count[b] <= 0:
                raise ValueError(f"KV block {b} is not allocated")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if b in self._key_of:
                    self._free[b] = None  # cached: keep for reuse, evict in LRU order
                else:
                    # Holds nothing reusable: put it first in line, before cached blocks.
                    self._free[b] = None
                    self._free.move_to_end(b, last=False)

    def _unregister(self, b: int) -> None:
        del self._block_of[self._key_of.pop(b)]
        self._lora_of.pop(b, None)
        h = self._hash_of.pop(b)
        del self._by_hash[h]
        self._announced.pop(h, None)  # told removed now: a request computing it again tells it again
        if self.events is not None:
            self.events.append(BlockRemoved((h,), self.medium))

    def forget_adapter(self, name: str) -> None:
        """Forget the blocks adapter ``name`` computed (it was unloaded): no later request finds them."""
        for b in [b for b, n in self._lora_of.items() if n == name]:
            self._unregister(b)

    def reset(self) -> None:
        """Forget every cached prefix (``POST /reset_prefix_cache``, new weights, sleep): no later request finds
        one. Blocks requests hold now keep their contents but are no one's prefix any more."""
        self._key_of.clear()
        self._block_of.clear()
        self._hash_of.clear()
        self._lora_of.clear()
        self._by_hash.clear()
        self._announced.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def register(self, block: int, parent: int | None, tokens: tuple[int, ...], lora: str | None = None,
                 h: int | None = None) -> int:
        """Make a just-filled block findable; return its chained hash (``h`` when the caller knows it already).
        When another block already holds this content the first one stays registered (no duplicates)."""
        key = (parent, tokens)
        if h is None:
            h = block_hash(parent, tokens)
        if self.enable_prefix_caching and key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key
            self._hash_of[block] = h
            self._by_hash[h] = block
            if lora is not None:
                self._lora_of[block] = lora
            if self.events is not None and h not in self._announced:
                self.events.append(BlockStored((h,), parent, tokens, self.block_size, adapter_id(lora), self.medium))
        return h

    def announce(self, hashes: Sequence[int], token_ids: Sequence[int], root: int | None,
                 lora: str | None = None) -> list[int]:
        """Tell the full blocks of a prompt that just arrived (``hashes``, chained from ``root``) stored: the ones it
        will compute before they are, the ones cached already again (a touch: a router that keeps its engines'
        blocks in the order they were last used sees what this engine would evict first). Return the hashes this
        request tells that no block holds yet (``retract`` takes them back)."""
        if self.events is None or not self.enable_prefix_caching or not hashes:
            return []
        told = [h for h in hashes if h not in self._by_hash]
        for h in told:
            self._announced[h] += 1
        bs = self.block_size
        self.events.append(BlockStored(tuple(hashes), root, tuple(token_ids[:len(hashes) * bs]), bs,
                                       adapter_id(lora), self.medium))
        return told

    def retract(self, told: Sequence[int]) -> None:
        """A request that told ``told`` (``announce``) ended: those no request tells any more and none computed
        are told removed."""
        gone = []
        for h in told:
            n = self._announced.get(h, 0)
            if n > 1:
                self._announced[h] = n - 1
            elif n == 1:
                del self._announced[h]
                if h not in self._by_hash:
                    gone.append(h)
        if gone and self.events is not None:
            self.events.append(BlockRemoved(tuple(gone), self.medium))
