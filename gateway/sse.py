"""Server-sent events as the OpenAI API streams them: ``data: {json}\\n\\n`` ... ``data: [DONE]``."""

from __future__ import annotations

import orjson
from aiohttp import web


async def open_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",  # tell nginx-style proxies not to buffer the stream
    })
    await resp.prepare(request)
    return resp


def encode_event(payload: dict, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(payload) + b"\n\n"


async def send_event(resp: web.StreamResponse, payload: dict, event: str | None = None) -> None:
    await resp.write(encode_event(payload, event))


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")
