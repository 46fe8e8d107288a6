"""The gateway's side of the engine tier: membership, routing, and failure handling.

Each gateway keeps one DEALER socket per engine. The engine set comes from the supervisor's
cluster state (engines join, drain and leave at run time) or, standalone, from ``--engine``.
A socket monitor tells us the moment an engine's connection drops: every request in flight on
it then ends with an error at once, and the engine is not routed to until it (or its
replacement, on the same endpoint) says hello again.

Each engine serves one model (the supervisor's cluster state says which); ``ModelEngines`` is one
model's share of the client, so a request only ever reaches its own model's engines.

``submit`` sends a request to the routable engine of its model that the routing policy picks (``routing``: by what
each engine's prefix cache holds, as the engines' KV events tell ``kv_index``, within a bound on its load; or the
least loaded) and hands every output to the request's ``OutputSink`` as the engine reader receives
it, with no task woken in between; ``cancel`` aborts it in the engine. ``generate`` is the same as an
async iterator. A request that an engine refuses (draining, a full queue) or loses (dies) before
producing any output goes to another engine.

A generation request that an engine loses while it streams *migrates* (``--migration-limit``, default 3 moves
per request): this gateway holds its prompt and every token it has received, and sends both to another ready
engine of the model (``AddRequest.output_token_ids``), which computes them and goes on after them as if it had
generated them itself (max_tokens, min_tokens, penalties, a grammar replayed into a fresh matcher, a seeded draw
for the next position: ``engine_worker.sampler.seeded_uniform``). The sink hears nothing of it: its outputs go on
from the next token, none lost or repeated, so greedy and seeded requests write what they would have written
uninterrupted. An engine is lost when its connection drops (it died, hung and was killed, or its host was cut
off), when it hands its requests back at its drain timeout (``ERR_ENGINE_DRAINING``), or when its
expert-parallel group loses a member (``ERR_GROUP_LOST``). With no engine of the model left, a migrating request
waits up to ``--scaling-wait`` for one (a replacement), then fails as it would have without migration.

The sockets are plain ZeroMQ sockets read from the event loop: ``loop.add_reader`` on each socket's
file descriptor, and every message waiting is read in one callback (``_pump``). zmq.asyncio makes and
resolves a Future per receive and per send and wakes a reader task for each: an aiohttp app's ZeroMQ
round trip to an echoing peer cost it 37 µs of CPU through zmq.asyncio and 15 µs read this way (7 µs
with the I/O thread under ``SCHED_BATCH``, ``gateway_context``), measured side by side.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import zmq
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
    TranscribeOutput,
    TranscribeOutputs,
    TranscribeRequest,
    decode,
    encode,
)
from protocol.cluster import ClusterState
from protocol.constants import ERR_ENGINE_BUSY, ERR_ENGINE_DRAINING, ERR_GROUP_LOST
from zserve.curve import CurveKeys, is_tcp, secure_client

from .kv_index import KvFollower
from .logs import REQUEST_ID
from .routing import Router
from .tenancy import SERVED, Served

log = logging.getLogger("zserve.gateway.engines")

DRAINING = ERR_ENGINE_DRAINING
MAX_HANDBACKS = 8
DISCONNECT_GRACE = 0.2  # seconds; well inside the 1 s in which a dead engine's requests must end
# Seconds a migrating engine's requests wait for its connection to drop (what it wrote last is read by then) once the
# supervisor says it is gone; an engine host cut off never drops it and its requests move after this.
SETTLE_WAIT = 0.5
# An engine's hello is asked for again this often while it does not come (``EngineClient._greet``), and a greeting
# that could not be sent is tried again after GREET_RETRY.
GREET_INTERVAL, GREET_RETRY = 1.0, 0.05
# Seconds a request waits for an engine the supervisor reports ready that has not yet greeted this gateway: a
# replacement (rolling restart, restart after a crash) is ready before the gateway's socket reconnects to it
# (ZeroMQ retries up to RECONNECT_IVL_MAX, a second, apart), and the moment a hold on its model is released a
# request would find no engine and fail with a 503 although the engine is up.
CONNECT_WAIT = 5.0
PUMP_BATCH = 256  # messages one reader callback takes before letting other callbacks run
_EVENTS, _POLLIN, _NOBLOCK = zmq.EVENTS, zmq.POLLIN, zmq.NOBLOCK


def gateway_context() -> zmq.Context:
    """The gateway's ZeroMQ context, its I/O thread under ``SCHED_BATCH`` (set before the thread starts).

    A send wakes the context's I/O thread. As an ordinary thread it preempts the event loop at once when both
    share a core, so every request paid two context switches and the I/O thread woke once per message
    (``tests/bench/bench_gateway.py``, gateway pinned to one core: 35 µs of wall time per send, 17 µs of I/O
    thread CPU per request). A batch thread does not preempt on wakeup: it runs when the loop waits, or at once on
    an idle core, and then carries every message queued meanwhile (11 µs, 2.5 µs)."""
    ctx = zmq.Context.instance()
    if hasattr(os, "SCHED_BATCH"):
        ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    return ctx


class NoEngineAvailable(RuntimeError):
    """No engine is ready to take the request (the HTTP layer answers 503)."""


class EnginesBusy(NoEngineAvailable):
    """Every engine of the model refused the request because its queue is full (the HTTP layer answers 429)."""


class EngineRequestError(RuntimeError):
    """The engine ended a request with an error (or died with it); ``code`` says what kind, when the engine did
    (``RequestOutput.error_code``)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class OutputSink(Protocol):
    """Where a submitted request's results go, called from the engine reader (on the event loop, never
    concurrently). ``output`` gets every ``RequestOutput`` in order (the last one carries the finish reason;
    a ``PoolOutput`` for a pooling request); ``fail`` ends a request that will get no more outputs with
    ``EngineRequestError``, ``NoEngineAvailable`` or ``EnginesBusy``. Exactly one of a final output or a
    failure ends each request, unless it is cancelled first. Neither may block; an exception from either is
    logged and aborts the request."""

    def output(self, out: RequestOutput | PoolOutput) -> None: ...

    def fail(self, error: Exception) -> None: ...


