"""``/openapi.json``, ``/docs`` and ``/redoc`` on a real server: the document is valid OpenAPI 3, lists every
route the app serves with the request schemas its handlers validate with, and both pages render offline in a
headless Chromium (Debian's ``chromium``; ``.ci/run`` installs it) with every route in their DOM.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator

import httpx
import pytest
from openapi_spec_validator import validate

from gateway.app import ROUTE_FAMILIES
from gateway.openai_schemas import MAX_N, ChatCompletionRequest

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=10000", "--dump-dom")


@pytest.fixture(scope="module")
def http(tiny_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def doc(http) -> dict:
    r = http.get("/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


def _operations(doc: dict) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}


def _family_routes() -> set[tuple[str, str]]:
    """(method, path) of every route of every route family, with aiohttp's ``{name:regex}`` as ``{name}``."""
    return {(r.method, re.sub(r"\{(\w+):[^}]*\}", r"{\1}", r.path))
            for family in ROUTE_FAMILIES.values() for r in family.routes}


def test_openapi_json_is_valid_openapi_3(doc) -> None:
    validate(doc)
    assert doc["openapi"].startswith("3.")
    assert doc["info"]["title"] == "zserve" and doc["info"]["version"]


def test_openapi_lists_every_route_of_every_family(doc) -> None:
    missing = _family_routes() - _operations(doc)
    assert not missing, f"routes the app serves but /openapi.json does not list: {sorted(missing)}"
    assert {"/openapi.json", "/docs", "/redoc", "/v1/chat/completions", "/v1/messages", "/invocations"} <= set(
        doc["paths"])


def test_every_listed_operation_is_served(doc, http) -> None:
    # The document is generated from the live router, plugins' routes included: none of its operations is
    # a path the server has no route for. (/pause would pause the server every test shares, /reload replace its
    # processes.)
    for method, path in sorted(_operations(doc) - {("POST", "/pause"), ("POST", "/reload")}):
        r = http.request(method, re.sub(r"\{\w+\}", "x", path), content=b"{}",
                         headers={"Content-Type": "application/json"})
        assert not (r.status_code in (404, 405) and "no route" in r.text), (method, path, r.text)


def test_chat_request_schema_carries_the_pydantic_constraints(doc) -> None:
    op = doc["paths"]["/v1/chat/completions"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ChatCompletionRequest"
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert schema["properties"]["n"]["maximum"] == MAX_N and schema["properties"]["n"]["minimum"] == 1
    assert set(schema["required"]) == {"messages"}
    own = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    assert schema == {k: v for k, v in own.items() if k != "$defs"}  # the very schema parse() validates with
    assert "$defs" not in doc["components"]["schemas"]
    assert "text/event-stream" in op["responses"]["200"]["content"]  # stream: true answers SSE


def test_error_shapes_are_declared_per_family(doc) -> None:
    def error_schema(path: str) -> str:
        return doc["paths"][path]["post"]["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"]

    assert error_schema("/v1/chat/completions") == "#/components/schemas/OpenAIError"
    assert error_schema("/v1/messages") == "#/components/schemas/AnthropicError"
    assert error_schema("/v1/messages/count_tokens") == "#/components/schemas/AnthropicError"
    assert doc["components"]["schemas"]["AnthropicError"]["properties"]["type"]["const"] == "error"


def test_query_parameters_come_from_the_schema_that_checks_them(doc, http) -> None:
    params = {p["name"]: p for p in doc["paths"]["/v1/responses/{response_id}/input_items"]["get"]["parameters"]}
    assert params["response_id"]["in"] == "path"
    assert params["limit"]["schema"]["maximum"] == 100 and params["order"]["schema"]["enum"] == ["asc", "desc"]
    r = http.get("/v1/responses/resp_x/input_items", params={"limit": 101})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_nothing_from_outside(http, page) -> None:
    r = http.get(page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "http://" not in r.text and "https://" not in r.text and "//" not in r.text.replace("://", "")
    for asset in re.findall(r'(?:src|href)="([^"]+)"', r.text):
        got = http.get("/" + asset)
        assert got.status_code == 200 and len(got.content) > 1000, asset


def test_unknown_docs_asset_is_a_404(http) -> None:
    r = http.get("/docs/assets/..%2F..%2Fopenapi.py")
    assert r.status_code == 404 and "error" in r.json()


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it: apt-get install chromium)")
    return path


def _render(url: str, tmp_path) -> str:
    out = subprocess.run([_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path}", url],
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-2000:]
    return out.stdout.decode()


def test_swagger_ui_renders_every_operation(tiny_server, doc, tmp_path) -> None:
    dom = _render(tiny_server.url + "/docs", tmp_path)
    shown = set(re.findall(r'data-path="([^"]+)"', dom))
    assert "/v1/chat/completions" in shown
    assert shown == set(doc["paths"]), set(doc["paths"]) ^ shown


def test_redoc_renders_every_operation(tiny_server, doc, tmp_path) -> None:
    dom = _render(tiny_server.url + "/redoc", tmp_path)
    assert "/v1/chat/completions" in dom
    missing = [p for p in doc["paths"] if f">{p}<" not in dom]
    assert not missing, missing
