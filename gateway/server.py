"""The gateway process: serve HTTP on a listening socket inherited from the supervisor.

Several gateways share one socket; the kernel spreads connections among them. Besides HTTP, a
gateway keeps two pipes to the supervisor: it reads the cluster state (engine membership, pause)
from the control pipe and acknowledges each version, and it writes heartbeats from its event loop
(so a blocked loop stops them). SIGTERM drains: stop accepting, finish in-flight requests up to
the shutdown timeout, fail the rest with an error, exit 0 only if nothing was cut off.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

import orjson
import uvloop
from aiohttp import web

from zserve.catalog import ModelSource
from zserve.cluster import ClusterState
from zserve.proc import StatusPipe, die_with_parent, ignore_terminal_signals, set_title, setup_logging

from .app import build_app
from .engine_client import EngineClient
from .state import GatewayState, load_text
from .store import DEFAULT_MAX_ITEMS, DEFAULT_TTL_S, open_store
from .text.reasoning import get_reasoning_parser
from .text.tool_parsers import get_tool_parser

log = logging.getLogger("zserve.gateway")

EXIT_CUT_OFF = 3


class ControlReader:
    """Reads cluster-state lines from the supervisor's control pipe and applies them in order."""

    def __init__(self, fd: int, state_cb):
        self.fd = fd
        self.buf = b""
        self.cb = state_cb
        self.queue: asyncio.Queue[ClusterState] = asyncio.Queue()

    def on_readable(self) -> None:
        try:
            data = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return
        if not data:  # the supervisor is gone; PDEATHSIG will end us
            asyncio.get_running_loop().remove_reader(self.fd)
            return
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            try:
                msg = orjson.loads(line)
                if msg.get("event") == "cluster":
                    self.queue.put_nowait(ClusterState.from_json(msg["state"]))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                log.warning("unreadable control line from the supervisor: %s", e)

    async def run(self) -> None:
        while True:
            await self.cb(await self.queue.get())


async def serve(a: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    status = StatusPipe(a.status_fd)
    source = ModelSource.from_json(orjson.loads(a.model_source))
    tokenizer, template = await loop.run_in_executor(None, load_text, source, a.cache_dir)
    engines = EngineClient(a.engine or [], client_id=f"gw{a.index}-{os.getpid()}")
    names = a.served_model_name or [source.model_id]
    state = GatewayState(a.index, source, names, tokenizer, template, engines, control_socket=a.control_socket,
                         tool_parser=get_tool_parser(a.tool_call_parser) if a.tool_call_parser else None,
                         reasoning_parser=get_reasoning_parser(a.reasoning_parser) if a.reasoning_parser else None,
                         responses=open_store(a.state_url, a.responses_db or os.path.join(a.cache_dir or ".", "responses.db"),
                                              ttl_s=a.responses_ttl, max_items=a.responses_max_items))
    tasks: list[asyncio.Task] = []

    async def apply(cluster: ClusterState) -> None:
        await engines.apply_cluster(cluster)
        state.cluster = cluster
        status.send("ack", version=cluster.version)

    if a.control_fd is not None:
        reader = ControlReader(a.control_fd, apply)
        os.set_blocking(a.control_fd, False)
        loop.add_reader(a.control_fd, reader.on_readable)
        tasks.append(asyncio.create_task(reader.run()))
    await engines.start()
    await asyncio.wait_for(engines.any_ready.wait(), a.engine_timeout)

    async def heartbeat() -> None:
        while True:
            status.send("heartbeat", in_flight=engines.in_flight, draining=state.draining)
            await asyncio.sleep(a.heartbeat_interval)

    tasks.append(asyncio.create_task(heartbeat()))
    app = build_app(state)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=a.shutdown_timeout + 5)
    await runner.setup()
    sock = socket.socket(fileno=a.fd)
    sock.setblocking(False)
    site = web.SockSite(runner, sock)
    await site.start()
    log.info("gateway %d serving on %s", a.index, sock.getsockname())
    status.send("ready", index=a.index)

    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    code = await drain(state, site, a.shutdown_timeout)
    await runner.cleanup()
    for t in tasks:
        t.cancel()
    await engines.close()
    await state.responses.close()
    return code


async def drain(state: GatewayState, site: web.SockSite, timeout: float) -> int:
    """Stop accepting, let in-flight requests finish for up to ``timeout`` s, then fail the rest."""
    state.draining = True
    await site.stop()  # closes only this process's copy of the shared listening socket
    engines = state.engines
    log.info("gateway %d draining %d in-flight request(s) (up to %.0fs)", state.index, engines.in_flight, timeout)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engines.in_flight and loop.time() < deadline:
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gateway", description="zserve HTTP gateway (started by `launch`)")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--fd", type=int, required=True, help="inherited listening socket")
    p.add_argument("--engine", action="append", default=None, help="engine endpoint, when not told by a supervisor")
    p.add_argument("--model-source", required=True)
    p.add_argument("--served-model-name", action="append", default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--engine-timeout", type=float, default=600.0)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--control-socket", default=None, help="the supervisor's control socket")
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--status-fd", type=int, default=None, help="pipe to the supervisor")
    p.add_argument("--control-fd", type=int, default=None, help="pipe from the supervisor")
    p.add_argument("--tool-call-parser", default=None)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--state-url", default=None, help="shared state (stored responses): sqlite:///PATH or redis://")
    p.add_argument("--responses-db", default=None, help="the SQLite file every gateway of this host shares")
    p.add_argument("--responses-ttl", type=float, default=DEFAULT_TTL_S)
    p.add_argument("--responses-max-items", type=int, default=DEFAULT_MAX_ITEMS)
    a = p.parse_args(argv)
    die_with_parent(a.parent_pid)
    ignore_terminal_signals()
    set_title(f"zserve: gateway {a.index}")
    setup_logging(f"gateway {a.index}")
    sys.exit(uvloop.run(serve(a)))
