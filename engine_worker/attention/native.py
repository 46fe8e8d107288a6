"""Decode attention on a CPU with the native kernel (``engine_worker.cpu_kernels``).

One pass per row over its blocks, read in place through the block table with an online softmax;
no copy of the cache. Chosen whenever the kernels built for this CPU and support the shapes.
"""

from __future__ import annotations

import torch

from engine_worker import cpu_kernels
from engine_worker.attention.base import PagedKernelBackend
from engine_worker.attention.layout import StepLayout
from engine_worker.kv_cache import PagedKVCache

__all__ = ["NativeBackend"]


class NativeBackend(PagedKernelBackend):
    name = "native"
    description = "native CPU kernels"
    native_kernels = True

    @classmethod
    def unavailable(cls, cache: PagedKVCache, num_heads: int, window: int | None) -> str | None:
        if cache.device.type != "cpu":
            return "not a CPU"
        if not cpu_kernels.supports(cache.device, cache.dtype, num_heads, cache.num_kv_heads, cache.head_dim):
            return ("kernels not built (disabled, or no compiler: see above)" if not cpu_kernels.available()
                    else f"unsupported dtype/shape ({cache.dtype}, {num_heads}/{cache.num_kv_heads} heads "
                         f"of {cache.head_dim})")
        return None

    def _decode(self, layer: int, q: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        return cpu_kernels.decode_attention(q, self.cache.layer_views[layer][0], layout.decode_tables,
                                            layout.decode_lens, self.cache.block_size, q.shape[-1] ** -0.5,
                                            self.window)
