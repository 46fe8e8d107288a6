"""LoRA adapters, given at start (``--enable-lora --lora-modules NAME=PATH ...``, vLLM's options) or loaded and
unloaded while serving through any gateway (``/v1/load_lora_adapter``, SageMaker's ``/adapters``), on one server of
3 gateways and 2 engines: every gateway serves each adapter's name as a model of its base's engines from the moment a
load answers, a request through it generates exactly what transformers + PEFT generate in fp32, an unload is a 404
everywhere at once while running requests finish, engines that start later (a restart, ``launch reload``) load the
adapters the cluster serves, and bad input is a 400 that changes nothing. An adapter given at start that cannot load
stops ``launch`` at once, naming it.

The adapters are written by PEFT on tiny-random's very weights (``tests.lora_adapters``), and the reference tokens
are computed here with transformers + PEFT, greedy, whatever the tokens are (the requests use ignore_eos)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.helpers import LAUNCH, ROOT, TINY, Server, pinned_client, procs, status, wait_until
from tests.lora_adapters import greedy_tokens, hf_llama_config, tiny_random_hf, write_adapter

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
RUNTIME = {"r": 8, "lora_alpha": 32, "target_modules": ["k_proj", "o_proj", "down_proj"]}  # loaded while serving
ADMIN = "lora-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
GATEWAYS = 3
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    """The server's --lora-dir: the adapters given at start are written in it, and those loaded later."""
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def adapters(lora_dir) -> dict[str, Path]:
    return {name: write_adapter(tiny_random_hf(), lora_dir / name, seed, **kw)
            for seed, (name, kw) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def server(adapters, lora_dir):
    s = Server("--count", str(GATEWAYS), "--engines", "2", *TINY, "--enable-lora", "--max-loras", "2",
               "--lora-dir", str(lora_dir), "--admin-key", ADMIN, "--lora-modules",
               *(f"{name}={path}" for name, path in adapters.items()), log_name="lora")
    yield s
    s.stop()


def load(url: str, name: str, path: str | Path, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/load_lora_adapter", headers=AUTH, timeout=330,
                      json={"lora_name": name, "lora_path": str(path), **extra})


def unload(url: str, name: str) -> httpx.Response:
    return httpx.post(url + "/v1/unload_lora_adapter", headers=AUTH, timeout=60, json={"lora_name": name})


def completion_statuses(url: str, model: str, n: int = 200) -> list[int]:
    """``n`` completions for ``model`` at once, each on a fresh connection (so they spread over every gateway)."""
    def one(_) -> int:
        with httpx.Client(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            return c.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}).status_code

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, range(n)))


def models_by_gateway(url: str) -> dict[int, list[str]]:
    """Each gateway's /v1/models ids, asked over fresh connections until every gateway answered."""
    seen: dict[int, list[str]] = {}

    def every_gateway() -> bool:
        with pinned_client(url) as c:
            seen[c.get("/load").json()["gateway"]] = [m["id"] for m in c.get("/v1/models").json()["data"]]
        return len(seen) == GATEWAYS

    wait_until(every_gateway, 60, 0.01, "every gateway to answer")
    return seen


def engine_loras(server: Server) -> dict[int, set[str]]:
    return {p["index"]: set(p.get("loras") or ()) for p in procs(server, "engine") if p["state"] == "ready"}


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
        return set(seen) == set(range(GATEWAYS))

    wait_until(both_listed, 60, 0.01, "every gateway to answer")
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


