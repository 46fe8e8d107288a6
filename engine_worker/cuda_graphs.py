"""CUDA graphs for decode steps: one captured forward pass per padded batch size.

A decode step of a small model on a GPU is mostly kernel-launch overhead (hundreds of small
kernels, each launched from Python). Captured once, the whole forward pass replays as one graph.
Graphs need fixed shapes and fixed addresses, so every input lives in a static buffer sized for
the largest batch: token ids, positions, cache slots, block tables (padded to the longest
possible context) and lengths. A step of B sequences uses the graph of the smallest captured
size >= B; the padding rows point at a scratch KV block that the block manager never hands out,
so their writes touch nothing real. Only decode-only steps replay; prefills run eagerly.

Attention inside the graph is a paged backend's kernel (``AttentionBackend.paged``: Triton on
CUDA, ``attention/triton.py``), whose launch shapes depend only on the batch size. ``DecodeGraphs``
is built by the runner when its backend is paged and ``--enforce-eager`` is off; after capturing,
it replays one step against the eager forward pass and disables itself on any difference, so an
untested GPU/driver/torch combination falls back to eager instead of serving wrong tokens.

On a CPU the same object runs in *emulation*: nothing is captured and ``run`` calls the forward
pass on the static buffers. Tests use that to check the padding, the scratch block and the
buffer handling; only the capture itself needs a GPU.
"""

from __future__ import annotations

import logging

import torch

from engine_worker.attention import AttentionBackend, StepLayout

log = logging.getLogger(__name__)

__all__ = ["DecodeGraphs", "capture_sizes"]


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to ``max_batch`` (vLLM's spacing)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """Static buffers and one graph (or, on a CPU, one emulated replay) per batch size."""

    def __init__(self, model, attention: AttentionBackend, max_batch: int, max_blocks_per_seq: int,
                 scratch_block: int):
        self.model = model
        self.attention = attention
        kv = attention.cache
        self.device = kv.device
        self.sizes = capture_sizes(max_batch)
        self.block_size = kv.block_size
        self.scratch_block = scratch_block
        n, dev = max(self.sizes), kv.device
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), scratch_block * kv.block_size, dtype=torch.long, device=dev)
        self.tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=dev)
        self.lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.emulated = self.device.type != "cuda"

    @property
    def max_batch(self) -> int:
        return max(self.sizes)

    def _layout(self, bs: int) -> StepLayout:
        rows = list(range(bs))
        return StepLayout(order=rows, first_token_index=rows, last_token_index=rows, positions=self.positions[:bs],
                          slot_mapping=self.slots[:bs], num_decode=bs, prefills=[], decode_tables=self.tables[:bs],
                          decode_lens=self.lens[:bs])

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.ids[:bs], self._layout(bs), self.attention)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size (largest first, sharing one memory pool). No-op when emulated."""
        if self.emulated:
            return
        pool = None
        for bs in sorted(self.sizes, reverse=True):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile Triton kernels, settle the allocator
                    self._forward(bs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return 0 < num_seqs <= self.max_batch and max_blocks <= self.tables.shape[1]

    @torch.inference_mode()
    def run(self, ids: list[int], positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
            lens: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[B, hidden]`` of a decode-only step: ``ids`` one token per sequence,
        the rest as ``StepLayout`` holds them (``tables`` [B, width] int32, ``lens`` [B] int32)."""
        b, width = tables.shape
        bs = next(s for s in self.sizes if s >= b)
        self.ids[:b].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slots[:b].copy_(slots, non_blocking=True)
        self.tables[:b, :width].copy_(tables, non_blocking=True)
        self.lens[:b].copy_(lens, non_blocking=True)
        # Padding rows: one key each, in the scratch block.
        self.ids[b:bs] = 0
        self.positions[b:bs] = 0
        self.slots[b:bs] = self.scratch_block * self.block_size
        self.tables[b:bs] = self.scratch_block
        self.lens[b:bs] = 1
        if self.emulated:
            return self._forward(bs)[:b]
        self.graphs[bs].replay()
        return self.outputs[bs][:b]

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
