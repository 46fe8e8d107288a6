"""Fuzzing a real server: every operation of its live ``/openapi.json`` with schemathesis, then hostile HTTP
(a slow body, huge headers, broken and extreme JSON). Nothing may answer 5xx or take a process down.

The server is this module's own (one gateway, tiny-random): fuzzing pauses nothing and loads nobody else's.
``--max-model-len 128`` bounds what a generated request can ask the engine for. Generation is derandomized,
so a failure reproduces on the next run; schemathesis prints the request that failed.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.helpers import TINY, Server, complete, status, wait_until

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
BODY_TIMEOUT_S = 3.0  # --body-timeout (default 10 s)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[Server]:
    s = Server("--count", "1", *TINY, "--max-model-len", "128", "--max-num-seqs", "16", "--body-timeout",
               str(BODY_TIMEOUT_S), log_name="fuzz")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def pids(fuzz_server) -> dict[str, int]:
    """Every process of the server by name, before anything hostile happened."""
    return _pids(fuzz_server)


def _pids(server: Server) -> dict[str, int]:
    st = status(server)
    return {"supervisor": st["pid"], **{f"{p['tier']} {p['index']}": p["pid"] for p in st["processes"]}}


@pytest.fixture(scope="module")
def api_schema(fuzz_server, pids):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


def _assert_still_serving(server: Server, pids: dict[str, int]) -> None:
    r = complete(server.url)
    assert r.status_code == 200, r.text
    assert _pids(server) == pids, "a process of the server was replaced"
    # Nothing a refused request started stays counted in flight (it would hold a drain up forever).
    wait_until(lambda: httpx.get(server.url + "/load", timeout=10).json()["in_flight"] == 0, 10,
               what="no request left in flight")


# POST /pause and /sleep are left out: a paused or sleeping server answers generation with a deliberate 503 (held
# first, up to --scaling-wait), which is not a fault. So are /reload and /scale: replacing or adding processes is what
# they are for (the survival checks compare every process's pid).
NOT_FUZZED = {("POST", "/pause"), ("POST", "/sleep"), ("POST", "/reload"), ("POST", "/scale")}
FUZZ = settings(max_examples=6, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck))


def _fuzz(operation) -> str | None:
    """Run one operation's generated requests (valid and invalid bodies); the first failure, or None."""
    strategy = st.one_of(*(operation.as_strategy(mode) for mode in GenerationMode))

    @FUZZ
    @given(case=strategy)
    def run(case) -> None:
        # Most bodies name a model; naming the served one takes them past the model lookup into the handler.
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = "tiny-random"
        case.call_and_validate(checks=CHECKS, timeout=60)

    try:
        run()
    except Exception as e:  # every failure is reported, with the request that caused it
        return f"{operation.method.upper()} {operation.path}: {e}"
    return None


def test_no_operation_fails_on_generated_requests(api_schema) -> None:
    # schemathesis' own pytest parametrization cannot run under this pytest; one test loops over the live
    # document's operations instead (plugins' routes included) and reports every operation that failed.
    operations = [r.ok() for r in api_schema.get_all_operations()]
    assert len(operations) > 30
    failures = [f for op in operations if (op.method.upper(), op.path) not in NOT_FUZZED
                if (f := _fuzz(op)) is not None]
    assert not failures, "\n\n".join(failures)


def test_server_survives_the_fuzzing(fuzz_server, pids) -> None:
    _assert_still_serving(fuzz_server, pids)


# -- hostile HTTP --------------------------------------------------------------------------------------

