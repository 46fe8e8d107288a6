"""The engine worker process: load a model, serve it over ZeroMQ, step the batch forever.

Wire: the engine binds a ROUTER socket; each gateway (and the supervisor) connects a DEALER,
sends ClientHello and gets EngineHello back. AddRequest/AbortRequest flow in; after every step
the engine sends each client one StepOutputs with the new tokens of that client's requests, and
every ``stats_interval`` an EngineStats to all clients (routing load, and the supervisor's sign of
life). Bad frames are logged and dropped; they never stop the loop.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import orjson
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
    decode,
    encode,
)
from protocol.constants import ERR_BAD_FRAME, ERR_ENGINE_BUSY, ERR_ENGINE_DRAINING
from protocol.control import Heartbeat, Ready
from protocol.messages import MODEL_TASKS
from zserve.catalog import ModelSource
from zserve.config import EngineConfig
from zserve.curve import CurveKeys, secure_server
from zserve.proc import StatusPipe, boot_phase, die_with_parent, ignore_terminal_signals, set_title, setup_logging

from .scheduler import Scheduler
from .sequence import Sequence

log = logging.getLogger("zserve.engine")


class EngineServer:
    def __init__(self, rank: int, endpoint: str, runner, scheduler: Scheduler, hello: EngineHello,
                 stats_interval: float = 0.1, max_waiting: int | None = None, keys: CurveKeys | None = None):
        self.rank = rank
        self.keys = keys  # CURVE on a TCP endpoint (an engine host's): only authorized gateways get in
        self.max_waiting = max_waiting  # a full queue hands new requests back (429 once every engine is full)
        self.runner = runner
        self.scheduler = scheduler
        self.hello = replace(hello, max_waiting=max_waiting)  # announced as enforced: gateways check requests by it
        self.stats_interval = stats_interval
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + (1 << 20))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if keys is not None:
            secure_server(self.sock, keys, f"engine {rank}")
        self.sock.bind(endpoint)
        self.clients: dict[bytes, float] = {}
        # request id -> ZeroMQ identity of the gateway that owns it, until its last output goes out
        self.requests: dict[str, bytes] = {}
        self._last_stats = 0.0
        self._stop = False
        self.draining = False
        self.loop_tick = time.monotonic()  # the step loop's last sign of life
        self.step_started: float | None = None  # set while a forward pass runs
        self._stalled = False  # the last step had work but ran nothing (grammars still compiling)

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

    def _refused(self, client: bytes, msg: AddRequest | PoolRequest) -> bool:
        """Hand a request back (the gateway tries another engine) while draining or with a full queue."""
        trace = f" (X-Request-Id {msg.trace_id})" if msg.trace_id else ""
        if self.draining:
            self.send(client, ErrorMessage(ERR_ENGINE_DRAINING, f"engine {self.rank} is draining", msg.request_id))
        elif self.max_waiting is not None and len(self.scheduler.waiting) >= self.max_waiting:
            log.debug("refused request %s%s: %d requests already wait", msg.request_id, trace, self.max_waiting)
            self.send(client, ErrorMessage(ERR_ENGINE_BUSY, f"engine {self.rank} has {self.max_waiting} requests "
                                           "waiting", msg.request_id))
        else:
            log.debug("request %s%s: %d prompt tokens", msg.request_id, trace, len(msg.prompt_token_ids))
            return False
        return True

    def add(self, client: bytes, msg: AddRequest) -> None:
        if self._refused(client, msg):
            return
        err = self._check_ids(msg.prompt_token_ids)
        if err is None:
            add = getattr(self.scheduler, "add", None)
            err = ("this model does not generate (it serves: " + ", ".join(self.hello.tasks) + ")" if add is None
                   else add(Sequence(msg.request_id, list(msg.prompt_token_ids), msg.sampling)))
            if err is None:
                self.requests[msg.request_id] = client
        if err is not None:
            log.info("request %s%s failed: %s", msg.request_id, f" (X-Request-Id {msg.trace_id})" if msg.trace_id
                     else "", err)
            self.send(client, StepOutputs(self.rank, (RequestOutput(msg.request_id, (), "error", error=err),)))

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

    def _check_ids(self, ids: tuple[int, ...]) -> str | None:
        vocab = self.hello.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        return f"token id {bad} is outside the vocabulary ({vocab})" if bad is not None else None

    def poll_inbound(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for messages, then take every message already queued."""
        if self.sock.poll(timeout_ms):
            self.take_inbound()

    def take_inbound(self) -> None:
        """Handle every message already queued on the socket."""
        while True:
            try:
                client, *frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
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
        per_client: dict[bytes, list] = {}
        for out in outs:
            done = isinstance(out, PoolOutput) or out.finish_reason is not None
            client = self.requests.pop(out.request_id, None) if done else self.requests.get(out.request_id)
            if client is not None:
                per_client.setdefault(client, []).append(out)
        for client, mine in per_client.items():
            pooled = tuple(o for o in mine if isinstance(o, PoolOutput))
            if pooled:
                self.send(client, PoolOutputs(self.rank, pooled))
            if len(pooled) < len(mine):
                self.send(client, StepOutputs(self.rank, tuple(o for o in mine if not isinstance(o, PoolOutput))))

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
        while not (self.draining and not self.scheduler.has_work):
            self.loop_tick = time.monotonic()
            busy = self.scheduler.has_work
            # Waiting only for grammars to compile: do not spin, but look again soon.
            self.poll_inbound((2 if self._stalled else 0) if busy else int(self.stats_interval * 1000))
            if self.scheduler.has_work:
                self.step()
            self.publish_stats()
        self.publish_stats()
        log.info("engine %d drained; exiting", self.rank)

    def start_draining(self, *_) -> None:
        """SIGTERM: take no new requests, finish the running ones, then leave the loop."""
        if not self.draining:
            log.info("engine %d draining %d running, %d waiting request(s)", self.rank, len(self.scheduler.running),
                     len(self.scheduler.waiting))
        self.draining = True

    def alive(self, stall_limit: float = 10.0, max_step: float = 600.0) -> bool:
        """For the heartbeat thread: the loop ticks, or is inside a forward pass of bounded length."""
        now = time.monotonic()
        started = self.step_started
        return now - self.loop_tick < stall_limit or (started is not None and now - started < max_step)


