"""What zserve's gateway costs beside bare echo apps, and how requests/s grow with gateways (issue 13).

Four targets answer the same non-streaming chat completion (one short user message, max_tokens 1,
temperature 0): a bare aiohttp + uvloop + orjson echo app, a bare FastAPI + uvicorn + pydantic echo app,
the aiohttp echo app forwarding a prompt of the same length to zserve's engine over ZeroMQ and answering
when the token comes back (all three in echo_apps.py) and `launch api-server --model tiny-random --count 1
--dtype float32`. The echo apps answer at once; the forwarding one and zserve wait for an engine that
shares their core, which costs any process in front of it CPU of its own (idle wake-ups, the engine's
time slices and cache footprint): that app is the floor of a gateway here, with none of a gateway's work.
One load generator serves all four: a separate process with C keep-alive HTTP/1.1 connections on raw asyncio
streams (cheaper per request than an HTTP client library, so it stays out of the way), pinned to its own
core when the machine has two. For each target: requests/s and the measured process's CPU time per
request (utime + stime from /proc over the measured window, divided by requests): the app process for an
echo app, the gateway process (found by its title, ``zserve: gateway 0``) for zserve. Targets are
interleaved in rounds and medians reported. Then requests/s with 1, 2 and 4 gateways, nothing pinned.
``--stream-tokens`` measures instead the CPU per streamed token: 64 concurrent streams of 256 tokens
(``ignore_eos``) from the tiny engine, against the aiohttp echo app streaming the same (one chunk to every
stream per 20 ms step), the floor of zserve's stack, and the forward echo app streaming a fixed chunk for each
of the same engine's outputs, the floor of a token forwarded from an engine on the same core;
``--stream-intervals 1,4,8`` adds a zserve per ``--stream-interval`` value (fewer, larger chunks). Rerun with:

    .venv/bin/python tests/bench/bench_gateway.py --requests 3000 --concurrency 32 --rounds 3
    .venv/bin/python tests/bench/bench_gateway.py --stream-tokens --stream-intervals 1,4,8

The FastAPI baseline needs the ``bench`` extra (``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench.procstat import cpu_seconds, find_titled, pin  # noqa: E402

MESSAGE = "What is the capital of France?"
ECHO_APPS = Path(__file__).with_name("echo_apps.py")


def chat_body(model: str, stream_tokens: int = 0) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": MESSAGE}], "max_tokens": 1, "temperature": 0}
    if stream_tokens:
        body.update(max_tokens=stream_tokens, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    return body


# --- the load generator (runs in its own process: `bench_gateway.py --loader SPEC_JSON`) ---------------------------


@dataclass
class LoadResult:
    requests: int = 0
    failures: int = 0
    tokens: int = 0  # streamed completion tokens (--stream-tokens)
    wall_s: float = 0.0
    server_cpu_s: float = 0.0  # of the measured pids together
    loader_cpu_s: float = 0.0


def http_request(url: str, body: dict) -> bytes:
    u = urlsplit(url)
    data = json.dumps(body).encode()
    return (f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def read_response(reader: asyncio.StreamReader) -> int:
    """Read one HTTP/1.1 response (Content-Length or chunked body); return its status."""
    status = int((await reader.readuntil(b"\r\n")).split(b" ", 2)[1])
    length, chunked = 0, False
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    if not chunked:
        await reader.readexactly(length)
        return status
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        await reader.readexactly(size + 2)
    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
        pass
    return status


async def send_requests(url: str, request: bytes, n: int, conns: list) -> int:
    """Send n requests over the keep-alive connections, each waiting for its answer; return the failures."""
    left, failures = n, 0
    host, port = urlsplit(url).hostname, urlsplit(url).port

    async def on(i: int) -> None:
        nonlocal left, failures
        while left > 0:
            left -= 1
            reader, writer = conns[i]
            try:
                writer.write(request)
                failures += await read_response(reader) != 200
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                failures += 1
                writer.close()
                conns[i] = await asyncio.open_connection(host, port)

    await asyncio.gather(*(on(i) for i in range(len(conns))))
    return failures


async def stream_once(session, url: str, body: dict) -> int:
    """One streamed chat completion; its completion tokens from the usage chunk (0: it failed)."""
    async with session.post(url, json=body) as r:
        if r.status != 200:
            return 0
        tokens = 0
        async for line in r.content:
            if line.startswith(b"data: {") and b'"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return tokens


async def generate_load(spec: dict) -> LoadResult:
    pids, url, n, conc = spec["pids"], spec["url"], spec["requests"], spec["concurrency"]
    res = LoadResult()
    if spec["stream_tokens"]:
        import aiohttp  # SSE parsing is not the loader's hot path here: the engine paces the tokens

        body = chat_body(spec["model"], spec["stream_tokens"])
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as session:
            await asyncio.gather(*(stream_once(session, url, dict(body, max_tokens=4)) for _ in range(conc)))  # warm
            c0, l0, t0 = sum(map(cpu_seconds, pids)), time.process_time(), time.monotonic()
            tokens = await asyncio.gather(*(stream_once(session, url, body) for _ in range(n)))
            res.wall_s, res.loader_cpu_s = time.monotonic() - t0, time.process_time() - l0
            res.server_cpu_s = sum(map(cpu_seconds, pids)) - c0
        res.requests, res.failures, res.tokens = n, sum(t != spec["stream_tokens"] for t in tokens), sum(tokens)
        return res
    request = http_request(url, chat_body(spec["model"]))
    u = urlsplit(url)
    conns = [await asyncio.open_connection(u.hostname, u.port) for _ in range(conc)]
    warm_failures = await send_requests(url, request, max(200, n // 10), conns)  # connections, caches, code paths
    c0, l0, t0 = sum(map(cpu_seconds, pids)), time.process_time(), time.monotonic()
    res.failures = await send_requests(url, request, n, conns)
    res.wall_s, res.loader_cpu_s = time.monotonic() - t0, time.process_time() - l0
    res.server_cpu_s = sum(map(cpu_seconds, pids)) - c0
    res.requests = n
    res.failures += warm_failures
    for _, writer in conns:
        writer.close()
    return res


def run_loader(spec: dict, core: int | None) -> LoadResult:
    """Run the load generator in its own process (pinned to ``core`` before it starts) and return its result."""
    preexec = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
    out = subprocess.run([sys.executable, __file__, "--loader", json.dumps(spec)], cwd=ROOT, check=True,
                         stdout=subprocess.PIPE, preexec_fn=preexec).stdout
    return LoadResult(**json.loads(out.decode().strip().splitlines()[-1]))


# --- the servers under test ---------------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    proc: subprocess.Popen
    url: str  # of the chat-completions route
    model: str
    measured: list[int]  # pids whose CPU time is the server's cost
    note: str = ""
    rounds: list[LoadResult] = field(default_factory=list)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def pinned_to(core: int | None):
    return (lambda: os.sched_setaffinity(0, {core})) if core is not None else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drain(stream) -> None:
    threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()


def start_echo(framework: str, core: int | None, extra: list[str] = ()) -> Target:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ECHO_APPS), framework, "--port", str(port), *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, preexec_fn=pinned_to(core))
    note = proc.stdout.readline().decode().strip()
    drain(proc.stdout)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    request = urllib.request.Request(url, json.dumps(chat_body("echo")).encode(), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the {framework} echo app did not start") from None
            time.sleep(0.2)
    return Target(f"{framework} echo", proc, url, "echo", [proc.pid], note)


def start_forward(zserve: Target, core: int | None) -> Target:
    """The ``forward`` echo app against ``zserve``'s engine, sending prompts as long as zserve's for the benchmark's
    message (its /tokenize route renders the chat template as the chat route does)."""
    base = zserve.url.removesuffix("/v1/chat/completions")
    with urllib.request.urlopen(base + "/load", timeout=10) as r:
        endpoint = json.loads(r.read())["engines"][0]["endpoint"]
    body = json.dumps({"model": zserve.model, "messages": chat_body(zserve.model)["messages"]}).encode()
    request = urllib.request.Request(base + "/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        n = json.loads(r.read())["count"]
    return start_echo("forward", core, ["--engine", endpoint, "--prompt-tokens", str(n)])


def start_zserve(gateways: int, core: int | None, engine_shares_core: bool, max_num_seqs: int,
                 engine_threads: int | None = None, stream_interval: int = 1) -> Target:
    """`launch api-server` with the tiny engine; with a core, the gateways are pinned to it (and the engine too
    when ``engine_shares_core``: the whole server inherits the core, so the engine's torch uses one thread)."""
    proc = subprocess.Popen([sys.executable, "-m", "launch", "api-server", "--model", "tiny-random", "--count",
                             str(gateways), "--dtype", "float32", "--port", "0", "--max-num-seqs", str(max_num_seqs),
                             *(["--engine-threads", str(engine_threads)] if engine_threads else []),
                             "--stream-interval", str(stream_interval)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            preexec_fn=pinned_to(core if engine_shares_core else None))
    for raw in proc.stdout:
        if m := re.search(r"zserve: serving .* at (http://\S+) ", raw.decode()):
            base = m.group(1)
            break
    else:
        raise RuntimeError(f"launch api-server --count {gateways} did not start")
    drain(proc.stdout)
    titled = find_titled(proc.pid, "zserve: gateway ")
    gws = [titled[f"zserve: gateway {i}"] for i in range(gateways)]
    if core is not None:
        for pid in [proc.pid, *gws]:
            pin(pid, {core})
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        model = json.loads(r.read())["data"][0]["id"]
    name = f"zserve, {gateways} gateway{'s' * (gateways != 1)}"
    if stream_interval > 1:
        name += f", interval {stream_interval}"
    return Target(name, proc, base + "/v1/chat/completions", model,
                  gws)


# --- the runs -------------------------------------------------------------------------------------------------------


def measure(targets: list[Target], args, loader_core: int | None, stream_tokens: int = 0) -> None:
    for _ in range(args.rounds):
        for t in targets:
            spec = {"url": t.url, "model": t.model, "pids": t.measured, "concurrency": args.concurrency,
                    "requests": args.requests, "stream_tokens": stream_tokens}
            if stream_tokens:
                spec.update(concurrency=args.streams, requests=args.streams)
            t.rounds.append(run_loader(spec, loader_core))


def med(t: Target, key) -> float:
    return statistics.median(key(r) for r in t.rounds)


def rps(r: LoadResult) -> float:
    return r.requests / r.wall_s


def cpu_us(r: LoadResult) -> float:
    return r.server_cpu_s / r.requests * 1e6


def failures(t: Target) -> int:
    return sum(r.failures for r in t.rounds)


def print_head_to_head(targets: list[Target], args, placement: str) -> None:
    a, f = targets[0], targets[1]
    fwd = next((t for t in targets if t.name == "forward echo"), None)
    print(f"Head to head: {args.requests} requests x {args.rounds} rounds (interleaved, medians), {args.concurrency} "
          f"keep-alive connections, non-streaming chat completion, max_tokens 1, temperature 0")
    print(placement)
    for t in targets:
        if t.note:
            print(f"  {t.name}: {t.note}")
    print(f"{'target':20} {'req/s':>7} {'vs aio':>7} {'vs fapi':>7} {'CPU µs/req':>11} {'vs aio':>7} {'vs fapi':>7} "
          f"{'vs fwd':>7} {'server CPU':>10} {'loader CPU':>10} {'failed':>6}")
    for t in targets:
        r, c = med(t, rps), med(t, cpu_us)
        busy = med(t, lambda x: x.server_cpu_s / x.wall_s) * 100
        loader = med(t, lambda x: x.loader_cpu_s / x.wall_s) * 100
        vs_fwd = f"{c / med(fwd, cpu_us):6.2f}x" if fwd is not None else "      -"
        print(f"{t.name:20} {r:7.0f} {r / med(a, rps):6.2f}x {r / med(f, rps):6.2f}x {c:11.0f} "
              f"{c / med(a, cpu_us):6.2f}x {c / med(f, cpu_us):6.2f}x {vs_fwd} {busy:9.0f}% {loader:9.0f}% "
              f"{failures(t):6}")
    print("(server CPU: the measured process's CPU time over the window's wall time; loader CPU: the load "
          "generator's; near 100% means that process was the bottleneck. forward echo: the aiohttp echo that also "
          "waits for zserve's engine to generate the token, the floor of any gateway in front of that engine)")


def print_scaling(targets: list[Target], args, cores: int) -> None:
    print(f"\nScaling: {args.requests} requests x {args.rounds} rounds (interleaved, medians), {args.concurrency} "
          f"connections, nothing pinned: the {cores} cores are shared by the gateways, the engine "
          f"({args.scaling_engine_threads or 'the default number of'} torch threads) and the loader")
    print(f"{'gateways':>8} {'req/s':>7} {'vs 1':>6} {'gateway CPU µs/req':>19} {'failed':>6}")
    one = med(targets[0], rps)
    for t in targets:
        n = len(t.measured)
        print(f"{n:8} {med(t, rps):7.0f} {med(t, rps) / one:5.2f}x {med(t, cpu_us):19.0f} {failures(t):6}"
              + ("   (more gateways than cores: they and the loader share the cores)" if n > cores else ""))


def print_streaming(targets: list[Target], args, placement: str) -> None:
    print(f"Streaming: {args.streams} concurrent streams x {args.stream_tokens} tokens (ignore_eos, temperature 0), "
          f"{args.rounds} rounds (interleaved, medians); the aiohttp echo writes one chunk to every stream every "
          f"20 ms (an engine step); zserve: 1 gateway, tiny-random engine, float32")
    print(placement)
    def per_token(t: Target) -> float:
        return med(t, lambda r: r.server_cpu_s / max(1, r.tokens) * 1e6)

    floor = per_token(targets[0])
    fwd = next((t for t in targets if t.name == "forward echo"), None)
    print(f"{'target':30} {'tokens/round':>12} {'tokens/s':>9} {'CPU µs/token':>13} {'vs aio':>7} {'vs fwd':>7} "
          f"{'server CPU':>10} {'failed':>6}")
    for t in targets:
        per_tok = per_token(t)
        vs_fwd = f"{per_tok / per_token(fwd):6.2f}x" if fwd is not None else "      -"
        print(f"{t.name:30} {med(t, lambda r: r.tokens):12.0f} {med(t, lambda r: r.tokens / r.wall_s):9.0f} "
              f"{per_tok:13.1f} {per_tok / floor:6.2f}x {vs_fwd} "
              f"{med(t, lambda r: r.server_cpu_s / r.wall_s) * 100:9.0f}% {failures(t):6}")
    print("(CPU: the echo app's process, zserve's gateway process. forward echo: the aiohttp app that streams a fixed "
          "chunk for each of zserve's engine outputs, written as zserve writes them: the floor of a streamed token "
          "forwarded from an engine)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="measured requests per target per round")
    p.add_argument("--concurrency", type=int, default=32, help="keep-alive connections")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-scaling", action="store_true", help="only the head-to-head table")
    p.add_argument("--engine", choices=["shared", "free"], default="shared",
                   help="shared: zserve's engine runs on the server's core too (torch on 1 thread); "
                        "free: the engine is left unpinned")
    p.add_argument("--scaling-engine-threads", type=int, default=1,
                   help="torch threads of the engine in the scaling runs (0: zserve's default, all cores); with "
                        "nothing pinned, a 2-thread engine spinning on cores the gateways need starves them")
    p.add_argument("--stream-tokens", nargs="?", type=int, const=256, default=0, metavar="N",
                   help="measure the gateway's CPU per streamed token instead (N tokens per stream, default 256)")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams with --stream-tokens")
    p.add_argument("--stream-intervals", type=lambda v: [int(x) for x in v.split(",")], default=[1], metavar="N,...",
                   help="with --stream-tokens: one zserve per --stream-interval value (default 1)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--loader", help=argparse.SUPPRESS)  # internal: run the load generator with this JSON spec
    args = p.parse_args()
    if args.loader:
        import uvloop

        print(json.dumps(asdict(uvloop.run(generate_load(json.loads(args.loader))))))
        return

    cores = sorted(os.sched_getaffinity(0))
    server_core, loader_core = (cores[0], cores[1]) if len(cores) >= 2 else (None, None)
    if server_core is None:
        placement = "1 core: nothing pinned, the loader shares the core with the server"
    else:
        engine = (f"the engine shares core {server_core} (torch on 1 thread)" if args.engine == "shared"
                  else "the engine is not pinned")
        server = "server (echo app; zserve supervisor + gateway)"
        placement = (f"pinned: {server} on core {server_core}, {engine}, loader on core {loader_core}; the machine "
                     f"has {len(cores)} cores")
    results: dict = {"date": time.strftime("%Y-%m-%d"), "cores": len(cores), "placement": placement,
                     "args": {k: str(v) for k, v in vars(args).items() if k != "loader"}}
    targets: list[Target] = []
    try:
        if args.stream_tokens:
            # Appended one at a time: a target that fails to start must not leave the ones before it running.
            targets.append(start_echo("aiohttp", server_core))
            for n in args.stream_intervals:
                targets.append(start_zserve(1, server_core, args.engine == "shared", max(64, args.streams),
                                            stream_interval=n))
            targets.insert(1, start_forward(targets[1], server_core))
            measure(targets, args, loader_core, args.stream_tokens)
            print_streaming(targets, args, placement)
            results["streaming"] = {t.name: [asdict(r) for r in t.rounds] for t in targets}
        else:
            targets.append(start_echo("aiohttp", server_core))
            targets.append(start_echo("fastapi", server_core))
            targets.append(start_zserve(1, server_core, args.engine == "shared", max(32, args.concurrency)))
            targets.insert(2, start_forward(targets[2], server_core))
            measure(targets, args, loader_core)
            for t in targets:
                t.stop()
            print_head_to_head(targets, args, placement)
            results["head_to_head"] = {t.name: [asdict(r) for r in t.rounds] for t in targets}
            if not args.skip_scaling:
                targets = []
                for n in (1, 2, 4):
                    targets.append(start_zserve(n, None, False, max(32, args.concurrency),
                                                args.scaling_engine_threads))
                measure(targets, args, None)
                print_scaling(targets, args, len(cores))
                results["scaling"] = {len(t.measured): [asdict(r) for r in t.rounds] for t in targets}
    finally:
        for t in targets:
            t.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
