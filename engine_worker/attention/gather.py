"""Decode attention in plain torch: keys gathered through the block tables (or a view).

The keys and values of every decoding sequence are gathered through the block tables, whole
blocks at a time, in ``(kv head, sequence)`` order, and attended with SDPA (small batches) or
two batched matmuls with an fp32 softmax (larger ones, faster on CPUs). A lone decoder whose
blocks are consecutive in the pool reads a view instead, no copy. The path that always works:
the fallback on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_worker.attention.base import AttentionBackend
from engine_worker.attention.layout import SeqLayout, StepLayout, padded_tables
from engine_worker.kv_cache import PagedKVCache

__all__ = ["GatherBackend", "GatherPlan", "SDPA_MAX_DECODE_BATCH"]

# Decode batches up to this size use SDPA; larger ones two batched matmuls (faster on CPUs).
SDPA_MAX_DECODE_BATCH = 8


@dataclass(frozen=True)
class GatherPlan:
    """How the decode rows of one step read the pool (``StepLayout.decode``)."""

    width: int  # keys read per decode row
    view: tuple[int, int] | None  # (first slot, length): a lone decoder on consecutive blocks
    gather: torch.Tensor | None  # [2 * KV * B * blocks] rows of the (k|v, head, block) view
    mask: torch.Tensor | None  # [1, B, 1, width] bool, True = attend (False: padding, window)


class GatherBackend(AttentionBackend):
    name = "gather"
    description = "torch (gathered keys)"

    def __init__(self, cache: PagedKVCache, num_heads: int | None = None, window: int | None = None):
        super().__init__(cache, num_heads, window)
        self.sdpa_max_decode_batch = SDPA_MAX_DECODE_BATCH

    def _plan_decode(self, seqs: list[SeqLayout]) -> dict:
        return dict(decode=self.gather_plan(seqs))

    def gather_plan(self, seqs: list[SeqLayout]) -> GatherPlan:
        bs, window, dev = self.cache.block_size, self.window, self.cache.device
        lens = [s.start_pos + 1 for s in seqs]
        width = max(lens)
        table0 = seqs[0].block_table
        nb = -(-width // bs)
        if len(seqs) == 1 and all(table0[j] == table0[0] + j for j in range(nb)):
            skip = max(0, width - window) if window is not None else 0
            return GatherPlan(width - skip, (table0[0] * bs + skip, width - skip), None, None)
        # Whole blocks of every row (tables padded with block 0), for keys and values of every KV
        # head at once: one gather of block-sized rows per layer. Positions past a row's length
        # are masked out.
        bt = padded_tables(seqs, nb, torch.long).view(-1)
        planes = torch.arange(2 * self.cache.num_kv_heads)[:, None] * self.cache.num_blocks
        gather = (planes + bt[None, :]).view(-1).to(dev)
        width = nb * bs
        mask = None
        windowed = window is not None and max(lens) > window
        if windowed or any(ln != width for ln in lens):
            lt = torch.tensor(lens, device=dev)[:, None]
            k_pos = torch.arange(width, device=dev)[None, :]
            mask = k_pos < lt
            if windowed:
                mask &= k_pos >= lt - window
            mask = mask[None, :, None, :]
        return GatherPlan(width, None, gather, mask)

    def _decode(self, layer: int, q: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        plan = layout.decode
        assert isinstance(plan, GatherPlan)
        kv_layer, ck, cv = self.cache.layer_views[layer]
        b, n_heads, head_dim = q.shape
        n_kv = self.cache.num_kv_heads
        # One query per sequence: fold the query heads of each KV group into the "query length"
        # axis, so grouped-query attention needs no repeat_interleave. The batch axes are
        # (kv head, sequence) because that is the order the gathered keys come out in, so the
        # matmuls read them without a copy.
        qg = q.view(b, n_kv, n_heads // n_kv, head_dim).transpose(0, 1)  # [KV, B, G, D]
        if plan.view is not None:
            s0, ln = plan.view
            kd = ck[:, s0 : s0 + ln].unsqueeze(1)  # [KV, 1, L, D], a view
            vd = cv[:, s0 : s0 + ln].unsqueeze(1)
        else:
            kv_blocks = kv_layer.view(-1, self.cache.block_size * head_dim)  # [(2 * KV * blocks), bs * D]
            both = kv_blocks.index_select(0, plan.gather).view(2, n_kv, b, plan.width, head_dim)
            kd, vd = both[0], both[1]
        if b <= self.sdpa_max_decode_batch:
            o = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=plan.mask)
        else:
            # Plain matmuls for larger batches: with one query row per head group, CPU SDPA
            # spends more on setup than on math (measured 2x slower in bf16 at 32 x 200 keys).
            # Scores and softmax in fp32 whatever the cache dtype, as attention kernels do.
            scores = torch.matmul(qg, kd.transpose(-1, -2)).float().mul_(head_dim ** -0.5)  # [KV, B, G, L]
            if plan.mask is not None:
                scores.masked_fill_(~plan.mask, float("-inf"))
            o = torch.matmul(scores.softmax(dim=-1).to(vd.dtype), vd)  # [KV, B, G, D]
        return o.transpose(0, 1).reshape(b, n_heads * head_dim)
