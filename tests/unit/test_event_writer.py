"""``sse.EventWriter`` writes a stream's events from callbacks, as the engine reader does, over a real socket:
straight to the transport while the client keeps up, through the request's task (``until``) when the client
reads slowly or the response is not chunked (HTTP/1.0). Either way the client gets every event, in order, in
a well-formed response."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from gateway.sse import EventWriter, open_stream

EVENTS = 400
PAYLOAD = b'{"n":%d,"pad":"' + b"x" * 1000 + b'"}'


def make_app(seen: dict) -> web.Application:
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = await open_stream(request)
        sock = request.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # so that a client that does not read pauses us
        events = EventWriter(request, resp)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def emit(i: int) -> None:  # one event per loop iteration, from a callback: the engine reader's way
            events.data(PAYLOAD % i)
            seen["queued"] = seen.get("queued", False) or bool(events._pending)
            if i + 1 < EVENTS:
                loop.call_soon(emit, i + 1)
            else:
                done.set_result(None)

        loop.call_soon(emit, 0)
        await events.until(done)
        await events.close()
        return resp

    app = web.Application()
    app.router.add_get("/stream", stream)
    return app


def read_response(sock: socket.socket) -> bytes:
    chunks = []
    while data := sock.recv(1 << 16):
        chunks.append(data)
    return b"".join(chunks)


def dechunk(body: bytes) -> bytes:
    """The payload of a chunked body; fails on any framing error."""
    out, at = [], 0
    while True:
        end = body.index(b"\r\n", at)
        size = int(body[at:end], 16)
        at = end + 2
        if size == 0:
            assert body[at:] == b"\r\n", "the body goes on after its last chunk"
            return b"".join(out)
        out.append(body[at:at + size])
        assert body[at + size:at + size + 2] == b"\r\n", "a chunk does not end where its size says"
        at += size + 2


def events_of(payload: bytes) -> list[bytes]:
    assert payload.endswith(b"data: [DONE]\n\n")
    return [e.removeprefix(b"data: ") for e in payload.split(b"\n\n")[:-2]]


@pytest.mark.parametrize("version, slow", [("1.1", False), ("1.1", True), ("1.0", False)],
                         ids=["fast client", "slow client", "HTTP/1.0"])
def test_every_event_arrives_in_order_in_a_well_formed_response(version: str, slow: bool) -> None:
    seen: dict = {}

    async def main() -> bytes:
        runner = web.AppRunner(make_app(seen))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        client = socket.socket()
        if slow:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port))
        client.sendall(f"GET /stream HTTP/{version}\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        loop = asyncio.get_running_loop()
        if slow:  # read nothing until events had to wait for the task
            deadline = loop.time() + 30
            while not seen.get("queued") and loop.time() < deadline:
                await asyncio.sleep(0.01)
            assert seen.get("queued"), "the server never had to hold events back"
        data = await loop.run_in_executor(None, read_response, client)
        client.close()
        await runner.cleanup()
        return data

    raw = asyncio.run(main())
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/{version} 200".encode())
    chunked = b"transfer-encoding: chunked" in head.lower()
    assert chunked == (version == "1.1")
    got = events_of(dechunk(body) if chunked else body)
    assert got == [PAYLOAD % i for i in range(EVENTS)]
