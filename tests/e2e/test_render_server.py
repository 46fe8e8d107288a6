"""`launch render`: gateways with no engine anywhere, answering what a request would send to one.

The ids it renders are checked against a tiny-random api-server (SmolLM2's tokenizer and chat
template) twice over: the api-server's own render routes answer the same, and its engine shows the
ids are the ones it gets — a real request's ``usage.prompt_tokens`` counts them, and the engine
scores the prompt (completions: ``echo`` + ``logprobs``) or the first token after it (chat:
``top_logprobs``) exactly as it does when handed the rendered ids on ``/inference/v1/generate``.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.helpers import LAUNCH, ROOT, Server, status, wait_until

MODEL = "tiny-random"
CHAT = {"model": MODEL, "messages": [{"role": "system", "content": "Answer briefly."},
                                     {"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 8, "seed": 7, "stop": ["\n\n"]}
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def render_server() -> Iterator[Server]:
    s = Server("--count", "2", "--model", MODEL, subcommand="render", log_name="render")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def render(render_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=render_server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def api(tiny_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        yield c


def ok(r: httpx.Response) -> dict | list:
    assert r.status_code == 200, r.text
    return r.json()


def without_ids(rendered: dict) -> dict:
    return {k: v for k, v in rendered.items() if k != "request_id"}


def test_render_server_runs_no_engine_and_never_imports_torch(render_server):
    kids = render_server.descendants()
    titles = sorted(" ".join(p.cmdline()).strip() for p in kids)  # their process titles: "zserve: engine 0", ...
    assert titles == ["zserve: gateway 0", "zserve: gateway 1", "zserve: preload gateway"], titles  # (no engines')
    for p in kids:  # torch's shared libraries are mapped into any process that imported it
        assert not [m.path for m in p.memory_maps() if "torch" in m.path]
    st = status(render_server)
    assert st["desired"] == {"gateway": 2, "engine": 0}
    assert sorted((p["tier"], p["state"]) for p in st["processes"]) == [("gateway", "ready")] * 2
    out = subprocess.run([*LAUNCH, "status", "--port", str(render_server.port)], cwd=ROOT, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    assert "no engine (render only)" in out
    scale = subprocess.run([*LAUNCH, "scale", "engine", "1", "--port", str(render_server.port), "--no-wait"],
                           cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert scale.returncode != 0 and "no engine tier" in scale.stderr


def test_health_ping_models_and_metrics_need_no_engine(render):
    health = {"status": "ok", "engines_ready": 0, "engines_desired": 0, "paused": False,
              "models": {MODEL: {"engines_ready": 0, "engines_desired": 0}}}
    assert ok(render.get("/health")) == health
    assert ok(render.get("/ping")) == health and ok(render.post("/ping")) == health
    models = ok(render.get("/v1/models"))["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, 8192)]  # the model's own, from its GGUF
    render.post("/v1/completions/render", json={"prompt": "hi"})
    counted = 'zserve_http_requests_total{method="POST",route="/v1/completions/render",status="200"}'

    def scrape() -> bool:  # the other gateway, if it served the post, counts it with its next metrics flush
        metrics = render.get("/metrics")
        assert metrics.status_code == 200
        return counted in metrics.text

    wait_until(scrape, 10, what="the render request in /metrics")


def test_tokenize_and_detokenize_answer_as_on_the_api_server(render, api):
    for body in ({"prompt": PROMPTS[0]}, {"messages": CHAT["messages"], "return_token_strs": True}):
        assert ok(render.post("/tokenize", json=body)) == ok(api.post("/tokenize", json=body))
    ids = ok(render.post("/tokenize", json={"prompt": PROMPTS[1]}))["tokens"]
    assert ok(render.post("/detokenize", json={"tokens": ids})) == {"prompt": PROMPTS[1]}


def test_chat_render_is_what_the_engine_gets(render, api):
    got = ok(render.post("/v1/chat/completions/render", json=CHAT))
    assert without_ids(got) == without_ids(ok(api.post("/v1/chat/completions/render", json=CHAT)))
    ids = got["token_ids"]
    assert got["request_id"].startswith("chatcmpl-") and got["model"] == MODEL and got["n"] == 1
    assert got["prompt"].endswith("<|im_start|>assistant\n") and "What is the capital of France?" in got["prompt"]
    assert ok(render.post("/tokenize", json={"messages": CHAT["messages"]}))["tokens"] == ids
    sp = got["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["seed"], sp["top_k"]) == (8, 0.0, 7, 0)
    assert got["text_options"] == {"stop": ["\n\n"], "include_stop_str_in_output": False, "skip_special_tokens": True}
    # Without max_tokens the engine gets the rest of the context.
    rest = ok(render.post("/v1/chat/completions/render", json={**CHAT, "max_tokens": None}))
    assert rest["sampling_params"]["max_tokens"] == 8192 - len(ids)

    # The engine's side: the chat route's prompt has len(ids) tokens, and the first token after it is
    # scored exactly as after the rendered ids sent as they are.
    chat = ok(api.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": 5}))
    assert chat["usage"]["prompt_tokens"] == len(ids)
    gen = ok(api.post("/inference/v1/generate", json={"model": MODEL, "token_ids": ids,
                                                      "sampling_params": {"max_tokens": 1, "temperature": 0,
                                                                          "logprobs": 5}}))
    via_chat = sorted(t["logprob"] for t in chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"])
    via_ids = sorted(t["logprob"] for t in gen["choices"][0]["logprobs"]["content"][0]["top_logprobs"])
    assert via_chat == pytest.approx(via_ids, abs=1e-3)


def test_completion_render_is_what_the_engine_gets_for_each_prompt(render, api):
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 3, "n": 2, "seed": 1, "temperature": 0.5}
    got = ok(render.post("/v1/completions/render", json=body))
    assert [without_ids(r) for r in got] == [without_ids(r) for r in ok(api.post("/v1/completions/render", json=body))]
    assert [r["prompt"] for r in got] == PROMPTS
    assert all(r["n"] == 2 and r["sampling_params"]["max_tokens"] == 3 for r in got)
    for text, r in zip(PROMPTS, got):
        ids = r["token_ids"]
        assert ok(render.post("/tokenize", json={"prompt": text, "add_special_tokens": False}))["tokens"] == ids
        # The engine scores every prompt token the same whether the text or the rendered ids are sent.
        echo = ok(api.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0,
                                                    "echo": True, "logprobs": 0}))
        assert echo["usage"]["prompt_tokens"] == len(ids)
        via_text = echo["choices"][0]["logprobs"]["token_logprobs"][:len(ids)]
        gen = ok(api.post("/inference/v1/generate", json={"model": MODEL, "token_ids": ids,
                                                          "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}}))
        via_ids = [p["logprob"] for p in gen["prompt_logprobs"]]
        assert via_text[0] is None and via_ids[0] is None
        assert via_text[1:] == pytest.approx(via_ids[1:], abs=1e-3)
    # A prompt given as ids renders as those ids, with their text beside them.
    [as_ids] = ok(render.post("/v1/completions/render", json={"model": MODEL, "prompt": got[0]["token_ids"]}))
    assert as_ids["token_ids"] == got[0]["token_ids"] and as_ids["prompt"] == PROMPTS[0]
    assert as_ids["sampling_params"]["max_tokens"] == 16  # the completions route's default


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions/render", {**CHAT, "messages": []}),
    ("/v1/chat/completions/render", {**CHAT, "model": "nope"}),
    ("/v1/chat/completions/render", {**CHAT, "max_tokens": 9000}),  # past the model's 8192
    ("/v1/chat/completions/render", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("/v1/chat/completions/render", {**CHAT, "response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "x", "schema": 3}}}),
    ("/v1/completions/render", {"model": MODEL, "prompt": "hi", "suffix": "x"}),
    ("/v1/completions/render", {"model": MODEL, "prompt": [], "max_tokens": 2}),
    ("/v1/completions/render", {"model": MODEL, "prompt": [49152]}),
])
def test_render_refuses_what_the_route_refuses(render, api, path, body):
    mine, theirs = render.post(path, json=body), api.post(path, json=body)
    assert mine.status_code in (400, 404) and mine.status_code == theirs.status_code
    assert mine.json() == theirs.json()
    generating = path.removesuffix("/render")
    assert api.post(generating, json=body).json() == theirs.json()  # the same checks as the generation route


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
    ("/inference/v1/generate", {"model": MODEL, "token_ids": [1, 2, 3]}),
    ("/v1/responses", {"model": MODEL, "input": "hi"}),
    ("/invocations", CHAT),
])
def test_generation_routes_say_the_server_renders_only(render, path, body):
    r = render.post(path, json=body, timeout=10)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "render_only" and "render-only server" in err["message"]


def test_anthropic_messages_refuse_in_anthropic_shape(render):
    r = render.post("/v1/messages", json={"model": MODEL, "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "render-only server" in body["error"]["message"]
    counted = render.post("/v1/messages/count_tokens", json={"model": MODEL,
                                                            "messages": [{"role": "user", "content": "hi"}]})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


def test_sigterm_stops_a_render_server_cleanly():
    s = Server("--model", MODEL, subcommand="render", log_name="render-stop")
    kids = s.descendants()
    assert kids
    assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    assert s.stop(signal.SIGTERM) == 0
    assert not [p for p in kids if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_invalid_arguments_fail_fast_naming_the_flag():
    for args, flag in [(["--count", "0"], "--count"), (["--max-model-len", "8"], "--max-model-len"),
                       (["--engines", "1"], "--engines"), (["--tool-call-parser", "nope"], "--tool-call-parser")]:
        r = subprocess.run([*LAUNCH, "render", "--model", MODEL, *args], cwd=ROOT, capture_output=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert flag in r.stderr.decode(), r.stderr
