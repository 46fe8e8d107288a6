"""Hugging Face directories: tiny Llama / Mistral / Qwen2 / Mixtral checkpoints written by the
test (config.json + safetensors) load through the registry and match transformers' logits and
greedy tokens; broken directories fail with errors that say what is wrong."""

from __future__ import annotations

import json

import pytest
import torch

from engine_worker.loader import load_model

from .hf_checkpoints import (
    CONFIGS,
    CPU,
    EXPERTS,
    LAYERS,
    PROMPT,
    checkpoint_tensors,
    our_greedy,
    our_logits,
    source,
    write_checkpoint,
)


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
        stacked[p + "mlp.experts.gate_up_proj"] = torch.stack([torch.cat([t[q + "w1.weight"], t[q + "w3.weight"]])
                                                               for q in e])
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
