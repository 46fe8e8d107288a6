"""The model registry: Hugging Face ``architectures`` names -> how to read their config.

Every supported architecture is a member of the Llama family and runs on ``LlamaForCausalLM``;
what differs is read from ``config.json`` here. An unknown architecture fails with the list of
the supported ones.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_worker.models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["ARCHITECTURES", "LlamaConfig", "LlamaForCausalLM", "config_from_hf", "supported_architectures"]


def _common(d: dict, arch: str, **extra) -> LlamaConfig:
    def need(key: str):
        if key not in d or d[key] is None:
            raise ValueError(f"config.json of a {arch} lacks {key!r}")
        return d[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = d.get("head_dim") or hidden // heads
    rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    llama3 = None
    if rope_type == "llama3":
        llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                  int(rope["original_max_position_embeddings"]))
    elif rope_type not in ("default", None):
        raise NotImplementedError(f"{arch}: RoPE scaling {rope_type!r} is not supported")
    theta = d.get("rope_theta")
    if theta is None and isinstance(rope, dict):
        theta = rope.get("rope_theta")
    if d.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"{arch}: activation {d.get('hidden_act')!r} is not supported (only silu)")
    window = d.get("sliding_window") if d.get("use_sliding_window", True) else None
    return LlamaConfig(
        num_layers=int(need("num_hidden_layers")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        vocab_size=int(need("vocab_size")),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        rope_theta=float(theta if theta is not None else 10000.0),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        architecture=arch,
        rope_llama3=llama3,
        sliding_window=int(window) if window else None,
        **extra,
    )


def _llama(d: dict, arch: str) -> LlamaConfig:
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise NotImplementedError(f"{arch}: attention_bias/mlp_bias checkpoints are not supported")
    return _common(d, arch)


def _qwen2(d: dict, arch: str) -> LlamaConfig:
    return _common(d, arch, attention_bias=True)


def _mixtral(d: dict, arch: str) -> LlamaConfig:
    return _common(d, arch, num_experts=int(d["num_local_experts"]), num_experts_per_tok=int(d["num_experts_per_tok"]))


ARCHITECTURES: dict[str, Callable[[dict, str], LlamaConfig]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "MixtralForCausalLM": _mixtral,
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def config_from_hf(d: dict) -> LlamaConfig:
    """A ``LlamaConfig`` from a parsed ``config.json``; clear errors for what is not supported."""
    archs = d.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ValueError("config.json names no 'architectures'")
    arch = archs[0]
    parse = ARCHITECTURES.get(arch)
    if parse is None:
        raise NotImplementedError(f"architecture {arch!r} is not supported; "
                                  f"supported: {', '.join(supported_architectures())}")
    return parse(d, arch)
