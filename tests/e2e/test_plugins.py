"""Endpoint plugins with real processes: the example plugin (examples/zserve-example-plugin, installed by
``make install-test``) answers on every gateway, ``--disable-family`` turns a family's routes into 404s, and a
plugin that takes a core route without opting in stops ``launch api-server`` at start-up, naming itself."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import TINY, Server, wait_until


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server("--count", "2", *TINY, "--disable-family", "anthropic", log_name="plugins")
    yield s
    s.stop()


def fresh(url: str) -> httpx.Client:
    """A client that opens a new connection per request, so the kernel may hand each to another gateway."""
    return httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0))


def test_the_example_plugin_answers_on_every_gateway(server):
    seen: set[int] = set()

    def both_answered() -> bool:
        with fresh(server.url) as c:
            r = c.get("/example/v1/info")
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["plugin"] == "example" and info["started_at"] is not None
        assert [m["name"] for m in info["models"]] == ["tiny-random"]
        seen.add(info["gateway"])
        return seen == {0, 1}

    wait_until(both_answered, timeout=60, interval=0.01, what="both gateways to answer /example/v1/info")
    with fresh(server.url) as c:
        r = c.post("/example/v1/reverse", json={"model": "tiny-random", "text": "hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == "dlrow olleh" and body["tokens"] == 2 and body["model"] == "tiny-random"
    log = server.tail(200_000)
    assert log.count("endpoint plugins: example (2 routes)") == 1, log  # logged once, not once per gateway


def test_a_disabled_family_answers_404_while_the_others_serve(server):
    with fresh(server.url) as c:
        gone = c.post("/v1/messages", json={"model": "tiny-random", "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "hi"}]})
        chat = c.post("/v1/chat/completions", json={"model": "tiny-random", "max_tokens": 4,
                                                    "messages": [{"role": "user", "content": "hi"}]})
    assert gone.status_code == 404, gone.text
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant", chat.text


def install_plugin(root: Path, name: str, source: str) -> Path:
    """A plugin as pip would install it: its module and its dist-info with the entry point, in ``root``."""
    root.mkdir()
    (root / f"{name}_plugin.py").write_text(textwrap.dedent(source))
    dist = root / f"{name}_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[zserve.endpoints]\n{name} = {name}_plugin:plugin\n")
    return root


def test_a_plugin_that_takes_a_core_route_without_opting_in_fails_start_up(tmp_path):
    path = install_plugin(tmp_path / "site", "hijack", """
        from aiohttp import web
        from gateway.plugins import EndpointPlugin

        routes = web.RouteTableDef()

        @routes.post("/v1/chat/completions")
        async def chat(request):
            return web.json_response({"hijacked": True})

        plugin = EndpointPlugin("hijack", routes)
    """)
    with pytest.raises(RuntimeError) as e:
        Server(*TINY, log_name="plugins-bad", env={"PYTHONPATH": str(path)}, ready_timeout=120)
    err = str(e.value)
    assert err.startswith("server exited with 1"), err
    assert re.search(r"error: gateway \d cannot start: plugin 'hijack': POST /v1/chat/completions is a route of "
                     r"the 'openai' family; list \('POST', '/v1/chat/completions'\) in its EndpointPlugin.replaces",
                     err), err
    assert "restarting it in" not in err, err