@dataclass(eq=False)  # identity: one per socket, kept in sets
class EngineConnection:
    endpoint: str
    sock: zmq.Socket
    monitor: zmq.Socket
    cluster_state: str | None = None  # the supervisor's word: starting / ready / draining; None = standalone
    hello: EngineHello | None = None
    stats: EngineStats | None = None
    outstanding: int = 0  # this gateway's requests in flight on the engine
    sent_since_stats: int = 0  # of those, the ones sent since the engine's last EngineStats (which misses them)
    known_rank: int | None = None  # kept after the engine is gone, for messages
    model: str | None = None  # the model it serves, from the cluster state; None = standalone (any)
    loras: frozenset[str] | None = None  # the LoRA adapters it reported loaded (cluster state); None = standalone
    tasks: list[asyncio.Task] = field(default_factory=list)
    closed: bool = False
    # Set when the socket's monitor saw the connection drop: ZeroMQ's I/O thread has queued everything the engine
    # sent before it went (cleared on each new handshake).
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    greeted: float = 0.0  # (event-loop time) when this gateway last sent it ClientHello

    def serves(self, model: str | None, lora: str | None = None) -> bool:
        """Whether a request of ``model`` (through LoRA adapter ``lora``) may go here: an adapter's requests go only
        to the engines that have loaded it."""
        return (model is None or self.model is None or self.model == model) and (
            lora is None or self.loras is None or lora in self.loras)

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
    """An ``OutputSink`` for a task that pulls (``generate``): a deque of outputs and failures, and at most
    one waiting consumer (an ``asyncio.Queue`` without what a single consumer never needs)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item: RequestOutput | PoolOutput | Exception) -> None:
        self.items.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    output = fail = put_nowait

    async def get(self, coalesce: bool = False) -> RequestOutput | PoolOutput:
        """The next output (with ``coalesce``, merged with the outputs queued behind it: ``take_outputs``);
        a failure is raised."""
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item = self.items.popleft()
        if isinstance(item, Exception):
            raise item
        return self.take_outputs(item) if coalesce and type(item) is RequestOutput else item

    def take_outputs(self, out: RequestOutput) -> RequestOutput:
        """``out`` with the outputs queued behind it merged in, up to a finish or a failure.

        Under load a request's consumer can fall a few engine steps behind; it then takes them as one
        output (one detokenizer pass, one stream chunk, one write), as vLLM's output collector does."""
        items = self.items
        while out.finish_reason is None and items and type(items[0]) is RequestOutput:
            out = merge_outputs(out, items.popleft())
        return out


class _Waiter:
    """An ``OutputSink`` for a request with one answer (pooling): a future."""

    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()

    def output(self, out: RequestOutput | PoolOutput) -> None:
        if not self.future.done():
            self.future.set_result(out)

    def fail(self, error: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(error)


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
                   else b.prompt_top_logprobs,
                   prompt_ranks=a.prompt_ranks if a.prompt_logprobs is not None else b.prompt_ranks)


class _Stream:
    """One request in flight on an engine."""

    __slots__ = ("request_id", "sink", "frames", "model", "engine", "route_key", "started", "busy", "refused", "add",
                 "generated", "migrations", "wait_until", "served")

    def __init__(self, request_id: str, sink: OutputSink, frames: list[bytes], model: str | None,
                 add: AddRequest | None = None, served: Served | None = None):
        self.request_id = request_id
        self.sink = sink
        self.frames = frames  # the encoded request, resent on a hand-back
        self.model = model  # routed only to engines of this model
        self.engine: EngineConnection | None = None
        self.route_key: int | None = None  # the prefix routing placed it by (``Router.left`` when it leaves)
        self.started = False  # the engine has sent output for it
        self.busy = 0  # engines that refused it for a full queue
        self.refused: set[str] = set()  # endpoints that refused or lost it before any output
        self.add = add  # a generation request (None: pooling, which never migrates)
        self.generated: list[int] = []  # the tokens its sink has been given (with migration on)
        self.migrations = 0  # times it moved to another engine
        self.wait_until: float | None = None  # migrating with no engine left: waits for one until then
        self.served = served  # its tenant (``gateway.tenancy``), charged each generated token


