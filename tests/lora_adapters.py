"""LoRA adapters for tests, written by PEFT itself, and transformers models of the catalog's tiny-random shape to
write them on and to compute reference tokens with (the engine's unit tests and the end-to-end tests share them).

    base = tiny_random_hf()                                   # tiny-random's very weights, as a transformers model
    write_adapter(base, tmp / "sql", seed=0, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    greedy_tokens(peft.PeftModel.from_pretrained(tiny_random_hf(), str(tmp / "sql")), prompt, 32)

Each needs ``transformers`` and ``peft`` (the test extra); a test module without them is skipped.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from zserve.catalog import TINY_RANDOM, TINY_RANDOM_CONFIG, resolve


def hf_llama_config(**overrides: Any):
    """A transformers ``LlamaConfig`` of tiny-random's shape (``overrides``: any of its keywords)."""
    transformers = pytest.importorskip("transformers")
    rc = dict(TINY_RANDOM_CONFIG)
    return transformers.LlamaConfig(**{
        "vocab_size": rc["vocab_size"], "hidden_size": rc["hidden_size"], "intermediate_size": rc["intermediate_size"],
        "num_hidden_layers": rc["num_layers"], "num_attention_heads": rc["num_heads"],
        "num_key_value_heads": rc["num_kv_heads"], "max_position_embeddings": rc["max_position_embeddings"],
        "rope_theta": rc["rope_theta"], "rms_norm_eps": rc["rms_norm_eps"], "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, **overrides})


def tiny_random_hf():
    """The catalog's tiny-random model (``engine_worker.loader``'s seeded weights, drawn here in the same order) as a
    transformers ``LlamaForCausalLM`` in fp32: what an engine serving ``--model tiny-random`` computes."""
    import transformers

    from engine_worker.loader import RANDOM_INIT_STD, load_model

    ours = load_model(resolve(TINY_RANDOM), torch.float32, torch.device("cpu")).model  # (its names and shapes)
    gen = torch.Generator().manual_seed(int(dict(TINY_RANDOM_CONFIG)["seed"]))
    weights = {name: torch.ones(ours.weight_shape(name)) if name.endswith("norm.weight")
               else torch.empty(ours.weight_shape(name)).normal_(0.0, RANDOM_INIT_STD, generator=gen)
               for name in ours.weight_names()}
    model = transformers.LlamaForCausalLM(hf_llama_config())
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # (tied to the embeddings)
    model.tie_weights()
    return model.float().eval()


def write_adapter(base, root: Path, seed: int, scale: float = 0.3, **lora_config: Any) -> Path:
    """A PEFT adapter on ``base`` with random, output-changing A and B (PEFT starts B at zero), of standard deviation
    ``scale``. ``base`` is changed (PEFT wraps its modules): give a copy of a model used again."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(base, peft.LoraConfig(**lora_config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(root)
    return root


def greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    """The ``n`` most likely next tokens, one after another, whatever they are (as a request with temperature 0 and
    ignore_eos generates them)."""
    config = copy.deepcopy(model.generation_config)
    config.update(do_sample=False, max_new_tokens=n, min_new_tokens=None, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)[0]
    assert len(out) == len(prompt) + n  # (no EOS stops it)
    return out[len(prompt):].tolist()
