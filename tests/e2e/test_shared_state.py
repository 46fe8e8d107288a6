"""Two gateway hosts (two `launch api-server` groups) sharing one Redis (`--state-url redis://…`, started here):
a stored response is fetched through the other host; `/pause` and `/resume` sent to one host are reported by
every gateway of both before they are answered; a LoRA adapter loaded or unloaded through one host is served (or
a 404) on both when the route answers; killing Redis mid-run crashes nothing and loses no request, and the hosts
share control again once Redis is back."""

from __future__ import annotations

import os
import shutil
import signal
import threading

import httpx
import openai
import pytest

from tests.helpers import (
    TINY,
    Traffic,
    collect_finishes,
    free_port,
    hosts_sharing,
    ready_pids,
    start_redis,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("shared-redis")
    box = {"proc": start_redis(port, workdir), "port": port, "dir": workdir}
    yield box
    stop_process(box["proc"])


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shared-lora")


@pytest.fixture(scope="module")
def hosts(redis_server, lora_dir):
    url = f"redis://127.0.0.1:{redis_server['port']}/0"
    with hosts_sharing(url, *TINY, "--enable-lora", "--lora-dir", str(lora_dir), log_name="shared-host") as ab:
        yield ab


def every_gateway(url: str, count: int = 2) -> dict[int, dict]:
    """Each gateway's own /status, by index (new connections until the kernel handed one to each)."""
    seen: dict[int, dict] = {}

    def all_seen():
        st = httpx.get(url + "/status", headers={"Connection": "close"}, timeout=10).json()
        seen[st["gateway"]] = st
        return len(seen) == count

    wait_until(all_seen, 30, 0.0, f"a connection to each of {count} gateways")
    return seen


def paused_everywhere(hosts) -> set[bool]:
    return {st["paused"] for h in hosts for st in every_gateway(h.url).values()}


def test_a_response_stored_through_one_host_is_fetched_through_the_other(hosts):
    a, b = hosts
    first = openai.OpenAI(base_url=a.url + "/v1", api_key="x", max_retries=0, timeout=60)
    other = openai.OpenAI(base_url=b.url + "/v1", api_key="x", max_retries=0, timeout=60)
    made = first.responses.create(model="tiny-random", input="hello", max_output_tokens=4, store=True)
    fetched = other.responses.retrieve(made.id)
    assert fetched.id == made.id and fetched.output_text == made.output_text


def test_pause_and_resume_on_one_host_hold_on_every_gateway_of_both(hosts):
    a, b = hosts
    r = httpx.post(a.url + "/pause", timeout=30)
    assert r.status_code == 200 and r.json()["unacknowledged"] == [], r.text
    # Answered only once every gateway of both hosts applied it: no waiting here.
    assert paused_everywhere(hosts) == {True}
    refused = httpx.post(b.url + "/v1/completions", json={"model": "tiny-random", "prompt": "x", "max_tokens": 2},
                         timeout=30)
    assert refused.status_code == 503, refused.text
    r = httpx.post(b.url + "/resume", timeout=30)
    assert r.status_code == 200 and r.json()["unacknowledged"] == [], r.text
    assert paused_everywhere(hosts) == {False}


def test_a_lora_adapter_loaded_through_one_host_is_served_by_both_when_it_answers(hosts, lora_dir):
    pytest.importorskip("peft")
    from tests.lora_adapters import tiny_random_hf, write_adapter

    a, b = hosts
    write_adapter(tiny_random_hf(), lora_dir / "shared", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])

    def complete(url: str) -> int:
        return httpx.post(url + "/v1/completions", json={"model": "shared", "prompt": "x", "max_tokens": 2},
                          headers={"Connection": "close"}, timeout=60).status_code

    r = httpx.post(a.url + "/v1/load_lora_adapter", json={"lora_name": "shared", "lora_path": "shared"}, timeout=330)
    assert r.status_code == 200, r.text
    assert [complete(h.url) for h in (b, a) for _ in range(8)] == [200] * 16  # b's gateways and engine have it
    r = httpx.post(b.url + "/v1/unload_lora_adapter", json={"lora_name": "shared"}, timeout=60)
    assert r.status_code == 200, r.text
    assert [complete(h.url) for h in (a, b) for _ in range(8)] == [404] * 16


def test_an_abort_through_one_host_ends_the_request_another_host_serves(hosts):
    a, b = hosts
    finish: list[str | None] = []

    def generate() -> None:
        with httpx.stream("POST", b.url + "/inference/v1/generate", timeout=120, json={
                "model": "tiny-random", "token_ids": [1, 2, 3], "request_id": "rollout-on-b", "stream": True,
                "sampling_params": {"max_tokens": 3000, "ignore_eos": True}}) as r:
            collect_finishes(r, finish)

    reader = threading.Thread(target=generate)
    reader.start()
    wait_until(lambda: len(finish) >= 2, 60, what="the generation on host B to stream")
    r = httpx.post(a.url + "/abort_requests", json={"request_ids": ["rollout-on-b", "nowhere"]}, timeout=30)
    assert r.status_code == 200 and r.json() == {"aborted": ["rollout-on-b"], "unknown": ["nowhere"]}, r.text
    reader.join(60)
    assert finish[-1] == "abort"


def test_losing_redis_crashes_nothing_and_control_is_shared_again_when_it_returns(hosts, redis_server):
    a, b = hosts
    pids = {h.url: (ready_pids(h, "gateway"), ready_pids(h, "engine")) for h in hosts}
    with Traffic(a.url, "tiny-random", workers=2) as ta, Traffic(b.url, "tiny-random", workers=2) as tb:
        wait_until(lambda: ta.ok >= 5 and tb.ok >= 5, 60, what="traffic on both hosts")
        os.kill(redis_server["proc"].pid, signal.SIGKILL)
        redis_server["proc"].wait()
        wait_until(lambda: "shared control state" in a.tail(20000) and "unreachable" in a.tail(20000), 30, 0.1,
                   "host a to notice Redis is gone")
        # Control still answers, for this host only, and says so.
        r = httpx.post(a.url + "/pause", timeout=30)
        assert r.status_code == 200 and r.json()["unacknowledged"], r.text
        assert {st["paused"] for st in every_gateway(a.url).values()} == {True}
        assert {st["paused"] for st in every_gateway(b.url).values()} == {False}
        assert httpx.post(a.url + "/resume", timeout=30).status_code == 200
        ok_a, ok_b = ta.ok, tb.ok
        wait_until(lambda: ta.ok >= ok_a + 5 and tb.ok >= ok_b + 5, 60, what="traffic after Redis died")
    assert not tb.failed, tb.failed  # host b was never paused: nothing of it failed
    assert all(f.startswith("503") or "503" in f for f in ta.failed), ta.failed  # only what the pause refused
    assert {h.url: (ready_pids(h, "gateway"), ready_pids(h, "engine")) for h in hosts} == pids
    redis_server["proc"] = start_redis(redis_server["port"], redis_server["dir"])
    for h in hosts:
        wait_until(lambda h=h: "reachable again" in h.tail(50000), 30, 0.1, "the hosts to reach Redis again")
    wait_until(lambda: httpx.post(b.url + "/pause", timeout=30).json()["unacknowledged"] == [], 30, 0.5,
               "a pause that every host acknowledges")
    assert paused_everywhere(hosts) == {True}
    assert httpx.post(a.url + "/resume", timeout=30).json()["unacknowledged"] == []
    assert paused_everywhere(hosts) == {False}