def _heartbeat(server: EngineServer, status: StatusPipe, interval: float) -> None:
    """Beat while the step loop is healthy, so a long forward pass is not mistaken for a hang."""
    while True:
        if server.alive():
            f = server.scheduler.stats_fields()
            status.send(Heartbeat(running=f["running"], waiting=f["waiting"], kv_used=round(f["kv_used"], 4),
                                  draining=server.draining))
        time.sleep(interval)


def _progress(stage: str, done: int, total: int) -> None:
    # One line on start, every 10%, and at the end: readable under systemd as well as a terminal.
    step = max(1, total // 10)
    if done == total or done % step == 0 or done == 1:
        print(f"[engine] {stage}: {done}/{total} ({100 * done // max(1, total)}%)", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine_worker",
                                description="zserve engine worker (started by `launch`)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--endpoint", required=True, help="ZeroMQ endpoint to bind, e.g. ipc:///run/zserve/engine-0.sock")
    p.add_argument("--model-source", required=True, help="JSON from zserve.catalog.ModelSource.to_json()")
    p.add_argument("--device", type=int, default=None, help="CUDA device index (None: the default choice)")
    p.add_argument("--config", default=None, help="JSON from zserve.config.EngineConfig.to_json() (default: defaults)")
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--status-fd", type=int, default=None, help="pipe to the supervisor")
    p.add_argument("--control-fd", type=int, default=None, help="pipe from the supervisor (expert-parallel groups)")
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--ep-size", type=int, default=None,
                   help="expert parallel: the group size whose share of experts to load (the supervisor forms it)")
    p.add_argument("--ep-member", type=int, default=0, help="expert parallel: this engine's member rank")
    p.add_argument("--keys", default=None, help="CURVE key directory (zserve.curve) of a TCP endpoint")
    a = p.parse_args(argv)
    try:
        cfg = EngineConfig.from_json(a.config) if a.config else EngineConfig()
        a.curve = CurveKeys.for_server(a.keys) if a.keys else None
    except (ValueError, TypeError) as e:
        p.error(f"--config / --keys: {e}")

    die_with_parent(a.parent_pid)
    ignore_terminal_signals()
    set_title(f"zserve: engine {a.rank}")
    setup_logging(f"engine {a.rank}")

    from .device import configure_cpu_threads, parse_memory, resolve_dtype, select_device
    from .grammar import Grammars, tokenizer_json_loader
    from .loader import load_model
    from .runner import ModelRunner

    source = ModelSource.from_json(orjson.loads(a.model_source))
    device = select_device(a.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if device.type == "cpu":
        configure_cpu_threads(cfg.threads)
    t0 = time.monotonic()
    status = StatusPipe(a.status_fd)
    if source.weights == "hf":
        from .pooling import is_pooling_model

        if is_pooling_model(source.path):
            serve_pooling(a, cfg, source, device, dtype, status, t0)
            return
    # A model that cannot load or a KV cache too small for one request can never start: exit with
    # EXIT_BOOT_ERROR, which the supervisor treats as fatal at once instead of reloading in a loop.
    grouped = a.ep_size is not None
    with boot_phase(status, f"engine {a.rank}"):
        loaded = load_model(source, dtype, device, progress=_progress,
                            expert_share=(a.ep_member, a.ep_size) if grouped else None)
        own = loaded.config.max_position_embeddings
        kv_bytes = parse_memory(cfg.kv_cache_memory, device) if cfg.kv_cache_memory is not None else None
        runner = ModelRunner(loaded, device, dtype, cfg.max_num_seqs, own if cfg.max_model_len is None else
                             min(cfg.max_model_len, own), block_size=cfg.block_size, kv_cache_bytes=kv_bytes,
                             cuda_graphs=False if cfg.enforce_eager else None, expert_parallel=grouped,
                             fit_context=cfg.max_model_len is None)
        max_model_len = runner.max_model_len
    if cfg.seed is not None:
        runner.sampler.seed_shared(cfg.seed + a.rank)
    log.info("engine %d KV cache: %d blocks of %d tokens (%.0f MiB), prefix caching %s; context %d tokens (%s)",
             a.rank, runner.num_blocks, cfg.block_size, runner.kv_cache_bytes / (1 << 20),
             "on" if cfg.enable_prefix_caching else "off", max_model_len, _context_origin(cfg.max_model_len, own,
                                                                                       max_model_len))
    grammars = Grammars(tokenizer_json_loader(source.tokenizer_path), runner.vocab_size, runner.eos_token_ids)
    scheduler = Scheduler(runner, cfg.max_num_seqs, max(cfg.max_num_batched_tokens, cfg.max_num_seqs),
                          enable_prefix_caching=cfg.enable_prefix_caching, grammars=grammars)
    hello = EngineHello(
        rank=a.rank,
        model_id=source.model_id,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=max_model_len,
        vocab_size=runner.vocab_size,
        eos_token_ids=tuple(runner.eos_token_ids),
        pid=os.getpid(),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        tasks=("generate", "embed"),  # embeddings by last-token pooling (Scheduler.add_pool)
        embed_size=loaded.config.hidden_size,
    )
    if grouped:
        from .ep_server import GroupedEngineServer

        server: EngineServer = GroupedEngineServer(a.rank, a.endpoint, runner, scheduler, hello,
                                                   max_waiting=cfg.max_waiting, keys=a.curve, control_fd=a.control_fd,
                                                   status=status, source=source)
        # Before Ready: a resize pauses admission once its new members are ready, and this half second of
        # work would otherwise land inside that pause.
        grammars.prepare().result()
    else:
        server = EngineServer(a.rank, a.endpoint, runner, scheduler, hello, max_waiting=cfg.max_waiting, keys=a.curve)
    _serve(a, server, status, source, t0)
    if not grouped:
        grammars.prepare()
    server.serve_forever()


def _context_origin(asked: int | None, own: int, got: int) -> str:
    """Where an engine's context length came from, for its start-up line."""
    if asked is None:
        return "the model's own" if got == own else f"the model's {own}, lowered to what the KV cache holds"
    return "--max-model-len" if got == asked else f"--max-model-len {asked}, capped to the model's own"


def serve_pooling(a: argparse.Namespace, cfg: EngineConfig, source: ModelSource, device, dtype, status: StatusPipe,
                  t0: float) -> None:
    """An engine for an encoder (embed / classify): no KV cache, no sampler, batches of whole inputs.
    Its step budget is at least 4096 tokens: one forward pass per step, however many inputs fill it."""
    from .pooling import PoolingRunner
    from .pooling_scheduler import PoolingScheduler

    budget = max(cfg.max_num_batched_tokens, 4096)
    with boot_phase(status, f"engine {a.rank}"):
        runner = PoolingRunner(source.path, device, dtype, max_batch_tokens=budget)
    scheduler = PoolingScheduler(runner, max(cfg.max_num_seqs, 256), budget)
    config = orjson.loads((Path(source.path) / "config.json").read_bytes())
    embeds = "embed" in runner.tasks
    hello = EngineHello(
        rank=a.rank, model_id=source.model_id, max_num_seqs=scheduler.max_num_seqs,
        max_model_len=runner.max_model_len if cfg.max_model_len is None else min(cfg.max_model_len,
                                                                                  runner.max_model_len),
        vocab_size=runner.vocab_size, eos_token_ids=(),
        pid=os.getpid(), device=str(device), dtype=str(dtype).removeprefix("torch."),
        tasks=tuple(t for t in runner.tasks if t in MODEL_TASKS), embed_size=runner.hidden_size if embeds else 0,
        labels=tuple(runner.labels or ()),
        matryoshka=embeds and bool(config.get("matryoshka_dimensions") or config.get("is_matryoshka")))
    server = EngineServer(a.rank, a.endpoint, runner, scheduler, hello, max_waiting=cfg.max_waiting, keys=a.curve)
    _serve(a, server, status, source, t0)
    server.serve_forever()


def _serve(a: argparse.Namespace, server: EngineServer, status: StatusPipe, source: ModelSource, t0: float) -> None:
    """Log the engine ready, install its SIGTERM drain and heartbeat, and tell the supervisor."""
    hello = server.hello
    log.info("engine %d ready: %s (%s) on %s (%s) in %.1fs, endpoint %s", a.rank, source.model_id,
             ", ".join(hello.tasks), hello.device, hello.dtype, time.monotonic() - t0, a.endpoint)
    signal.signal(signal.SIGTERM, server.start_draining)
    threading.Thread(target=_heartbeat, args=(server, status, a.heartbeat_interval), daemon=True,
                     name="heartbeat").start()
    status.send(Ready(index=a.rank, endpoint=a.endpoint, device=hello.device, dtype=hello.dtype))
