"""The Llama architecture in plain torch (SmolLM2 is one): RMSNorm, RoPE, GQA attention, SwiGLU.

The model works on one *flattened* batch per step: all tokens of all sequences (prefill chunks
and decodes mixed) go through each linear layer together as ``[num_tokens, hidden]``; only
attention looks at sequence boundaries, and that is the KV cache's job (``kv_cache.attend``).

For speed on CPUs the Q/K/V projections are fused into one matrix and gate/up into another: one
large matmul per step instead of three (or two) smaller ones, and fewer Python-level calls.
``load_weights`` takes Hugging Face tensor names, so every weight format (GGUF, safetensors,
random) maps onto the same names and the fusing happens in one place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.kv_cache import SlotKVCache, StepLayout


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture's shape; built from GGUF metadata or a catalog random_config."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "max_position_embeddings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, not {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.shape = (size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def __init__(self, head_dim: int, max_positions: int, theta: float, device: torch.device):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", torch.cat((freqs, freqs), dim=-1).cos().to(device), persistent=False)
        self.register_buffer("signed_sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [N, 1, D]: broadcasts over the heads of q and k.
        return self.cos[positions].to(dtype)[:, None, :], self.signed_sin[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``[N, heads, D]`` (the layout after undoing llama.cpp's permutation):
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``."""
    return x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin).addcmul_(x, cos)


def _weight(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
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


class Linear(nn.Module):
    """``y = x @ W.T`` without bias.

    On a CPU the weight can be pre-packed once into oneDNN's blocked layout (``pack``): measured
    2x faster than ``F.linear`` (MKL) at batch 1 and 3-4x at batch 8 on SmolLM2's shapes, because
    it streams the weights at close to memory bandwidth. Packing drops the plain copy unless
    asked to keep it (the tied LM head shares its weight with the embedding lookup).
    """

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight: nn.Parameter | None = _weight(out_features, in_features, dtype, device)
        self.packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")
        return F.linear(x, self.weight)

    def pack(self, keep_plain: bool = False) -> None:
        if self.packed_weight is None:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            if not keep_plain:
                self.weight = None


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(q_size + 2 * kv_size, cfg.hidden_size, dtype, device)  # rows: q | k | v
        self.o_proj = Linear(cfg.hidden_size, q_size, dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, kv: SlotKVCache, layout: StepLayout
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_heads = self.n_heads + self.n_kv
        # Rotate q and k together: one set of elementwise kernels instead of two.
        qk = apply_rope(qkv[:, : qk_heads * self.head_dim].view(n, qk_heads, self.head_dim), cos, signed_sin)
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        v = qkv[:, qk_heads * self.head_dim :].view(n, self.n_kv, self.head_dim)
        return self.o_proj(kv.attend(self.layer, q, k, v, layout))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(2 * cfg.intermediate_size, cfg.hidden_size, dtype, device)  # rows: gate | up
        self.down_proj = Linear(cfg.hidden_size, cfg.intermediate_size, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up[:, : self.inter], gate_up[:, self.inter :]
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, layer, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(cfg, dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, kv: SlotKVCache, layout: StepLayout
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, signed_sin, kv, layout)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The whole model. ``forward`` returns hidden states; ``compute_logits`` only for chosen rows."""

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.embed_weight = _weight(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = Linear(cfg.vocab_size, cfg.hidden_size, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_weight
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, device)
        self.packed = False

    def forward(self, input_ids: torch.Tensor, layout: StepLayout, kv: SlotKVCache) -> torch.Tensor:
        """Hidden states ``[N, hidden]`` (before the final norm) for the step's flat token batch."""
        x = F.embedding(input_ids, self.embed_weight)
        cos, signed_sin = self.rope(layout.positions, self.dtype)
        for layer in self.layers:
            x = layer(x, cos, signed_sin, kv, layout)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for the rows that are sampled (only those pay for the large LM head)."""
        return self.lm_head(self.norm(hidden))

    def pack_for_cpu(self) -> bool:
        """Pre-pack every linear weight for oneDNN (see ``Linear``); True when packed.

        A one-way step for serving: afterwards the plain weights are gone (except the
        embedding) and ``load_weights`` refuses. Calling it again is a no-op.
        """
        if self.packed:
            return True
        if self.embed_weight.device.type != "cpu" or not onednn_packing_available(self.dtype):
            return False
        for layer in self.layers:
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin.pack()
        self.lm_head.pack(keep_plain=self.config.tie_word_embeddings)
        self.packed = True
        return True

    # -- weights -------------------------------------------------------------------------------

    def _targets(self) -> dict[str, tuple[torch.Tensor, int]]:
        """HF tensor name -> (destination parameter, first row inside it)."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        t: dict[str, tuple[torch.Tensor, int]] = {
            "model.embed_tokens.weight": (self.embed_weight, 0),
            "model.norm.weight": (self.norm.weight, 0),
        }
        if not cfg.tie_word_embeddings:
            t["lm_head.weight"] = (self.lm_head.weight, 0)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a, m = layer.self_attn, layer.mlp
            t[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, 0)
            t[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, 0)
            t[p + "self_attn.q_proj.weight"] = (a.qkv_proj.weight, 0)
            t[p + "self_attn.k_proj.weight"] = (a.qkv_proj.weight, q)
            t[p + "self_attn.v_proj.weight"] = (a.qkv_proj.weight, q + kv)
            t[p + "self_attn.o_proj.weight"] = (a.o_proj.weight, 0)
            t[p + "mlp.gate_proj.weight"] = (m.gate_up_proj.weight, 0)
            t[p + "mlp.up_proj.weight"] = (m.gate_up_proj.weight, cfg.intermediate_size)
            t[p + "mlp.down_proj.weight"] = (m.down_proj.weight, 0)
        return t

    def weight_names(self) -> list[str]:
        """Every HF tensor name ``load_weights`` expects, in a fixed order."""
        return list(self._targets())

    def weight_shape(self, name: str) -> tuple[int, ...]:
        """The shape of the HF tensor ``name`` (before fusing)."""
        return self._shape(name, self._targets()[name][0])

    def _shape(self, name: str, dest: torch.Tensor) -> tuple[int, ...]:
        cfg = self.config
        if dest.dim() == 1:
            return tuple(dest.shape)
        rows = {
            "q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim,
            "v_proj": cfg.num_kv_heads * cfg.head_dim, "gate_proj": cfg.intermediate_size,
            "up_proj": cfg.intermediate_size,
        }.get(name.split(".")[-2], dest.shape[0])
        return (rows, dest.shape[1])

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (any dtype/device); fails unless every weight arrives once."""
        if self.packed:
            raise RuntimeError("weights were packed for serving; load into a fresh model")
        targets = self._targets()
        missing = set(targets)
        for name, tensor in weights:
            if name not in targets:
                raise ValueError(f"unexpected weight {name!r} for a {self.config.num_layers}-layer Llama")
            if name not in missing:
                raise ValueError(f"weight {name!r} given twice")
            dest, row = targets[name]
            expected = self._shape(name, dest)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            dest[row : row + expected[0]].copy_(tensor)
            missing.remove(name)
        if missing:
            raise ValueError(f"{len(missing)} weights missing, e.g. {sorted(missing)[:3]}")
