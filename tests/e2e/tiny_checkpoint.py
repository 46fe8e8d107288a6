"""A second checkpoint of tiny-random's architecture (other random weights), as a Hugging Face directory: what a
weight update (``POST /update_weights``) loads in the tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zserve.catalog import TINY_RANDOM_CONFIG


def write_tiny_checkpoint(root: Path, seed: int = 1) -> Path:
    """tiny-random's shapes, weights drawn with ``seed`` (tiny-random itself is seed 0), in safetensors."""
    from safetensors.torch import save_file

    from engine_worker.models.llama import LlamaConfig, LlamaForCausalLM

    rc = dict(TINY_RANDOM_CONFIG)
    cfg = LlamaConfig(num_layers=rc["num_layers"], hidden_size=rc["hidden_size"],
                      intermediate_size=rc["intermediate_size"], num_heads=rc["num_heads"],
                      num_kv_heads=rc["num_kv_heads"], head_dim=rc["hidden_size"] // rc["num_heads"],
                      vocab_size=rc["vocab_size"], max_position_embeddings=rc["max_position_embeddings"],
                      rope_theta=rc["rope_theta"], rms_norm_eps=rc["rms_norm_eps"])
    model = LlamaForCausalLM(cfg, torch.float32, torch.device("meta"))
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.ones(model.weight_shape(name)) if name.endswith("norm.weight")
                      else torch.empty(model.weight_shape(name)).normal_(0.0, 0.05, generator=gen))
               for name in model.weight_names()}
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
        "tie_word_embeddings": True, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}))
    return root
