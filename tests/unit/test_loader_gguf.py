"""GGUF files of every supported layout, written by the test with the gguf package: the same
weights loaded from GGUF (F32 and Q8_0 tensors, llama.cpp's Q/K permutation for ``llama``,
biases for ``qwen2``, stacked experts for Mixtral-style ``llama``) compute exactly what they
compute when loaded from a Hugging Face directory (itself checked against transformers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine_worker.loader import load_model
from zserve.catalog import ModelSource

from .hf_checkpoints import CONFIGS, EXPERTS, LAYERS, checkpoint_tensors, our_logits, write_checkpoint

gguf = pytest.importorskip("gguf")

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2"}
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "block_sparse_moe.gate": "ffn_gate_inp",
}


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert script: interleave the two rotary halves of every head's rows."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(kind: str, t: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    cfg = CONFIGS[kind]
    out: dict[str, np.ndarray] = {"token_embd.weight": t["model.embed_tokens.weight"].numpy(),
                                  "output_norm.weight": t["model.norm.weight"].numpy()}
    if "lm_head.weight" in t:
        out["output.weight"] = t["lm_head.weight"].numpy()
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for hf, g in LAYER_NAMES.items():
            for kind_ in ("weight", "bias"):
                name = f"{p}{hf}.{kind_}"
                if name not in t:
                    continue
                w = t[name].numpy()
                if GGUF_ARCH[kind] == "llama" and g in ("attn_q", "attn_k"):
                    w = permute_qk(w, cfg["num_attention_heads"] if g == "attn_q" else cfg["num_key_value_heads"])
                out[f"blk.{i}.{g}.{kind_}"] = w
        if kind == "mixtral":
            e = [f"{p}block_sparse_moe.experts.{j}." for j in range(EXPERTS)]
            for w_name, g in (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")):
                out[f"blk.{i}.{g}.weight"] = np.stack([t[q + w_name + ".weight"].numpy() for q in e])
    return out


def write_gguf(path: Path, kind: str, t: dict[str, torch.Tensor], quantize: bool) -> Path:
    cfg = CONFIGS[kind]
    arch = GGUF_ARCH[kind]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_eos_token_id(1)
    if kind == "mixtral":
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, arr in gguf_tensors(kind, t).items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if quantize and arr.ndim >= 2 and arr.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(arr, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def roundtrip_q8(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What Q8_0 storage does to each 2D+ tensor whose rows are whole 32-blocks."""
    q8 = gguf.GGMLQuantizationType.Q8_0
    out = {}
    for name, v in t.items():
        a = v.numpy().astype(np.float32)
        if a.ndim >= 2 and a.shape[-1] % 32 == 0:
            a = gguf.quants.dequantize(gguf.quants.quantize(a, q8), q8).reshape(a.shape)
        out[name] = torch.from_numpy(np.ascontiguousarray(a))
    return out


@pytest.mark.parametrize("quantize", [False, True], ids=["f32", "q8_0"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral"])
def test_gguf_computes_what_the_same_weights_from_a_hf_directory_compute(tmp_path, kind, quantize):
    t = checkpoint_tensors(kind)
    if quantize:
        t = roundtrip_q8(t)  # quantizing again gives the same blocks: the GGUF holds exactly these
    path = write_gguf(tmp_path / f"{kind}.gguf", kind, t, quantize)
    lm = load_model(ModelSource(kind, "gguf", str(path), str(path)), torch.float32, torch.device("cpu"))
    assert lm.config.architecture == {"qwen2": "Qwen2ForCausalLM"}.get(kind, "LlamaForCausalLM")
    assert lm.config.num_experts == (EXPERTS if kind == "mixtral" else 0) and lm.eos_token_ids == [1]
    want = our_logits(write_checkpoint(tmp_path / kind, kind, tensors=t))
    got = _logits(path)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def _logits(path: Path) -> torch.Tensor:
    from engine_worker.attention import SeqLayout, select_backend
    from engine_worker.kv_cache import PagedKVCache

    from .hf_checkpoints import PROMPT

    lm = load_model(ModelSource(path.stem, "gguf", str(path), str(path)), torch.float32, torch.device("cpu"))
    cfg = lm.config
    attn = select_backend(PagedKVCache(cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                                       torch.device("cpu")))
    with torch.inference_mode():
        return lm.model.compute_logits(lm.model(torch.tensor(PROMPT), attn.plan([SeqLayout([0, 1], 0, len(PROMPT))]),
                                                attn))


def test_unknown_gguf_architecture_is_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(NotImplementedError, match="gpt2"):
        load_model(ModelSource("x", "gguf", str(tmp_path / "x.gguf"), ""), torch.float32, torch.device("cpu"))
