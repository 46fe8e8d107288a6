"""Engine operations from any gateway, acknowledged by every engine (issue 29): sleep and wake under load, a weight
update under 64 concurrent requests, the prefix-cache reset, profiling and aborts — each called through one gateway
and checked through the other, on 2 gateways and 2 engines (tiny-random: what is checked does not depend on what
the model writes, only on which weights wrote it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import zmq

from protocol.kv_events import AllBlocksCleared, BlockStored, chain_root, decode_batch, prefix_hashes
from tests.helpers import (
    LAUNCH,
    ROOT,
    Server,
    StreamResult,
    Traffic,
    collect_finishes,
    pinned_client,
    run_stream,
    status,
    stream_body,
    wait_until,
)

from .tiny_checkpoint import write_tiny_checkpoint

MODEL = "tiny-random"
PROMPTS = [f"Question {i}: what comes after {i}?" for i in range(8)]


@pytest.fixture(scope="module")
def profiler_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def server(profiler_dir) -> Iterator[Server]:
    s = Server("--count", "2", "--engines", "2", "--model", MODEL, "--dtype", "float32", "--max-num-seqs", "16",
               "--profiler-dir", str(profiler_dir), "--scaling-wait", "60", log_name="engine-ops")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gateways(server) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """One client pinned to each gateway: calls go through one, checks through the other."""
    found: dict[int, httpx.Client] = {}
    extra = []
    for _ in range(64):
        c = pinned_client(server.url, timeout=300)
        index = c.get("/load").json()["gateway"]
        (extra if index in found else []).append(c)
        found.setdefault(index, c)
        if len(found) == 2:
            break
    assert len(found) == 2, "the kernel never gave a connection to the second gateway"
    yield found[0], found[1]
    for c in [*found.values(), *extra]:
        c.close()


def greedy(client: httpx.Client, prompt: str) -> str:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    body = r.json()
    assert all(e["ok"] for e in body.get("engines", [])), body
    return body


def test_sleep_holds_requests_frees_memory_and_wake_serves_them(server, gateways):
    a, b = gateways
    with Traffic(server.url, MODEL, workers=3, keepalive=False) as traffic:
        asleep = ok(a.post("/sleep", json={"level": 2}))
        assert [e["engine"] for e in asleep["engines"]] == [0, 1] and asleep["models"] == [MODEL]
        assert b.get("/is_sleeping").json()["is_sleeping"] is True  # the other gateway says so at once
        assert [e["sleeping"] for e in b.get("/weight_info").json()["engines"]] == [2, 2]
        held = StreamResult()
        reader = threading.Thread(target=run_stream, args=(server.url, stream_body(8), held))
        reader.start()
        done_before = traffic.ok
        wait_until(lambda: status(server)["processes"][0].get("sleeping") == 2, 30, what="launch status to say so")
        assert not held.done and held.chunks == 0  # held while the model sleeps
        woken = ok(b.post("/wake_up", params={"tags": ["weights", "kv_cache"]}))
        reader.join(60)
        assert held.done and held.error is None and held.chunks >= 1
        wait_until(lambda: traffic.ok > done_before + 3, 60, what="traffic to flow again after the wake")
    assert traffic.failed == []  # held, never refused: the sleep was shorter than --scaling-wait
    assert a.get("/is_sleeping").json() == {"is_sleeping": False, "models": {}, "gateway": 0}
    for slept, awake in zip(asleep["engines"], woken["engines"]):
        # Level 2 frees the weights and the KV pages: less resident memory asleep, more once woken.
        assert slept["after"]["rss_bytes"] < slept["before"]["rss_bytes"], slept
        assert awake["after"]["rss_bytes"] > awake["before"]["rss_bytes"], awake
    print("resident MiB before/asleep/awake:", [(e["before"]["rss_bytes"] >> 20, e["after"]["rss_bytes"] >> 20,
                                                  w["after"]["rss_bytes"] >> 20)
                                                 for e, w in zip(asleep["engines"], woken["engines"])])


def test_an_operation_waits_for_running_requests_and_refuses_a_second_one(server, gateways):
    a, b = gateways
    long = StreamResult()
    reader = threading.Thread(target=run_stream, args=(server.url, stream_body(6000), long))
    reader.start()
    wait_until(lambda: long.chunks >= 2, 60, what="the stream to start")
    busy = b.post("/reset_prefix_cache")  # requests run: refused, nothing changed
    assert busy.status_code == 409 and "reset_running" in busy.json()["error"]["message"], busy.text
    with ThreadPoolExecutor(1) as pool:
        sleeping = pool.submit(a.post, "/sleep", json={"level": 1})  # waits for the stream to end
        wait_until(lambda: [h["reason"] for h in b.get("/status").json()["holds"]] == ["sleeping"], 30,
                   what="the model's requests to be held")
        assert b.get("/is_sleeping").json()["is_sleeping"] is False  # not asleep before every engine is
        second = b.post("/wake_up")
        assert second.status_code == 409 and second.json()["error"]["code"] == "busy", second.text
        assert not sleeping.done() and long.error is None  # the sleep waits: the stream goes on
        at = long.chunks
        wait_until(lambda: long.chunks > at + 5, 60, what="the stream to go on")
        long.leave.set()  # its client leaves: the request ends, and the engine can sleep
        reader.join(120)
        ok(sleeping.result(120))
    ok(b.post("/wake_up"))


def test_reset_prefix_cache_empties_every_engine(server, gateways):
    a, b = gateways
    body = {"model": MODEL, "prompt": "The same long system prompt, again and again. " * 12, "max_tokens": 2}

    def cached(client: httpx.Client) -> int:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert max(cached(c) for c in (a, b, a, b, a, b)) > 0  # both engines have it by now
    reset = ok(a.post("/reset_prefix_cache"))
    assert sorted(e["engine"] for e in reset["engines"]) == [0, 1] and any(e["cached_blocks"] for e in reset["engines"])
    assert cached(b) == 0  # whichever engine serves it


def test_engines_publish_their_kv_cache_events_in_vllms_format(server, gateways):
    """Every engine publishes what its prefix cache stores and forgets: the hashes a gateway computes from the token
    ids alone, and a reset's AllBlocksCleared; a late subscriber replays what it missed."""
    a, b = gateways
    sources = b.get("/kv_event_sources").json()["sources"]
    assert sorted(s["engine"] for s in sources) == [0, 1] and all(s["endpoint"].startswith("ipc://") for s in sources)
    ctx = zmq.Context.instance()
    subs = []
    for s in sources:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, s["topic"].encode())
        sub.connect(s["endpoint"])
        subs.append(sub)
    ids = list(range(1000, 1000 + 64))  # four full blocks of 16
    want = prefix_hashes(ids, 16, chain_root(MODEL))
    stored: list[int] = []
    cleared = False

    def read() -> None:
        nonlocal cleared
        for sub in subs:
            while sub.poll(0):
                _, _, payload = sub.recv_multipart()
                for e in decode_batch(payload)[1]:
                    stored.extend(getattr(e, "block_hashes", ()) if isinstance(e, BlockStored) else ())
                    cleared = cleared or isinstance(e, AllBlocksCleared)

    def sent_until_stored() -> bool:  # (a subscription takes a moment: a request until its events arrive)
        r = a.post("/inference/v1/generate", json={"model": MODEL, "token_ids": ids,
                                                   "sampling_params": {"max_tokens": 1, "temperature": 0}})
        assert r.status_code == 200, r.text
        read()
        return set(want) <= set(stored)

    wait_until(sent_until_stored, 60, 0.2, "the engine's BlockStored events")
    ok(b.post("/reset_prefix_cache"))
    wait_until(lambda: read() or cleared, 30, 0.05, "AllBlocksCleared")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(sources[0]["replay_endpoint"])
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed = []
    while not replayed or replayed[-1][0] != (-1).to_bytes(8, "big", signed=True):
        assert dealer.poll(5000), replayed
        replayed.append(dealer.recv_multipart()[1:])
    assert [int.from_bytes(f[0], "big") for f in replayed[:-1]] == list(range(len(replayed) - 1))  # from 0, no gap
    for sock in (*subs, dealer):
        sock.close(0)


