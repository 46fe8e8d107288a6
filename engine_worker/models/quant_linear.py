"""Weights kept quantized: GGUF's codes and per-group scales (``engine_worker.gguf_quant``) laid out once for the
native kernel (``cpu_kernels/qgemm.cpp``), so a linear layer reads 4 or 8 bits a weight instead of 16 or 32.

A ``QuantWeight`` is one (possibly fused) weight matrix ``[N, K]``: Q, K and V, or gate and up, become one matrix as
the dense layers do. Parts of different types (a Q4_K_M file keeps some tensors in Q6_K) share the widest form: 4 bits
when every part is 4-bit with the same group, else a signed byte a code with the smallest group.

On a CPU with the native kernels, ``matmul`` runs the kernel on float32 activations: the products are those of the
dequantized float32 model up to the order of the sums, so greedy text follows it (bf16 activations agree with it on
96% of a text's positions: ``tests/bench/bench_quant_accuracy.py``). On CUDA, a 4-bit matrix is also packed for
torch's int4 kernel (``torch.ops.aten._weight_int4pack_mm``, tinygemm: ``(q - 8) * scale + zero`` per group, which
every 4-bit type here maps onto), checked against the dequantized weight once at load; the tiled codes are then
dropped unless the matrix is also the embedding (its rows are looked up). Otherwise (8-bit types, no compiler) the
weight is dequantized on the fly, one matrix at a time, into the activations' dtype: the memory held stays
quantized.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker import cpu_kernels
from engine_worker.gguf_quant import QuantParts

log = logging.getLogger(__name__)

TILE = 16  # output rows per tile: one AVX-512 vector of float32


class QuantWeight(nn.Module):
    """``W [N, K] = scale * q + min`` by group of ``group`` inputs, tiled for ``qgemm.cpp``:

    - ``codes`` uint8: 4-bit: ``[tiles, K / 2, 16]``, byte ``j`` of pair ``p`` holds rows ``16t + j``'s codes for
      inputs ``2p`` (low nibble) and ``2p + 1`` (high); 8-bit: ``[tiles, K, 16]`` signed bytes;
    - ``scales``, ``mins`` ``[tiles, K / group, 16]``, float16 where that is exact, else float32 (``mins`` None when
      every min is 0).

    Rows past ``N`` in the last tile are zeros. A module whose tensors are plain attributes: ``model.to(dtype)``
    leaves the float32 scales alone, and ``engine_worker.residency`` finds them (sleep, weight replacement).
    """

    def __init__(self, parts: Sequence[QuantParts], device: torch.device, lookups: bool = False):
        """``lookups``: rows of the weight are also read alone (``dequantize(rows=...)``: the embedding)."""
        super().__init__()
        bits = 4 if all(p.bits == 4 for p in parts) and len({p.group for p in parts}) == 1 else 8
        group = min(p.group for p in parts)
        q = torch.cat([p.q for p in parts])
        scale = torch.cat([_regroup(p.scale, p.group, group) for p in parts])
        has_min = any(p.min is not None for p in parts)
        mn = torch.cat([_regroup(p.min if p.min is not None else torch.zeros_like(p.scale), p.group, group)
                        for p in parts]) if has_min else None
        self.n, self.k = q.shape
        self.group, self.bits = group, bits
        self.kinds = sorted({p.kind for p in parts})
        rows = (q, scale, mn)  # in row order, unpadded (CUDA's int4 packing starts from these)
        tiles = -(-self.n // TILE)
        pad = tiles * TILE - self.n
        if pad:
            q = F.pad(q, (0, 0, 0, pad))
            scale = F.pad(scale, (0, 0, 0, pad))
            mn = None if mn is None else F.pad(mn, (0, 0, 0, pad))
        q = q.view(tiles, TILE, self.k).transpose(1, 2)  # [tiles, K, 16]
        if bits == 4:
            q = q.to(torch.uint8)
            codes = q[:, 0::2] | (q[:, 1::2] << 4)
        else:
            codes = q.to(torch.int8).view(torch.uint8)
        self.codes = codes.contiguous().to(device)
        # float16 where that is exact (Q4_0, Q4_1, Q8_0: GGUF's own d and m), as llama.cpp reads them: a fifth fewer
        # bytes for a 4-bit weight; float32 for the K types' products of two scales.
        half = all(torch.equal(t.half().float(), t) for t in (scale, mn) if t is not None)
        store = torch.float16 if half else torch.float32
        self.scales = _tiled(scale, tiles).to(device, store)
        self.mins = None if mn is None else _tiled(mn, tiles).to(device, store)
        # tinygemm's packed weight and its bf16 scales and zeros (plain tensor attributes, as the codes, so that
        # engine_worker.residency moves them when the engine sleeps); None off CUDA or where it does not fit.
        self.int4_packed: torch.Tensor | None = None
        self.int4_scales_zeros: torch.Tensor | None = None
        if device.type == "cuda" and bits == 4:
            self.int4_packed, self.int4_scales_zeros = _cuda_int4pack(self, *rows) or (None, None)
            if self.int4_packed is not None and not lookups:  # (4 bits a weight once, not twice)
                self.codes = torch.empty(0, dtype=torch.uint8, device=device)
                self.scales, self.mins = torch.empty(0, device=device), None

    @property
    def nbytes(self) -> int:
        held = (self.codes, self.scales, self.mins, self.int4_packed, self.int4_scales_zeros)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The dense weight ``[N, K]`` in ``dtype`` (with ``rows``: only those rows, e.g. embedding lookups)."""
        if rows is None:
            rows = torch.arange(self.n, device=self.codes.device)
        tile, lane = rows // TILE, rows % TILE
        c = self.codes[tile, :, lane]  # [R, K / 2] or [R, K]
        if self.bits == 4:
            q = torch.stack([c & 15, c >> 4], dim=-1).flatten(1).float()
        else:
            q = c.view(torch.int8).float()
        groups = self.k // self.group
        w = q.view(-1, groups, self.group) * self.scales[tile, :, lane].float()[..., None]
        if self.mins is not None:
            w += self.mins[tile, :, lane].float()[..., None]
        return w.view(-1, self.k).to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` in ``x``'s dtype."""
        if self.int4_packed is not None:
            y = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), self.int4_packed, self.group,
                                                   self.int4_scales_zeros)
            return y.to(x.dtype)
        if x.is_cpu and cpu_kernels.available():
            return cpu_kernels.qgemm(x, self.codes, self.scales, self.mins, self.n, self.group, self.bits)
        return F.linear(x, self.dequantize(x.dtype))


def _regroup(t: torch.Tensor, group: int, to: int) -> torch.Tensor:
    """Per-group values ``[rows, K / group]`` repeated for a finer group ``to``."""
    return t if group == to else t.repeat_interleave(group // to, dim=1)


def _tiled(t: torch.Tensor, tiles: int) -> torch.Tensor:
    """``[tiles * 16, groups]`` -> ``[tiles, groups, 16]`` float32."""
    return t.float().view(tiles, TILE, -1).transpose(1, 2).contiguous()


def _cuda_int4pack(weight: QuantWeight, q: torch.Tensor, scale: torch.Tensor,
                   mn: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``weight`` packed for tinygemm (``q`` [N, K] codes in the original row order, per-group ``scale``/``mn``), or
    None where the shape or this torch does not allow it or the packed product is not the dequantized one."""
    n, k, group = weight.n, weight.k, weight.group
    inner = next((t for t in (8, 4, 2) if k % (t * 16) == 0), None)
    if inner is None or n % 8 or group not in (32, 64, 128, 256):
        return None
    try:
        device = weight.codes.device
        q, scale = q.to(device), scale.to(device)
        mn = None if mn is None else mn.to(device)
        q = q.to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4) | q[:, 1::2], inner)
        zero = (mn if mn is not None else torch.zeros_like(scale)) + 8 * scale  # (q - 8) * scale + zero
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(device, torch.bfloat16)
        x = torch.randn(4, k, device=device, dtype=torch.bfloat16)
        got = torch.ops.aten._weight_int4pack_mm(x, packed, group, scales_zeros).float()
        want = x.float() @ weight.dequantize().T
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
            raise ValueError(f"the packed product is off by {(got - want).abs().max().item():.3g}")
        return packed, scales_zeros
    except Exception as e:  # an op missing from this build, a shape it refuses: the dequantizing path serves
        log.warning("int4 CUDA kernel not used for a %dx%d weight: %s", n, k, e)
        return None
