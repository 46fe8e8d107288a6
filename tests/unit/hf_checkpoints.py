"""Tiny Hugging Face checkpoints (Llama, Llama 3, Mistral with and without a window, Qwen2,
Mixtral) written by tests, and our engine's logits / greedy tokens on them: shared by the HF
directory tests and the GGUF loader tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine_worker.attention import SeqLayout, select_backend
from engine_worker.engine import Engine
from engine_worker.kv_cache import PagedKVCache
from engine_worker.loader import load_model
from engine_worker.scheduler import run_until_done
from engine_worker.sequence import Sequence
from protocol.messages import SamplingParams
from zserve.catalog import ModelSource
from zserve.config import EngineConfig

CPU = torch.device("cpu")
VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, EXPERTS = 96, 32, 48, 2, 4, 2, 4
PROMPT = [3, 17, 42, 5, 77, 8, 91, 23, 64, 11, 2, 50, 33]

BASE = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "eos_token_id": 1, "bos_token_id": 0, "torch_dtype": "float32",
}
CONFIGS = {
    "llama": {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "mistral": {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
    # A window shorter than the prompt: prefill, chunks and decode all attend to 5 keys at most.
    "mistral-window": {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 5},
    "llama3": {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}},
    "qwen2": {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True,
              "use_sliding_window": False, "sliding_window": 4096},
    "mixtral": {**BASE, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": EXPERTS,
                "num_experts_per_tok": 2, "sliding_window": None, "rope_theta": 1e6},
}


def layer_tensors(w, prefix: str, hidden: int, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """One decoder layer's norms and attention projections, drawn from ``w(*shape)`` in a fixed order."""
    hd = hidden // heads
    return {prefix + "input_layernorm.weight": 1 + w(hidden), prefix + "post_attention_layernorm.weight": 1 + w(hidden),
            prefix + "self_attn.q_proj.weight": w(heads * hd, hidden),
            prefix + "self_attn.k_proj.weight": w(kv_heads * hd, hidden),
            prefix + "self_attn.v_proj.weight": w(kv_heads * hd, hidden),
            prefix + "self_attn.o_proj.weight": w(hidden, heads * hd)}


def checkpoint_tensors(kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the checkpoint names each architecture is published with."""
    g = torch.Generator().manual_seed(seed)
    cfg = CONFIGS[kind]

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    hd = HIDDEN // HEADS
    t = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": 1 + w(HIDDEN)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = w(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t.update(layer_tensors(w, p, HIDDEN, HEADS, KV_HEADS))
        if kind == "qwen2":
            t[p + "self_attn.q_proj.bias"] = w(HEADS * hd)
            t[p + "self_attn.k_proj.bias"] = w(KV_HEADS * hd)
            t[p + "self_attn.v_proj.bias"] = w(KV_HEADS * hd)
        if kind == "mixtral":
            t[p + "block_sparse_moe.gate.weight"] = w(EXPERTS, HIDDEN)
            for e in range(EXPERTS):
                q = f"{p}block_sparse_moe.experts.{e}."
                t[q + "w1.weight"], t[q + "w3.weight"], t[q + "w2.weight"] = (w(INTER, HIDDEN), w(INTER, HIDDEN),
                                                                               w(HIDDEN, INTER))
        else:
            t[p + "mlp.gate_proj.weight"] = w(INTER, HIDDEN)
            t[p + "mlp.up_proj.weight"] = w(INTER, HIDDEN)
            t[p + "mlp.down_proj.weight"] = w(HIDDEN, INTER)
    return t


def write_checkpoint(root: Path, kind: str, shards: int = 1, config: dict | None = None,
                     tensors: dict[str, torch.Tensor] | None = None) -> Path:
    # The reference writer (installed with transformers) checks our reader against the format.
    save_file = pytest.importorskip("safetensors.torch").save_file
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or CONFIGS[kind]))
    tensors = checkpoint_tensors(kind) if tensors is None else tensors
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(root / "model.safetensors"))
        return root
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(root / fname))
        weight_map.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def source(root: Path) -> ModelSource:
    return ModelSource(root.name, "hf", str(root), str(root))


def our_logits(root: Path) -> torch.Tensor:
    lm = load_model(source(root), torch.float32, CPU)
    cfg = lm.config
    kv = PagedKVCache(cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU)
    attn = select_backend(kv, cfg.num_heads, cfg.sliding_window)
    layout = attn.plan([SeqLayout([0, 1], 0, len(PROMPT))])
    with torch.inference_mode():
        return lm.model.compute_logits(lm.model(torch.tensor(PROMPT), layout, attn))


def our_greedy(root: Path, n: int, native: bool = True) -> list[int]:
    lm = load_model(source(root), torch.float32, CPU)
    # native=False: the torch path (no compiler here, or CUDA); a budget of 5: chunked prefill over the paged cache
    sched = Engine.generation(lm, CPU, torch.float32, EngineConfig(max_num_seqs=2, max_model_len=64, block_size=4,
                                                                   max_num_batched_tokens=5),
                              num_blocks=16, attention=None if native else "gather").scheduler
    # min_tokens masks EOS as transformers' min_new_tokens does
    sched.add(Sequence("r", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)))
    return [t for o in run_until_done(sched)["r"] for t in o.new_token_ids]