def test_profiles_are_written_by_every_engine(server, gateways, profiler_dir):
    a, b = gateways
    ok(a.post("/start_profile"))
    for p in PROMPTS[:4]:
        greedy(b, p)
    stopped = ok(b.post("/stop_profile"))
    traces = [Path(e["trace"]) for e in stopped["engines"]]
    assert sorted(t.parent for t in traces) == [profiler_dir] * 2
    assert sorted(t.name.split("-")[1] for t in traces) == ["0", "1"]  # named by engine (and time)
    for t in traces:
        assert "traceEvents" in json.loads(t.read_text())  # a Chrome trace
    assert b.post("/stop_profile").status_code == 409  # not profiling any more


def test_aborts_reach_the_request_through_another_gateway(server, gateways):
    a, b = gateways
    finish: list[str | None] = []

    def generate() -> None:
        with a.stream("POST", "/inference/v1/generate", json={
                "model": MODEL, "token_ids": [1, 2, 3, 4], "request_id": "rl-rollout-7", "stream": True,
                "sampling_params": {"max_tokens": 2000, "ignore_eos": True}}) as r:
            collect_finishes(r, finish)

    reader = threading.Thread(target=generate)
    reader.start()
    wait_until(lambda: len(finish) >= 2, 60, what="the generation to stream")
    r = b.post("/abort_requests", json={"request_ids": ["rl-rollout-7", "never-sent"]})
    assert r.status_code == 200 and r.json() == {"aborted": ["rl-rollout-7"], "unknown": ["never-sent"]}, r.text
    reader.join(60)
    assert finish[-1] == "abort" and len(finish) < 2000

    # Any request, by its X-Request-Id, through vLLM's other path of the route.
    chat: list[str | None] = []

    def chat_stream() -> None:
        with a.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "chat-42"}, json={
                "model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 2000,
                "ignore_eos": True, "stream": True}) as r:
            collect_finishes(r, chat)

    reader = threading.Thread(target=chat_stream)
    reader.start()
    wait_until(lambda: len(chat) >= 2, 60, what="the chat to stream")
    assert b.post("/inference/v1/abort_requests", json={"request_ids": ["chat-42"]}).json()["aborted"] == ["chat-42"]
    reader.join(60)
    assert chat[-1] == "abort"


