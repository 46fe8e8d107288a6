"""The gateway process: serve HTTP on a listening socket inherited from the supervisor.

Several gateways share one socket; the kernel spreads connections among them. Besides HTTP, a
gateway keeps two pipes to the supervisor: it reads the cluster state (engine membership, pause)
from the control pipe and acknowledges each version, and it writes heartbeats from its event loop
(so a blocked loop stops them). SIGTERM drains: stop accepting, finish in-flight requests up to
the shutdown timeout, fail the rest with an error, exit 0 only if nothing was cut off. A
render-only gateway (``launch render``) has no engine tier: it is ready as soon as it listens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable

import uvloop
from aiohttp import web

from protocol import ProtocolError
from protocol.cluster import ClusterState
from protocol.constants import EXIT_CUT_OFF, LISTEN_BACKLOG
from protocol.control import (
    PIPE_COMMANDS,
    AbortReport,
    AbortRequests,
    Ack,
    ClusterUpdate,
    Heartbeat,
    LineBuffer,
    Ready,
)
from zserve.curve import CurveKeys
from zserve.heap import settle
from zserve.launch_spec import ChildPipes, parse_child_argv
from zserve.proc import (
    StatusPipe,
    boot_phase,
    die_with_parent,
    exit_now,
    ignore_terminal_signals,
    set_title,
    setup_logging,
)

from . import logs
from .admission import Guard
from .app import ROUTE_FAMILIES, build_app
from .config import GatewayLaunch
from .engine_client import EngineClient, ModelEngines
from .metrics import RECORDER
from .plugins import PluginContext, check_disabled, describe, installed_plugin_names, load_plugins
from .quota import open_quota
from .security import CorsPolicy, Keys
from .state import GatewayState, ServedModel, load_text
from .store import open_store
from .tenancy import Tenancy
from .text.reasoning import get_reasoning_parser
from .text.tool_parsers import get_tool_parser

log = logging.getLogger("zserve.gateway")

HELLO_WAIT = 2.0  # seconds a cluster-state ack waits for the engines it calls ready to say hello


class ControlReader:
    """Reads cluster-state lines from the supervisor's control pipe and applies them in order."""

    def __init__(self, fd: int, state_cb, abort_cb=None):
        self.fd = fd
        self.lines = LineBuffer()
        self.cb = state_cb
        self.abort_cb = abort_cb  # AbortRequests: end those requests here, answer which were here
        self.queue: asyncio.Queue[ClusterState] = asyncio.Queue()

    def on_readable(self) -> None:
        try:
            data = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return
        if not data:  # the supervisor is gone; PDEATHSIG will end us
            asyncio.get_running_loop().remove_reader(self.fd)
            return
        for msg in self.lines.messages(data, PIPE_COMMANDS, self._dropped):
            if isinstance(msg, ClusterUpdate):
                self.queue.put_nowait(msg.state)
            elif isinstance(msg, AbortRequests) and self.abort_cb is not None:
                self.abort_cb(msg)

    @staticmethod
    def _dropped(e: ProtocolError) -> None:
        log.warning("dropped a control line from the supervisor: %s", e)

    async def run(self) -> None:
        while True:
            await self.cb(await self.queue.get())


