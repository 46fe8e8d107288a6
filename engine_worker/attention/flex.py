"""Decode attention on CUDA with FlexAttention over the whole paged pool.

Each decode query attends to the pool directly: a block mask says which pool slots each row may
read (the blocks of its table, and in its last block only the filled positions), so no per-step
copy of the cache is made. Key order does not matter to attention (keys carry their rotary
position already), so the mask needs no logical-to-physical reordering. The mask reads the pool
in physical order and knows no positions, so windowed models never take this path.

Used on CUDA when the Triton kernel is not; any trouble building a mask falls back to the gather
path for good. The CPU never selects it (tests run the same mask eagerly on the CPU to check it).
"""

from __future__ import annotations

import logging

import torch

from engine_worker.attention.gather import GatherBackend, GatherPlan
from engine_worker.attention.layout import SeqLayout, StepLayout
from engine_worker.kv_cache import PagedKVCache

__all__ = ["FlexBackend", "flex_decode", "flex_decode_mask"]

log = logging.getLogger(__name__)

_FLEX: tuple | None = None


def _flex_available() -> bool:
    global _FLEX
    if _FLEX is None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            _FLEX = (torch.compile(flex_attention, dynamic=True), create_block_mask)
        except Exception:  # pragma: no cover - depends on the torch build
            _FLEX = ()
    return bool(_FLEX)


def flex_decode_mask(num_blocks: int, block_size: int, seqs: list[SeqLayout], lens: list[int], device: torch.device):
    """The FlexAttention block mask for one step's decode rows over the whole pool."""
    from torch.nn.attention.flex_attention import create_block_mask

    b = len(seqs)
    allowed = torch.zeros((b, num_blocks), dtype=torch.bool)
    last_block = torch.empty(b, dtype=torch.long)
    last_fill = torch.empty(b, dtype=torch.long)
    for row, (s, ln) in enumerate(zip(seqs, lens)):
        used = -(-ln // block_size)
        allowed[row, torch.tensor(s.block_table[:used])] = True
        last_block[row] = s.block_table[used - 1]
        last_fill[row] = ln - (used - 1) * block_size
    allowed, last_block, last_fill = allowed.to(device), last_block.to(device), last_fill.to(device)

    def mask_mod(bi, h, q_idx, kv_idx):
        blk = kv_idx // block_size
        return allowed[bi, blk] & ((blk != last_block[bi]) | (kv_idx % block_size < last_fill[bi]))

    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=1, KV_LEN=num_blocks * block_size, device=device)


def flex_decode(ck: torch.Tensor, cv: torch.Tensor, q: torch.Tensor, block_mask, attention=None) -> torch.Tensor:
    """Decode attention of ``q`` ([B, H, D]) over the pool ``ck``/``cv`` ([KV, S, D])."""
    if attention is None:
        attention = _FLEX[0]  # type: ignore[index]
    b, n_heads, head_dim = q.shape
    o = attention(q[:, :, None, :], ck.unsqueeze(0).expand(b, -1, -1, -1), cv.unsqueeze(0).expand(b, -1, -1, -1),
                  block_mask=block_mask, enable_gqa=True)
    return o.reshape(b, n_heads * head_dim)


class FlexBackend(GatherBackend):
    name = "flex"

    def __init__(self, cache: PagedKVCache, num_heads: int | None = None, window: int | None = None):
        super().__init__(cache, num_heads, window)
        self.enabled = True  # False after a mask failed to build: the gather path from then on

    @classmethod
    def unavailable(cls, cache: PagedKVCache, num_heads: int, window: int | None) -> str | None:
        if cache.device.type != "cuda":
            return "not a CUDA device"
        if window is not None:
            return "its mask knows no positions (sliding window)"
        if not _flex_available():
            return "FlexAttention does not import"
        return None

    @property
    def description(self) -> str:  # type: ignore[override]
        """What decode runs on now: after a mask failure, the gather path."""
        return "FlexAttention over the paged pool" if self.enabled else GatherBackend.description

    def _plan_decode(self, seqs: list[SeqLayout]) -> dict:  # pragma: no cover - CUDA
        if self.enabled:
            try:
                c = self.cache
                return dict(decode=flex_decode_mask(c.num_blocks, c.block_size, seqs,
                                                    [s.start_pos + 1 for s in seqs], c.device))
            except Exception as e:  # any trouble: the gather path is always there
                log.warning("FlexAttention block mask failed (%s): decode attention gathers keys from now on", e)
                self.enabled = False
        return super()._plan_decode(seqs)

    def _decode(self, layer: int, q: torch.Tensor, layout: StepLayout) -> torch.Tensor:  # pragma: no cover - CUDA
        if isinstance(layout.decode, GatherPlan):
            return super()._decode(layer, q, layout)
        _, ck, cv = self.cache.layer_views[layer]
        return flex_decode(ck, cv, q, layout.decode)
