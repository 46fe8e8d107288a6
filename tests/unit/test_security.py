"""Which key opens which route (gateway.security.authorize), the key file's digests, and CORS decisions."""

from __future__ import annotations

import os
import stat

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from gateway.errors import APIError
from gateway.logs import REQUEST_ID, MalformedRequestFilter, RequestIdFilter
from gateway.security import CorsPolicy, Keys, admin_route, authorize, write_key_file


async def _plain(request):  # pragma: no cover - never called
    return web.Response()


@admin_route
async def _admin(request):  # pragma: no cover - never called
    return web.Response()


def request(path: str, handler=_plain, method: str = "GET", **headers: str) -> web.Request:
    req = make_mocked_request(method, path, headers=headers)
    req._match_info = web.UrlMappingMatchInfo({}, web.ResourceRoute(method, handler, web.PlainResource(path)))
    return req


@pytest.fixture()
def keys(tmp_path) -> Keys:
    path = tmp_path / "keys.json"
    write_key_file(str(path), ("sk-alpha-1", "sk-beta-2"), ("adm-gamma-3",))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert b"sk-alpha-1" not in path.read_bytes() and b"adm-gamma-3" not in path.read_bytes()  # digests only
    return Keys.load(str(path))


def status_of(req: web.Request, keys: Keys, metrics_auth: bool = False) -> int:
    try:
        authorize(req, keys, metrics_auth)
    except APIError as e:
        return e.status
    return 200


def test_api_keys_open_routes_by_bearer_or_x_api_key(keys):
    assert status_of(request("/v1/models"), keys) == 401
    assert status_of(request("/v1/models", Authorization="Bearer sk-alpha-1"), keys) == 200
    assert status_of(request("/v1/models", Authorization="bearer sk-beta-2"), keys) == 200
    assert status_of(request("/v1/models", **{"x-api-key": "sk-beta-2"}), keys) == 200
    assert status_of(request("/v1/models", Authorization="Bearer sk-c"), keys) == 401
    assert status_of(request("/v1/models", Authorization="Basic sk-alpha-1"), keys) == 401
    assert status_of(request("/v1/models", Authorization="Bearer adm-gamma-3"), keys) == 401  # admin key: no API key
    assert status_of(request("/health"), keys) == status_of(request("/ping", method="POST"), keys) == 200
    assert status_of(request("/v1/chat/completions", method="OPTIONS"), keys) == 200  # CORS preflights


def test_admin_routes_take_only_the_admin_key(keys):
    assert status_of(request("/pause", _admin, "POST"), keys) == 401
    assert status_of(request("/pause", _admin, "POST", Authorization="Bearer sk-alpha-1"), keys) == 403
    assert status_of(request("/pause", _admin, "POST", Authorization="Bearer adm-gamma-3"), keys) == 200
    api_only = Keys(api=keys.api)
    assert status_of(request("/pause", _admin, "POST", Authorization="Bearer sk-alpha-1"), api_only) == 403
    admin_only = Keys(admin=keys.admin)  # only admin routes are closed
    assert status_of(request("/v1/models"), admin_only) == 200
    assert status_of(request("/pause", _admin, "POST"), admin_only) == 401
    assert status_of(request("/pause", _admin, "POST"), Keys()) == 200  # no keys: open, as before


def test_metrics_stay_open_unless_metrics_auth(keys):
    assert status_of(request("/metrics"), keys) == 200
    assert status_of(request("/metrics"), keys, metrics_auth=True) == 401
    assert status_of(request("/metrics", Authorization="Bearer sk-alpha-1"), keys, metrics_auth=True) == 200


def test_refusals_quote_no_key(keys):
    with pytest.raises(APIError) as e:
        authorize(request("/v1/models", Authorization="Bearer sk-secret-guess"), keys, False)
    assert "sk-secret-guess" not in e.value.message and e.value.headers == {"WWW-Authenticate": "Bearer"}


def test_cors_allows_only_the_configured_origins():
    policy = CorsPolicy(origins=("https://a.example",), credentials=True)
    pre = {"Access-Control-Request-Method": "POST"}
    ok = policy.preflight(request("/v1/models", method="OPTIONS", Origin="https://a.example", **pre))
    assert ok.headers["Access-Control-Allow-Origin"] == "https://a.example"
    assert ok.headers["Access-Control-Allow-Credentials"] == "true"
    no = policy.preflight(request("/v1/models", method="OPTIONS", Origin="https://b.example", **pre))
    assert "Access-Control-Allow-Origin" not in no.headers
    star = CorsPolicy(origins=("*",))
    assert star.preflight(request("/x", method="OPTIONS", Origin="https://z.example", **pre)).headers[
        "Access-Control-Allow-Origin"] == "*"
    assert CorsPolicy().preflight(request("/x", method="OPTIONS", Origin="https://z.example", **pre)).status == 204


def test_log_lines_name_the_request_and_malformed_requests_fold(caplog):
    import logging

    from aiohttp.http_exceptions import BadHttpMessage

    rec = logging.LogRecord("x", logging.INFO, __file__, 1, "served %d tokens", (3,), None)
    token = REQUEST_ID.set("rid-1")
    try:
        RequestIdFilter().filter(rec)
    finally:
        REQUEST_ID.reset(token)
    assert rec.getMessage() == "served 3 tokens [request rid-1]"
    folded = MalformedRequestFilter(interval=60)
    bad = BadHttpMessage("Invalid header value char: b'Authorization: Bearer sk-x'")
    records = [logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request", (),
                                 (BadHttpMessage, bad, None)) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="zserve.gateway"):
        assert not any(folded.filter(r) for r in records)  # aiohttp's records are dropped...
    lines = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(lines) == 1 and "sk-x" not in lines[0] and folded.folded == 2  # ...one short line said instead