async def serve(a: GatewayLaunch, pipes: ChildPipes) -> int:
    loop = asyncio.get_running_loop()
    status = StatusPipe(pipes.status_fd)
    # A plugin that cannot load, or a family to disable that is not here, can never start: a boot error.
    with boot_phase(status, f"gateway {a.index}"):
        check_disabled(a.config.disabled_families, ROUTE_FAMILIES, installed_plugin_names())
        plugins = load_plugins(reserved=ROUTE_FAMILIES, skip=a.config.disabled_families)
    with boot_phase(status, f"gateway {a.index}"):
        keys = CurveKeys.for_client(a.keys_dir) if a.keys_dir else None
    engines = EngineClient(list(a.engines), client_id=f"gw{a.index}-{os.getpid()}", keys=keys)
    models = []
    for entry in a.models:
        source = entry.source
        tokenizer, template = await loop.run_in_executor(None, load_text, source, a.cache_dir)
        models.append(ServedModel(source, list(entry.names or [source.model_id]), tokenizer, template,
                                  ModelEngines(engines, source.model_id), dict(entry.loras)))
    cfg = a.config
    state = GatewayState(a.index, models, engines, control_socket=a.control_socket,
                         tool_parser=get_tool_parser(cfg.tool_call_parser) if cfg.tool_call_parser else None,
                         reasoning_parser=get_reasoning_parser(cfg.reasoning_parser) if cfg.reasoning_parser else None,
                         responses=open_store(cfg.state_url,
                                              a.responses_db or os.path.join(a.cache_dir or ".", "responses.db"),
                                              ttl_s=cfg.responses_ttl, max_items=cfg.responses_max_items),
                         render_only=cfg.render_only, default_max_model_len=cfg.max_model_len,
                         stream_interval=cfg.stream_interval, scaling_wait=cfg.scaling_wait,
                         max_audio_mb=cfg.max_audio_mb, max_audio_seconds=cfg.max_audio_seconds)
    engines.hold = state.wait_for
    engines.migration_limit, engines.migration_max_len = cfg.migration_limit, cfg.migration_max_len
    engines.migration_wait, engines.on_migration = cfg.scaling_wait, RECORDER.migration
    engines.router.policy, engines.router.max_share = cfg.routing_policy, cfg.routing_max_share
    engines.router.on_decision = RECORDER.routing
    # Each tenant's limits are kept for every gateway of the host (and, with --state-url redis://, of every host).
    tenancy = Tenancy(open_quota(a.quota_dir, a.index, cfg.state_url) if a.quota_dir else None, RECORDER.tenants)
    guard = Guard(Keys.load(a.key_file), cfg.metrics_auth, cfg.max_concurrent_requests, tenancy, cfg.body_timeout)
    with boot_phase(status, f"gateway {a.index}"):  # a plugin route that takes a core one without saying so
        app = build_app(state, [f for f in ROUTE_FAMILIES if f not in cfg.disabled_families], plugins,
                        PluginContext(state, cfg), guard=guard,
                        cors=CorsPolicy(cfg.allowed_origins, cfg.allowed_methods, cfg.allowed_headers,
                                        cfg.allow_credentials))
    if a.index == 0:  # every gateway mounts the same: say it once
        if plugins:
            log.info("endpoint plugins: %s", describe(plugins))
        if cfg.disabled_families:
            log.info("disabled route families: %s (their routes answer 404)", ", ".join(cfg.disabled_families))
    tasks: list[asyncio.Task] = []

    keys_version = 0

    async def apply(cluster: ClusterState) -> None:
        nonlocal keys_version
        if cluster.keys_version != keys_version and a.key_file:  # the tenants were reloaded: the file is new
            guard.keys, keys_version = Keys.load(a.key_file), cluster.keys_version
        await engines.apply_cluster(cluster)
        # Acknowledge once the engines the supervisor calls ready answer here too (they bound their socket
        # before saying so: a hello follows within milliseconds), so "every gateway applied it" means routable.
        await engines.wait_hello([e.endpoint for e in cluster.engines if e.state == "ready"], HELLO_WAIT)
        state.apply_cluster(cluster)  # wakes the requests a resize held, once it is over
        status.send(Ack(cluster.version))

    if pipes.control_fd is not None:
        def abort(msg: AbortRequests) -> None:
            status.send(AbortReport(msg.id, tuple(engines.abort_ids(msg.request_ids))))

        reader = ControlReader(pipes.control_fd, apply, abort)
        os.set_blocking(pipes.control_fd, False)
        loop.add_reader(pipes.control_fd, reader.on_readable)
        tasks.append(asyncio.create_task(reader.run()))
    await engines.start()
    if not cfg.render_only:  # a render-only gateway has no engine to wait for
        await asyncio.wait_for(engines.any_ready.wait(), a.engine_timeout)
        # Serve once every engine the supervisor calls ready has greeted this gateway too (a hello follows its
        # connection within milliseconds), not at the first: a gateway started while serving (a rolling restart,
        # a scale-up) otherwise answered a request of another model that instant with a 503, no engine being ready.
        await engines.wait_hello([ep for ep, e in engines.engines.items() if e.cluster_state == "ready"], HELLO_WAIT)
    if pipes.control_fd is not None:  # and once it serves what the cluster state says (its LoRA adapters, holds)
        async with asyncio.timeout(a.engine_timeout):
            while state.cluster is None:
                await asyncio.sleep(0.01)
        # and once it knows what every engine's prefix cache holds (a replay of its KV events): a gateway started
        # late routes its first request as the others do
        await engines.wait_caught_up(HELLO_WAIT)

    async def heartbeat() -> None:
        while True:
            status.send(Heartbeat(in_flight=engines.in_flight, draining=state.draining))
            await asyncio.sleep(a.heartbeat_interval)

    tasks.append(asyncio.create_task(heartbeat()))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=a.shutdown_timeout + 5)
    with boot_phase(status, f"gateway {a.index}"):  # runs the plugins' start-up hooks
        await runner.setup()
    sock = socket.socket(fileno=a.fd)
    sock.setblocking(False)
    site = web.SockSite(runner, sock, backlog=LISTEN_BACKLOG)  # aiohttp listens again on the inherited socket
    await site.start()
    log.info("gateway %d serving on %s", a.index, sock.getsockname())
    settle()  # what it has built lives as long as it does: out of the cycle collector's way
    status.send(Ready(index=a.index))

    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    code = await drain(state, site, runner.server, a.shutdown_timeout)
    await runner.cleanup()
    for t in tasks:
        t.cancel()
    await engines.close()
    await state.responses.close()
    await tenancy.close()
    return code


