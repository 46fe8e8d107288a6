"""Engine tiers on other hosts: the registry an engine host's supervisor serves, and its gateway-host client.

``launch engine --bind tcp://ADDR:PORT`` runs engines only. Its supervisor binds a ZeroMQ ROUTER at PORT
(``RegistryServer``); engine rank r binds PORT + 1 + r, and publishes its KV cache events (``protocol.kv_events``)
on KV + 2r and answers replays on KV + 2r + 1, KV (``--kv-events-port``) being by default the first port after
every engine port its models could ever take. ``launch api-server --engine tcp://HOST:PORT``
runs gateways only; its supervisor keeps one DEALER per engine host (``RemoteEngines``), says
``RegistryHello`` every heartbeat interval and gets ``EngineRegistry`` back, and at once whenever the engine
host's membership changes (an engine starts, gets ready, drains, dies). It merges those engines into the
cluster state it gives its gateways, which then connect to each engine directly and route by the load the
engines report, exactly as they do with local engines. An engine host that stays silent for the heartbeat
timeout drops out of the cluster state (its engines died with it) until it answers again.

Each hello also says which registry version every gateway of that host has applied, so the engine host drains
an engine (scale-down, rolling restart) only once no gateway host routes to it any more; and the registry
carries the engine host's holds on its models (``protocol.holds``), so while it replaces a model's only engine
(``reloading``) gateway hosts hold that model's new requests as its own gateways would, and only that model's.

Both sockets use CURVE (``zserve.curve``) unless ``--insecure``. Lines are the control protocol's JSON lines
(``protocol.control``), one per ZeroMQ message; anything else is dropped and logged, rate-limited.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import replace

import zmq

from protocol import ProtocolError
from protocol.cluster import EngineInfo
from protocol.control import (
    REGISTRY_REPLIES,
    REGISTRY_REQUESTS,
    EngineRegistry,
    RegistryHello,
    RemoteOperation,
    RemoteOperationReply,
    decode_line,
    encode_line,
)
from protocol.holds import Hold
from zserve.config import MAX_ENGINES_PER_MODEL
from zserve.curve import BindError, CurveKeys, is_tcp, secure_client, secure_server, tcp_host, tcp_port, with_port
from zserve.curve import bind as bind_socket  # (this module's --bind is a parameter named bind)

from ..sockets import ListenError

log = logging.getLogger("zserve.launch")

MAX_MESSAGE = 1 << 20
WILDCARDS = ("0.0.0.0", "::", "*", "")
LOG_EVERY_S = 10.0


def engine_endpoint(bind: str, rank: int) -> str:
    """Where engine ``rank`` of an engine host bound at ``bind`` listens: the port after the registry's plus
    its rank."""
    return with_port(bind, tcp_port(bind) + 1 + rank)


KV_PORTS_PER_ENGINE = 2  # its KV events' PUB socket and, on the next port, their replay socket


def engine_ports(bind: str, models: int) -> range:
    """Every port the engines of an engine host bound at ``bind`` may take, however they scale: model m's ranks are
    m * 64 .. m * 64 + 63 (``launch.tiers``)."""
    first = tcp_port(bind) + 1
    return range(first, first + models * MAX_ENGINES_PER_MODEL)


def kv_events_ports(bind: str, models: int, first: int | None = None) -> range:
    """Every port those engines' KV events may take: two a rank from ``first`` on (None: right after the engine
    ports, so that no scaling ever makes the two meet)."""
    start = engine_ports(bind, models).stop if first is None else first
    return range(start, start + KV_PORTS_PER_ENGINE * models * MAX_ENGINES_PER_MODEL)


def kv_events_endpoint(bind: str, first: int, rank: int) -> str:
    """Where engine ``rank`` publishes its KV cache events, ``first`` being ``kv_events_ports(...).start`` (its
    replay socket is on the next port: ``protocol.kv_events.replay_endpoint``)."""
    return with_port(bind, first + KV_PORTS_PER_ENGINE * rank)


class _Throttled:
    """A warning at most every LOG_EVERY_S (a flood of bad frames must not flood the log)."""

    def __init__(self) -> None:
        self.last = -LOG_EVERY_S
        self.dropped = 0

    def warn(self, msg: str, *args) -> None:
        now = time.monotonic()
        self.dropped += 1
        if now - self.last >= LOG_EVERY_S:
            log.warning(msg + " (%d dropped since the last such line)", *args, self.dropped)
            self.last, self.dropped = now, 0


class RegistryServer:
    """The engine host's side: answers every hello with the engines, pushes each change to subscribers."""

    def __init__(self, bind: str, keys: CurveKeys | None, subscriber_timeout: float):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if keys is not None:
            secure_server(self.sock, keys, f"the engine registry at {bind}")
        try:
            bind_socket(self.sock, bind, "the engine registry")
        except BindError as e:
            raise ListenError(str(e)) from None
        self.timeout = subscriber_timeout
        self.subscribers: dict[bytes, tuple[float, str, int]] = {}  # identity → (last hello, its host, applied)
        self.loras: dict[bytes, dict] = {}  # identity → the LoRA adapters its last hello asked for, by model
        self.state = EngineRegistry(0)
        self.marks: list[tuple[int, int]] = []  # (cluster-state version, the registry version that carried it)
        self.operations: list[tuple[bytes, RemoteOperation]] = []  # asked by gateway hosts, not taken yet
        self.bad = _Throttled()

    def fileno(self) -> int:
        return self.sock.getsockopt(zmq.FD)

    def take_operations(self) -> list[tuple[bytes, RemoteOperation]]:
        """The engine operations gateway hosts asked for since the last call (who asked, what)."""
        ops, self.operations = self.operations, []
        return ops

    def answer(self, who: bytes, reply: RemoteOperationReply) -> None:
        self._send(who, encode_line(reply))

    def pump(self) -> None:
        """Answer every hello waiting (the descriptor signals edges: read until none is left)."""
        while True:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.bad.warn("engine registry: dropped a message of %d frames", len(frames))
                continue
            who, line = frames
            try:
                msg = decode_line(line, REGISTRY_REQUESTS)
            except ProtocolError as e:
                self.bad.warn("engine registry: dropped a bad message: %s", e)
                continue
            if isinstance(msg, RemoteOperation):
                self.operations.append((who, msg))
                continue
            assert isinstance(msg, RegistryHello)
            if who not in self.subscribers:
                log.info("gateway host %s subscribed to the engine registry", msg.host)
            self.subscribers[who] = (time.monotonic(), msg.host, msg.applied)
            self.loras[who] = msg.loras or {}
            self._send(who, encode_line(self.state))

    def publish(self, state: EngineRegistry, cluster_version: int) -> None:
        """The engine host's cluster state ``cluster_version``: a new membership or phase goes to every gateway
        host heard from recently."""
        if (state.engines, state.models, state.holds, state.lora_errors) != (
                self.state.engines, self.state.models, self.state.holds, self.state.lora_errors):
            self.state = replace(state, version=self.state.version + 1)
            now = time.monotonic()
            line = encode_line(self.state)
            for who, (seen, host, _) in list(self.subscribers.items()):
                if now - seen > self.timeout:
                    log.info("gateway host %s left the engine registry (silent for %.0fs)", host, now - seen)
                    del self.subscribers[who]
                    self.loras.pop(who, None)
                else:
                    self._send(who, line)
        if not self.marks or cluster_version > self.marks[-1][0]:
            self.marks = [*self.marks[-255:], (cluster_version, self.state.version)]

    def wanted_loras(self) -> dict[str, dict[str, str]]:
        """The LoRA adapters the gateway hosts heard from recently want, by model (each one's union)."""
        now, wanted = time.monotonic(), {}
        for who, (seen, _, _) in self.subscribers.items():
            if now - seen <= self.timeout:
                for model, adapters in self.loras.get(who, {}).items():
                    wanted.setdefault(model, {}).update(adapters)
        return wanted

    def lagging(self, cluster_version: int) -> list[str]:
        """The gateway hosts (heard from recently) whose gateways have not applied what cluster-state
        ``cluster_version`` told them yet: an engine is drained only once none routes to it."""
        wanted = next((r for cv, r in self.marks if cv >= cluster_version), None)
        if wanted is None:
            return ["the engine registry (not sent yet)"]
        now = time.monotonic()
        return [f"gateway host {host}" for seen, host, applied in self.subscribers.values()
                if now - seen <= self.timeout and applied < wanted]

    def _send(self, who: bytes, line: bytes) -> None:
        try:
            self.sock.send_multipart([who, line], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # its queue is full; it asks again within a heartbeat interval

    def close(self) -> None:
        self.sock.close(0)


class RemoteEngines:
    """A gateway host's view of one engine host's engines (an empty view while it is silent)."""

    def __init__(self, url: str, keys: CurveKeys | None, interval: float, timeout: float):
        self.url = url
        self.host = tcp_host(url)
        self.interval, self.timeout = interval, timeout
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # a hello is sent only on a connection that is up
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if keys is not None:
            secure_client(self.sock, keys)
        self.sock.connect(url)
        self.name = socket.gethostname()[:256] or "gateway-host"
        self.loras: dict[str, dict[str, str]] = {}  # the adapters this host's cluster wants, by model (every hello)
        self.applied = 0  # the registry version every gateway here applied
        self.carried: tuple[int, int] | None = None  # (cluster-state version, registry version it carries)
        self.registry: EngineRegistry | None = None
        self.heard = 0.0
        self.said = -interval
        self.lost_logged = False
        self.replies: dict[int, RemoteOperationReply] = {}  # engine operations answered, by id
        self.bad = _Throttled()

    def fileno(self) -> int:
        return self.sock.getsockopt(zmq.FD)

    def operate(self, msg: RemoteOperation) -> bool:
        """Ask the engine host to carry out an engine operation; False when it cannot be sent now."""
        try:
            self.sock.send(encode_line(msg), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def say_hello(self, now: float) -> None:
        self.said = now
        try:
            self.sock.send(encode_line(RegistryHello(self.name, self.applied, self.loras or None)), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected (yet): the next interval tries again

    def applied_by_gateways(self, lagging, now: float) -> None:
        """Once every gateway here applied the cluster state that carried the registry's last version, say so
        at once (the engine host drains an engine only after that)."""
        if self.carried is not None and self.carried[1] > self.applied and not lagging(self.carried[0]):
            self.applied = self.carried[1]
            self.say_hello(now)

    def want_loras(self, loras: dict[str, dict[str, str]], now: float) -> None:
        """Ask for these adapters from now on (at once when they changed)."""
        if loras != self.loras:
            self.loras = loras
            self.say_hello(now)

    def lora_errors(self, now: float) -> dict[str, str]:
        """The adapters the engine host's engines refused (name -> why)."""
        return dict(self.registry.lora_errors or {}) if self.fresh(now) and self.registry is not None else {}

    def holds(self, now: float) -> tuple[Hold, ...]:
        """The engine host's holds on its models (none while it is silent: its engines left the cluster)."""
        return self.registry.holds if self.fresh(now) and self.registry is not None else ()

    def tick(self, now: float) -> None:
        if now - self.said >= self.interval:
            self.say_hello(now)
        if self.registry is not None and not self.fresh(now) and not self.lost_logged:
            self.lost_logged = True
            log.error("engine host %s silent for %.0fs: its engines leave the cluster until it answers", self.url,
                      now - self.heard)

    def pump(self) -> bool:
        """Take every reply waiting; whether the engines changed."""
        changed = False
        while True:
            try:
                line = self.sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return changed
            try:
                msg = decode_line(line, REGISTRY_REPLIES)
            except ProtocolError as e:
                self.bad.warn("engine host %s: dropped a bad registry message: %s", self.url, e)
                continue
            if isinstance(msg, RemoteOperationReply):
                self.replies[msg.id] = msg
                continue
            assert isinstance(msg, EngineRegistry)
            if self.registry is not None and msg.version < self.registry.version:
                self.applied, self.carried = 0, None  # a restarted engine host counts from 1 again
            if self.registry is None or self.lost_logged:
                log.info("engine host %s: %d engine(s) for %s", self.url, len(msg.engines),
                         ", ".join(msg.models or {}) or "no model")
            self.lost_logged = False
            changed = changed or self.registry is None or msg.engines != self.registry.engines or (
                msg.lora_errors != self.registry.lora_errors)
            self.registry = msg
            self.heard = time.monotonic()

    def fresh(self, now: float) -> bool:
        return self.registry is not None and now - self.heard <= self.timeout

    def engines(self, now: float) -> tuple[EngineInfo, ...]:
        if not self.fresh(now):
            return ()
        assert self.registry is not None
        return tuple(replace(e, endpoint=self._reachable(e.endpoint), kv_events=self._reachable(e.kv_events))
                     for e in self.registry.engines)

    def models(self, now: float) -> dict[str, int]:
        return dict(self.registry.models or {}) if self.fresh(now) and self.registry is not None else {}

    def _reachable(self, endpoint: str) -> str:
        """An engine (or its KV events) bound on a wildcard address is reached at the host its registry was
        reached at."""
        if is_tcp(endpoint) and tcp_host(endpoint) in WILDCARDS:
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"tcp://{host}:{tcp_port(endpoint)}"
        return endpoint

    def close(self) -> None:
        self.sock.close(0)