def test_bad_operations_change_nothing(server, gateways, tmp_path):
    a, b = gateways
    cases = [("/sleep", {"level": 3}, 400), ("/sleep", {"level": "2"}, 400), ("/sleep", {"model": "nope"}, 404),
             ("/wake_up", {"tags": ["brains"]}, 400), ("/wake_up", {"tags": []}, 400),
             ("/update_weights", {}, 400), ("/update_weights", {"path": str(tmp_path / "none")}, 400),
             ("/update_weight_version", {}, 400), ("/abort_requests", {"request_ids": []}, 400),
             ("/reset_prefix_cache", {"unknown": 1}, 400)]
    for route, body, code in cases:
        r = a.post(route, json=body)
        assert r.status_code == code and "error" in r.json(), (route, body, r.text)
    assert b.get("/is_sleeping").json()["is_sleeping"] is False
    assert {e["weight_version"] for e in b.get("/weight_info").json()["engines"]} == {"default"}


def test_weight_update_under_load_never_mixes_weights(server, gateways, tmp_path):
    a, b = gateways
    old = {p: greedy(a, p) for p in PROMPTS}
    # A checkpoint of another architecture is refused by every engine: 400, and every engine serves the old weights.
    from tests.unit.hf_checkpoints import write_checkpoint

    other = write_checkpoint(tmp_path / "llama-other", "llama")
    refused = b.post("/update_weights", json={"path": str(other), "version": "wrong"})
    assert refused.status_code == 400 and "engine 0" in refused.json()["error"]["message"], refused.text
    assert {greedy(b, p) for p in PROMPTS[:2]} == {old[p] for p in PROMPTS[:2]}

    new_dir = write_tiny_checkpoint(tmp_path / "tiny-v2")
    urls = [server.url] * 64
    with ThreadPoolExecutor(16) as pool, httpx.Client(base_url=server.url, timeout=300) as c:
        futures = [pool.submit(lambda i: (PROMPTS[i % 8], greedy(c, PROMPTS[i % 8])), i) for i in range(len(urls))]
        wait_until(lambda: sum(f.done() for f in futures) >= 4, 60, what="the first responses")
        updated = ok(a.post("/update_weights", json={"update_info": {"path": str(new_dir), "version": "v2"}}))
        results = [f.result(300) for f in futures]
    new = {p: greedy(b, p) for p in PROMPTS}
    assert sum(old[p] != new[p] for p in PROMPTS) >= 6  # the two checkpoints write differently
    for prompt, text in results:
        assert text in (old[prompt], new[prompt]), (prompt, text)  # wholly old or wholly new weights
    assert updated["pause_s"] is not None and [e["version"] for e in updated["engines"]] == ["v2", "v2"]
    info = b.get("/weight_info").json()
    assert info["models"] == {MODEL: "v2"} and [e["weight_version"] for e in info["engines"]] == ["v2", "v2"]
    assert b.get("/v1/models").json()["data"][0]["weight_version"] == "v2"
    assert f'zserve_model_weight_version_info{{model="{MODEL}",version="v2"}} 1.0' in b.get("/metrics").text
    assert {p["weight_version"] for p in status(server)["processes"] if p["tier"] == "engine"} == {"v2"}
    ok(b.post("/update_weight_version", json={"version": "v2.1"}))
    assert a.get("/weight_info").json()["models"] == {MODEL: "v2.1"}
    assert b.get("/get_world_size").json() == {"world_size": 2, "models": {MODEL: 2}}
    print("weight update: admission held", updated["pause_s"], "s; whole operation", updated["seconds"], "s")


