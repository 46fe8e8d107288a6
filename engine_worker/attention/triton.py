"""Decode attention on CUDA with a paged Triton kernel: the GPU twin of the native CPU kernel.

One program per (sequence, KV head) reads that row's keys and values in place through its block
table, in chunks of ``BLOCK_N`` keys with an online softmax, for the G query heads that share
the KV head. Shapes are static for a given batch size (block tables padded to a fixed width), so
a decode step built on it can be captured in a CUDA graph (``cuda_graphs.py``), which the
FlexAttention path (a block mask rebuilt on the host every step) cannot.

Triton ships with torch's CUDA builds. The same kernel runs on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the tests check it on machines without a GPU;
on a GPU, ``self_check`` compares it once with ``reference_decode_attention`` before the engine
trusts it (``TritonBackend.unavailable``).
"""

from __future__ import annotations

import functools
import logging

import torch

from engine_worker.attention.base import PagedKernelBackend
from engine_worker.attention.layout import StepLayout
from engine_worker.attention.reference import reference_decode_attention
from engine_worker.kv_cache import PagedKVCache

log = logging.getLogger(__name__)

__all__ = ["TritonBackend", "available", "decode_attention", "self_check"]


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(q_ptr, kv_ptr, tables_ptr, lens_ptr, out_ptr, q_stride, plane, table_stride, scale, window,
                     H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                     DP: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        length = tl.load(lens_ptr + b)
        start = 0
        if window > 0:
            start = tl.maximum(length - window, 0)
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        gd_mask = (g < G)[:, None] & (d < D)[None, :]
        q_rows = q_ptr + b.to(tl.int64) * q_stride + (h * G + g)[:, None] * D + d[None, :]
        q = tl.load(q_rows, mask=gd_mask, other=0.0).to(tl.float32) * scale  # [GP, DP]
        m = tl.full([GP], float("-inf"), tl.float32)
        denom = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        k_plane = kv_ptr + h.to(tl.int64) * plane
        v_plane = kv_ptr + (KV + h).to(tl.int64) * plane
        for n0 in range(start, length, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            live = pos < length
            block = tl.load(tables_ptr + b.to(tl.int64) * table_stride + pos // BS, mask=live, other=0)
            slot = block.to(tl.int64) * BS + pos % BS
            nd_mask = live[:, None] & (d < D)[None, :]
            k = tl.load(k_plane + slot[:, None] * D + d[None, :], mask=nd_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GP, BLOCK_N]
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            v = tl.load(v_plane + slot[:, None] * D + d[None, :], mask=nd_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / denom[:, None]
        out_rows = out_ptr + (b.to(tl.int64) * H + h * G + g)[:, None] * D + d[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=gd_mask)

    return triton, paged_decode


@functools.cache
def available() -> bool:
    """Whether Triton imports (it ships with torch's CUDA builds)."""
    try:
        _kernel()
        return True
    except Exception as e:  # no triton, or one that does not match this torch
        log.info("Triton unavailable (%s)", e)
        return False


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                     block_size: int, scale: float, window: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``cpu_kernels.decode_attention``: ``q`` [B, H, D] (rows may be strided),
    ``kv_layer`` [2, KV, slots, D], ``tables`` [B, width] int32, ``lens`` [B] int32 (>= 1).
    Returns [B, H * D]; ``out`` may be given (a CUDA graph's static buffer)."""
    triton, kernel = _kernel()
    b, h, d = q.shape
    kv_heads, slots = kv_layer.shape[1], kv_layer.shape[2]
    if (q.stride(2) != 1 or q.stride(1) != d or not kv_layer.is_contiguous() or h % kv_heads
            or tables.dtype != torch.int32 or lens.dtype != torch.int32 or not tables.is_contiguous()):
        raise ValueError("decode_attention: unsupported layout")
    if out is None:
        out = torch.empty((b, h * d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    g = h // kv_heads
    dp = triton.next_power_of_2(d)
    gp = max(triton.next_power_of_2(g), 1)
    block_n = 32 if gp * dp <= 512 else 16
    kernel[(b, kv_heads)](q, kv_layer, tables, lens, out, q.stride(0), slots * d, tables.stride(0), scale,
                          window or 0, H=h, KV=kv_heads, G=g, GP=gp, D=d, DP=dp, BS=block_size, BLOCK_N=block_n)
    return out


def self_check(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, window: int | None) -> bool:
    """Run the kernel once on random data against plain torch; False (and a warning) on any
    error or mismatch, so that a GPU/Triton combination nobody tested falls back, not corrupts."""
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        nb, lens_list = 12, [1, 7, 40]
        kv = torch.randn(2, num_kv_heads, nb * block_size, head_dim, generator=gen).to(device=device, dtype=dtype)
        tables = torch.randperm(nb, generator=gen)[: 3 * 4].view(3, 4).to(torch.int32)
        lens = torch.tensor([min(n, 4 * block_size) for n in lens_list], dtype=torch.int32)
        q = torch.randn(3, num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
        got = decode_attention(q, kv, tables.to(device), lens.to(device), block_size, head_dim ** -0.5, window)
        want = reference_decode_attention(q, kv, tables, lens, block_size, window, torch.float32)
        err = (got.float().cpu() - want).abs().max().item()
        tol = 1e-3 if dtype == torch.float32 else 3e-2
        if not err <= tol:
            log.warning("Triton decode attention disagrees with torch (max error %.3g): not used", err)
            return False
        return True
    except Exception as e:
        log.warning("Triton decode attention failed its self-check (%s): not used", e)
        return False



class TritonBackend(PagedKernelBackend):
    name = "triton"
    description = "Triton paged kernel"

    @classmethod
    def unavailable(cls, cache: PagedKVCache, num_heads: int, window: int | None) -> str | None:
        if cache.device.type != "cuda":
            return "not a CUDA device"
        if not available():
            return "Triton does not import"
        if not self_check(cache.device, cache.dtype, num_heads, cache.num_kv_heads, cache.head_dim,
                          cache.block_size, window):
            return "failed its self-check (see above)"
        return None

    def _decode(self, layer: int, q: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        return decode_attention(q, self.cache.layer_views[layer][0], layout.decode_tables, layout.decode_lens,
                                self.cache.block_size, q.shape[-1] ** -0.5, self.window)
