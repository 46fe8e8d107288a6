"""An engine's wire server: serve an assembled engine (``engine.Engine``) over ZeroMQ, step the batch forever.

Wire: the engine binds a ROUTER socket; each gateway (and the supervisor) connects a DEALER,
sends ClientHello and gets EngineHello back. AddRequest/AbortRequest flow in; after every step
the engine sends each client one StepOutputs with the new tokens of that client's requests, and
every ``stats_interval`` an EngineStats to all clients (routing load, and the supervisor's sign of
life). Bad frames are logged and dropped; they never stop the loop.

The supervisor's control pipe is polled with the socket: a ``LoraCommand`` loads or unloads a LoRA adapter
between two steps, and the engine answers ``LoraReport`` on its status pipe; an ``EngineOp`` (sleep, weights,
cache resets, profiling: ``operations``) is carried out between two steps too, those that wait for the running
requests once they have ended (an expert-parallel engine also takes its group commands there: ``ep_server``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import zmq

from protocol import (
    MAX_FRAME_BYTES,
    AbortRequest,
    AddRequest,
    ClientHello,
    EngineHello,
    EngineStats,
    ErrorMessage,
    GroupWake,
    PoolOutput,
    PoolOutputs,
    PoolRequest,
    ProtocolError,
    RequestOutput,
    StepOutputs,
    TranscribeOutput,
    TranscribeOutputs,
    TranscribeRequest,
    decode,
    encode,
)
from protocol.constants import ERR_BAD_FRAME, ERR_ENGINE_BUSY, ERR_ENGINE_DRAINING, ERR_LORA_NOT_LOADED
from protocol.control import PIPE_COMMANDS, ControlMessage, EngineOp, LineBuffer, LoraCommand, LoraReport
from zserve.catalog import ModelSource
from zserve.curve import CurveKeys, bind, secure_server
from zserve.proc import StatusPipe

from .kv_publisher import KvEventPublisher
from .operations import DEFAULT_VERSION, EngineOps
from .scheduler import Scheduler
from .sequence import Sequence

log = logging.getLogger("zserve.engine")

CLOSE_LINGER_MS = 2000  # at exit, how long queued outputs may wait for a gateway to read them
# After a drain timeout's hand-backs, how long the engine stays connected before it exits: a gateway that saw the
# connection drop first would move those requests as lost (engine_lost) before reading that they were handed back.
HANDBACK_GRACE_S = 0.25


def bind_engine_socket(ctx: zmq.Context, endpoint: str, keys: CurveKeys | None = None, name: str = "engine"
                       ) -> zmq.Socket:
    """The engine's ROUTER, bound at ``endpoint``: each gateway is one peer, known by its ZeroMQ identity (its
    client id).

    ``ROUTER_HANDOVER``: a new connection with a gateway's identity takes it over from an older one still open.
    A restarted engine's endpoint is reached first by the gateway's old socket (ZeroMQ reconnects it on its own),
    which the gateway then closes as the supervisor's cluster state drops the dead engine, and opens a new one.
    Without handover the ROUTER keeps the identity for the old connection and silently drops everything the new
    one sends, the greeting included, for as long as the engine lives: that gateway never routed to it."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + (1 << 20))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if keys is not None:
        secure_server(sock, keys, name)
    bind(sock, endpoint, f"{name}'s socket")
    return sock


