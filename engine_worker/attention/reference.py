"""The decode-attention oracle: every paged kernel is checked against it (tests, and the Triton
backend's start-up self-check). Plain torch, row by row, straight from the block tables."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["reference_decode_attention"]


def reference_decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, tables: Sequence | torch.Tensor,
                               lens: Sequence | torch.Tensor, block_size: int, window: int | None = None,
                               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Decode attention written out row by row on the CPU in ``dtype``.

    ``q`` [B, H, D]; ``kv_layer`` [2, KV, slots, D]; ``tables``/``lens`` per row (lists or tensors).
    Returns [B, H * D].
    """
    q, kv_layer = q.to("cpu", dtype), kv_layer.to("cpu", dtype)
    n_kv, d = kv_layer.shape[1], q.shape[-1]
    rows = []
    for r in range(q.shape[0]):
        n = int(lens[r])
        first = max(0, n - window) if window else 0
        slots = [int(tables[r][p // block_size]) * block_size + p % block_size for p in range(first, n)]
        k, v = kv_layer[0][:, slots], kv_layer[1][:, slots]  # [KV, L, D]
        heads = q[r].view(n_kv, -1, d)  # [KV, G, D]
        w = (heads @ k.transpose(-1, -2) * d ** -0.5).softmax(-1)
        rows.append((w @ v).reshape(-1))
    return torch.stack(rows)