# How long a connection this gateway accepted before it stopped listening may take to send its first request (a client
# sends it at once; one silent this long is no client about to).
FIRST_REQUEST_GRACE_S = 5.0


def _awaiting_first_request(server: web.Server | None) -> bool:
    """Whether a connection this gateway accepted has not sent its first request yet. Closing it would lose that
    request: its client connected to the shared socket before this gateway stopped listening, and sees a reset
    (aiohttp counts a connection's parsed requests in ``_request_count``; without it, none is waited for)."""
    return server is not None and any(getattr(c, "_request_count", 1) == 0 for c in server.connections)


async def drain(state: GatewayState, site: web.SockSite, server: web.Server | None, timeout: float) -> int:
    """Stop accepting, serve the connections already accepted, let in-flight requests finish for up to ``timeout``
    s, then fail the rest."""
    state.draining = True
    await site.stop()  # closes only this process's copy of the shared listening socket
    engines = state.engines
    log.info("gateway %d draining %d in-flight request(s) (up to %.0fs)", state.index, engines.in_flight, timeout)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    first_requests_by = loop.time() + min(FIRST_REQUEST_GRACE_S, timeout)
    while (engines.in_flight or (loop.time() < first_requests_by and _awaiting_first_request(server))) \
            and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if not engines.in_flight:
        log.info("gateway %d drained", state.index)
        return 0
    n = engines.fail_all("the server is shutting down")
    log.warning("gateway %d: shutdown timeout; ended %d request(s) with an error", state.index, n)
    end = loop.time() + 5
    while engines.in_flight and loop.time() < end:  # let handlers write their error responses
        await asyncio.sleep(0.02)
    return EXIT_CUT_OFF


def profiled(name: str, run: Callable[[], int]) -> int:
    """``run()``; under ``ZSERVE_PROFILE_DIR`` (a developer's switch: where a gateway's CPU goes, for the gateway
    benchmarks) inside ``cProfile``, the stats written to ``<dir>/<name>-<pid>.prof`` when it returns (a drained,
    not a killed, gateway)."""
    directory = os.environ.get("ZSERVE_PROFILE_DIR")
    if not directory:
        return run()
    import cProfile

    profile = cProfile.Profile()
    try:
        return profile.runcall(run)
    finally:
        profile.dump_stats(os.path.join(directory, f"{name}-{os.getpid()}.prof"))


def main(argv: list[str] | None = None) -> None:
    """``python -m gateway --launch JSON``: the ``GatewayLaunch`` the supervisor built (``launch.handoff``)."""
    a, pipes = parse_child_argv(argv, "python -m gateway", "zserve HTTP gateway (started by `launch`)",
                                GatewayLaunch.from_json)
    die_with_parent(pipes.parent_pid)
    ignore_terminal_signals()
    set_title(f"zserve: gateway {a.index}")
    setup_logging(f"gateway {a.index}")
    logs.install()
    exit_now(profiled(f"gateway-{a.index}", lambda: uvloop.run(serve(a, pipes))))  # (serve closed its sockets)
