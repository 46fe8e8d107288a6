"""Bare chat-completions echo servers: the floor that bench_gateway.py measures zserve's gateway against.

Both parse a chat-completions JSON body and answer one fixed ``chat.completion`` object; nothing else.
The aiohttp app also streams (``"stream": true``): like an engine step, every ``--step-ms`` it writes one
``chat.completion.chunk`` event to every open stream until each has had ``max_tokens``, then a usage
chunk and ``[DONE]``: the floor of a streamed token on zserve's stack.
``aiohttp`` is zserve's own stack with no zserve code (aiohttp + uvloop + orjson); ``fastapi`` is the common
alternative (FastAPI + uvicorn + a pydantic model of the request; uvicorn on uvloop, with httptools when it
is installed, else h11). ``forward`` is the aiohttp app that also asks an engine for its token: each request
sends a fixed prompt (``--prompt-tokens`` ids, max_tokens 1, greedy) to a running zserve engine over ZeroMQ
(protocol/, the socket read from the event loop as zserve's gateway reads it) and answers when the engine's
output comes back: what any gateway of this two-tier design pays to wait on an engine, with none of the
work a real gateway does (validation, chat template, tokenizer, sampling parameters, text). Streamed, it asks
for ``max_tokens`` tokens (``ignore_eos``) and writes a fixed chunk for each engine output as it arrives, from
the socket's reader, with zserve's own direct write (``gateway.sse.EventWriter``): the floor of a streamed token
forwarded from an engine, without a detokenizer, stop strings, metrics or the response's shape. Run one with:

    .venv/bin/python tests/bench/echo_apps.py aiohttp --port 8101
    .venv/bin/python tests/bench/echo_apps.py fastapi --port 8102
    .venv/bin/python tests/bench/echo_apps.py forward --port 8103 --engine ipc:///run/zserve/engine-0.sock

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


def chunk_json(content: str | None, finish: str | None, usage: dict | None = None) -> bytes:
    """One ``chat.completion.chunk`` as a minimal OpenAI-compatible server writes it: a dict through orjson (with
    ``usage``: the usage chunk, no choices)."""
    import orjson

    body: dict[str, Any] = {"id": "chatcmpl-echo", "object": "chat.completion.chunk", "created": ANSWER["created"],
                            "model": "echo", "choices": []}
    if usage is None:
        body["choices"] = [{"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": finish}]
    else:
        body["usage"] = usage
    return orjson.dumps(body)


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def serve_aiohttp(host: str, port: int, step_ms: float = 20.0) -> None:
    import orjson
    import uvloop
    from aiohttp import web

    answer = orjson.dumps(ANSWER)
    streams: list[tuple[web.StreamResponse, list[int], asyncio.Future]] = []  # response, [tokens left], done

    def chunk(content: str, finish: str | None) -> bytes:
        """One SSE event."""
        return b"data: " + chunk_json(content, finish) + b"\n\n"

    async def engine_steps() -> None:
        """Like an engine step: every step_ms, one token to every open stream."""
        while True:
            await asyncio.sleep(step_ms / 1000)
            for resp, left, done in list(streams):
                left[0] -= 1
                try:
                    await resp.write(chunk("Hello", None if left[0] else "length"))
                except ConnectionError:
                    left[0] = 0
                if not left[0]:
                    streams.remove((resp, left, done))
                    done.set_result(None)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return web.json_response({"error": {"message": "messages must be a list"}}, status=400)
        if not body.get("stream"):
            return web.Response(body=answer, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        n = int(body.get("max_tokens") or 16)
        done = asyncio.get_running_loop().create_future()
        streams.append((resp, [n], done))
        await done
        await resp.write(b"data: " + chunk_json(None, None, usage_of(12, n)) + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        print(f"echo: aiohttp serving at http://{host}:{port}", flush=True)
        await engine_steps()  # until the process is terminated

    uvloop.run(serve())


def serve_forward(host: str, port: int, engine: str, prompt_tokens: int) -> None:
    import os
    import sys
    from pathlib import Path

    import orjson
    import uvloop
    import zmq
    from aiohttp import web

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from gateway.sse import EventWriter, open_stream
    from protocol import AddRequest, SamplingParams, StepOutputs, decode, encode

    answer = orjson.dumps(ANSWER)
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = tuple(range(1, prompt_tokens + 1))

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        ctx = zmq.Context()
        if hasattr(os, "SCHED_BATCH"):  # as zserve's gateway sets it (gateway/engine_client.py)
            ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"forward-{os.getpid()}".encode())
        sock.connect(engine)
        waiting: dict[str, asyncio.Future] = {}
        writers: dict[str, EventWriter] = {}  # streamed requests: a chunk per engine output, written at once
        recheck: list[bool] = []

        def pump() -> None:
            recheck.clear()
            while sock.get(zmq.EVENTS) & zmq.POLLIN:
                msg = decode(sock.recv_multipart(zmq.NOBLOCK))
                if isinstance(msg, StepOutputs):
                    for out in msg.outputs:
                        rid, finish = out.request_id, out.finish_reason
                        if (events := writers.get(rid)) is not None:
                            try:
                                events.data(chunk_json("Hello", finish))
                            except ConnectionError:
                                pass
                        if finish is not None and (fut := waiting.pop(rid, None)) is not None:
                            writers.pop(rid, None)
                            fut.set_result(out)

        loop.add_reader(sock.get(zmq.FD), pump)
        counter = iter(range(1 << 62))

        async def chat(request: web.Request) -> web.Response:
            body = orjson.loads(await request.read())
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                return web.json_response({"error": {"message": "messages must be a list"}}, status=400)
            rid = f"fwd-{next(counter)}"
            fut = waiting[rid] = loop.create_future()
            streamed = bool(body.get("stream"))
            n = int(body.get("max_tokens") or 16) if streamed else 1
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) if streamed else sampling
            if streamed:
                resp = await open_stream(request)
                events = writers[rid] = EventWriter(request, resp)
            sock.send_multipart(encode(AddRequest(rid, prompt, params)), zmq.NOBLOCK, copy=False)
            if not recheck:  # a send can take the edge that announces a reply: read once per loop iteration
                recheck.append(True)
                loop.call_soon(pump)
            if not streamed:
                await fut
                return web.Response(body=answer, content_type="application/json")
            await events.until(fut)
            events.data(chunk_json(None, None, usage_of(prompt_tokens, n)))
            await events.close()
            return resp

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        print(f"echo: forward serving at http://{host}:{port} (engine {engine}, {prompt_tokens}-token prompt)",
              flush=True)
        await asyncio.Event().wait()

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
    p.add_argument("framework", choices=["aiohttp", "fastapi", "forward"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--step-ms", type=float, default=20.0,
                   help="aiohttp, streamed requests: one token to every open stream this often (an engine's step)")
    p.add_argument("--engine", help="forward: the engine's ZeroMQ endpoint (a gateway's /load lists them)")
    p.add_argument("--prompt-tokens", type=int, default=20, help="forward: the prompt's length in tokens")
    a = p.parse_args()
    if a.framework == "aiohttp":
        serve_aiohttp(a.host, a.port, a.step_ms)
    elif a.framework == "forward":
        if not a.engine:
            p.error("forward needs --engine")
        serve_forward(a.host, a.port, a.engine, a.prompt_tokens)
    else:
        serve_fastapi(a.host, a.port)


if __name__ == "__main__":
    main()
