"""A client that leaves before its answer ends is counted as 499 (nginx's convention) in
``zserve_http_requests_total``, never as a 500: on every generation route, mid-stream and before a non-streamed
answer. The client is a raw socket, closed once the request is known to be generating."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from tests.helpers import wait_until

LONG = 4000  # tokens: far more than are generated before the client leaves
CHAT = [{"role": "user", "content": "Tell me a long story."}]
ROUTES = {
    "/v1/completions": {"model": "tiny-random", "prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True,
                        "temperature": 0},
    "/v1/chat/completions": {"model": "tiny-random", "messages": CHAT, "max_tokens": LONG, "ignore_eos": True,
                             "temperature": 0},
    "/v1/messages": {"model": "tiny-random", "messages": CHAT, "max_tokens": LONG, "temperature": 0},
    "/v1/responses": {"model": "tiny-random", "input": "Tell me a long story.", "max_output_tokens": LONG,
                      "temperature": 0, "store": False},
    "/inference/v1/generate": {"model": "tiny-random", "token_ids": [1, 2, 3],
                               "sampling_params": {"max_tokens": LONG, "ignore_eos": True, "temperature": 0}},
}


def _requests_by_status(url: str) -> dict[tuple[str, str], float]:
    """zserve_http_requests_total by (route, status), summed over methods, as /metrics shows them."""
    counts: dict[tuple[str, str], float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("zserve_http_requests_total{"):
            head, value = line.rsplit(" ", 1)
            labels = dict(kv.split("=", 1) for kv in head[head.index("{") + 1:-1].split(","))
            key = (labels["route"].strip('"'), labels["status"].strip('"'))
            counts[key] = counts.get(key, 0) + float(value)
    return counts


def _server_errors(counts: dict[tuple[str, str], float]) -> float:
    return sum(v for (_, status), v in counts.items() if status.startswith("5"))


def _running(url: str) -> int:
    return sum(e["running"] or 0 for e in httpx.get(url + "/load", timeout=10).json()["engines"])


def _post(url: str, path: str, body: dict) -> socket.socket:
    """Send a POST on a socket of its own (read it, or close it to leave)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    data = orjson.dumps(body)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), parts.netloc.encode(), len(data), data))
    return sock


@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "before-the-answer"])
@pytest.mark.parametrize("path", list(ROUTES))
def test_a_client_that_leaves_is_counted_as_499_not_as_a_server_error(tiny_server, path, stream):
    url = tiny_server.url
    wait_until(lambda: _running(url) == 0, 30, what="an idle engine")  # (what an earlier test started has ended)
    before = _requests_by_status(url)
    sock = _post(url, path, {**ROUTES[path], "stream": stream})
    try:
        if stream:  # leave once the first event arrived
            got = b""
            while b"data: " not in got:
                chunk = sock.recv(65536)
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 200"), got
        else:  # leave while the answer is being generated
            wait_until(lambda: _running(url) >= 1, 30, what="the request to run")
    finally:
        sock.close()

    def counted() -> dict | None:
        now = _requests_by_status(url)
        return now if now.get((path, "499"), 0) > before.get((path, "499"), 0) else None

    after = wait_until(counted, 10, what=f"a 499 for {path}")  # each gateway writes its numbers every 0.5 s
    assert after[(path, "499")] == before.get((path, "499"), 0) + 1
    assert _server_errors(after) == _server_errors(before), {k: v for k, v in after.items() if k[1][0] == "5"}
    wait_until(lambda: _running(url) == 0, 10, what="the engine to drop the request")  # aborted: nothing left
