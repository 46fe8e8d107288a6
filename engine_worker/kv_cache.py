"""The paged KV cache: the pool tensors every attention backend reads and writes.

Storage per layer is ``[num_kv_heads, num_blocks * block_size, head_dim]`` for keys and the same
for values: a token at position ``p`` of a request lives in slot ``table[p // bs] * bs + p % bs``.
``BlockManager`` decides which blocks a request holds; how a step's queries read the pool is
``engine_worker.attention``'s job. This module only owns the tensors.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["PagedKVCache"]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A zero-filled pool, and on a CPU the mapping it lives in (sleep hands its pages back: ``residency``).
    On a CPU it is anonymous mmap'd memory, which the kernel hands out as zero pages on first touch: a pool of
    several GiB costs nothing until requests fill it, so an engine is ready seconds sooner (``torch.zeros`` writes
    every page up front) and an idle one holds only what it used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device), None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape), buf


class PagedKVCache:
    """K/V pools ``[num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim]``."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        # Keys and values of a layer side by side, so one gather fetches both.
        # Zeros, not empty: padded (masked) key rows are still multiplied by a zero weight in
        # attention, and a NaN bit pattern left in uninitialised memory would poison the row.
        self.kv, self.buffer = _zeros((num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim), dtype, device)
        self.k = self.kv[:, 0]  # views: [num_layers, num_kv_heads, slots, head_dim]
        self.v = self.kv[:, 1]
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        # Per layer (kv [2, KV, slots, D], k, v), made once: a step would otherwise pay three
        # tensor views per layer just to find its slice of the pool.
        self.layer_views = [(self.kv[i], self.k[i], self.v[i]) for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``k``/``v`` ([N, kv_heads, D]) of layer ``layer`` in the slots ``slot_mapping`` ([N])."""
        _, ck, cv = self.layer_views[layer]
        ck.index_copy_(1, slot_mapping, k.transpose(0, 1))
        cv.index_copy_(1, slot_mapping, v.transpose(0, 1))
