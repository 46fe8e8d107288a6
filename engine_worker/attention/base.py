"""The one interface every attention backend implements, and the prefill attention they share.

A backend is bound to one ``PagedKVCache`` and does three things per step:

- ``plan(seqs)``: lay the step's tokens out once (``StepLayout``), shared by every layer;
- ``write_kv(layer, k, v, layout)``: store the step's new keys/values in the pool;
- ``attend(layer, q, k, v, layout)``: attention output of every token of the step.

Backends differ only in how *decode* rows (one new token per sequence) read the pool:
``_plan_decode`` and ``_decode``. Prefill spans always run SDPA here: over their own new keys
when they start at position 0, over their prefix gathered through the block table otherwise.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from engine_worker.attention.layout import SeqLayout, StepLayout, padded_tables, plan_tokens
from engine_worker.kv_cache import PagedKVCache

__all__ = ["AttentionBackend", "PagedKernelBackend"]


class AttentionBackend:
    """Attention over a paged ``PagedKVCache``; subclasses provide the decode path."""

    name: ClassVar[str]  # short id: "native", "triton", "flex", "gather"
    description: ClassVar[str]  # for logs and ``ModelRunner.attention_backend``
    # Decode reads the pool in place through int32 block tables with shapes fixed by the batch
    # size (``StepLayout.decode_tables``/``decode_lens``), so a decode step can be a CUDA graph.
    paged: ClassVar[bool] = False
    # The model may run its native CPU kernels alongside (norms, SwiGLU, and RoPE fused with the
    # K/V store, in which case it writes K/V itself and skips ``write_kv``).
    native_kernels: ClassVar[bool] = False

    def __init__(self, cache: PagedKVCache, num_heads: int | None = None, window: int | None = None):
        if window is not None and window < 1:
            raise ValueError(f"sliding_window must be positive, not {window}")
        self.cache = cache
        self.num_heads = num_heads or cache.num_kv_heads
        # Sliding-window attention (Mistral): a query at position p sees keys p-W+1 .. p.
        self.window = window

    @classmethod
    def unavailable(cls, cache: PagedKVCache, num_heads: int, window: int | None) -> str | None:
        """Why this backend cannot serve ``cache`` (None: it can). May build or self-check a kernel."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description})"

    # -- one step ----------------------------------------------------------------------------

    def plan(self, seqs: list[SeqLayout]) -> StepLayout:
        """Lay out one step's sequences; computed once per step and read by every layer."""
        c = self.cache
        decode, fields = plan_tokens(seqs, c.block_size, c.num_blocks, self.window, c.device)
        if decode:
            fields.update(self._plan_decode([seqs[i] for i in decode]))
        return StepLayout(**fields)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, layout: StepLayout) -> None:
        """Store this step's ``k``/``v`` ([N, kv_heads, D]) in their slots of the pool."""
        self.cache.write(layer, k, v, layout.slot_mapping)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """Attend ``q`` ([N, heads, D]) once this step's ``k``/``v`` ([N, kv_heads, D]) are written.

        Returns ``[N, heads * D]`` in the step's token order.
        """
        n_tokens, n_heads, head_dim = q.shape
        outs: list[torch.Tensor] = []
        if layout.num_decode:
            qd = q if layout.num_decode == n_tokens else q[: layout.num_decode]
            outs.append(self._decode(layer, qd, layout))
        _, ck, cv = self.cache.layer_views[layer]
        for p in layout.prefills:
            qp = q[p.offset : p.offset + p.num_tokens].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if p.gather is None:
                kp = k[p.offset : p.offset + p.num_tokens].transpose(0, 1).unsqueeze(0)  # [1, KV, n, D]
                vp = v[p.offset : p.offset + p.num_tokens].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=p.mask is None, attn_mask=p.mask,
                                                   enable_gqa=True)
            else:
                kp = ck.index_select(1, p.gather).unsqueeze(0)
                vp = cv.index_select(1, p.gather).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, enable_gqa=True)
            outs.append(o[0].transpose(0, 1).reshape(p.num_tokens, n_heads * head_dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # -- what a backend provides -------------------------------------------------------------

    def _plan_decode(self, seqs: list[SeqLayout]) -> dict:
        """``StepLayout`` fields for the step's decode rows (``seqs``, one new token each)."""
        raise NotImplementedError

    def _decode(self, layer: int, q: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """Decode attention of ``q`` ([B, heads, D], one row per decoding sequence) -> [B, heads * D]."""
        raise NotImplementedError


class PagedKernelBackend(AttentionBackend):
    """A backend whose kernel reads the pool in place through int32 block tables (native, Triton)."""

    paged = True

    def _plan_decode(self, seqs: list[SeqLayout]) -> dict:
        lens = [s.start_pos + 1 for s in seqs]
        nb = -(-max(lens) // self.cache.block_size)
        dev = self.cache.device
        return dict(decode_tables=padded_tables(seqs, nb, torch.int32).to(dev),
                    decode_lens=torch.tensor(lens, dtype=torch.int32).to(dev))
