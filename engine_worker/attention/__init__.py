"""Attention over the paged KV cache (``engine_worker.kv_cache``): one interface, several backends.

``select_backend(cache, num_heads, window)`` picks one backend at start-up (and logs which and
why); the runner and the model then only use the ``AttentionBackend`` interface:
``plan(seqs) -> StepLayout`` once per step, ``write_kv`` and ``attend`` per layer.

Backends differ in how decode rows (one new token per sequence) read the pool:

- ``native``: the C++ CPU kernel (``cpu_kernels``) reads the blocks in place through int32 block
  tables; the model's other native kernels run alongside;
- ``triton``: the CUDA twin of that kernel, once it passed its self-check; static shapes, so a
  decode step can be a CUDA graph;
- ``flex``: FlexAttention over the pool on CUDA with a per-step block mask (no sliding window);
- ``gather``: keys gathered through the block tables (SDPA for small batches, two batched
  matmuls with an fp32 softmax for larger ones; a lone decoder on consecutive blocks reads a
  view): plain torch, the fallback everywhere.

Prefills are the same for all: a prefill that starts at position 0 attends to its own new keys
directly, causally; one that continues a cached prefix (a chunk, or a prefix-cache hit) gathers
that prefix. ``reference.reference_decode_attention`` is the oracle the kernels are checked by.
"""

from __future__ import annotations

from engine_worker.attention.base import AttentionBackend
from engine_worker.attention.layout import PrefillSpan, SeqLayout, StepLayout
from engine_worker.attention.select import BACKENDS, select_backend

__all__ = ["BACKENDS", "AttentionBackend", "PrefillSpan", "SeqLayout", "StepLayout", "select_backend"]
