"""Building blocks shared by the model families: RMSNorm, rotary embeddings, and a linear layer
that runs on oneDNN-prepacked weights on CPUs.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker import cpu_kernels
from engine_worker.models.quant_linear import QuantWeight


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``; ``add_forward`` fuses the residual add before it.

    With ``native`` set (CPU, ``cpu_kernels`` built) both run as one native pass each.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.shape = (size,)
        self.native = False

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; the native path updates ``residual`` in place."""
        if self.native:
            return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return self.forward(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return cpu_kernels.add_rms_norm(x, None, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # Low precision: normalise in fp32 as the reference implementation does, scale after.
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE, computed once for every position.

    The angles are computed in fp32 exactly as transformers does (inv_freq from an int64 arange,
    then position * inv_freq). The sin table is stored with its first half negated, so that
    ``rotate_half(x) * sin`` becomes ``roll(x, D/2) * signed_sin``: one kernel instead of
    slice/neg/cat, with bit-identical products.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, device: torch.device,
                 llama3: tuple[float, float, float, int] | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if llama3 is not None:
            inv_freq = _llama3_inv_freq(inv_freq, *llama3)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", torch.cat((freqs, freqs), dim=-1).cos().to(device), persistent=False)
        self.register_buffer("signed_sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(device), persistent=False)
        self._float: tuple[torch.Tensor, torch.Tensor] | None = None

    def float_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` as float32 ``[positions, D]`` for the native kernel (which rounds
        them to the model's dtype itself); made once, since ``model.to(dtype)`` converts buffers."""
        if self._float is None or self._float[0].device != self.cos.device:
            self._float = (self.cos.float().contiguous(), self.signed_sin.float().contiguous())
        return self._float

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [N, 1, D]: broadcasts over the heads of q and k.
        return self.cos[positions].to(dtype)[:, None, :], self.signed_sin[positions].to(dtype)[:, None, :]


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    """Llama 3.1's frequency-dependent RoPE scaling (as transformers' ``_compute_llama3_parameters``)."""
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``[N, heads, D]`` (the layout after undoing llama.cpp's permutation):
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``."""
    return x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin).addcmul_(x, cos)


def copy_checkpoint(weights, targets: dict[str, tuple[torch.Tensor, int, tuple[int, ...]]], what: str) -> None:
    """Copy ``(name, tensor)`` pairs into ``targets`` (name -> destination, first row, expected
    shape), each exactly once: an unknown, repeated, misshapen or missing weight is a ValueError
    naming it (``what`` describes the model in the message)."""
    missing = set(targets)
    with torch.no_grad():
        for name, tensor in weights:
            if name not in targets:
                raise ValueError(f"unexpected weight {name!r} for {what} (config and weights do not match)")
            if name not in missing:
                raise ValueError(f"weight {name!r} given twice")
            dest, row, expected = targets[name]
            if tuple(tensor.shape) != expected:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            dest[row : row + expected[0]].copy_(tensor)
            missing.remove(name)
    if missing:
        raise ValueError(f"{len(missing)} weights missing, e.g. {sorted(missing)[:3]} "
                         "(config and weights do not match)")


def new_weight(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised on purpose: every weight is overwritten by load_weights.
    return nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)


def onednn_packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch can run linears on oneDNN-prepacked CPU weights in ``dtype``.

    The ops are the ones torch's own CPU inference compiler uses for frozen weights; they are not
    a documented API, so this checks them once on a small case and reports False on any error.
    """
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
        x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        return bool(torch.allclose(y.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2))
    except Exception:  # missing op, unsupported CPU: fall back to F.linear
        return False


class StepAdapters(Protocol):
    """What a linear layer needs of one step's LoRA adapters (``engine_worker.lora.LoraStep``): to add their
    low-rank updates to its output ``y`` for input ``x``, each on its own token rows."""

    def add(self, linear: Linear, x: torch.Tensor, y: torch.Tensor) -> None: ...


class Linear(nn.Module):
    """``y = x @ W.T (+ b)``.

    On a CPU the weight can be pre-packed once into oneDNN's blocked layout (``pack``): measured
    2x faster than ``F.linear`` (MKL) at batch 1 and 3-4x at batch 8 on SmolLM2's shapes, because
    it streams the weights at close to memory bandwidth. Packing drops the plain copy unless
    asked to keep it (the tied LM head shares its weight with the embedding lookup).

    A step serving LoRA adapters passes them (``StepAdapters``), which add each adapter's low-rank update on that
    adapter's rows after the base matmul (``engine_worker.lora``); without one, a linear costs one None check more.

    A weight kept quantized (``quant``, a ``QuantWeight``: ``--quantization auto`` on a GGUF file) replaces the
    plain one: the matmul runs on the quantized codes (``QuantWeight.matmul``).
    """

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, device: torch.device,
                 bias: bool = False):
        super().__init__()
        self.weight: nn.Parameter | None = new_weight(out_features, in_features, dtype, device)
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self.packed_weight: torch.Tensor | None = None
        self.quant: QuantWeight | None = None

    def quantize(self, quant: QuantWeight) -> None:
        """Serve from ``quant`` (the same shape) from now on; the plain weight is dropped."""
        self.quant, self.weight = quant, None

    def forward(self, x: torch.Tensor, lora: StepAdapters | None = None) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant.matmul(x)
            if self.bias is not None:
                y += self.bias
        elif self.packed_weight is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        if lora is not None:
            lora.add(self, x, y)
        return y

    def pack(self, keep_plain: bool = False) -> None:
        if self.packed_weight is None and self.quant is None:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            if not keep_plain:
                self.weight = None
