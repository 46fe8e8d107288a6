"""The Llama family in plain torch: RMSNorm, RoPE, GQA attention, SwiGLU or routed SwiGLU experts.

One implementation serves every architecture of the registry (``models/__init__.py``): Llama
(SmolLM2, Llama 2/3), Mistral (the same graph), Qwen2 (biases on the Q/K/V projections) and
Mixtral (each MLP replaced by a top-k routed mixture of experts, ``models/moe.py``); the
differences are fields of ``LlamaConfig``.

The model works on one *flattened* batch per step: all tokens of all sequences (prefill chunks
and decodes mixed) go through each linear layer together as ``[num_tokens, hidden]``; only
attention looks at sequence boundaries, and that is the attention backend's job
(``engine_worker.attention``: ``write_kv`` and ``attend`` over the paged KV cache).

For speed on CPUs the Q/K/V projections are fused into one matrix and gate/up into another: one
large matmul per step instead of three (or two) smaller ones, and fewer Python-level calls.
``load_weights`` takes Hugging Face tensor names, so every weight format (GGUF, safetensors,
random) maps onto the same names and the fusing happens in one place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker import cpu_kernels
from engine_worker.attention import AttentionBackend, StepLayout
from engine_worker.gguf_quant import QuantParts
from engine_worker.models import native_decode
from engine_worker.models.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    StepAdapters,
    apply_rope,
    copy_checkpoint,
    new_weight,
    onednn_packing_available,
)
from engine_worker.models.moe import SparseMoE
from engine_worker.models.quant_linear import QuantWeight


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
    architecture: str = "LlamaForCausalLM"
    attention_bias: bool = False  # Qwen2: biases on q/k/v (not o)
    num_experts: int = 0  # Mixtral: experts per MoE layer (0 = dense MLP)
    num_experts_per_tok: int = 0
    # Llama 3.1 "llama3" RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_positions)
    rope_llama3: tuple[float, float, float, int] | None = None
    sliding_window: int | None = None  # Mistral: each query attends to the last this-many keys

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "max_position_embeddings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, not {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} "
                             f"must be in 1..num_experts={self.num_experts}")


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(q_size + 2 * kv_size, cfg.hidden_size, dtype, device,
                               bias=cfg.attention_bias)  # q | k | v
        self.o_proj = Linear(cfg.hidden_size, q_size, dtype, device)
        self.native = False

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, attn: AttentionBackend,
        layout: StepLayout, rope: RotaryEmbedding, lora: StepAdapters | None = None,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x, lora)
        qk_heads = self.n_heads + self.n_kv
        if self.native:
            # One native pass: rotate q and k in place, store k and v in the paged cache.
            cpu_kernels.rope_and_store(qkv, layout.positions, *rope.float_tables(),
                                       attn.cache.layer_views[self.layer][0], layout.slot_mapping, self.n_heads,
                                       self.n_kv, self.head_dim)
            heads = qkv.view(n, qk_heads + self.n_kv, self.head_dim)
            q, k, v = heads[:, : self.n_heads], heads[:, self.n_heads : qk_heads], heads[:, qk_heads:]
            return self.o_proj(attn.attend(self.layer, q, k, v, layout), lora)
        # Rotate q and k together: one set of elementwise kernels instead of two.
        qk = apply_rope(qkv[:, : qk_heads * self.head_dim].view(n, qk_heads, self.head_dim), cos, signed_sin)
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        v = qkv[:, qk_heads * self.head_dim :].view(n, self.n_kv, self.head_dim)
        attn.write_kv(self.layer, k, v, layout)
        return self.o_proj(attn.attend(self.layer, q, k, v, layout), lora)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(2 * cfg.intermediate_size, cfg.hidden_size, dtype, device)  # rows: gate | up
        self.down_proj = Linear(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        self.native = False

    def forward(self, x: torch.Tensor, lora: StepAdapters | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)
        if self.native:
            return self.down_proj(cpu_kernels.silu_and_mul(gate_up), lora)
        gate, up = gate_up[:, : self.inter], gate_up[:, self.inter :]
        return self.down_proj(F.silu(gate) * up, lora)


    def linears(self) -> tuple[Linear, ...]:
        return (self.gate_up_proj, self.down_proj)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, dtype: torch.dtype, device: torch.device,
                 expert_ids: Sequence[int] | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, layer, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = SparseMoE(cfg, dtype, device, expert_ids) if cfg.num_experts else LlamaMLP(cfg, dtype, device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, signed_sin: torch.Tensor,
        attn: AttentionBackend, layout: StepLayout, rope: RotaryEmbedding, lora: StepAdapters | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream)``: their sum is the layer's output. Keeping them
        apart lets the next layer fuse the add into its first norm (``RMSNorm.add_forward``)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, signed_sin, attn, layout, rope, lora)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h, lora), residual


class LlamaForCausalLM(nn.Module):
    """The whole model. ``forward`` returns hidden states; ``compute_logits`` only for chosen rows.

    ``expert_ids``: the experts of every MoE layer this model holds (expert parallelism; default all).
    """

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device,
                 expert_ids: Sequence[int] | None = None):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        if expert_ids is not None and not cfg.num_experts:
            raise ValueError(f"a {cfg.architecture} has no experts to split")
        self.expert_ids = list(range(cfg.num_experts)) if expert_ids is None else list(expert_ids)
        self.embed_weight = new_weight(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, dtype, device, expert_ids)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = Linear(cfg.vocab_size, cfg.hidden_size, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_weight
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, device, cfg.rope_llama3)
        self.packed = False
        self.native = False
        self.embed_quant: QuantWeight | None = None  # the embedding, kept quantized (``use_quantized``)

    def use_quantized(self, parts: dict[str, QuantParts]) -> set[str]:
        """Serve the linears (and the embedding) that ``parts`` holds, by HF name, from their quantized codes
        (``QuantWeight``); the names used, which ``load_weights`` is then told to skip. A fused linear is quantized
        only when ``parts`` has all of its pieces."""
        if self.packed:
            raise RuntimeError("weights were packed for serving; load into a fresh model")
        device, used = self.embed_weight.device, set()

        def take(linear: Linear, names: list[str]) -> None:
            if all(n in parts for n in names):
                linear.quantize(QuantWeight([parts[n] for n in names], device))
                used.update(names)

        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            take(layer.self_attn.qkv_proj, [p + f"self_attn.{x}_proj.weight" for x in "qkv"])
            take(layer.self_attn.o_proj, [p + "self_attn.o_proj.weight"])
            if isinstance(layer.mlp, LlamaMLP):
                take(layer.mlp.gate_up_proj, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
                take(layer.mlp.down_proj, [p + "mlp.down_proj.weight"])
        embed = parts.get("model.embed_tokens.weight")
        if embed is not None:
            self.embed_quant = QuantWeight([embed], device, lookups=True)
            self.embed_weight = nn.Parameter(torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=device),
                                             requires_grad=False)
            used.add("model.embed_tokens.weight")
            if self.config.tie_word_embeddings:
                self.lm_head.quantize(self.embed_quant)
        if not self.config.tie_word_embeddings:
            take(self.lm_head, ["lm_head.weight"])
        return used

    def quantized_kinds(self) -> list[str]:
        """The GGUF types of the weights kept quantized (none: [])."""
        kinds = {k for m in self.modules() if isinstance(m, Linear) and m.quant is not None for k in m.quant.kinds}
        return sorted(kinds | set(self.embed_quant.kinds if self.embed_quant is not None else ()))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_quant is not None:
            return self.embed_quant.dequantize(self.dtype, input_ids)
        return F.embedding(input_ids, self.embed_weight)

    def use_native_kernels(self, on: bool) -> None:
        """Run norms, RoPE + KV store and the SwiGLU activation as native CPU kernels
        (``engine_worker.cpu_kernels``); the runner turns this on when its attention backend says
        so (``AttentionBackend.native_kernels``)."""
        self.native = on
        for m in self.modules():
            if isinstance(m, (RMSNorm, LlamaAttention, LlamaMLP)):
                m.native = on

    def forward(self, input_ids: torch.Tensor, layout: StepLayout, attn: AttentionBackend,
                lora: StepAdapters | None = None) -> torch.Tensor:
        """Hidden states ``[N, hidden]`` (before the final norm) for the step's flat token batch,
        laid out by ``attn.plan``; ``lora``: the step's LoRA adapters, by token row (``engine_worker.lora``)."""
        x = self.embed(input_ids)
        if self.native and lora is None:  # a decode step: every layer in one native call, where it can
            out = native_decode.run(self, x, layout, attn)
            if out is not None:
                return out
        cos = signed_sin = None
        if not self.native:
            cos, signed_sin = self.rope(layout.positions, self.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, signed_sin, attn, layout, self.rope, lora)
        return x + residual

    def lora_targets(self) -> list[dict[str, Linear]]:
        """Per layer, the linears a LoRA adapter can adapt, by ``engine_worker.lora.FUSED`` kind. Experts are left
        out (``SparseMoE`` ignores the step's adapters): their MLP takes none."""
        out = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            linears = {"qkv": a.qkv_proj, "o": a.o_proj}
            if isinstance(m, LlamaMLP):
                linears.update(gate_up=m.gate_up_proj, down=m.down_proj)
            out.append(linears)
        return out

    # -- expert parallelism ----------------------------------------------------------------------
    def set_expert_group(self, group) -> None:
        """Run every MoE layer across ``group`` (an ``ExpertGroup``; None: alone)."""
        for layer in self.layers:
            layer.mlp.group = group

    def holds(self, name: str) -> bool:
        """Whether the HF tensor ``name`` belongs to this model (False for other members' experts)."""
        _, sep, rest = name.partition(".block_sparse_moe.experts.")
        return not sep or int(rest.split(".", 1)[0]) in self.expert_ids

    def reshard(self, expert_ids: Sequence[int], read) -> None:
        """Hold ``expert_ids`` in every MoE layer from now on, reading new experts with ``read(names)``. Every
        layer's new experts are loaded before any layer changes: a failed read leaves the model as it was."""
        staged = [layer.mlp.staged_experts(expert_ids, f"model.layers.{i}.block_sparse_moe.", read, self.packed)
                  for i, layer in enumerate(self.layers)]
        for layer, experts in zip(self.layers, staged):
            layer.mlp.use_experts(expert_ids, experts)
        self.expert_ids = list(expert_ids)

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
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *layer.mlp.linears()):
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
            if cfg.attention_bias:
                t[p + "self_attn.q_proj.bias"] = (a.qkv_proj.bias, 0)
                t[p + "self_attn.k_proj.bias"] = (a.qkv_proj.bias, q)
                t[p + "self_attn.v_proj.bias"] = (a.qkv_proj.bias, q + kv)
            if isinstance(m, SparseMoE):
                t.update(m.targets(p + "block_sparse_moe."))
            else:
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
        rows = {
            "q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim,
            "v_proj": cfg.num_kv_heads * cfg.head_dim, "gate_proj": cfg.intermediate_size,
            "up_proj": cfg.intermediate_size, "w1": cfg.intermediate_size, "w3": cfg.intermediate_size,
        }.get(name.split(".")[-2], dest.shape[0])
        if dest.dim() == 1:
            return (rows,)
        return (rows, dest.shape[1])

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], skip: set[str] = frozenset()) -> None:
        """Copy HF-named tensors in (any dtype/device); fails unless every weight but ``skip`` (those kept quantized,
        ``use_quantized``) arrives once."""
        if self.packed:
            raise RuntimeError("weights were packed for serving; load into a fresh model")
        targets = {name: (dest, row, self._shape(name, dest)) for name, (dest, row) in self._targets().items()
                   if name not in skip}
        if len(self.expert_ids) < self.config.num_experts:  # expert parallel: skip the other members' experts
            weights = ((name, w) for name, w in weights if self.holds(name))
        copy_checkpoint(weights, targets, f"a {self.config.num_layers}-layer {self.config.architecture}")
