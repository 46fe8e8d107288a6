"""Serving a Hugging Face model directory (config.json + safetensors + tokenizer files) end to end."""

from __future__ import annotations

import json

import openai
import pytest

from tests.helpers import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zserve.catalog import smollm2_gguf_path
    from zserve.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("tiny-llama-hf")
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root, safe_serialization=True)
    tok = Tokenizer.from_gguf(str(smollm2_gguf_path()))
    tok.backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": tok.chat_template}))
    return root, model, tok


def test_hf_directory_serves_the_same_greedy_tokens_as_transformers(hf_dir):
    import torch

    from gateway.text.chat_template import ChatTemplate

    root, model, tok = hf_dir
    s = Server("--model", str(root), "--dtype", "float32", "--max-model-len", "1024", log_name="hf-dir")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [root.name]
        ids = tok.encode("The quick brown fox jumps over")
        with torch.inference_mode():
            want = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=8, min_new_tokens=8)[0, len(ids):].tolist()
        r = client.completions.create(model=root.name, prompt=ids, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, "skip_special_tokens": False})
        assert r.choices[0].text == tok.decode(want, skip_special_tokens=False)
        messages = [{"role": "user", "content": "hi"}]
        chat = client.chat.completions.create(model=root.name, messages=messages, max_tokens=4, temperature=0)
        rendered = ChatTemplate(tok.chat_template, "<|im_start|>", "<|im_end|>").render(messages)
        assert chat.usage.prompt_tokens == len(tok.encode(rendered))  # the directory's template was used
        assert chat.choices[0].finish_reason in ("stop", "length")
    finally:
        s.stop()
