"""The gateway's side of the engine tier: one DEALER socket per engine, least-loaded routing.

Each gateway connects to every engine, says ClientHello, and keeps the latest EngineHello and
EngineStats of each. ``generate`` sends one request to the least-loaded ready engine and yields
that request's outputs as the engine streams them; leaving the iterator early (client gone, stop
string hit) aborts the request in the engine so its KV slot is freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from protocol import (
    MAX_FRAME_BYTES,
    AbortRequest,
    AddRequest,
    ClientHello,
    EngineHello,
    EngineStats,
    ErrorMessage,
    ProtocolError,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    decode,
    encode,
)

log = logging.getLogger("zserve.gateway.engines")


class NoEngineAvailable(RuntimeError):
    """No engine is ready to take the request (the HTTP layer answers 503)."""


class EngineRequestError(RuntimeError):
    """The engine ended a request with an error."""


@dataclass
class EngineConnection:
    endpoint: str
    sock: zmq.asyncio.Socket
    hello: EngineHello | None = None
    stats: EngineStats | None = None
    outstanding: int = 0  # this gateway's requests in flight on the engine
    last_seen: float = 0.0
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def load(self) -> float:
        """Outstanding work as this gateway knows it plus the engine's own queue."""
        waiting = self.stats.waiting if self.stats else 0
        return self.outstanding + waiting


class EngineClient:
    def __init__(self, endpoints: list[str], client_id: str | None = None):
        self.client_id = client_id or f"gw-{uuid.uuid4().hex[:12]}"
        self.ctx = zmq.asyncio.Context.instance()
        self.engines: list[EngineConnection] = []
        for ep in endpoints:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"{self.client_id}".encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + (1 << 20))
            sock.connect(ep)
            self.engines.append(EngineConnection(ep, sock))
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._tasks: list[asyncio.Task] = []

    async def start(self, timeout: float = 600.0) -> None:
        """Say hello to every engine and wait until all have answered."""
        for eng in self.engines:
            await eng.sock.send_multipart(encode(ClientHello(self.client_id)))
            self._tasks.append(asyncio.create_task(self._read(eng), name=f"engine-reader {eng.endpoint}"))
        await asyncio.wait_for(asyncio.gather(*(e.ready.wait() for e in self.engines)), timeout)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for eng in self.engines:
            eng.sock.close(0)

    @property
    def ready_engines(self) -> list[EngineConnection]:
        return [e for e in self.engines if e.hello is not None]

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def pick_engine(self) -> EngineConnection:
        ready = self.ready_engines
        if not ready:
            raise NoEngineAvailable("no engine is ready")
        return min(ready, key=lambda e: e.load)

    async def _read(self, eng: EngineConnection) -> None:
        while True:
            frames = await eng.sock.recv_multipart(copy=False)
            try:
                msg = decode([f.buffer for f in frames])
            except ProtocolError as e:
                log.warning("dropped a bad frame from engine %s: %s", eng.endpoint, e)
                continue
            eng.last_seen = time.monotonic()
            if isinstance(msg, StepOutputs):
                for out in msg.outputs:
                    q = self._streams.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
            elif isinstance(msg, EngineStats):
                eng.stats = msg
            elif isinstance(msg, EngineHello):
                eng.hello = msg
                eng.ready.set()
                log.info("engine %d at %s: %s, %s/%s", msg.rank, eng.endpoint, msg.model_id, msg.device, msg.dtype)
            elif isinstance(msg, ErrorMessage):
                log.warning("engine %s reports %s: %s", eng.endpoint, msg.code, msg.message)

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until one carries a finish reason."""
        eng = self.pick_engine()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = q
        eng.outstanding += 1
        finished = False
        try:
            await eng.sock.send_multipart(encode(AddRequest(request_id, tuple(prompt_token_ids), sampling)), copy=False)
            while True:
                out = await q.get()
                if out.finish_reason == "error":
                    finished = True
                    raise EngineRequestError(out.error or "the engine failed the request")
                if out.finish_reason is not None:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            eng.outstanding -= 1
            self._streams.pop(request_id, None)
            if not finished:
                try:
                    await eng.sock.send_multipart(encode(AbortRequest((request_id,))))
                except zmq.ZMQError:
                    pass
