"""What a server says about itself over real HTTP: readiness (``/ready``, ``/readyz``), ``/server_info`` (an admin
route: version, models, every option with its secrets redacted, the processes from the supervisor) and
``/tokenizer_info``.

One server with every kind of secret an option can hold: API keys (``--api-key``), the admin key (from the
environment) and a Redis URL with a password (``--state-url``; its Redis is never reached by these requests, and
the host's shared control state only logs that it is down), as ``test_gateway_security`` starts its keyed server.
"""

from __future__ import annotations

import httpx
import jinja2
import pytest

from tests.helpers import Server
from zserve import __version__
from zserve.catalog import TINY_RANDOM

KEY, ADMIN, REDIS_PASSWORD = "sk-info-0123456789abcdef", "adm-info-5555aaaa", "hunter2-redis-secret"
SECRETS = (KEY, ADMIN, REDIS_PASSWORD)
AUTH, ADMIN_AUTH = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def server():
    s = Server("--model", TINY_RANDOM, "--dtype", "float32", "--count", "2", "--max-num-seqs", "4", "--api-key", KEY,
               "--state-url", f"redis://:{REDIS_PASSWORD}@127.0.0.1:1/0", log_name="server-info",
               env={"ZSERVE_ADMIN_KEY": ADMIN})
    yield s
    s.stop()


@pytest.mark.parametrize("path", ["/ready", "/readyz"])
def test_readiness_answers_ready_without_a_key_and_not_ready_while_paused(server, path):
    r = httpx.get(server.url + path, timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ready"}
    # /pause answers once every gateway applied it: whichever gateway answers the probe is not ready, then is again.
    assert httpx.post(f"{server.url}/pause", headers=ADMIN_AUTH, timeout=30).json()["paused"] is True
    try:
        for _ in range(4):
            r = httpx.get(server.url + path, timeout=30)
            assert r.status_code == 503 and r.json()["status"] == "not ready" and "paused" in r.json()["reason"]
            assert r.headers["Retry-After"] == "1"
    finally:
        assert httpx.post(f"{server.url}/resume", headers=ADMIN_AUTH, timeout=30).json()["paused"] is False
    assert httpx.get(server.url + path, timeout=30).status_code == 200


def test_server_info_is_an_admin_route(server):
    assert httpx.get(f"{server.url}/server_info", timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/server_info", headers=AUTH, timeout=30).status_code == 403


def test_server_info_describes_the_server_with_every_secret_redacted(server):
    r = httpx.get(f"{server.url}/server_info", headers=ADMIN_AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert not [s for s in SECRETS if s in r.text]
    info = r.json()
    assert info["version"] == __version__ and isinstance(info["protocol_version"], int)
    assert [m["id"] for m in info["models"]] == [TINY_RANDOM] and info["models"][0]["engines"]
    options = info["options"]
    assert options["api_keys"] == "<1 redacted>" and options["admin_keys"] == "<1 redacted>"
    assert options["gateway"]["state_url"] == "redis://:***@127.0.0.1:1/0"
    assert options["gateways"] == 2 and options["models"][0]["engine"]["max_num_seqs"] == 4
    tiers = sorted((p["tier"], p["index"]) for p in info["processes"] if p["state"] == "ready")
    assert tiers == [("engine", 0), ("gateway", 0), ("gateway", 1)]
    assert info["gateway"]["index"] in (0, 1) and info["supervisor"]["pid"] > 0


def test_tokenizer_info_is_the_models_tokenizer_configuration(server):
    r = httpx.get(f"{server.url}/tokenizer_info", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["model"] == TINY_RANDOM and info["tokenizer_class"] and info["vocab_size"] > 0
    # The chat template given is the one the server renders with, and the special tokens are the model's.
    messages = [{"role": "user", "content": "hi"}]
    prompt = jinja2.Environment().from_string(info["chat_template"]).render(messages=messages,
                                                                             add_generation_prompt=True)
    rendered = httpx.post(f"{server.url}/v1/chat/completions/render", headers=AUTH, timeout=30,
                          json={"model": TINY_RANDOM, "messages": messages}).json()
    assert rendered["prompt"] == prompt
    eos = httpx.post(f"{server.url}/tokenize", headers=AUTH, timeout=30,
                     json={"model": TINY_RANDOM, "prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == [info["eos_token_id"]]
    missing = httpx.get(f"{server.url}/tokenizer_info", params={"model": "nope"}, headers=AUTH, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
