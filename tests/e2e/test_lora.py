"""LoRA adapters given at start (``--enable-lora --lora-modules NAME=PATH ...``, vLLM's options): every gateway
serves each adapter's name as a model of its base's engines, and a request through it generates exactly what
transformers + PEFT generate in fp32; an adapter that cannot load stops ``launch`` at once, naming it.

The adapters are written by PEFT on tiny-random's very weights (``tests.lora_adapters``), and the reference tokens
are computed here with transformers + PEFT, greedy, whatever the tokens are (the requests use ignore_eos)."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.helpers import LAUNCH, ROOT, TINY, Server, pinned_client, wait_until
from tests.lora_adapters import greedy_tokens, tiny_random_hf, write_adapter

pytestmark = pytest.mark.slow

peft = pytest.importorskip("peft")

BASE = "tiny-random"
NEW_TOKENS = 32
# Different ranks and targets, one rsLoRA: each changes the base model's tokens.
ADAPTERS = {
    "a": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "b": {"r": 4, "lora_alpha": 8, "use_rslora": True,
          "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
}
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {name: write_adapter(tiny_random_hf(), root / name, seed, **kw)
            for seed, (name, kw) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def server(adapters):
    s = Server("--count", "2", *TINY, "--enable-lora", "--max-loras", "2", "--lora-modules",
               *(f"{name}={path}" for name, path in adapters.items()), log_name="lora")
    yield s
    s.stop()


def generate(url: str, model: str) -> list[int]:
    r = httpx.post(url + "/inference/v1/generate", timeout=120, json={
        "model": model, "token_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_every_gateway_lists_each_adapter_as_a_model_of_its_base(server, adapters):
    seen: dict[int, dict] = {}

    def both_listed() -> bool:
        with pinned_client(server.url) as c:  # one connection: /load and /v1/models reach the same gateway
            seen[c.get("/load").json()["gateway"]] = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        return set(seen) == {0, 1}

    wait_until(both_listed, 60, 0.01, "both gateways to answer")
    for cards in seen.values():
        assert list(cards) == [BASE, "a", "b"]
        for name, path in adapters.items():
            card = cards[name]
            assert (card["object"], card["root"], card["parent"], card["tasks"]) == ("model", str(path), BASE,
                                                                                      ["generate"])
            assert card["max_model_len"] == cards[BASE]["max_model_len"] and card["owned_by"] == cards[BASE]["owned_by"]
        assert cards[BASE]["parent"] is None
    one = httpx.get(server.url + "/v1/models/a").json()
    assert (one["id"], one["parent"], one["root"]) == ("a", BASE, str(adapters["a"]))


def test_greedy_tokens_through_each_adapter_and_the_base_equal_transformers_and_peft(server, adapters):
    with ThreadPoolExecutor(3) as pool:  # at once: both adapters and the base model share the engine's steps
        got = dict(zip(["a", "b", BASE], pool.map(lambda m: generate(server.url, m), ["a", "b", BASE])))
    want = {BASE: greedy_tokens(tiny_random_hf(), PROMPT, NEW_TOKENS)}
    for name, path in adapters.items():
        want[name] = greedy_tokens(peft.PeftModel.from_pretrained(tiny_random_hf(), str(path)).eval(), PROMPT,
                                   NEW_TOKENS)
    assert got == want
    assert want["a"] != want[BASE] and want["b"] != want[BASE] and want["a"] != want["b"]


def test_the_sdks_chat_and_messages_through_an_adapter_echo_its_name(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.model == "a" and chat.usage.completion_tokens == 8 and chat.choices[0].finish_reason == "length"
    stream = list(client.completions.create(model="b", prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert stream and all(c.model == "b" for c in stream)
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    msg = claude.messages.create(model="a", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert msg.model == "a" and msg.usage.output_tokens >= 1 and msg.stop_reason in ("max_tokens", "end_turn")


def test_an_unknown_adapter_is_a_404_and_an_adapter_does_not_embed(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="c", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="a", input="hi")
    assert e.value.body["code"] == "unsupported_task" and "LoRA adapter 'a'" in e.value.body["message"]  # type: ignore[index]
    assert client.embeddings.create(model=BASE, input="hi").data  # (the base model embeds)


def test_launch_bench_spreads_its_requests_over_the_adapters_it_is_given(server, tmp_path):
    """vLLM's ``--lora-modules`` of its benchmark: each request asks for one of the adapters (an adapter the server
    does not serve fails every request, so the names are what is sent)."""
    import orjson

    def bench(*names: str) -> tuple[subprocess.CompletedProcess, dict]:
        out = tmp_path / f"{'-'.join(names)}.json"
        r = subprocess.run([*LAUNCH, "bench", "--base-url", server.url, "--no-progress", "--num-prompts", "8",
                            "--random-input-len", "16", "--random-output-len", "4", "--result-file", str(out),
                            *(a for n in names for a in ("--lora-modules", n))], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        return r, orjson.loads(out.read_bytes()) if out.exists() else {}

    r, result = bench("a", "b")
    assert r.returncode == 0 and result["results"][0]["completed"] == 8, r.stdout + r.stderr
    assert "each through one of 2 LoRA adapters" in r.stdout
    r, _ = bench("nope")
    assert r.returncode == 1, r.stdout + r.stderr  # every request failed: 404, no such model


def test_an_adapter_that_cannot_load_is_a_boot_error_naming_it(adapters):
    # Rank 8 above --max-lora-rank 4: the engine refuses it before it says ready, and launch stops at once.
    r = subprocess.run([*LAUNCH, "api-server", "--port", "0", *TINY, "--max-lora-rank", "4", "--lora-modules",
                        f"a={adapters['a']}"], cwd=ROOT, capture_output=True, timeout=90)
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert "error: engine 0 cannot start" in err and "adapter 'a' has rank 8, above this engine's max_lora_rank=4" \
        in err, err
    assert "restarting it in" not in err and "engine 0 ready" not in err, err
