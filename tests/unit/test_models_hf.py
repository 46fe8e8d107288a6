"""Hugging Face directories: tiny Llama / Mistral / Qwen2 / Mixtral checkpoints written by the
test (config.json + safetensors) load through the registry and match transformers' logits and
greedy tokens; broken directories fail with errors that say what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine_worker.attention import SeqLayout, select_backend
from engine_worker.kv_cache import PagedKVCache
from engine_worker.loader import load_model
from engine_worker.runner import ModelRunner
from engine_worker.scheduler import Scheduler, run_until_done
from engine_worker.sequence import Sequence
from protocol.messages import SamplingParams
from zserve.catalog import ModelSource

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
        t[p + "input_layernorm.weight"] = 1 + w(HIDDEN)
        t[p + "post_attention_layernorm.weight"] = 1 + w(HIDDEN)
        t[p + "self_attn.q_proj.weight"] = w(HEADS * hd, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = w(KV_HEADS * hd, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = w(KV_HEADS * hd, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * hd)
        if kind == "qwen2":
            t[p + "self_attn.q_proj.bias"] = w(HEADS * hd)
            t[p + "self_attn.k_proj.bias"] = w(KV_HEADS * hd)
            t[p + "self_attn.v_proj.bias"] = w(KV_HEADS * hd)
        if kind == "mixtral":
            t[p + "block_sparse_moe.gate.weight"] = w(EXPERTS, HIDDEN)
            for e in range(EXPERTS):
                q = f"{p}block_sparse_moe.experts.{e}."
                t[q + "w1.weight"], t[q + "w3.weight"], t[q + "w2.weight"] = w(INTER, HIDDEN), w(INTER, HIDDEN), w(HIDDEN, INTER)
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
    # native=False: the torch path (no compiler here, or CUDA)
    runner = ModelRunner(lm, CPU, torch.float32, max_num_seqs=2, max_model_len=64, num_blocks=16, block_size=4,
                         attention=None if native else "gather")
    sched = Scheduler(runner, 2, 5)  # chunked prefill over the paged cache
    # min_tokens masks EOS as transformers' min_new_tokens does
    sched.add(Sequence("r", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)))
    return [t for o in run_until_done(sched)["r"] for t in o.new_token_ids]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "llama3", "mistral", "mistral-window", "qwen2", "mixtral"])
def test_tiny_checkpoint_matches_transformers(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    root = write_checkpoint(tmp_path / kind, kind, shards=2 if kind == "qwen2" else 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        want = hf(ids).logits[0]
        want_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                                  min_new_tokens=6, pad_token_id=1)[0, len(PROMPT):].tolist()
    got = our_logits(root)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert our_greedy(root, 6) == want_tokens
    if kind in ("llama", "mistral-window"):
        assert our_greedy(root, 6, native=False) == want_tokens


def test_mixtral_stacked_expert_tensors_load_like_per_expert_ones(tmp_path):
    """transformers >= 5 saves experts stacked (mlp.experts.gate_up_proj / down_proj)."""
    t = checkpoint_tensors("mixtral")
    stacked = {k: v for k, v in t.items() if "block_sparse_moe" not in k}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        e = [f"{p}block_sparse_moe.experts.{j}." for j in range(EXPERTS)]
        stacked[p + "mlp.gate.weight"] = t[p + "block_sparse_moe.gate.weight"]
        stacked[p + "mlp.experts.gate_up_proj"] = torch.stack([torch.cat([t[q + "w1.weight"], t[q + "w3.weight"]]) for q in e])
        stacked[p + "mlp.experts.down_proj"] = torch.stack([t[q + "w2.weight"] for q in e])
    a = our_logits(write_checkpoint(tmp_path / "a", "mixtral"))
    b = our_logits(write_checkpoint(tmp_path / "b", "mixtral", tensors=stacked))
    assert torch.equal(a, b)


def test_bf16_checkpoint_loads_into_fp32_and_eos_comes_from_the_config(tmp_path):
    t = {k: v.to(torch.bfloat16) for k, v in checkpoint_tensors("llama").items()}
    root = write_checkpoint(tmp_path / "bf16", "llama", tensors=t)
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    lm = load_model(source(root), torch.float32, CPU)
    assert lm.eos_token_ids == [1, 7] and lm.model.embed_weight.dtype == torch.float32
    assert torch.equal(lm.model.embed_weight, t["model.embed_tokens.weight"].float())


def test_unknown_architecture_is_refused_by_name(tmp_path):
    root = write_checkpoint(tmp_path / "x", "llama", config={**CONFIGS["llama"], "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_model(source(root), torch.float32, CPU)


def test_missing_files_are_named(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(source(root), torch.float32, CPU)
    (root / "config.json").write_text(json.dumps(CONFIGS["llama"]))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(source(root), torch.float32, CPU)
    sharded = write_checkpoint(tmp_path / "sharded", "llama", shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_model(source(sharded), torch.float32, CPU)


def test_config_and_weights_that_disagree_fail_clearly(tmp_path):
    more_layers = write_checkpoint(tmp_path / "layers", "llama", config={**CONFIGS["llama"], "num_hidden_layers": 3})
    with pytest.raises(ValueError, match="missing.*do not match"):
        load_model(source(more_layers), torch.float32, CPU)
    wider = write_checkpoint(tmp_path / "wide", "llama", config={**CONFIGS["llama"], "intermediate_size": 64})
    with pytest.raises(ValueError, match="shape"):
        load_model(source(wider), torch.float32, CPU)
    t = checkpoint_tensors("llama")
    t["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="unexpected weight"):
        load_model(source(write_checkpoint(tmp_path / "extra", "llama", tensors=t)), torch.float32, CPU)
    bad = tmp_path / "bad"
    write_checkpoint(bad, "llama")
    (bad / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="safetensors"):
        load_model(source(bad), torch.float32, CPU)