def test_a_load_through_one_gateway_is_served_by_every_gateway_and_engine_when_it_answers(server, lora_dir):
    path = write_adapter(tiny_random_hf(), lora_dir / "c", 7, **RUNTIME)
    r = load(server.url, "c", "c")  # relative to --lora-dir
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'c' added successfully.")
    # At once, on the shared port: no request may meet a gateway or an engine that lacks it.
    assert completion_statuses(server.url, "c") == [200] * 200
    assert all(ids == [BASE, "a", "b", "c"] for ids in models_by_gateway(server.url).values())
    assert engine_loras(server) == {0: {"a", "b", "c"}, 1: {"a", "b", "c"}}
    want = greedy_tokens(peft.PeftModel.from_pretrained(tiny_random_hf(), str(path)).eval(), PROMPT, NEW_TOKENS)
    assert generate(server.url, "c") == want and want != greedy_tokens(tiny_random_hf(), PROMPT, NEW_TOKENS)
    card = httpx.get(server.url + "/v1/models/c").json()
    assert (card["root"], card["parent"]) == (str(path.resolve()), BASE)
    # Counted per adapter (every gateway's numbers once flushed: FLUSH_INTERVAL).
    def counted() -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('zserve_lora_requests_total{lora="c"}'))

    wait_until(lambda: counted() >= 201, 10, 0.1, "the adapter's requests to be counted")
    info = [line for line in httpx.get(server.url + "/metrics").text.splitlines()
            if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 2 and all('max_lora="2"' in line for line in info), info  # one per engine


def test_an_unload_is_a_404_everywhere_at_once_while_running_requests_finish(server):
    body = {"model": "c", "prompt": "hi", "max_tokens": 120, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks: list[dict] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    r = unload(server.url, "c")
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'c' removed successfully.")
    assert completion_statuses(server.url, "c") == [404] * 200
    reader.join(120)
    assert chunks[-1]["usage"]["completion_tokens"] == 120, chunks[-1]  # it ran to its end through the adapter
    assert any(c["choices"] and c["choices"][0]["finish_reason"] == "length" for c in chunks)
    wait_until(lambda: engine_loras(server) == {0: {"a", "b"}, 1: {"a", "b"}}, 30, 0.2, "both engines to drop it")
    assert all(ids == [BASE, "a", "b"] for ids in models_by_gateway(server.url).values())
    r = unload(server.url, "c")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_bad_input_is_a_400_that_changes_nothing(server, lora_dir, tmp_path):
    outside = write_adapter(tiny_random_hf(), tmp_path / "outside", 8, **RUNTIME)
    (lora_dir / "escape").symlink_to(outside)  # a directory inside that is a link out
    linked = lora_dir / "linked"
    linked.mkdir()
    (linked / "adapter_config.json").write_text((outside / "adapter_config.json").read_text())
    (linked / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")  # a file linked out
    write_adapter(tiny_random_hf(), lora_dir / "rank32", 9, r=32, lora_alpha=32, target_modules=["q_proj"])
    write_adapter(__import__("transformers").LlamaForCausalLM(hf_llama_config(hidden_size=32, intermediate_size=48)),
                  lora_dir / "other", 10, r=4, lora_alpha=8, target_modules=["q_proj"])
    broken = lora_dir / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    (broken / "adapter_model.safetensors").write_bytes(b"nothing")
    cases = [
        (str(outside), "outside the directories adapters may be loaded from"),
        (f"{lora_dir}/../{outside.parent.name}/outside", "outside the directories"),
        ("../" + outside.parent.name, "outside the directories"),
        ("escape", "outside the directories"),
        ("linked", "adapter_model.safetensors links outside --lora-dir"),
        ("missing", "does not exist in any --lora-dir"),
        ("rank32", "has rank 32, above this engine's max_lora_rank=16"),
        ("other", "(an adapter for another model?)"),
        ("broken", "adapter_config.json"),
    ]
    for path, said in cases:
        r = load(server.url, "x", path)
        assert r.status_code == 400 and said in r.json()["error"]["message"], (path, r.text)
    for name in ("a", BASE):  # an adapter's name, a model's
        r = load(server.url, name, "a")
        assert r.status_code == 400, r.text
    assert httpx.post(server.url + "/v1/load_lora_adapter", timeout=30,
                      json={"lora_name": "x", "lora_path": "a"}).status_code == 401  # no admin key
    assert load(server.url, "", "a").status_code == 400
    assert all(ids == [BASE, "a", "b"] for ids in models_by_gateway(server.url).values())
    assert engine_loras(server) == {0: {"a", "b"}, 1: {"a", "b"}}


def test_sagemakers_adapter_routes_load_and_delete(server, lora_dir):
    write_adapter(tiny_random_hf(), lora_dir / "d", 11, **RUNTIME)
    r = httpx.post(server.url + "/adapters", headers=AUTH, timeout=330, json={"name": "d", "src": str(lora_dir / "d")})
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "d" and r.json()["engines"] == 2 and r.json()["status"] == "loaded"
    assert completion_statuses(server.url, "d", 20) == [200] * 20
    r = httpx.delete(server.url + "/adapters/d", headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "unloaded", r.text
    assert httpx.delete(server.url + "/adapters/d", headers=AUTH, timeout=60).status_code == 404


def test_engines_that_start_later_load_the_adapters_the_cluster_serves(server, lora_dir):
    write_adapter(tiny_random_hf(), lora_dir / "e", 12, **RUNTIME)
    assert load(server.url, "e", "e").status_code == 200
    old = {p["index"]: p["pid"] for p in procs(server, "engine")}
    os.kill(old[0], signal.SIGKILL)
    wait_until(lambda: any(p["index"] == 0 and p["state"] == "ready" and p["pid"] != old[0]
                           for p in procs(server, "engine")), 120, 0.2, "engine 0's replacement")
    assert engine_loras(server)[0] == {"a", "b", "e"}  # (it lists them before it is ready)
    assert completion_statuses(server.url, "e", 40) == [200] * 40
    # A rolling restart replaces every process; the new ones serve what the cluster serves.
    r = subprocess.run([*LAUNCH, "reload", "--port", str(server.port)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not {p["pid"] for p in procs(server, "engine")} & set(old.values())
    assert engine_loras(server) == {0: {"a", "b", "e"}, 1: {"a", "b", "e"}}
    assert all(ids == [BASE, "a", "b", "e"] for ids in models_by_gateway(server.url).values())
    assert completion_statuses(server.url, "e", 40) == [200] * 40
    assert "lora: a, b, e" in subprocess.run([*LAUNCH, "status", "--port", str(server.port)], cwd=ROOT,
                                             capture_output=True, text=True, timeout=30).stdout
    assert status(server)["cluster_version"] > 0


def test_an_adapter_that_cannot_load_is_a_boot_error_naming_it(adapters):
    # Rank 8 above --max-lora-rank 4: the engine refuses it before it says ready, and launch stops at once.
    r = subprocess.run([*LAUNCH, "api-server", "--port", "0", *TINY, "--max-lora-rank", "4", "--lora-modules",
                        f"a={adapters['a']}"], cwd=ROOT, capture_output=True, timeout=90)
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert "error: engine 0 cannot start" in err and "adapter 'a' has rank 8, above this engine's max_lora_rank=4" \
        in err, err
    assert "restarting it in" not in err and "engine 0 ready" not in err, err
