"""Prefix-affine routing that every gateway agrees on (issue 30), on 3 gateways and 2 engines: one 512-token prefix
sent through every gateway on separate connections reaches one engine (the X-Zserve-Engine header says which, the
usage's cached tokens that it held the prefix); once that engine is killed the prefix settles on the other, and stays
there when the killed engine's replacement (an empty cache) is back; a gateway started afterwards routes it the same
way from its first request. Routing decisions are in /metrics, each engine's cached blocks in ``launch status``.
(tiny-random: routing depends on the prompt's tokens and the engines' cache, not on what the model writes.)"""

from __future__ import annotations

import json
import os
import random
import signal
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import TINY, Server, pinned_client, procs, wait_until

MODEL = "tiny-random"
PREFIX = [random.Random(30).randrange(1000, 20000) for _ in range(512)]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server("--count", "3", "--engines", "2", *TINY, "--max-num-seqs", "16", log_name="prefix-routing")
    yield s
    s.stop()


def pin(server: Server, index: int, tries: int = 64) -> httpx.Client:
    """A client on a connection the kernel gave to gateway ``index``."""
    for _ in range(tries):
        c = pinned_client(server.url, timeout=120)
        if c.get("/load").json()["gateway"] == index:
            return c
        c.close()
    raise AssertionError(f"no connection reached gateway {index}")


@pytest.fixture(scope="module")
def gateways(server) -> Iterator[list[httpx.Client]]:
    clients = [pin(server, i) for i in range(3)]
    yield clients
    for c in clients:
        c.close()


def ask(client: httpx.Client, suffix: int, stream: bool = False) -> tuple[int, int]:
    """(the engine that served the prefix and ``suffix``, the prompt tokens it found cached)."""
    prompt = PREFIX + [random.Random(suffix).randrange(1000, 20000) for _ in range(8)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        usage = json.loads(lines[-1][6:])["usage"]
    else:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
    return int(r.headers["X-Zserve-Engine"]), usage["prompt_tokens_details"]["cached_tokens"]


def routable(client: httpx.Client) -> set[int]:
    return {e["rank"] for e in client.get("/status").json()["engines"] if e["routable"]}


def test_one_prefix_reaches_one_engine_through_every_gateway_and_settles_on_the_other_when_it_dies(server, gateways):
    wait_until(lambda: all(routable(g) == {0, 1} for g in gateways), 60, 0.1, "both engines routable everywhere")
    first, _ = ask(gateways[0], 0)
    served = [ask(g, 100 * turn + i, stream=turn == 1) for turn in range(3) for i, g in enumerate(gateways)]
    assert {e for e, _ in served} == {first}, f"the prefix was split over engines: {served}"
    assert all(cached >= len(PREFIX) for _, cached in served), served

    def decisions() -> dict[tuple[str, str], float]:  # every gateway's, summed (each flushes within 0.5 s)
        return {(s.labels["reason"], s.labels["engine"]): s.value for f in text_string_to_metric_families(
            gateways[1].get("/metrics").text) if f.name == "zserve_routing_decisions" for s in f.samples
                if s.name.endswith("_total")}

    wait_until(lambda: sum(decisions().values()) >= 10, 10, 0.1, "every gateway's routing decisions in /metrics")
    assert decisions().get(("cache", str(first)), 0) >= 9, decisions()  # the first one found nothing cached
    engines = {p["index"]: p for p in procs(server, "engine")}
    wait_until(lambda: ({p["index"]: p for p in procs(server, "engine")}[first].get("kv_blocks_cached") or 0)
               >= len(PREFIX) // 16, 30, 0.2, "launch status to show the engine's cached blocks")

    other = 1 - first
    os.kill(engines[first]["pid"], signal.SIGKILL)
    wait_until(lambda: all(routable(g) == {other} for g in gateways), 60, 0.1, "the killed engine unroutable")
    assert ask(gateways[0], 1000)[0] == other  # the only engine left: it computes the prefix now
    wait_until(lambda: all(routable(g) == {0, 1} for g in gateways), 120, 0.2, "the replacement routable everywhere")
    assert {p["index"]: p["pid"] for p in procs(server, "engine")}[first] != engines[first]["pid"]
    served = [ask(g, 2000 + 10 * turn + i) for turn in range(2) for i, g in enumerate(gateways)]
    assert {e for e, _ in served} == {other}, f"the replacement (empty) took a request of the prefix: {served}"
    assert all(cached >= len(PREFIX) for _, cached in served), served

    # A gateway started now (gateway 2 killed and replaced) knows what every engine holds from its first request.
    old = {p["index"]: p["pid"] for p in procs(server, "gateway")}
    gateways[2].close()
    os.kill(old[2], signal.SIGKILL)
    wait_until(lambda: any(p["index"] == 2 and p["pid"] not in (None, old[2]) and p["state"] == "ready"
                           for p in procs(server, "gateway")), 120, 0.2, "gateway 2's replacement")
    gateways[2] = fresh = pin(server, 2)
    assert fresh.get("/status").json()["pid"] != old[2]
    assert ask(fresh, 3000) == (other, len(PREFIX))