def test_engines_that_start_later_start_in_the_clusters_condition(server, gateways):
    """After the update above: a killed engine's replacement and an added engine read the new weights (v2.1's
    label), and one that starts while the model sleeps is put to sleep with it."""
    a, b = gateways
    ok(a.post("/sleep", json={"level": 1}))
    old = {p["index"]: p["pid"] for p in status(server)["processes"] if p["tier"] == "engine"}
    os.kill(old[0], signal.SIGKILL)
    wait_until(lambda: any(p["tier"] == "engine" and p["index"] == 0 and p["pid"] not in (None, old[0])
                           and p["state"] == "ready" and p.get("sleeping") == 1 for p in status(server)["processes"]),
               120, 0.2, "engine 0's replacement to be put to sleep")
    assert b.get("/is_sleeping").json()["is_sleeping"] is True
    ok(b.post("/wake_up"))
    r = subprocess.run([*LAUNCH, "scale", "engine", "3", "--port", str(server.port), "--timeout", "120"], cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    wait_until(lambda: len([e for e in a.get("/weight_info").json()["engines"] if e["state"] == "ready"]) == 3, 120,
               0.2, "the third engine")
    engines = a.get("/weight_info").json()["engines"]
    assert [(e["weight_version"], e["sleeping"]) for e in engines] == [("v2.1", 0)] * 3
    new_outputs = {p: greedy(a, p) for p in PROMPTS[:3]}
    for _ in range(2):  # whichever engine serves them, the new weights write the same
        assert {p: greedy(b, p) for p in PROMPTS[:3]} == new_outputs
