"""Errors raised anywhere in a handler and rendered by one middleware, in the API family's shape.

Handlers raise ``APIError(status, message)``; the middleware renders it as the family of the
route expects, because that is what the official SDKs parse into their exception classes
(BadRequestError, NotFoundError, ...):

- OpenAI (the default, also for aiohttp's own 404/405/413): ``{"error": {"message", "type", "param", "code"}}``
- Anthropic: ``{"type": "error", "error": {"type", "message"}}``

A family marks its handlers with ``@error_shape(body_fn)``; everything else gets the OpenAI shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import orjson
from aiohttp import web

log = logging.getLogger("zserve.gateway")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


ErrorBody = Callable[[APIError], dict]
_SHAPE_ATTR = "__zserve_error_shape__"


def error_shape(body: ErrorBody):
    """Decorator: errors raised by this handler are rendered with ``body`` instead of OpenAI's shape."""
    def mark(handler):
        setattr(handler, _SHAPE_ATTR, body)
        return handler
    return mark


def shape_of(handler) -> ErrorBody:
    """How errors of ``handler`` are rendered (its ``@error_shape``, else OpenAI's)."""
    return getattr(handler, _SHAPE_ATTR, APIError.body)


def routing_error(status: int, method: str, path: str, reason: str = "", allow: str | None = None) -> APIError:
    """What the app answers for a route it cannot serve (404 no route, 405 wrong method, 413 body too large)."""
    msg = {404: f"no route for {method} {path}",
           405: f"method {method} is not allowed on {path}",
           413: "request body too large"}.get(status, reason)
    return APIError(status, msg, headers={"Allow": allow} if allow is not None else None)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_response(err: APIError, body: ErrorBody = APIError.body) -> web.Response:
    return web.Response(status=err.status, body=orjson.dumps(body(err)), content_type="application/json",
                        headers=err.headers)


def handler_error(request: web.Request, e: Exception) -> web.Response:
    """The response for what a handler raised, in its family's shape; called while handling ``e`` (a redirect,
    an HTTPException under 400, is raised again for aiohttp to send)."""
    if isinstance(e, APIError):
        return error_response(e, shape_of(request.match_info.handler))
    if isinstance(e, web.HTTPException):
        if e.status < 400:
            raise e
        err = routing_error(e.status, request.method, request.path, e.reason, e.headers.get("Allow"))
        return error_response(err, shape_of(request.match_info.handler))
    log.exception("unhandled error serving %s %s", request.method, request.path)
    return error_response(APIError(500, "internal server error"), shape_of(request.match_info.handler))


@web.middleware
async def error_middleware(request: web.Request, handler):
    """``handler_error`` alone, for an app without the gateway's middleware (``admission.gateway_middleware``
    does the same inside)."""
    try:
        return await handler(request)
    except Exception as e:
        return handler_error(request, e)