class EngineServer:
    def __init__(self, rank: int, endpoint: str, runner, scheduler: Scheduler, hello: EngineHello,
                 stats_interval: float = 0.1, max_waiting: int | None = None, keys: CurveKeys | None = None,
                 drain_timeout: float | None = None, control_fd: int | None = None, status: StatusPipe | None = None,
                 source: ModelSource | None = None, weight_version: str = DEFAULT_VERSION,
                 kv_events: str | None = None):
        self.rank = rank
        # Seconds a drain lets running requests finish before handing the rest back (None: until they finish).
        self.drain_timeout = drain_timeout
        self.drain_deadline: float | None = None
        self.exit_after = 0.0  # a drained engine leaves no sooner (HANDBACK_GRACE_S after hand-backs)
        self.keys = keys  # CURVE on a TCP endpoint (an engine host's): only authorized gateways get in
        self.max_waiting = max_waiting  # a full queue hands new requests back (429 once every engine is full)
        self.runner = runner
        self.scheduler = scheduler
        self.hello = replace(hello, max_waiting=max_waiting)  # announced as enforced: gateways check requests by it
        self.stats_interval = stats_interval
        self.ctx = zmq.Context.instance()
        self.sock = bind_engine_socket(self.ctx, endpoint, keys, f"engine {rank}")
        self.status = status or StatusPipe(None)  # to the supervisor (LoraReport; Ready and heartbeats: engine.py)
        self.control_fd = control_fd  # from the supervisor (PIPE_COMMANDS)
        self.lines = LineBuffer()
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        if control_fd is not None:
            os.set_blocking(control_fd, False)
            self.poller.register(control_fd, zmq.POLLIN)
        self.clients: dict[bytes, float] = {}
        # request id -> ZeroMQ identity of the gateway that owns it, until its last output goes out
        self.requests: dict[str, bytes] = {}
        self._last_stats = 0.0
        self._stop = False
        self.draining = False
        self.loop_tick = time.monotonic()  # the step loop's last sign of life
        self.step_started: float | None = None  # set while a forward pass runs
        self._stalled = False  # the last step had work but ran nothing (grammars still compiling)
        self.ops = EngineOps(self, source, weight_version)  # sleep, weights, caches, profiling
        # KV cache events (``kv_publisher``): the block manager tells, the publisher sends after each step.
        self.kv: KvEventPublisher | None = None
        bm = getattr(scheduler, "block_manager", None)
        if kv_events is not None and bm is not None:
            self.kv = KvEventPublisher(self.ctx, kv_events, keys)
            bm.events = []
            bm.medium = "GPU" if getattr(runner, "device", None) is not None and runner.device.type == "cuda" else None
            self.poller.register(self.kv.replay, zmq.POLLIN)
            # Gateways compute a request's block hashes with the engine's block size to score it (prefix routing).
            self.hello = replace(self.hello, kv_block_size=bm.block_size if bm.enable_prefix_caching else 0)

    # -- what an operation asks of its server (``operations.Host``) -----------------------------------
    def quiet(self) -> bool:
        return True  # (between two steps, which is when operations run)

    def expert_share(self) -> tuple[int, int] | None:
        return None

    def use_source(self, source: ModelSource) -> None:
        pass

    def send(self, client: bytes, msg) -> None:
        try:
            self.sock.send_multipart([client, *encode(msg)], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("client %r is not reading; dropped a %s message", client, msg.TYPE)

    # -- inbound -----------------------------------------------------------------------------
    def handle(self, client: bytes, frames: list) -> None:
        try:
            msg = decode(frames)
        except ProtocolError as e:
            log.warning("dropped a bad frame from client %r: %s", client, e)
            if e.request_id is not None:
                self.send(client, StepOutputs(self.rank, (RequestOutput(e.request_id, (), "error",
                                                                        error=f"bad request frame: {e}"),)))
            else:
                self.send(client, ErrorMessage(ERR_BAD_FRAME, str(e)[:4000]))
            return
        if type(msg) is GroupWake:
            self.on_wake(msg)
            return
        self.clients[client] = time.monotonic()
        if isinstance(msg, AddRequest):
            self.add(client, msg)
        elif isinstance(msg, PoolRequest):
            self.add_pool(client, msg)
        elif isinstance(msg, TranscribeRequest):
            self.add_transcribe(client, msg)
        elif isinstance(msg, AbortRequest):
            aborted = [rid for rid in msg.request_ids if self.scheduler.abort(rid) is not None]
            owners = {rid: self.requests.pop(rid, None) for rid in aborted}
            outs = tuple(RequestOutput(rid, (), "abort") for rid, owner in owners.items() if owner == client)
            # (A pooling request has no stream to end: its client stops waiting when it aborts.)
            if outs:
                self.send(client, StepOutputs(self.rank, outs))
        elif isinstance(msg, ClientHello):
            self.send(client, self.hello)
            self.send(client, self.stats())
        else:
            log.warning("client %r sent an unexpected %s message; ignored", client, msg.TYPE)

    def on_wake(self, msg: GroupWake) -> None:
        log.warning("engine %d is in no expert-parallel group; ignored a wake-up", self.rank)

    def _refused(self, client: bytes, msg: AddRequest | PoolRequest | TranscribeRequest) -> bool:
        """Hand a request back (the gateway tries another engine) while draining or with a full queue."""
        trace = f" (X-Request-Id {msg.trace_id})" if msg.trace_id else ""
        if self.draining:
            self.send(client, ErrorMessage(ERR_ENGINE_DRAINING, f"engine {self.rank} is draining", msg.request_id))
        elif self.max_waiting is not None and len(self.scheduler.waiting) >= self.max_waiting:
            log.debug("refused request %s%s: %d requests already wait", msg.request_id, trace, self.max_waiting)
            self.send(client, ErrorMessage(ERR_ENGINE_BUSY, f"engine {self.rank} has {self.max_waiting} requests "
                                           "waiting", msg.request_id))
        else:
            if getattr(msg, "output_token_ids", ()):
                log.info("request %s%s moved here: %d prompt tokens, %d generated elsewhere", msg.request_id, trace,
                         len(msg.prompt_token_ids), len(msg.output_token_ids))  # type: ignore[union-attr]
            elif isinstance(msg, TranscribeRequest):
                log.debug("request %s%s: %.1f s of audio to %s", msg.request_id, trace, msg.seconds, msg.task)
            else:
                log.debug("request %s%s: %d prompt tokens", msg.request_id, trace, len(msg.prompt_token_ids))
            return False
        return True

    def add(self, client: bytes, msg: AddRequest) -> None:
        if self._refused(client, msg):
            return
        err, code = self._check_ids(msg.prompt_token_ids), None
        add = getattr(self.scheduler, "add", None)
        if err is None and add is None:
            err = "this model does not generate (it serves: " + ", ".join(self.hello.tasks) + ")"
        elif err is None and msg.lora is not None and (err := self.scheduler.lora_missing(msg.lora)) is not None:
            code = ERR_LORA_NOT_LOADED  # the gateway's 404, as for a model it does not know
        elif err is None:
            err = add(Sequence(msg.request_id, list(msg.prompt_token_ids), msg.sampling,
                               output_ids=list(msg.output_token_ids), lora=msg.lora,
                               tenant=msg.tenant, weight=msg.weight))
            if err is None:
                self.requests[msg.request_id] = client
        if err is not None:
            log.info("request %s%s failed: %s", msg.request_id, f" (X-Request-Id {msg.trace_id})" if msg.trace_id
                     else "", err)
            self.send(client, StepOutputs(self.rank, (RequestOutput(msg.request_id, (), "error", error=err,
                                                                    error_code=code),)))

    def add_pool(self, client: bytes, msg: PoolRequest) -> None:
        if self._refused(client, msg):
            return
        err = self._check_ids(msg.prompt_token_ids)
        if err is None:
            add = getattr(self.scheduler, "add_pool", None)
            err = ("this model does not pool (it serves: " + ", ".join(self.hello.tasks) + ")" if add is None
                   else add(msg))
            if err is None:
                self.requests[msg.request_id] = client
        if err is not None:
            n = len(msg.prompt_token_ids)
            self.send(client, PoolOutputs(self.rank, (PoolOutput(msg.request_id, (), n, err[:4000]),)))

    def add_transcribe(self, client: bytes, msg: TranscribeRequest) -> None:
        if self._refused(client, msg):
            return
        add = getattr(self.scheduler, "add_transcribe", None)
        err = ("this model does not transcribe speech (it serves: " + ", ".join(self.hello.tasks) + ")" if add is None
               else add(msg))
        if err is None:
            self.requests[msg.request_id] = client
        else:
            self.send(client, TranscribeOutputs(self.rank, (TranscribeOutput(msg.request_id, done=True,
                                                                              error=err[:4000]),)))

    def _check_ids(self, ids: tuple[int, ...]) -> str | None:
        vocab = self.hello.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        return f"token id {bad} is outside the vocabulary ({vocab})" if bad is not None else None

    def poll_inbound(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for messages (requests, the supervisor's commands), then take every message
        already queued."""
        ready = dict(self.poller.poll(timeout_ms))
        if self.control_fd is not None and self.control_fd in ready:
            self.read_control()
        if self.sock in ready:
            self.take_inbound()
        if self.kv is not None and self.kv.replay in ready:
            self.kv.serve_replay()

    # -- the supervisor's control pipe ---------------------------------------------------------
    def read_control(self) -> None:
        try:
            data = os.read(self.control_fd, 65536)  # type: ignore[arg-type]
        except BlockingIOError:
            return
        if not data:  # the supervisor is gone (PDEATHSIG ends us)
            self.poller.unregister(self.control_fd)
            self.control_fd = None
            return
        for msg in self.lines.messages(data, PIPE_COMMANDS, self._dropped):
            self.on_control(msg)

    def _dropped(self, e: ProtocolError) -> None:
        log.warning("engine %d: dropped a control line: %s", self.rank, e)

    def on_control(self, msg: ControlMessage) -> None:
        if isinstance(msg, LoraCommand):
            self.on_lora(msg)
        elif isinstance(msg, EngineOp):
            self.ops.handle(msg)
            self.publish_kv()  # (a reset or a swap forgets blocks)
        else:
            log.warning("engine %d: ignored a %s control message", self.rank, msg.TYPE)

    def on_lora(self, cmd: LoraCommand) -> None:
        """Load or unload a LoRA adapter between two steps, and report what is loaded now."""
        sched, error = self.scheduler, None
        if not hasattr(sched, "load_lora"):
            error = "this model serves no LoRA adapters (it does not generate)"
        elif cmd.action == "load":
            t0 = time.monotonic()
            error = sched.load_lora(cmd.name, cmd.path)
            if error is None:
                log.info("engine %d loaded LoRA adapter %r from %s in %.0f ms", self.rank, cmd.name, cmd.path,
                         (time.monotonic() - t0) * 1000)
            else:
                log.warning("engine %d could not load LoRA adapter %r: %s", self.rank, cmd.name, error)
        else:
            sched.unload_lora(cmd.name)
            log.info("engine %d unloaded LoRA adapter %r%s", self.rank, cmd.name,
                     " (dropped once its running requests end)" if cmd.name in sched.lora_closing else "")
        self.report_loras(cmd.name, error)

    def report_loras(self, name: str | None = None, error: str | None = None) -> None:
        """Tell the supervisor which adapters this engine serves now (before Ready, after each command)."""
        loaded = getattr(self.scheduler, "loaded_loras", tuple)()
        self.status.send(LoraReport(loaded, name, error[:4000] if error else None))

    def take_inbound(self) -> None:
        """Handle every message already queued on the socket."""
        while True:
            try:
                client, *frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.publish_kv()  # the prompt blocks of requests that just arrived (BlockManager.announce)
                return
            self.handle(client.bytes, [f.buffer for f in frames])

    # -- stepping ----------------------------------------------------------------------------
    def step(self) -> None:
        """One engine step; each client gets the outputs of its requests in one message."""
        self.step_started = time.monotonic()
        steps = self.scheduler.steps
        try:
            outs = self.scheduler.step()
        finally:
            self.step_started = None
        self._stalled = self.scheduler.steps == steps and not outs
        if getattr(self.scheduler, "lora_closing", None):
            self.scheduler.drop_closed_loras()
        self.publish_kv()
        # Each client's outputs, by message: generated tokens, pooled vectors, transcribed windows.
        per_client: dict[bytes, tuple[list, list, list]] = {}
        for out in outs:
            kind = type(out)
            done = out.done if kind is TranscribeOutput else kind is PoolOutput or out.finish_reason is not None
            client = self.requests.pop(out.request_id, None) if done else self.requests.get(out.request_id)
            if client is not None:
                mine = per_client.get(client)
                if mine is None:
                    mine = per_client[client] = ([], [], [])
                mine[1 if kind is PoolOutput else 2 if kind is TranscribeOutput else 0].append(out)
        for client, (generated, pooled, heard) in per_client.items():
            if pooled:
                self.send(client, PoolOutputs(self.rank, tuple(pooled)))
            if heard:
                self.send(client, TranscribeOutputs(self.rank, tuple(heard)))
            if generated:
                self.send(client, StepOutputs(self.rank, tuple(generated)))

    def publish_kv(self) -> None:
        """Send the KV events of what just happened (blocks stored, evicted, forgotten) as one batch."""
        if self.kv is not None:
            self.kv.publish(self.scheduler.block_manager.events)

    def stats(self) -> EngineStats:
        return EngineStats(rank=self.rank, timestamp=time.time(), **self.scheduler.stats_fields())

    def publish_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < self.stats_interval:
            return
        self._last_stats = now
        st = self.stats()
        for client in list(self.clients):
            self.send(client, st)

    def serve_forever(self) -> None:
        while not (self.draining and not self.scheduler.has_work and time.monotonic() >= self.exit_after):
            self.loop_tick = time.monotonic()
            if self.drain_deadline is not None and self.loop_tick >= self.drain_deadline:
                self.hand_back()
                continue
            asleep = self.ops.asleep  # (requests wait in the queue until it wakes)
            busy = self.scheduler.has_work and not asleep
            # Waiting only for grammars to compile (or for an operation): do not spin, but look again soon.
            self.poll_inbound((2 if self._stalled else 0) if busy else int(self.stats_interval * 1000))
            self.scheduler.hold_new = self.ops.holding
            if self.scheduler.has_work and not self.ops.asleep:
                self.step()
            self.ops.poll()
            self.publish_stats()
        self.publish_stats()
        log.info("engine %d drained; exiting", self.rank)

    def close(self) -> None:
        """Close every socket of this process once what they queued is sent (the last outputs and hand-backs go
        out), waiting at most ``CLOSE_LINGER_MS`` for a gateway that no longer reads."""
        self.ctx.destroy(linger=CLOSE_LINGER_MS)

    def start_draining(self, *_) -> None:
        """SIGTERM: take no new requests, finish the running ones (until ``drain_timeout``: ``hand_back``), then
        leave the loop."""
        if not self.draining:
            log.info("engine %d draining %d running, %d waiting request(s)", self.rank, len(self.scheduler.running),
                     len(self.scheduler.waiting))
            if self.drain_timeout is not None:
                self.drain_deadline = time.monotonic() + self.drain_timeout
        self.draining = True

    def hand_back(self) -> None:
        """The drain timeout came: end every request still here and hand each back to its gateway
        (ERR_ENGINE_DRAINING), which sends it to another engine of the model; one that produced tokens goes on from
        them there (a migration) instead of being cut off. Its outputs so far went out before, on the same socket."""
        seqs = self.scheduler.abort_all("abort")
        for s in seqs:
            client = self.requests.pop(s.request_id, None)
            if client is not None:
                self.send(client, ErrorMessage(ERR_ENGINE_DRAINING, f"engine {self.rank} reached its drain timeout "
                                               f"after {len(s.output_ids)} generated tokens", s.request_id))
        if seqs:
            self.exit_after = time.monotonic() + HANDBACK_GRACE_S
            self.drain_deadline = None
            log.warning("engine %d: drain timeout (%.0fs) reached; handed %d request(s) back to their gateways",
                        self.rank, self.drain_timeout or 0, len(seqs))

    def alive(self, stall_limit: float = 10.0, max_step: float = 600.0) -> bool:
        """For the heartbeat thread: the loop ticks, or is inside a forward pass of bounded length."""
        now = time.monotonic()
        started = self.step_started
        return now - self.loop_tick < stall_limit or (started is not None and now - started < max_step)
