"""The engine configuration end to end: `launch api-server` fills it, every engine runs with it."""

from __future__ import annotations

import subprocess

import httpx

from tests.helpers import LAUNCH, ROOT, Server


def _sampled_texts(*options: str) -> list[str]:
    """Two unseeded, sampled completions, one after the other, on a fresh tiny-random server."""
    s = Server("--count", "1", "--model", "tiny-random", "--dtype", "float32", *options, log_name="seed")
    try:
        body = {"model": "tiny-random", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0}
        return [httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                for _ in range(2)]
    finally:
        s.stop()


def test_seed_makes_unseeded_sampling_repeatable_across_restarts() -> None:
    first = _sampled_texts("--seed", "7")
    assert first[0] != first[1]  # one generator, drawn on: the two requests differ
    assert _sampled_texts("--seed", "7") == first
    assert _sampled_texts("--seed", "8") != first


def test_a_bad_engine_option_is_a_usage_error_before_anything_starts() -> None:
    proc = subprocess.run([*LAUNCH, "api-server", "--port", "0", "--max-num-seqs", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--max-num-seqs must be an integer in 1..4096" in proc.stderr


def test_the_default_context_is_the_models_own_and_the_engine_says_so(tiny_server) -> None:
    """No --max-model-len: tiny-random's (SmolLM2's) own 8192 tokens, as vLLM defaults, so a 6,000-token prompt
    is served; the engine's start-up line says where its context came from."""
    url = tiny_server.url
    card = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
    assert card["max_model_len"] == 8192
    prompt = [1000 + i % 500 for i in range(6000)]
    r = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": prompt, "max_tokens": 2},
                   timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 6000, r.text
    over = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": prompt * 2, "max_tokens": 2},
                      timeout=60)
    assert over.status_code == 400 and "maximum context length is 8192" in over.json()["error"]["message"]
    assert "context 8192 tokens (the model's own)" in tiny_server.tail(10**7)