class EngineClient:
    def __init__(self, endpoints: list[str] | None = None, client_id: str | None = None,
                 keys: CurveKeys | None = None):
        self.client_id = client_id or f"gw-{uuid.uuid4().hex[:12]}"
        self.keys = keys  # CURVE for engines on other hosts (tcp:// endpoints)
        self.ctx = gateway_context()
        self.engines: dict[str, EngineConnection] = {}
        self._streams: dict[str, _Stream] = {}
        self._static = list(endpoints or [])
        self.any_ready = asyncio.Event()
        # Each engine's KV cache events, followed (by endpoint), and the routing that reads them (``routing``).
        self.followers: dict[str, KvFollower] = {}
        self.router = Router(followers=self.followers)
        self.version = 0  # bumped whenever an engine joins, leaves, says hello, drops or changes state
        self._ready: list[EngineConnection] = []
        # ``_ready`` by (model, LoRA adapter), as asked
        self._ready_by_model: dict[tuple[str | None, str | None], list[EngineConnection]] = {}
        self._recheck: set[EngineConnection] = set()  # sockets sent on in this loop iteration
        # How long a request of a model that a draining engine handed back may wait for an engine when none is
        # left (the gateway's --scaling-wait while a restart or resize holds the model; 0: fail it at once).
        self.hold: Callable[[str | None], float] | None = None
        self._parked: list[tuple[_Stream, float]] = []  # (handed back with no engine left, until when)
        # Migration (the gateway's --migration-limit, --migration-max-len, --scaling-wait): moves per request (0:
        # off), the longest prompt + generated tokens re-sent (None: any the engine takes), how long a migrating
        # request waits for an engine when none is left.
        self.migration_limit = 0
        self.migration_max_len: int | None = None
        self.migration_wait = 0.0
        # Told of every request that lost its engine while streaming: (cause of MIGRATION_CAUSES, whether it moved;
        # False: it had exhausted its migrations, or is too long to re-send) — the gateway's metrics.
        self.on_migration: Callable[[str, bool], None] | None = None
        # The ids clients named their requests by (/inference/v1/generate's request_id) → the engine request ids
        # of those running here: POST /abort_requests finds them through any gateway.
        self.aliases: dict[str, set[str]] = {}

    # -- membership ---------------------------------------------------------------------------
    async def start(self) -> None:
        for ep in self._static:
            self._connect(ep)

    def _connect(self, endpoint: str) -> EngineConnection:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.client_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for an engine that is not connected
        # No high-water mark: a send that cannot go now (``zmq.Again``) then means the engine is not connected, never
        # that a burst outran a busy engine (ZeroMQ's default of 1,000 queued messages failed a request of 2,049
        # pooled inputs with a 503). What waits here is bounded by the gateway's own limits on requests and parts.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + (1 << 20))
        if self.keys is not None and is_tcp(endpoint):
            secure_client(sock, self.keys)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint)
        eng = EngineConnection(endpoint, sock, monitor)
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.getsockopt(zmq.FD), self._pump, eng)
        loop.add_reader(monitor.getsockopt(zmq.FD), self._pump_monitor, eng)
        self.engines[endpoint] = eng
        # ZeroMQ's descriptors signal edges: what arrived before the readers were added is read now.
        loop.call_soon(self._pump, eng)
        loop.call_soon(self._pump_monitor, eng)
        return eng

    async def _drop(self, eng: EngineConnection, why: str) -> None:
        self.engines.pop(eng.endpoint, None)
        self._unfollow(eng.endpoint)
        self._update_ready()
        if any(st.engine is eng for st in self._streams.values()):
            await self._settle(eng)
        self._fail_streams(eng, why)
        for t in eng.tasks:
            t.cancel()
        await asyncio.gather(*eng.tasks, return_exceptions=True)
        self._close_sockets(eng)

    def _close_sockets(self, eng: EngineConnection) -> None:
        if eng.closed:
            return
        eng.closed = True
        loop = asyncio.get_running_loop()
        loop.remove_reader(eng.sock.getsockopt(zmq.FD))
        loop.remove_reader(eng.monitor.getsockopt(zmq.FD))
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
            eng.loras = frozenset(info.loras)
            self._follow(ep, info.kv_events)
        for ep, eng in list(self.engines.items()):
            if ep not in wanted:
                await self._drop(eng, f"lost engine {eng.rank} while serving the request")
        self._update_ready()

    def _follow(self, endpoint: str, kv_events: str) -> None:
        """Follow the KV events of the engine at ``endpoint`` where it publishes them (``kv_index``)."""
        f = self.followers.get(endpoint)
        if f is not None and f.endpoint != kv_events:
            self._unfollow(endpoint)
            f = None
        if f is None and kv_events:
            self.followers[endpoint] = KvFollower(self.ctx, kv_events, self.keys)

    def _unfollow(self, endpoint: str) -> None:
        f = self.followers.pop(endpoint, None)
        if f is not None:
            f.close()

    async def wait_hello(self, endpoints: list[str], timeout: float) -> bool:
        """Wait up to ``timeout`` s until every engine at ``endpoints`` has said hello; whether they all did."""
        return await _until(lambda: all((e := self.engines.get(ep)) is not None and e.hello is not None
                                        for ep in endpoints), timeout)

    async def wait_caught_up(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until every engine's KV events have been replayed here; whether they were."""
        return await _until(lambda: not any(f.state.replaying for f in self.followers.values()), timeout)

    def _update_ready(self) -> None:
        """Recompute what routing reads on every request; called on every membership change."""
        self.version += 1
        self._ready = [e for e in self.engines.values() if e.routable]
        self._ready_by_model.clear()
        if self._ready:
            self.any_ready.set()
        else:
            self.any_ready.clear()
        if self._parked:
            self._unpark()

    def _unpark(self) -> None:
        """Send the parked requests that an engine can take now; fail those whose wait is over."""
        now = asyncio.get_running_loop().time()
        parked, self._parked = self._parked, []
        for st, until in parked:
            if self._streams.get(st.request_id) is not st:
                continue  # cancelled meanwhile
            try:
                self._send(st)
            except NoEngineAvailable as e:
                if now < until and (st.wait_until is not None or self._may_wait(st.model) > 0):
                    self._parked.append((st, until))
                else:  # its wait is over, or what it waited for is gone (the hold ended, the engine left)
                    self._end(st, e)
                continue
            if st.wait_until is not None:
                st.wait_until = None
                self._moved(st, None, "after waiting for an engine")

    async def close(self) -> None:
        for eng in list(self.engines.values()):
            await self._drop(eng, "gateway shutting down")

    @property
    def ready_engines(self) -> list[EngineConnection]:
        return list(self._ready)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def pick_engine(self, exclude: set[str] = frozenset(), model: str | None = None,
                    lora: str | None = None, prompt: tuple[int, ...] | None = None) -> EngineConnection:
        """The engine of ``model`` (through ``lora``) that takes a request for ``prompt`` (None: a pooling request),
        by the routing policy (``routing.Router``)."""
        ready = self._ready_by_model.get((model, lora))
        if ready is None:
            ready = self._ready_by_model[model, lora] = [e for e in self._ready if e.serves(model, lora)]
        if exclude:
            ready = [e for e in ready if e.endpoint not in exclude]
        if len(ready) == 1:
            return ready[0]
        if not ready:
            raise NoEngineAvailable("no engine is ready" + (f" for model {model!r}" if model else "")
                                    + (f" with LoRA adapter {lora!r}" if lora else ""))
        return self.router.pick(ready, prompt, model, lora)

    # -- the sockets ----------------------------------------------------------------------------
    def _send_now(self, eng: EngineConnection, frames: list) -> None:
        """Send a message without waiting (``zmq.Again`` when it cannot go now).

        The socket's descriptor signals edges, and a send can consume the edge that would announce a message
        that arrived meanwhile, so the socket is read again once this loop iteration's callbacks have run,
        once for all the sends made in it (as zmq.asyncio does after each of its own sends)."""
        eng.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        if not self._recheck:
            asyncio.get_running_loop().call_soon(self._pump_sent)
        self._recheck.add(eng)

    def _pump_sent(self) -> None:
        engines = list(self._recheck)
        self._recheck.clear()
        for eng in engines:
            self._pump(eng)

    def _pump(self, eng: EngineConnection) -> None:
        """Read every message waiting on the engine's socket (up to ``PUMP_BATCH``, then again next iteration)."""
        if eng.closed:
            return
        sock = eng.sock
        for _ in range(PUMP_BATCH):
            try:
                # Asking first is cheaper than the zmq.Again a receive raises on an empty socket.
                if not sock.get(_EVENTS) & _POLLIN:
                    return
                frames = sock.recv_multipart(_NOBLOCK)
            except zmq.ZMQError as e:
                if not eng.closed:
                    log.warning("reading from engine %s failed: %s", eng.endpoint, e)
                return
            try:
                self._dispatch(eng, frames)
            except Exception:  # a bug here must not stop the reader: every request on the engine would hang
                log.exception("error handling a message from engine %s", eng.endpoint)
        asyncio.get_running_loop().call_soon(self._pump, eng)

    def _pump_monitor(self, eng: EngineConnection) -> None:
        while not eng.closed:
            try:
                frames = eng.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                eng.disconnected.clear()
                self._greet(eng, force=True)
            elif event == zmq.EVENT_DISCONNECTED:
                eng.disconnected.set()
                was = eng.rank
                eng.hello = None
                eng.stats = None
                if (f := self.followers.get(eng.endpoint)) is not None:
                    f.engine_lost()
                self._update_ready()
                eng.tasks = [t for t in eng.tasks if not t.done()]
                eng.tasks.append(asyncio.get_running_loop().create_task(self._lost(eng, was)))

    def _greet(self, eng: EngineConnection, force: bool = False) -> None:
        """Send ``ClientHello`` (the engine answers with its ``EngineHello``, which makes it routable here): at each
        handshake (``force``), else at most every ``GREET_INTERVAL`` while no hello came. A greeting that cannot go
        at once is tried again shortly while the connection stands, and an engine that sends stats to a gateway
        that has no hello from it is greeted again: without its hello, a gateway never routes to an engine that is
        up."""
        loop = asyncio.get_running_loop()
        if eng.closed or eng.hello is not None or (not force and loop.time() - eng.greeted < GREET_INTERVAL):
            return
        eng.greeted = loop.time()
        try:
            self._send_now(eng, encode(ClientHello(self.client_id)))
        except zmq.ZMQError as e:
            log.debug("could not greet engine %s yet (%s); trying again", eng.endpoint, e)
            loop.call_later(GREET_RETRY, lambda: None if eng.disconnected.is_set() else self._greet(eng, True))

    async def _lost(self, eng: EngineConnection, was: int | None) -> None:
        await self._settle(eng)
        n = self._fail_streams(eng, f"lost engine {was} while serving the request")
        log.warning("lost the connection to engine %s at %s; its %d in-flight request(s) %s", was, eng.endpoint, n,
                    "moved to other engines or failed" if self.migration_limit else "failed")

    async def _settle(self, eng: EngineConnection) -> None:
        """Before acting on a lost engine's requests: deliver what it sent before it went (a drained engine's last
        tokens). The monitor and the data socket are not ordered. Without migration a request then fails, so the
        reader gets ``DISCONNECT_GRACE``; a migrating one moves as soon as the socket holds nothing more (an output
        that still came later would only be dropped, and its tokens generated again where the request moved).

        The supervisor can say an engine is gone (it saw the process exit) before this gateway's ZeroMQ I/O thread
        has read what the engine wrote last (a drain timeout's hand-backs, written just before it exited): until the
        socket's monitor saw the connection drop, wait for that, up to ``SETTLE_WAIT``."""
        if not self.migration_limit:
            await asyncio.sleep(DISCONNECT_GRACE)
            return
        if not eng.disconnected.is_set() and eng.hello is not None:
            try:
                async with asyncio.timeout(SETTLE_WAIT):
                    await eng.disconnected.wait()
            except TimeoutError:
                pass  # (a host cut off: nothing more will come)
        for _ in range(2):
            self._pump(eng)
            await asyncio.sleep(0)

    def _dispatch(self, eng: EngineConnection, frames: list[bytes]) -> None:
        try:
            msg = decode(frames)
        except ProtocolError as e:
            log.warning("dropped a bad frame from engine %s: %s", eng.endpoint, e)
            return
        kind = type(msg)
        if kind is StepOutputs or kind is PoolOutputs or kind is TranscribeOutputs:
            streams = self._streams
            for out in msg.outputs:  # type: ignore[union-attr]
                st = streams.get(out.request_id)
                if st is not None and st.engine is eng:
                    self._deliver(st, out)

        elif kind is EngineStats:
            eng.stats = msg  # type: ignore[assignment]
            eng.sent_since_stats = 0
            if eng.hello is None:  # it knows this gateway, which has no hello from it: one greeting was lost
                self._greet(eng)
        elif kind is EngineHello:
            eng.hello = msg  # type: ignore[assignment]
            eng.known_rank = msg.rank  # type: ignore[union-attr]
            if (f := self.followers.get(eng.endpoint)) is not None:
                f.engine_hello(msg.pid)  # type: ignore[union-attr]
            self._update_ready()
            log.info("engine %d at %s: %s, %s/%s", msg.rank, eng.endpoint, msg.model_id,  # type: ignore[union-attr]
                     msg.device, msg.dtype)  # type: ignore[union-attr]
        elif kind is ErrorMessage:
            st = self._streams.get(msg.request_id) if msg.request_id else None  # type: ignore[union-attr]
            if st is not None and st.engine is eng:
                code = msg.code  # type: ignore[union-attr]
                if code == ERR_GROUP_LOST or (code == DRAINING and st.started):  # handed back while it ran
                    self._migrate(st, eng, "group_lost" if code == ERR_GROUP_LOST else "drain_timeout",
                                  msg.message, exclude=code == DRAINING)  # type: ignore[union-attr]
                elif code in (DRAINING, ERR_ENGINE_BUSY):
                    self._hand_back(st, eng, busy=code == ERR_ENGINE_BUSY)
                else:
                    self._end(st, EngineRequestError(msg.message))  # type: ignore[union-attr]
            elif msg.request_id and msg.code in (DRAINING, ERR_ENGINE_BUSY):  # type: ignore[union-attr]
                # A refusal of a request that ended meanwhile: another part of it was refused by every engine
                # and the whole request with it (one 429), or its client left. Nothing to act on.
                log.debug("engine %s refused %s, which had ended: %s", eng.endpoint, msg.request_id,  # type: ignore[union-attr]
                          msg.message)  # type: ignore[union-attr]
            else:
                log.warning("engine %s reports %s: %s", eng.endpoint, msg.code, msg.message)  # type: ignore[union-attr]

    # -- requests -------------------------------------------------------------------------------
    def _deliver(self, st: _Stream, out: RequestOutput | PoolOutput) -> None:
        st.started = True
        if type(out) is RequestOutput:
            finish = out.finish_reason
            if st.served is not None:
                st.served.generated(len(out.new_token_ids))
                if out.queue_time is not None:
                    st.served.queued(out.queue_time)
            if finish == "error":
                self._end(st, EngineRequestError(out.error or "the engine failed the request", out.error_code))
                return
            if self.migration_limit:
                st.generated += out.new_token_ids
            if finish is not None:
                if st.migrations:
                    log.info("request %s finished on %s after %d migration(s)%s", st.request_id, _engine(st.engine),
                         st.migrations, _trace(st))
                self._forget(st)  # finished by the engine: nothing to abort
        elif type(out) is not TranscribeOutput or out.done:  # (a transcription's windows come one by one)
            self._forget(st)
        try:
            st.sink.output(out)
        except Exception:
            self._sink_failed(st)

    def _end(self, st: _Stream, error: Exception, abort: bool = False) -> None:
        """End a request with ``error``; with ``abort``, tell its engine to stop working on it."""
        eng = self._forget(st)
        if abort and eng is not None:
            self._abort(eng, st.request_id)
        try:
            st.sink.fail(error)
        except Exception:
            log.exception("error ending %s", st.request_id)

    def _sink_failed(self, st: _Stream) -> None:
        """A bug in a sink: the request is aborted and still ends, with an error its client can read."""
        log.exception("error handling the output of %s; aborting it", st.request_id)
        self.cancel(st.request_id)
        try:
            st.sink.fail(EngineRequestError("the gateway failed handling the engine's output"))
        except Exception:
            log.exception("the sink of %s failed again", st.request_id)

    def _forget(self, st: _Stream) -> EngineConnection | None:
        """Stop following a request; the engine it was on, if any."""
        self._streams.pop(st.request_id, None)
        eng = st.engine
        if eng is not None:
            self._left(st, eng)
        return eng

    def _abort(self, eng: EngineConnection, request_id: str) -> None:
        if eng.hello is not None and not eng.closed:
            try:
                self._send_now(eng, encode(AbortRequest((request_id,))))
            except zmq.ZMQError:
                pass

    def _fail_streams(self, eng: EngineConnection, why: str) -> int:
        n = 0
        for st in list(self._streams.values()):
            if st.engine is eng:
                # One that produced output moves; one that had not is sent again as it is (both wait up to
                # --scaling-wait for an engine when none is left, as with --migration-limit 0 only held ones do).
                self._migrate(st, eng, "engine_lost", why)
                n += 1
        return n

    def _migrate(self, st: _Stream, eng: EngineConnection, cause: str, why: str, exclude: bool = True) -> None:
        """``eng`` lost a request (``cause``: one of MIGRATION_CAUSES). One it had sent no output for is handed back
        as it is. One that had produced output moves: its prompt and the tokens its sink was given go to another
        engine of its model (``exclude``: not ``eng``, which may come back as the model's engine once its
        expert-parallel group re-forms), which goes on after them. It fails with ``why`` instead when it has moved
        ``--migration-limit`` times, is longer than ``--migration-max-len``, or finds no engine within
        ``--scaling-wait``."""
        if not st.started:  # nothing of it came from this engine: what it holds (frames) is still what to send
            if exclude and not self.migration_limit:
                self._hand_back(st, eng)
            else:  # sent again as it is, waiting up to --scaling-wait for an engine as a moved request does
                self._resend(st, eng, cause, exclude)
            return
        add, n = st.add, len(st.generated)
        total = 0 if add is None else len(add.prompt_token_ids) + n
        if add is None or st.migrations >= self.migration_limit or n >= add.sampling.max_tokens or (
                self.migration_max_len is not None and total > self.migration_max_len):
            if add is not None and self.migration_limit:
                log.warning("request %s lost engine %s (%s) after %d tokens and %d migration(s): %s%s", st.request_id,
                            eng.rank, cause, n, st.migrations, "no migration left" if st.migrations
                            >= self.migration_limit else f"{total} tokens exceed --migration-max-len", _trace(st))
                if self.on_migration is not None:
                    self.on_migration(cause, False)
            self._end(st, EngineRequestError(why))
            return
        st.migrations += 1
        st.started = False  # until the engine it moves to sends output (before that, a refusal is a hand-back)
        st.frames = encode(replace(add, output_token_ids=tuple(st.generated)))
        if self.on_migration is not None:
            self.on_migration(cause, True)
        self._resend(st, eng, cause, exclude)

    def _resend(self, st: _Stream, eng: EngineConnection, cause: str, exclude: bool) -> None:
        """Send a request ``eng`` gave back (its ``frames`` say what to send now) to another engine of its model, or
        park it for up to ``--scaling-wait`` when none is there."""
        self._left(st, eng)
        st.busy = 0
        st.refused = {eng.endpoint} if exclude else set()
        try:
            self._send(st)
        except NoEngineAvailable as e:
            st.refused = set()  # the one to wait for may be its replacement, on the same endpoint
            if self.migration_wait <= 0:
                self._end(st, e)
                return
            st.wait_until = asyncio.get_running_loop().time() + self.migration_wait
            log.info("request %s lost engine %s (%s) after %d tokens; waiting up to %.0fs for another engine%s",
                     st.request_id, eng.rank, cause, len(st.generated), self.migration_wait, _trace(st))
            self._park(st, self.migration_wait)
            return
        self._moved(st, eng, cause)

    def _moved(self, st: _Stream, lost: EngineConnection | None, cause: str) -> None:
        if st.migrations:
            log.info("request %s moved from %s to %s after %d tokens (%s; migration %d of %d)%s", st.request_id,
                     _engine(lost), _engine(st.engine), len(st.generated), cause, st.migrations, self.migration_limit,
                     _trace(st))

    def _hand_back(self, st: _Stream, eng: EngineConnection, busy: bool = False) -> None:
        """``eng`` refused (draining, a full queue) or lost the request before any output: another engine of its
        model that has not refused it gets it, or it fails (``EnginesBusy`` when full queues refused it)."""
        st.refused.add(eng.endpoint)
        st.busy += busy
        self._left(st, eng)
        try:
            self._send(st)
        except NoEngineAvailable as e:
            # The engine is leaving while admission is held (a rolling restart of a model's only engine, an
            # expert-parallel resize): wait for its replacement, which takes the same endpoint.
            wait = 0.0 if busy else self.migration_wait if st.migrations else self._may_wait(st.model)
            if wait <= 0:
                self._end(st, e)
                return
            st.refused.discard(eng.endpoint)
            if st.migrations:  # a migrated request waits for an engine whatever the holds say
                st.wait_until = asyncio.get_running_loop().time() + wait
            self._park(st, wait)

    def _may_wait(self, model: str | None) -> float:
        """How long a request of ``model`` that finds no engine may wait for one instead of failing: while a hold
        that waits covers the model (``hold``: --scaling-wait), or while an engine of it is ready by the
        supervisor's word but has not yet greeted this gateway (``CONNECT_WAIT``); else 0."""
        wait = self.hold(model) if self.hold is not None else 0.0
        if wait <= 0 and self.connecting(model):
            wait = CONNECT_WAIT
        return wait

    def connecting(self, model: str | None) -> bool:
        """Whether an engine of ``model`` is ready by the supervisor's word but has not greeted this gateway yet."""
        return any(e.cluster_state == "ready" and e.hello is None and not e.closed and e.serves(model)
                   for e in self.engines.values())

    def _park(self, st: _Stream, wait: float) -> None:
        loop = asyncio.get_running_loop()
        self._parked.append((st, loop.time() + wait))
        loop.call_later(wait + 0.01, self._unpark)

    def fail_all(self, why: str) -> int:
        """End every in-flight request with an error, and abort it in its engine (shutdown timeout)."""
        streams = list(self._streams.values())
        for st in streams:
            self._end(st, EngineRequestError(why), abort=True)
        return len(streams)

    def _send(self, st: _Stream) -> None:
        """Send the request to the engine of its model that routing picks among those that have not refused it."""
        while True:
            if len(st.refused) > MAX_HANDBACKS:
                raise NoEngineAvailable("no engine would take the request")
            try:
                add = st.add
                eng = self.pick_engine(st.refused, st.model, add.lora if add is not None else None,
                                       add.prompt_token_ids if add is not None else None)
            except NoEngineAvailable:
                if st.busy:
                    raise EnginesBusy("every engine of the model has a full queue") from None
                raise
            try:
                self._send_now(eng, st.frames)
            except zmq.Again:  # the connection dropped between the pick and the send
                st.refused.add(eng.endpoint)
                continue
            st.engine = eng
            st.route_key = self.router.placed(eng)
            eng.outstanding += 1
            eng.sent_since_stats += 1
            return

    def _left(self, st: _Stream, eng: EngineConnection) -> None:
        """``st`` is no longer on ``eng`` (it ended, or goes to another engine)."""
        eng.outstanding -= 1
        st.engine = None
        if st.route_key is not None:
            self.router.left(st.route_key)
            st.route_key = None

    def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, sink: OutputSink,
               model: str | None = None, lora: str | None = None) -> None:
        """Send a generation request (through LoRA adapter ``lora`` of ``model``'s engines, or the base model); its
        outputs go to ``sink``. Raises ``NoEngineAvailable`` when no engine of ``model`` can take it now (nothing is
        left in flight then)."""
        served = SERVED.get()
        tenant, weight = ("", 1.0) if served is None else served.engine_tenant
        if served is not None and (priority := served.tenant.request_priority(sampling.priority)) != sampling.priority:
            sampling = replace(sampling, priority=priority)
        # Encoded (and so checked) before it is registered: a request the wire refuses must not stay in flight.
        add = AddRequest(request_id, tuple(prompt_token_ids), sampling, REQUEST_ID.get(), lora=lora, tenant=tenant,
                         weight=weight)
        self._submit(request_id, encode(add), sink, model, add, served)
        if served is not None:
            served.prompt(len(prompt_token_ids))

    def _submit(self, request_id: str, frames: list[bytes], sink: OutputSink, model: str | None,
                add: AddRequest | None = None, served: Served | None = None) -> None:
        st = _Stream(request_id, sink, frames, model, add, served)
        try:
            self._send(st)
        except EnginesBusy:
            raise
        except NoEngineAvailable:
            wait = self._may_wait(model)
            if wait <= 0:
                raise
            self._streams[request_id] = st
            self._park(st, wait)  # sent once the engine greets this gateway; failed if it does not in time
        else:
            self._streams[request_id] = st

    def rank_of(self, request_id: str) -> int | None:
        """The rank of the engine a request in flight is on (None: waiting for one, or ended)."""
        st = self._streams.get(request_id)
        return st.engine.rank if st is not None and st.engine is not None else None

    def cancel(self, request_id: str) -> None:
        """Stop a request early (its client went away, a stop string ended it): abort it in its engine. Its
        sink hears nothing more. Nothing happens for a request that has already ended."""
        st = self._streams.get(request_id)
        if st is not None:
            eng = self._forget(st)
            if eng is not None:
                self._abort(eng, request_id)

    def abort_ids(self, ids: tuple[str, ...]) -> list[str]:
        """End the generation requests a client named by one of ``ids`` (an ``X-Request-Id``, or an alias: the
        ``request_id`` of ``/inference/v1/generate``) with finish reason ``abort``; the ids found here. The engine
        answers an abort with an ``abort`` output, which ends the stream as any finish does."""
        wanted = set(ids)
        engine_ids = {rid: cid for cid in wanted for rid in self.aliases.get(cid, ())}
        found: set[str] = set()
        for st in list(self._streams.values()):
            trace = st.add.trace_id if st.add is not None else None
            alias = engine_ids.get(st.request_id.rsplit("-", 1)[0]) or engine_ids.get(st.request_id)
            cid = alias or (trace if trace in wanted else None)
            if cid is None or st.add is None:
                continue  # (a pooling request has no stream to end: it is over within a step)
            found.add(cid)
            if st.engine is not None and not st.engine.closed:
                self._abort(st.engine, st.request_id)
            else:
                self._deliver(st, RequestOutput(st.request_id, (), "abort"))
        return sorted(found)

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                       model: str | None = None, coalesce: bool = True,
                       lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """``submit`` as an async iterator: the request's outputs until one carries a finish reason (a failure is
        raised); with ``coalesce``, outputs that queued up while the consumer was busy come merged
        (``_Inbox.take_outputs``). Leaving early aborts the request in the engine."""
        inbox = _Inbox()
        self.submit(request_id, prompt_token_ids, sampling, inbox, model, lora)
        finished = False
        try:
            while not finished:
                out = await inbox.get(coalesce)
                finished = out.finish_reason is not None  # type: ignore[union-attr]
                yield out  # type: ignore[misc]
        finally:
            if not finished:
                self.cancel(request_id)

    async def transcribe(self, req: TranscribeRequest, model: str | None = None) -> AsyncIterator[TranscribeOutput]:
        """Run one recording through a speech engine: its windows' outputs as the engine decodes them, until the one
        that is ``done`` (a failure is raised). Like ``pool``, a request an engine refuses or loses before its first
        window goes to another engine; leaving early aborts it in the engine."""
        inbox = _Inbox()
        self._submit(req.request_id, encode(req), inbox, model, None, SERVED.get())
        finished = False
        try:
            while not finished:
                out = await inbox.get()
                if not isinstance(out, TranscribeOutput):
                    raise EngineRequestError("the engine answered a transcription with something else")
                finished = out.done
                if out.error is not None:
                    raise EngineRequestError(out.error)
                yield out
        finally:
            if not finished:
                self.cancel(req.request_id)

    async def pool(self, request_id: str, prompt_token_ids: list[int], task: str = "embed",
                   normalize: bool | None = None, dimensions: int | None = None, pair_start: int = 0,
                   model: str | None = None) -> PoolOutput:
        """Run one input through a pooling engine; its vector (or logits). Like ``generate``, a
        request an engine refuses or loses before answering goes to another engine."""
        frames = encode(PoolRequest(request_id, tuple(prompt_token_ids), task, normalize, dimensions, pair_start,
                                    REQUEST_ID.get()))
        waiter, served = _Waiter(), SERVED.get()
        self._submit(request_id, frames, waiter, model, None, served)
        if served is not None:
            served.prompt(len(prompt_token_ids))
        try:
            out = await waiter.future
        finally:
            self.cancel(request_id)  # a no-op once answered
        if not isinstance(out, PoolOutput):
            raise EngineRequestError("the engine answered a pooling request with generated tokens")
        if out.error is not None:
            raise EngineRequestError(out.error)
        return out


