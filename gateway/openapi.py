"""The OpenAPI document of what an app serves, generated from its router when asked, never kept by hand.

Each handler declares what the generator cannot see in the router: the pydantic model its body is
parsed with (``@request_body``, the same class ``parse`` validates with, so the document cannot
drift from the checks), its query parameters (``@query``) and, where it is not JSON, what it answers
(``@response``). Errors are described once per error shape (``error_schema``), matched through the
handler's ``@error_shape``. Every route of the router is listed, plugins' included; a route without
declarations still appears, with its path parameters.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .errors import APIError, ErrorBody, shape_of

JSON = "application/json"
SSE = "text/event-stream"
REF_TEMPLATE = "#/components/schemas/{model}"

_BODY_ATTR = "__zserve_request_body__"
_BODY_MEDIA_ATTR = "__zserve_request_media__"
_QUERY_ATTR = "__zserve_query__"
_RESPONSES_ATTR = "__zserve_responses__"
_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")

Schema = type[BaseModel] | dict[str, Any]


def request_body(schema: Schema, media_type: str = JSON) -> Callable:
    """Decorator: the handler's body is ``schema`` (the model it parses with, or a JSON schema), JSON unless
    ``media_type`` says otherwise (``multipart/form-data``: an upload)."""
    def mark(handler):
        setattr(handler, _BODY_ATTR, schema)
        setattr(handler, _BODY_MEDIA_ATTR, media_type)
        return handler
    return mark


def query(model: type[BaseModel]) -> Callable:
    """Decorator: the handler reads the fields of ``model`` (flat, scalar fields) from the query string."""
    def mark(handler):
        setattr(handler, _QUERY_ATTR, model)
        return handler
    return mark


def response(status: int, *media_types: str, description: str = "") -> Callable:
    """Decorator: the handler answers ``status`` with these media types (default: 200 in JSON).
    Stackable; a status declared here replaces the generic error range it falls in."""
    def mark(handler):
        declared = dict(getattr(handler, _RESPONSES_ATTR, {}))
        declared[status] = (media_types or (JSON,), description)
        setattr(handler, _RESPONSES_ATTR, declared)
        return handler
    return mark


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    """OpenAI's error shape, which every route answers unless it declares another."""

    error: OpenAIErrorDetail


_ERROR_MODELS: dict[ErrorBody, type[BaseModel]] = {APIError.body: OpenAIError}


def error_schema(body: ErrorBody, model: type[BaseModel]) -> None:
    """Describe the errors rendered by ``body`` (a family's ``@error_shape`` function) with ``model``."""
    _ERROR_MODELS[body] = model


def _path_params(resource: web.AbstractResource) -> list[str]:
    pattern = resource.get_info().get("pattern")
    return list(pattern.groupindex) if isinstance(pattern, re.Pattern) else []


def _served_routes(app: web.Application) -> list[tuple[str, str, Any, list[str]]]:
    """(path, method, handler, path parameters) of every route; the HEAD aiohttp adds beside a GET is left out."""
    routes = [r for r in app.router.routes() if r.resource is not None and r.method.lower() in _METHODS]
    gets = {(r.resource.canonical, r.handler) for r in routes if r.method == "GET"}
    return [(r.resource.canonical, r.method.lower(), r.handler, _path_params(r.resource)) for r in routes
            if not (r.method == "HEAD" and (r.resource.canonical, r.handler) in gets)]


def _summary(handler: Any) -> dict[str, str]:
    doc = inspect.getdoc(handler)
    if not doc:
        return {}
    first, _, rest = doc.partition("\n\n")
    return {"summary": " ".join(first.split()), **({"description": rest.strip()} if rest.strip() else {})}


def _family(handler: Any) -> str:
    return (getattr(handler, "__module__", "") or "app").rsplit(".", 1)[-1]


def openapi_document(app: web.Application, *, title: str, version: str) -> dict[str, Any]:
    """An OpenAPI 3.1 document of every route ``app`` serves, its schemas in ``components/schemas``."""
    routes = _served_routes(app)
    models: set[type[BaseModel]] = set()
    for _, _, handler, _ in routes:
        body = getattr(handler, _BODY_ATTR, None)
        if isinstance(body, type):
            models.add(body)
        if shape_of(handler) in _ERROR_MODELS:
            models.add(_ERROR_MODELS[shape_of(handler)])
    ordered = sorted(models, key=lambda m: (m.__module__, m.__qualname__))
    refs, top = models_json_schema([(m, "validation") for m in ordered], ref_template=REF_TEMPLATE)

    def ref(model: Schema) -> dict[str, Any]:
        return refs[(model, "validation")] if isinstance(model, type) else model

    paths: dict[str, dict[str, Any]] = {}
    for path, method, handler, params in sorted(routes, key=lambda r: (r[0], _METHODS.index(r[1]))):
        op: dict[str, Any] = {"operationId": f"{method}_{re.sub(r'[^A-Za-z0-9]+', '_', path).strip('_')}",
                              "tags": [_family(handler)], **_summary(handler)}
        parameters = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params]
        query_model = getattr(handler, _QUERY_ATTR, None)
        if query_model is not None:
            qs = query_model.model_json_schema()
            parameters += [{"name": name, "in": "query", "required": name in qs.get("required", ()), "schema": s}
                           for name, s in qs.get("properties", {}).items()]
        if parameters:
            op["parameters"] = parameters
        body = getattr(handler, _BODY_ATTR, None)
        if body is not None:
            op["requestBody"] = {"required": True,
                                 "content": {getattr(handler, _BODY_MEDIA_ATTR, JSON): {"schema": ref(body)}}}
        error_model = _ERROR_MODELS.get(shape_of(handler))  # None: a shape nobody described (a plugin's own)
        error = {"description": "an error, in this route's error shape",
                 "content": {JSON: {"schema": ref(error_model)} if error_model else {}}}
        responses: dict[str, Any] = {"4XX": error, "5XX": error}
        declared = getattr(handler, _RESPONSES_ATTR, None) or {200: ((JSON,), "")}
        for status, (media_types, description) in sorted(declared.items()):
            responses[str(status)] = {"description": description or "success",
                                      "content": {mt: {} for mt in media_types}}
        op["responses"] = dict(sorted(responses.items()))
        paths.setdefault(path, {})[method] = op
    # Keys (gateway.security), when the server has them: either scheme, or none on an open server. Swagger UI's
    # Authorize button fills them in.
    schemes = {"bearer": {"type": "http", "scheme": "bearer", "description": "an API key, or the admin key"},
               "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return {"openapi": "3.1.0", "info": {"title": title, "version": version},
            "security": [{"bearer": []}, {"x-api-key": []}, {}],
            "paths": paths, "components": {"schemas": top.get("$defs", {}), "securitySchemes": schemes}}
