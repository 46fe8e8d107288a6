"""A tiny random Mixtral-shaped checkpoint (8 experts, top-2, 2 layers, safetensors) with SmolLM2's tokenizer
and chat template, written by the expert-parallel tests; and its greedy tokens from one process holding every
expert, the reference an expert-parallel group must reproduce token for token."""

from __future__ import annotations

import json
from pathlib import Path

import torch

EXPERTS, TOP_K, LAYERS, HIDDEN, INTER, HEADS, KV_HEADS = 8, 2, 2, 64, 96, 4, 2


def write_moe_checkpoint(root: Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    from tests.unit.hf_checkpoints import layer_tensors
    from zserve.catalog import smollm2_gguf_path
    from zserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(str(smollm2_gguf_path()))
    vocab = tok.vocab_size
    config = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": vocab,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "hidden_act": "silu", "tie_word_embeddings": False,
        "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K, "sliding_window": None,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    t = {"model.embed_tokens.weight": w(vocab, HIDDEN, scale=1.0), "model.norm.weight": 1 + w(HIDDEN),
         "lm_head.weight": w(vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t.update(layer_tensors(w, p, HIDDEN, HEADS, KV_HEADS))
        t[p + "block_sparse_moe.gate.weight"] = w(EXPERTS, HIDDEN, scale=1.0)  # decisive routing
        for e in range(EXPERTS):
            q = f"{p}block_sparse_moe.experts.{e}."
            t[q + "w1.weight"], t[q + "w3.weight"] = w(INTER, HIDDEN), w(INTER, HIDDEN)
            t[q + "w2.weight"] = w(HIDDEN, INTER)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    save_file({n: x.contiguous() for n, x in sorted(t.items())}, str(root / "model.safetensors"))
    tok.backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": tok.chat_template}))
    return root


def reference_greedy(root: Path, prompts: list[list[int]], n: int, device: str = "cpu") -> list[list[int]]:
    """Each prompt's ``n`` greedy tokens (EOS ignored) from one in-process engine holding every expert (fp32)."""
    from engine_worker.engine import Engine
    from engine_worker.loader import load_model
    from engine_worker.scheduler import run_until_done
    from engine_worker.sequence import Sequence
    from protocol.messages import SamplingParams
    from zserve.catalog import ModelSource
    from zserve.config import EngineConfig

    dev = torch.device(device)
    lm = load_model(ModelSource(root.name, "hf", str(root), str(root)), torch.float32, dev)
    sched = Engine.generation(lm, dev, torch.float32, EngineConfig(max_num_seqs=4, max_model_len=256,
                                                                   max_num_batched_tokens=256, enforce_eager=True),
                              num_blocks=128).scheduler
    for i, p in enumerate(prompts):
        sched.add(Sequence(f"r{i}", list(p), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
    done = run_until_done(sched)
    return [[t for o in done[f"r{i}"] for t in o.new_token_ids] for i in range(len(prompts))]
