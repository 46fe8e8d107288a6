"""Bare chat-completions echo servers: the floor that bench_gateway.py measures zserve's gateway against.

Both parse a chat-completions JSON body and answer one fixed ``chat.completion`` object; nothing else.
``aiohttp`` is zserve's own stack with no zserve code (aiohttp + uvloop + orjson); ``fastapi`` is the common
alternative (FastAPI + uvicorn + a pydantic model of the request; uvicorn on uvloop, with httptools when it
is installed, else h11). Run one with:

    .venv/bin/python tests/bench/echo_apps.py aiohttp --port 8101
    .venv/bin/python tests/bench/echo_apps.py fastapi --port 8102

FastAPI and uvicorn come from the ``bench`` extra (``pip install -e .[bench]``); zserve never imports them.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from pydantic import BaseModel

ANSWER: dict[str, Any] = {
    "id": "chatcmpl-echo",
    "object": "chat.completion",
    "created": int(time.time()),
    "model": "echo",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None,
                 "finish_reason": "length"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
}


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(BaseModel):
    """The request fields a chat client sends here; FastAPI validates the body against this model."""

    model: str
    messages: list[Message]
    max_tokens: int | None = None
    temperature: float | None = None
    stream: bool = False


def http_implementation() -> str:
    """The HTTP parser uvicorn picks with ``http="auto"``."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def serve_aiohttp(host: str, port: int) -> None:
    import orjson
    import uvloop
    from aiohttp import web

    answer = orjson.dumps(ANSWER)

    async def chat(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return web.json_response({"error": {"message": "messages must be a list"}}, status=400)
        return web.Response(body=answer, content_type="application/json")

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        print(f"echo: aiohttp serving at http://{host}:{port}", flush=True)
        await asyncio.Event().wait()  # until the process is terminated

    uvloop.run(serve())


def serve_fastapi(host: str, port: int) -> None:
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest) -> dict[str, Any]:
        return ANSWER

    print(f"echo: fastapi serving at http://{host}:{port} (uvicorn, uvloop, {http_implementation()})", flush=True)
    uvicorn.run(app, host=host, port=port, loop="uvloop", http="auto", access_log=False, log_level="warning")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("framework", choices=["aiohttp", "fastapi"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args()
    (serve_aiohttp if a.framework == "aiohttp" else serve_fastapi)(a.host, a.port)


if __name__ == "__main__":
    main()
