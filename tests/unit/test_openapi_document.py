"""``gateway.openapi`` without a server: the document follows the router it is given, declarations or none."""

from __future__ import annotations

from aiohttp import web
from openapi_spec_validator import validate
from pydantic import BaseModel

from gateway.app import ROUTE_FAMILIES
from gateway.openapi import SSE, openapi_document, query, request_body, response


def _app(*extra: web.RouteDef) -> web.Application:
    app = web.Application()
    for family in ROUTE_FAMILIES.values():
        app.add_routes(family.routes)
    app.add_routes(extra)
    return app


async def _undeclared(request: web.Request) -> web.Response:
    return web.json_response({})


class EchoBody(BaseModel):
    text: str
    times: int = 1


class EchoQuery(BaseModel):
    loud: bool = False


@request_body(EchoBody)
@query(EchoQuery)
@response(200, SSE)
async def _declared(request: web.Request) -> web.Response:
    """Echo the text.

    As many times as asked."""
    return web.json_response({})


def test_a_route_added_to_the_router_is_listed_even_without_declarations() -> None:
    doc = openapi_document(_app(web.get("/x/{thing_id}/y", _undeclared)), title="t", version="1")
    validate(doc)
    op = doc["paths"]["/x/{thing_id}/y"]["get"]
    assert op["parameters"] == [{"name": "thing_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    assert "requestBody" not in op and set(op["responses"]) == {"200", "4XX", "5XX"}
    assert "head" not in doc["paths"]["/x/{thing_id}/y"]  # aiohttp's automatic HEAD beside a GET


def test_declarations_become_body_query_and_responses() -> None:
    doc = openapi_document(_app(web.post("/echo", _declared)), title="t", version="1")
    validate(doc)
    op = doc["paths"]["/echo"]["post"]
    assert op["summary"] == "Echo the text." and op["description"] == "As many times as asked."
    assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/EchoBody"}
    assert doc["components"]["schemas"]["EchoBody"]["required"] == ["text"]
    assert op["parameters"][0]["name"] == "loud" and op["parameters"][0]["in"] == "query"
    assert list(op["responses"]["200"]["content"]) == [SSE]
    assert op["tags"] == ["test_openapi_document"]


def test_operation_ids_are_unique_and_refs_resolve() -> None:
    doc = openapi_document(_app(), title="t", version="1")
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    schemas = doc["components"]["schemas"]

    def refs(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref":
                    yield v
                else:
                    yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    for ref in refs(doc):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref


def test_the_elastic_expert_parallel_routes_are_documented() -> None:
    doc = openapi_document(_app(), title="t", version="1")
    scale = doc["paths"]["/scale_elastic_ep"]["post"]
    body = doc["components"]["schemas"][scale["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                                        .rsplit("/", 1)[1]]
    assert body["required"] == ["new_data_parallel_size"]
    assert set(body["properties"]) == {"new_data_parallel_size", "drain_timeout", "model"}
    assert set(doc["paths"]["/is_scaling_elastic_ep"]) == {"get", "post"}
