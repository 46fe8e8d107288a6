"""What a chat request costs a gateway with its engine out of the picture (issue 32's per-request floor).

zserve's app (``gateway.app.build_app``: every route, the middleware, the tiny-random model's tokenizer and chat
template) serves in this process on a real socket, its one engine a stand-in that answers each request at once on
the event loop with a one-token output (a frame made once, the request id put in). The same load as
``bench_gateway.py`` (its loader, in its own process on the other core: 32 keep-alive connections, the same
one-token chat completion) goes to it and, alternating, to the bare aiohttp + orjson echo app. CPU per request is
the measured process's over the window. With no engine sharing the core and no ZeroMQ, this is the gateway's own
work, steady to about 5% from run to run where a server beside its engine moves 15%.

    .venv/bin/python tests/bench/bench_request_path.py [--rounds 5] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import sys
from pathlib import Path

import orjson
import uvloop
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import tests.bench.bench_gateway as bg  # noqa: E402
from gateway.admission import Guard  # noqa: E402
from gateway.app import build_app  # noqa: E402
from gateway.engine_client import ModelEngines  # noqa: E402
from gateway.security import Keys  # noqa: E402
from gateway.state import GatewayState, ServedModel, load_text  # noqa: E402
from protocol import RequestOutput, StepOutputs, encode  # noqa: E402
from tests.unit.fake_engine import fake_engine_client  # noqa: E402
from zserve.catalog import resolve  # noqa: E402

MODEL = "tiny-random"


async def serve_zserve() -> tuple[web.AppRunner, int]:
    client, eng, _ = fake_engine_client(MODEL)
    loop = asyncio.get_running_loop()
    placeholder = "chatcmpl-" + "0" * 32 + "-0"  # (the length of the route's request ids)
    head, data = encode(StepOutputs(0, (RequestOutput(placeholder, (5,), "length", num_prompt_tokens=37),)))

    def engine(_eng, frames: list[bytes]) -> None:  # the engine's side, as cheap as it goes
        msg = orjson.loads(frames[0])
        if msg.get("t") == "add":
            rid = msg["request_id"].encode()
            loop.call_soon(client._dispatch, eng, [head.replace(placeholder.encode(), rid), data])

    client._send_now = engine  # type: ignore[method-assign]
    source = resolve(MODEL)
    tokenizer, template = load_text(source)
    state = GatewayState(0, [ServedModel(source, [MODEL], tokenizer, template, ModelEngines(client, MODEL))], client)
    runner = web.AppRunner(build_app(state, guard=Guard(Keys(), metrics_auth=False, max_concurrent=None)),
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def main(args: argparse.Namespace) -> None:
    two = (os.cpu_count() or 1) >= 2
    if two:
        os.sched_setaffinity(0, {0})
    runner, port = await serve_zserve()
    echo = bg.start_echo("aiohttp", 0 if two else None)
    loader_core = 1 if two else None
    loop = asyncio.get_running_loop()

    def spec(url: str, pid: int) -> dict:
        return {"url": url, "model": MODEL, "pids": [pid], "concurrency": 32, "requests": args.requests,
                "stream_tokens": 0}

    targets = {"zserve's app": spec(f"http://127.0.0.1:{port}/v1/chat/completions", os.getpid()),
               "aiohttp echo": spec(echo.url, echo.proc.pid)}
    cpu: dict[str, list[float]] = {name: [] for name in targets}
    profile = cProfile.Profile() if args.profile else None
    try:
        for s in targets.values():  # warm: connections, caches, code paths
            await loop.run_in_executor(None, bg.run_loader, s, loader_core)
        for _ in range(args.rounds):
            for name, s in targets.items():
                if profile is not None and name == "zserve's app":
                    profile.enable()
                r = await loop.run_in_executor(None, bg.run_loader, s, loader_core)
                if profile is not None:
                    profile.disable()
                if r.failures:
                    raise SystemExit(f"{name}: {r.failures} requests failed")
                cpu[name].append(r.server_cpu_s / r.requests * 1e6)
    finally:
        echo.stop()
        await runner.cleanup()
    z, e = statistics.median(cpu["zserve's app"]), statistics.median(cpu["aiohttp echo"])
    print(f"one-token chat completions, {args.requests} a round, {args.rounds} rounds alternating, medians; "
          f"CPU µs per request: zserve's app {z:.0f}, the aiohttp echo app {e:.0f}; zserve's own {z - e:.0f} "
          f"({z / e:.2f}x the echo app)")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="also print where zserve's time goes (cProfile)")
    uvloop.run(main(ap.parse_args()))