async def _until(cond: Callable[[], bool], timeout: float) -> bool:
    """Poll ``cond`` every 10 ms for up to ``timeout`` s; whether it came true."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def _engine(eng: EngineConnection | None) -> str:
    """An engine as log lines name it: its rank and endpoint (engine hosts number their engines alike)."""
    return "an engine" if eng is None else f"engine {eng.rank} at {eng.endpoint}"


def _trace(st: _Stream) -> str:
    trace = st.add.trace_id if st.add is not None else None
    return f" (X-Request-Id {trace})" if trace else ""


class ModelEngines:
    """One model's engines: what a ``ModelState`` calls ``engines`` (routing, readiness, tasks). ``lora``: the
    LoRA adapter every generation request sent through it runs with (``with_lora``); None: the base model.

    What requests read of the membership (ready engines, their tasks, context, EOS ids) is computed
    once per membership change (``EngineClient.version``), not on every request."""

    def __init__(self, client: EngineClient, model: str | None, lora: str | None = None):
        self.client = client
        self.model = model
        self.lora = lora
        self._version = -1
        self._ready: list[EngineConnection] = []
        self._tasks: frozenset[str] = frozenset()
        self._primary: str | None = None
        self._max_model_len: int | None = None
        self._eos: frozenset[int] = frozenset()
        self._max_waiting: int | None = None

    def _view(self) -> None:
        if self._version == self.client.version:
            return
        ready = [e for e in self.client._ready if e.serves(self.model, self.lora)]
        hellos = [e.hello for e in ready if e.hello is not None]
        self._ready = ready
        self._tasks = frozenset(t for h in hellos for t in h.tasks)
        self._primary = next((h.tasks[0] for h in hellos if h.tasks), None)
        self._max_model_len = min((h.max_model_len for h in hellos), default=None)
        self._eos = frozenset(t for h in hellos for t in h.eos_token_ids)
        self._max_waiting = min((h.max_waiting for h in hellos if h.max_waiting is not None), default=None)
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
    def coming(self) -> bool:
        """An engine of the model is ready by the supervisor's word and about to greet this gateway: a request
        sent now waits for it (``CONNECT_WAIT``) rather than finding no engine."""
        return self.client.connecting(self.model)

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
    def max_waiting(self) -> int | None:
        """The most parts (choices, pooled inputs) one request may have: the smallest queue a ready engine of the
        model announces (``--max-waiting``; None: unbounded). Each part waits in an engine's queue as a request
        of its own, and a request is admitted whole, so one with more parts could never be served."""
        self._view()
        return self._max_waiting

    @property
    def in_flight(self) -> int:
        return self.client.in_flight

    def with_lora(self, name: str) -> ModelEngines:
        """The same engines, with generation requests run through their LoRA adapter ``name``."""
        return ModelEngines(self.client, self.model, name)

    def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
               sink: OutputSink) -> None:
        self.client.submit(request_id, prompt_token_ids, sampling, sink, self.model, self.lora)

    def cancel(self, request_id: str) -> None:
        self.client.cancel(request_id)

    def rank_of(self, request_id: str) -> int | None:
        return self.client.rank_of(request_id)

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 coalesce: bool = True) -> AsyncIterator[RequestOutput]:
        return self.client.generate(request_id, prompt_token_ids, sampling, self.model, coalesce, self.lora)

    def transcribe(self, req: TranscribeRequest) -> AsyncIterator[TranscribeOutput]:
        return self.client.transcribe(req, self.model)

    async def pool(self, request_id: str, prompt_token_ids: list[int], task: str = "embed",
                   normalize: bool | None = None, dimensions: int | None = None, pair_start: int = 0) -> PoolOutput:
        return await self.client.pool(request_id, prompt_token_ids, task, normalize, dimensions, pair_start,
                                      self.model)
