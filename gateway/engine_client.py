"""The gateway's side of the engine tier: membership, least-loaded routing, and failure handling.

Each gateway keeps one DEALER socket per engine. The engine set comes from the supervisor's
cluster state (engines join, drain and leave at run time) or, standalone, from ``--engine``.
A socket monitor tells us the moment an engine's connection drops: every request in flight on
it then ends with an error at once, and the engine is not routed to until it (or its
replacement, on the same endpoint) says hello again.

Each engine serves one model (the supervisor's cluster state says which); ``ModelEngines`` is one
model's share of the client, so a request only ever reaches its own model's engines.

``generate`` sends a request to the least-loaded routable engine of its model (outstanding work, not
round-robin) and yields its outputs; leaving the iterator early aborts the request in the
engine. A request that an engine refuses (draining) or loses (dies) before producing any output
goes to another engine; one that was already streaming ends with an error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol import (
    MAX_FRAME_BYTES,
    AbortRequest,
    AddRequest,
    ClientHello,
    EngineHello,
    EngineStats,
    ErrorMessage,
    PoolOutput,
    PoolOutputs,
    PoolRequest,
    ProtocolError,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    TopLogprobs,
    decode,
    encode,
)
from protocol.constants import ERR_ENGINE_BUSY, ERR_ENGINE_DRAINING
from zserve.cluster import ClusterState

from .logs import REQUEST_ID

log = logging.getLogger("zserve.gateway.engines")

DRAINING = ERR_ENGINE_DRAINING
MAX_HANDBACKS = 8
DISCONNECT_GRACE = 0.2  # seconds; well inside the 1 s in which a dead engine's requests must end


def gateway_context() -> zmq.asyncio.Context:
    """The gateway's ZeroMQ context, its I/O thread under ``SCHED_BATCH`` (set before the thread starts).

    A send wakes the context's I/O thread. As an ordinary thread it preempts the event loop at once when both
    share a core, so every request paid two context switches and the I/O thread woke once per message
    (``tests/bench/bench_gateway.py``, gateway pinned to one core: 35 µs of wall time per send, 17 µs of I/O
    thread CPU per request). A batch thread does not preempt on wakeup: it runs when the loop waits, or at once on
    an idle core, and then carries every message queued meanwhile (11 µs, 2.5 µs)."""
    ctx = zmq.asyncio.Context.instance()
    if hasattr(os, "SCHED_BATCH"):
        ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    return ctx


def send_now(sock: zmq.asyncio.Socket, frames: list) -> None:
    """Send a message without waiting (``zmq.Again`` when it cannot go now), with no Future.

    ``zmq.asyncio``'s ``send_multipart`` makes and resolves a Future even for a non-blocking send; on
    the request path that is a tenth of the send's cost. The socket's file descriptor is edge-triggered
    and a send can consume the edge that would wake the socket's reader, so the reader is rescheduled if a
    message is waiting, as ``zmq.asyncio`` itself does after its own sends, but once per loop iteration for
    all the sends made in it (reading the socket's events costs as much as a send)."""
    sock._shadow_sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
    if not _RECHECK:
        asyncio.get_running_loop().call_soon(_recheck)
    _RECHECK.add(sock)


_RECHECK: set[zmq.asyncio.Socket] = set()


def _recheck() -> None:
    socks = list(_RECHECK)
    _RECHECK.clear()
    for sock in socks:
        if not sock.closed:
            sock._schedule_remaining_events()


class NoEngineAvailable(RuntimeError):
    """No engine is ready to take the request (the HTTP layer answers 503)."""


class EnginesBusy(NoEngineAvailable):
    """Every engine of the model refused the request because its queue is full (the HTTP layer answers 429)."""


class EngineRequestError(RuntimeError):
    """The engine ended a request with an error (or died with it)."""


@dataclass(frozen=True)
class _HandBack:
    """Queued for a request that ``engine`` refused (draining) or lost (died) before producing
    anything; the request goes to another engine. Stale ones (from an engine already left) are
    ignored: an engine's death is noticed by both the socket monitor and the supervisor."""

    engine: EngineConnection
    busy: bool = False  # refused for a full queue (not draining, not lost)


@dataclass
class EngineConnection:
    endpoint: str
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    cluster_state: str | None = None  # the supervisor's word: starting / ready / draining; None = standalone
    hello: EngineHello | None = None
    stats: EngineStats | None = None
    outstanding: int = 0  # this gateway's requests in flight on the engine
    known_rank: int | None = None  # kept after the engine is gone, for messages
    model: str | None = None  # the model it serves, from the cluster state; None = standalone (any)
    tasks: list[asyncio.Task] = field(default_factory=list)

    def serves(self, model: str | None) -> bool:
        return model is None or self.model is None or self.model == model

    @property
    def routable(self) -> bool:
        return self.hello is not None and self.cluster_state in (None, "ready")

    @property
    def load(self) -> float:
        """Outstanding work as this gateway knows it plus the engine's own queue."""
        waiting = self.stats.waiting if self.stats else 0
        return self.outstanding + waiting

    @property
    def rank(self) -> int | None:
        return self.known_rank

    def describe(self) -> dict:
        """This gateway's view of the engine, as /load and /status report it."""
        st = self.stats
        return {"endpoint": self.endpoint, "rank": self.rank, "model": self.model, "state": self.cluster_state,
                "connected": self.hello is not None, "routable": self.routable,
                "running": st.running if st else None, "waiting": st.waiting if st else None,
                "kv_used": st.kv_used if st else None}


class _Inbox:
    """A request's messages from the engine reader: a deque and at most one waiting consumer (an
    ``asyncio.Queue`` without what a single consumer never needs)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self):
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()

    def take_outputs(self, out: RequestOutput) -> RequestOutput:
        """``out`` with the outputs queued behind it merged in, up to a finish, an error or a hand-back.

        Under load a request's consumer can fall a few engine steps behind; it then takes them as one
        output (one detokenizer pass, one stream chunk, one write), as vLLM's output collector does."""
        items = self.items
        while out.finish_reason is None and items and type(items[0]) is RequestOutput \
                and items[0].finish_reason != "error":
            out = merge_outputs(out, items.popleft())
        return out


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (``b`` follows ``a``)."""
    lps = a.logprobs + b.logprobs if a.logprobs is not None and b.logprobs is not None else None
    top = a.top_logprobs
    if top is not None and b.top_logprobs is not None and top.k == b.top_logprobs.k:
        top = TopLogprobs(top.k, top.token_ids + b.top_logprobs.token_ids, top.logprobs + b.top_logprobs.logprobs)
    else:
        top = None
    return replace(a, new_token_ids=a.new_token_ids + b.new_token_ids, finish_reason=b.finish_reason, logprobs=lps,
                   top_logprobs=top, num_prompt_tokens=a.num_prompt_tokens or b.num_prompt_tokens,
                   num_cached_tokens=max(a.num_cached_tokens, b.num_cached_tokens),
                   prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
                   prompt_top_logprobs=a.prompt_top_logprobs if a.prompt_logprobs is not None
                   else b.prompt_top_logprobs)


@dataclass
class _Stream:
    queue: _Inbox
    engine: EngineConnection | None = None
    failed_here: bool = False  # ended by this gateway (shutdown, engine lost), not by the engine
    started: bool = False  # the engine has sent output for it
    model: str | None = None  # routed only to engines of this model
    busy: int = 0  # engines that refused it for a full queue


class EngineClient:
    def __init__(self, endpoints: list[str] | None = None, client_id: str | None = None):
        self.client_id = client_id or f"gw-{uuid.uuid4().hex[:12]}"
        self.ctx = gateway_context()
        self.engines: dict[str, EngineConnection] = {}
        self._streams: dict[str, _Stream] = {}
        self._static = list(endpoints or [])
        self.any_ready = asyncio.Event()
        self._turn = 0
        self.version = 0  # bumped whenever an engine joins, leaves, says hello, drops or changes state
        self._ready: list[EngineConnection] = []

    # -- membership ---------------------------------------------------------------------------
    async def start(self) -> None:
        for ep in self._static:
            self._connect(ep)

    def _connect(self, endpoint: str) -> EngineConnection:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.client_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for an engine that is not connected
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + (1 << 20))
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint)
        eng = EngineConnection(endpoint, sock, monitor)
        eng.tasks = [asyncio.create_task(self._read(eng), name=f"engine-reader {endpoint}"),
                     asyncio.create_task(self._watch(eng), name=f"engine-monitor {endpoint}")]
        self.engines[endpoint] = eng
        return eng

    async def _drop(self, eng: EngineConnection, why: str) -> None:
        self.engines.pop(eng.endpoint, None)
        self._update_ready()
        if any(st.engine is eng for st in self._streams.values()):
            await asyncio.sleep(DISCONNECT_GRACE)  # let already-received outputs through first
        self._fail_streams(eng, why)
        for t in eng.tasks:
            t.cancel()
        await asyncio.gather(*eng.tasks, return_exceptions=True)
        eng.sock.disable_monitor()
        eng.monitor.close(0)
        eng.sock.close(0)

    async def apply_cluster(self, state: ClusterState) -> None:
        """Follow the supervisor's engine set: connect to new engines, drop departed ones."""
        wanted = {e.endpoint: e for e in state.engines}
        for ep, info in wanted.items():
            eng = self.engines.get(ep) or self._connect(ep)
            if eng.cluster_state != info.state:
                log.info("engine %d at %s is %s", info.rank, ep, info.state)
            eng.cluster_state = info.state
            eng.model = info.model or None
        for ep, eng in list(self.engines.items()):
            if ep not in wanted:
                await self._drop(eng, f"lost engine {eng.rank} while serving the request")
        self._update_ready()

    async def wait_hello(self, endpoints: list[str], timeout: float) -> bool:
        """Wait up to ``timeout`` s until every engine at ``endpoints`` has said hello; whether they all did."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            if all((e := self.engines.get(ep)) is not None and e.hello is not None for ep in endpoints):
                return True
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.01)

    def _update_ready(self) -> None:
        """Recompute what routing reads on every request; called on every membership change."""
        self.version += 1
        self._ready = [e for e in self.engines.values() if e.routable]
        if self._ready:
            self.any_ready.set()
        else:
            self.any_ready.clear()

    async def close(self) -> None:
        for eng in list(self.engines.values()):
            await self._drop(eng, "gateway shutting down")

    @property
    def ready_engines(self) -> list[EngineConnection]:
        return list(self._ready)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def pick_engine(self, exclude: set[str] = frozenset(), model: str | None = None) -> EngineConnection:
        ready = [e for e in self._ready if e.endpoint not in exclude and e.serves(model)]
        if len(ready) == 1:
            return ready[0]
        if not ready:
            raise NoEngineAvailable("no engine is ready" + (f" for model {model!r}" if model else ""))
        least = min(e.load for e in ready)
        tied = [e for e in ready if e.load == least]
        self._turn += 1  # ties rotate, so light sequential traffic still reaches every engine
        return tied[self._turn % len(tied)]

    # -- inbound ------------------------------------------------------------------------------
    async def _watch(self, eng: EngineConnection) -> None:
        while True:
            event = parse_monitor_message(await eng.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                await eng.sock.send_multipart(encode(ClientHello(self.client_id)))
            elif event == zmq.EVENT_DISCONNECTED:
                was = eng.rank
                eng.hello = None
                eng.stats = None
                self._update_ready()
                # The monitor and the data socket are not ordered: give the reader a moment to
                # deliver what the engine sent before it went (a drained engine's last tokens).
                await asyncio.sleep(DISCONNECT_GRACE)
                n = self._fail_streams(eng, f"lost engine {was} while serving the request")
                log.warning("lost the connection to engine %s at %s; failed its %d in-flight request(s)", was,
                            eng.endpoint, n)

    def _fail_streams(self, eng: EngineConnection, why: str) -> int:
        n = 0
        for rid, st in list(self._streams.items()):
            if st.engine is eng:
                if st.started:
                    st.failed_here = True
                    st.queue.put_nowait(RequestOutput(rid, (), "error", error=why))
                else:  # nothing was produced yet: safe to send it to another engine
                    st.queue.put_nowait(_HandBack(eng))
                n += 1
        return n

    async def _read(self, eng: EngineConnection) -> None:
        while True:
            frames = await eng.sock.recv_multipart(copy=False)
            try:
                msg = decode([f.buffer for f in frames])
            except ProtocolError as e:
                log.warning("dropped a bad frame from engine %s: %s", eng.endpoint, e)
                continue
            if isinstance(msg, StepOutputs | PoolOutputs):
                for out in msg.outputs:
                    st = self._streams.get(out.request_id)
                    if st is not None and st.engine is eng:
                        st.started = True
                        st.queue.put_nowait(out)
            elif isinstance(msg, EngineStats):
                eng.stats = msg
            elif isinstance(msg, EngineHello):
                eng.hello = msg
                eng.known_rank = msg.rank
                self._update_ready()
                log.info("engine %d at %s: %s, %s/%s", msg.rank, eng.endpoint, msg.model_id, msg.device, msg.dtype)
            elif isinstance(msg, ErrorMessage):
                st = self._streams.get(msg.request_id) if msg.request_id else None
                if st is not None and st.engine is eng:
                    st.queue.put_nowait(_HandBack(eng, busy=msg.code == ERR_ENGINE_BUSY)
                                        if msg.code in (DRAINING, ERR_ENGINE_BUSY) else
                                        RequestOutput(msg.request_id, (), "error", error=msg.message))
                else:
                    log.warning("engine %s reports %s: %s", eng.endpoint, msg.code, msg.message)

    # -- requests -------------------------------------------------------------------------------
    def fail_all(self, why: str) -> int:
        """End every in-flight request with an error (shutdown timeout)."""
        for rid, st in list(self._streams.items()):
            st.failed_here = True
            st.queue.put_nowait(RequestOutput(rid, (), "error", error=why))
        return len(self._streams)

    async def _send(self, st: _Stream, frames: list[bytes], refused: set[str]) -> None:
        """Send the request to the least-loaded engine of its model that has not refused it."""
        while True:
            if len(refused) > MAX_HANDBACKS:
                raise NoEngineAvailable("no engine would take the request")
            try:
                eng = self.pick_engine(refused, st.model)
            except NoEngineAvailable:
                if st.busy:
                    raise EnginesBusy("every engine of the model has a full queue") from None
                raise
            try:
                send_now(eng.sock, frames)
            except zmq.Again:  # the connection dropped between the pick and the send
                refused.add(eng.endpoint)
                continue
            st.engine = eng
            eng.outstanding += 1
            return

    @staticmethod
    def _detach(st: _Stream) -> None:
        if st.engine is not None:
            st.engine.outstanding -= 1
            st.engine = None

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                       model: str | None = None, coalesce: bool = True) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until one carries a finish reason; with ``coalesce``, outputs that queued up
        while the consumer was busy come merged (``_Inbox.take_outputs``)."""
        # Encoded (and so checked) before it is registered: a request the wire refuses must not stay in flight.
        frames = encode(AddRequest(request_id, tuple(prompt_token_ids), sampling, REQUEST_ID.get()))
        st = _Stream(_Inbox(), model=model)
        self._streams[request_id] = st
        refused: set[str] = set()
        finished = False
        try:
            await self._send(st, frames, refused)
            while True:
                out = await self._next_output(st, frames, refused, coalesce)
                if out.finish_reason == "error":
                    finished = True
                    raise EngineRequestError(out.error or "the engine failed the request")
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            await self._release(request_id, st, abort=not finished or st.failed_here)

    async def _next_output(self, st: _Stream, frames: list[bytes], refused: set[str], coalesce: bool = False):
        """The request's next output. A hand-back (its engine refused or lost it before any output)
        first sends it to another engine that has not refused it."""
        while True:
            out = await st.queue.get()
            if type(out) is RequestOutput:
                return st.queue.take_outputs(out) if coalesce else out
            if not isinstance(out, _HandBack):
                return out
            if out.engine is st.engine:
                refused.add(out.engine.endpoint)
                st.busy += out.busy
                self._detach(st)
                await self._send(st, frames, refused)

    async def _release(self, request_id: str, st: _Stream, abort: bool) -> None:
        """Forget a request; with ``abort``, tell its engine to stop working on it."""
        self._streams.pop(request_id, None)
        if st.engine is not None:
            eng = st.engine
            self._detach(st)
            if abort and eng.hello is not None:
                try:
                    send_now(eng.sock, encode(AbortRequest((request_id,))))
                except zmq.ZMQError:
                    pass

    async def pool(self, request_id: str, prompt_token_ids: list[int], task: str = "embed",
                   normalize: bool | None = None, dimensions: int | None = None, pair_start: int = 0,
                   model: str | None = None) -> PoolOutput:
        """Run one input through a pooling engine; its vector (or logits). Like ``generate``, a
        request an engine refuses or loses before answering goes to another engine."""
        frames = encode(PoolRequest(request_id, tuple(prompt_token_ids), task, normalize, dimensions, pair_start,
                                    REQUEST_ID.get()))
        st = _Stream(_Inbox(), model=model)
        self._streams[request_id] = st
        refused: set[str] = set()
        answered = False
        try:
            await self._send(st, frames, refused)
            out = await self._next_output(st, frames, refused)
            answered = True
            if isinstance(out, RequestOutput):  # failed here (shutdown) or refused with an error
                raise EngineRequestError(out.error or "the engine failed the request")
            if out.error is not None:
                raise EngineRequestError(out.error)
            return out
        finally:
            await self._release(request_id, st, abort=not answered)


class ModelEngines:
    """One model's engines: what a ``ModelState`` calls ``engines`` (routing, readiness, tasks).

    What requests read of the membership (ready engines, their tasks, context, EOS ids) is computed
    once per membership change (``EngineClient.version``), not on every request."""

    def __init__(self, client: EngineClient, model: str | None):
        self.client = client
        self.model = model
        self._version = -1
        self._ready: list[EngineConnection] = []
        self._tasks: frozenset[str] = frozenset()
        self._primary: str | None = None
        self._max_model_len: int | None = None
        self._eos: frozenset[int] = frozenset()

    def _view(self) -> None:
        if self._version == self.client.version:
            return
        ready = [e for e in self.client._ready if e.serves(self.model)]
        hellos = [e.hello for e in ready if e.hello is not None]
        self._ready = ready
        self._tasks = frozenset(t for h in hellos for t in h.tasks)
        self._primary = next((h.tasks[0] for h in hellos if h.tasks), None)
        self._max_model_len = min((h.max_model_len for h in hellos), default=None)
        self._eos = frozenset(t for h in hellos for t in h.eos_token_ids)
        self._version = self.client.version

    @property
    def ready_engines(self) -> list[EngineConnection]:
        self._view()
        return list(self._ready)

    @property
    def has_ready(self) -> bool:
        self._view()
        return bool(self._ready)

    @property
    def engines(self) -> dict[str, EngineConnection]:
        return {ep: e for ep, e in self.client.engines.items() if e.serves(self.model)}

    @property
    def tasks(self) -> frozenset[str]:
        """What the model's ready engines do (generate, embed, classify)."""
        self._view()
        return self._tasks

    @property
    def primary_task(self) -> str | None:
        """What the model is made for: the first task its engines announce (generate for a chat model that
        also embeds)."""
        self._view()
        return self._primary

    @property
    def max_model_len(self) -> int | None:
        """The smallest context of the model's ready engines (None while none is ready)."""
        self._view()
        return self._max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The EOS ids the model's ready engines announce."""
        self._view()
        return self._eos

    @property
    def in_flight(self) -> int:
        return self.client.in_flight

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 coalesce: bool = True) -> AsyncIterator[RequestOutput]:
        return self.client.generate(request_id, prompt_token_ids, sampling, self.model, coalesce)

    async def pool(self, request_id: str, prompt_token_ids: list[int], task: str = "embed",
                   normalize: bool | None = None, dimensions: int | None = None, pair_start: int = 0) -> PoolOutput:
        return await self.client.pool(request_id, prompt_token_ids, task, normalize, dimensions, pair_start,
                                      self.model)
