"""The gateway process: serve HTTP on a listening socket inherited from the supervisor.

Several gateways share one socket (SO_REUSEPORT set by the supervisor); the kernel spreads
connections among them. Every gateway connects to every engine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket

import orjson
import uvloop
from aiohttp import web

from zserve.catalog import ModelSource
from zserve.proc import StatusPipe, die_with_parent, ignore_terminal_signals, set_title, setup_logging

from .app import build_app
from .engine_client import EngineClient
from .state import GatewayState, load_text

log = logging.getLogger("zserve.gateway")


async def serve(a: argparse.Namespace) -> None:
    source = ModelSource.from_json(orjson.loads(a.model_source))
    tokenizer, template = load_text(source, cache_dir=a.cache_dir)
    engines = EngineClient(a.engine, client_id=f"gw{a.index}-{os.getpid()}")
    await engines.start(timeout=a.engine_timeout)
    names = a.served_model_name or [source.model_id]
    state = GatewayState(a.index, source, names, tokenizer, template, engines)
    app = build_app(state)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    sock = socket.socket(fileno=a.fd)
    sock.setblocking(False)
    site = web.SockSite(runner, sock, shutdown_timeout=a.shutdown_timeout)
    await site.start()
    log.info("gateway %d serving on %s", a.index, sock.getsockname())
    StatusPipe(a.status_fd).send("ready", index=a.index)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    log.info("gateway %d stopping", a.index)
    await runner.cleanup()
    await engines.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gateway", description="zserve HTTP gateway (started by `launch`)")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--fd", type=int, required=True, help="inherited listening socket")
    p.add_argument("--engine", action="append", required=True, help="engine endpoint (repeat per engine)")
    p.add_argument("--model-source", required=True)
    p.add_argument("--served-model-name", action="append", default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--engine-timeout", type=float, default=600.0)
    p.add_argument("--shutdown-timeout", type=float, default=5.0)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--status-fd", type=int, default=None, help="pipe to the supervisor")
    a = p.parse_args(argv)
    die_with_parent(a.parent_pid)
    ignore_terminal_signals()
    set_title(f"zserve: gateway {a.index}")
    setup_logging(f"gateway {a.index}")
    uvloop.run(serve(a))
