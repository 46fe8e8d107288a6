"""Errors in the OpenAI shape, raised anywhere in a handler and rendered by one middleware.

``{"error": {"message", "type", "param", "code"}}`` is what the official SDKs parse into their
exception classes (BadRequestError, NotFoundError, ...), so every failure, including ones aiohttp
raises itself (404 route, 405, 413 body too large), goes out in this shape.
"""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

log = logging.getLogger("zserve.gateway")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_response(err: APIError) -> web.Response:
    return web.Response(status=err.status, body=orjson.dumps(err.body()), content_type="application/json",
                        headers=err.headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        msg = {404: f"no route for {request.method} {request.path}", 405: f"method {request.method} is not allowed on {request.path}",
               413: "request body too large"}.get(e.status, e.reason)
        return error_response(APIError(e.status, msg, headers={k: v for k, v in e.headers.items() if k == "Allow"}))
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return error_response(APIError(500, "internal server error"))