def _raw(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def _status_line(data: bytes) -> int:
    return int(data.split(b" ", 2)[1])


def test_slow_body_gets_a_408_without_holding_up_others(fuzz_server, pids) -> None:
    length = 1000
    s = _raw(fuzz_server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n{" % length)
    start = time.monotonic()
    answer, others_ok = b"", False
    try:
        while time.monotonic() - start < BODY_TIMEOUT_S + 15:
            try:
                s.sendall(b" ")
            except OSError:  # closed by the server: also an answer
                break
            s.settimeout(0.5)  # the deliberate pacing: one byte per half second
            try:
                got = s.recv(65536)
            except TimeoutError:
                got = None
            if got is not None:
                answer = got
                break
            if not others_ok and time.monotonic() - start > 1:
                t0 = time.monotonic()
                assert complete(fuzz_server.url).status_code == 200  # the slow client holds nobody up
                assert time.monotonic() - t0 < 5
                others_ok = True
    finally:
        s.close()
    took = time.monotonic() - start
    assert others_ok
    assert BODY_TIMEOUT_S <= took < BODY_TIMEOUT_S + 5, f"the slow body was not cut off at --body-timeout ({took:.1f}s)"
    assert answer == b"" or _status_line(answer) == 408, answer[:200]
    if answer:
        assert b'"error"' in answer and b"did not arrive" in answer
    _assert_still_serving(fuzz_server, pids)


def test_huge_header_is_a_4xx(fuzz_server, pids) -> None:
    # Refused by aiohttp's parser before any route is known: its plain-text 400, then the connection closes.
    s = _raw(fuzz_server)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    except OSError:
        pass  # the server may close before reading all of it
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except OSError:
        pass
    finally:
        s.close()
    assert data == b"" or 400 <= _status_line(data) < 500, data[:200]
    _assert_still_serving(fuzz_server, pids)


OPENAI_BODIES = {
    "invalid UTF-8": b'{"model": "tiny-random", "prompt": "\xff\xfe\xfd"}',
    "deeply nested": b"[" * 100_000,
    "deeply nested object": b'{"a":' * 50_000,
    "1e400": b'{"model": "tiny-random", "prompt": "hi", "temperature": 1e400}',
    "2**70 int": b'{"model": "tiny-random", "prompt": "hi", "max_tokens": %d}' % 2**70,
    "2**70 seed": b'{"model": "tiny-random", "prompt": "hi", "seed": %d}' % 2**70,
    "2**63 top_k": b'{"model": "tiny-random", "prompt": "hi", "top_k": %d}' % 2**63,
    "NaN": b'{"model": "tiny-random", "prompt": "hi", "temperature": NaN}',
    "Infinity": b'{"model": "tiny-random", "prompt": "hi", "top_p": Infinity}',
    "-Infinity": b'{"model": "tiny-random", "prompt": "hi", "presence_penalty": -Infinity}',
    "lone surrogate": b'{"model": "tiny-random", "prompt": "\\ud800"}',
    "not an object": b'"hi"',
    "empty": b"",
}


@pytest.mark.parametrize("what", list(OPENAI_BODIES))
def test_broken_json_is_a_400_in_openai_shape(fuzz_server, what) -> None:
    r = httpx.post(fuzz_server.url + "/v1/completions", content=OPENAI_BODIES[what],
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("what", ["invalid UTF-8", "deeply nested", "NaN", "2**63 top_k"])
def test_broken_json_is_a_400_in_anthropic_shape(fuzz_server, what) -> None:
    body = OPENAI_BODIES[what].replace(b'"prompt": "hi"', b'"max_tokens": 4, "messages": [{"role": "user", '
                                                         b'"content": "hi"}]')
    r = httpx.post(fuzz_server.url + "/v1/messages", content=body, headers={"Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,body", [
    # Found by fuzzing; each was a 500 from the engine wire's checks (protocol/messages.py).
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2, "seed": 2**64 - 1}),  # seed + choice overflowed
    ("/inference/v1/generate", {"token_ids": [1, 2], "request_id": "r" * 256, "sampling_params": {"max_tokens": 2}}),
])
def test_extreme_but_valid_values_are_served(fuzz_server, path, body) -> None:
    r = httpx.post(fuzz_server.url + path, json={"model": "tiny-random", **body}, timeout=30)
    assert r.status_code == 200, r.text


def test_server_survives_the_hostile_requests(fuzz_server, pids) -> None:
    _assert_still_serving(fuzz_server, pids)
