"""Server-sent events as the OpenAI API streams them: ``data: {json}\\n\\n`` ... ``data: [DONE]``.

``EventWriter`` writes events from the engine reader's callbacks (``serving.choices.ChoiceRun``), as each
engine output is turned into text, without waking the request's task: one transport write per event. Only
when the client reads slowly (the transport is paused) or the response cannot be chunked (HTTP/1.0) do
events wait in a list for the task, which writes them through aiohttp with back-pressure (``until``).
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

# The ranks of the engines a generation went to (comma-separated, one per engine): which engine prefix routing
# chose, for clients and benchmarks (``launch bench`` reports how often a prefix's requests agree on one).
ENGINE_HEADER = "X-Zserve-Engine"


async def open_stream(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    resp = web.StreamResponse(headers={
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",  # tell nginx-style proxies not to buffer the stream
        **(headers or {}),
    })
    await resp.prepare(request)
    return resp


def encode_event(payload: dict, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(payload) + b"\n\n"


async def send_event(resp: web.StreamResponse, payload: dict, event: str | None = None) -> None:
    await resp.write(encode_event(payload, event))


DONE = b"data: [DONE]\n\n"


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(DONE)


class EventWriter:
    """A prepared stream's events, written at once from any callback on the event loop.

    An event goes straight to the transport as one HTTP chunk (aiohttp's framing for a chunked response,
    which ``StreamResponse.prepare`` chose) when nothing is waiting and the transport is not paused; otherwise
    it waits in ``_pending`` for ``until``, which runs in the request's task and writes through
    ``StreamResponse.write`` (so it waits for the client to drain its buffer). A write to a client that went
    away raises ``ConnectionResetError``."""

    __slots__ = ("resp", "_transport", "_protocol", "_direct", "_pending", "_wake")

    def __init__(self, request: web.Request, resp: web.StreamResponse):
        self.resp = resp
        self._transport = request.transport
        self._protocol = request.protocol
        writer = request.writer
        # prepare() chose chunked framing (HTTP/1.1, no length), which direct writes then frame as aiohttp does
        self._direct = (resp.headers.get("Transfer-Encoding") == "chunked" and not resp.compression
                        and self._transport is not None and hasattr(writer, "send_headers"))
        if self._direct:
            writer.send_headers()  # aiohttp holds them back to go with the first body write
        self._pending: list[bytes] = []
        self._wake: asyncio.Future | None = None

    def send(self, payload: dict) -> None:
        self.data(orjson.dumps(payload))

    def data(self, payload: bytes) -> None:
        """One ``data:`` event of JSON text ``payload``: written now unless events wait or the transport is
        paused (then it waits for ``until``)."""
        if self._direct and not self._pending and not self._protocol.writing_paused:
            t = self._transport
            if t is None or t.is_closing():
                raise ConnectionResetError("the client closed the connection")
            t.write(b"%x\r\ndata: %b\n\n\r\n" % (len(payload) + 8, payload))  # one chunk
        else:
            self._wait(b"data: " + payload + b"\n\n")

    def _wait(self, event: bytes) -> None:
        self._pending.append(event)
        self._wake_up()

    async def until(self, done: asyncio.Future) -> None:
        """Write what waits, as it comes, until ``done`` is (its exception is raised)."""
        loop = asyncio.get_running_loop()
        wake = self._wake_up
        done.add_done_callback(wake)
        try:
            while True:
                if self._pending:
                    data = b"".join(self._pending)
                    self._pending.clear()
                    await self.resp.write(data)
                    continue
                if done.done():
                    return done.result()
                self._wake = loop.create_future()
                await self._wake
        finally:
            done.remove_done_callback(wake)
            self._wake = None

    def _wake_up(self, _: object = None) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    async def close(self, last: bytes = DONE) -> None:
        """Write what waits and ``last``, and end the response."""
        data = b"".join(self._pending) + last
        self._pending.clear()
        await self.resp.write_eof(data)
