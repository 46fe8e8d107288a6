"""/invocations' dispatch, in process: the payload's shape names a route, which is found among the app's
own routes — so a family added later is reached with no change to the SageMaker router — and a
route the app lacks answers as the app would."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.errors import APIError, error_middleware
from gateway.routers import sagemaker
from gateway.routers.sagemaker import invocation_path, route_handler


@pytest.mark.parametrize("payload, path", [
    ({"messages": [], "prompt": "x"}, "/v1/chat/completions"),  # the first matching row wins
    ({"prompt": "x", "input": "y"}, "/v1/completions"),
    ({"input": ["a", "b"]}, "/v1/embeddings"),
    ({"query": "q", "documents": ["d"], "top_n": 1}, "/v1/rerank"),
])
def test_the_payload_shape_names_the_route(payload: dict, path: str) -> None:
    assert invocation_path(payload) == path


def test_a_payload_of_no_shape_is_a_400_naming_the_fields() -> None:
    with pytest.raises(APIError) as e:
        invocation_path({"query": "q"})
    assert e.value.status == 400
    assert "'query' and 'documents' for /v1/rerank" in e.value.message and "'messages'" in e.value.message


async def _rerank(request: web.Request) -> web.Response:
    return web.json_response({"reranked": (await request.json())["documents"][::-1]})


async def _teapot(request: web.Request) -> web.Response:
    raise APIError(418, "short and stout")


def _app() -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app.router.add_post("/v1/rerank", _rerank)  # a family that did not exist when the table was written
    app.router.add_get("/v1/embeddings", _teapot)
    app.router.add_post("/v1/completions", _teapot)
    app.add_routes(sagemaker.routes)
    return app


def test_route_handler_finds_registered_routes_and_refuses_others_as_the_app_would() -> None:
    app = _app()
    assert route_handler(app, "POST", "/v1/rerank") is _rerank
    with pytest.raises(APIError) as missing:
        route_handler(app, "POST", "/v1/chat/completions")
    assert (missing.value.status, missing.value.message) == (404, "no route for POST /v1/chat/completions")
    with pytest.raises(APIError) as wrong_method:
        route_handler(app, "POST", "/v1/embeddings")
    assert wrong_method.value.status == 405 and wrong_method.value.headers["Allow"] == "GET,HEAD"


def test_invocations_answers_with_the_route_it_names() -> None:
    async def run() -> None:
        async with TestClient(TestServer(_app())) as client:
            r = await client.post("/invocations", json={"query": "q", "documents": ["a", "b"]},
                                  headers={"X-Amzn-SageMaker-Custom-Attributes": "trace=1"})
            assert (r.status, await r.json()) == (200, {"reranked": ["b", "a"]})
            missing = await client.post("/invocations", json={"messages": []})
            direct = await client.post("/v1/chat/completions", json={"messages": []})
            assert missing.status == direct.status == 404
            assert await missing.json() == await direct.json()
            failing = await client.post("/invocations", json={"prompt": "x"})
            assert failing.status == 418 and (await failing.json())["error"]["message"] == "short and stout"

    asyncio.run(run())
