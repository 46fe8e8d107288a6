"""Gateway cost of each generation family beside /v1/chat/completions, in one run.

One gateway and one `tiny-random` engine (so the engine is cheap and the gateway's own work shows),
C concurrent keep-alive clients, sampled requests (temperature 1.0, the OpenAI default). For every
route: requests/s and the gateway process's CPU time per request (utime + stime from /proc over
the run, divided by requests served). Routes are measured in interleaved rounds and the median
round is reported, as a ratio to chat completions measured in the same rounds. Rerun with:

    .venv/bin/python tests/bench/bench_routes.py --requests 400 --concurrency 16 --rounds 3

``--api-key`` adds a row: chat completions on a second server started with ``--api-key`` (requests send
the bearer key), in the same rounds, so the key check's cost shows against the open server's chat row.
``--tenants`` adds another: chat on a server with a tenants file whose tenant has every limit (requests, tokens,
concurrency) set too high to refuse, so each request pays the whole tenant check (the shared-memory buckets, the
token charges, the headers) and nothing else differs. Compare it with the ``--api-key`` row.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench.procstat import cpu_seconds  # noqa: E402

MESSAGE = "Summarise the plot of a short story about a lighthouse keeper who befriends a seagull."


def payloads(model: str, tokens: int, stream: bool) -> dict[str, tuple[str, dict]]:
    msgs = [{"role": "user", "content": MESSAGE}]
    s = {"stream": stream}
    return {
        "chat": ("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": tokens, **s}),
        "completions": ("/v1/completions", {"model": model, "prompt": MESSAGE, "max_tokens": tokens, **s}),
        "messages": ("/v1/messages", {"model": model, "messages": msgs, "max_tokens": tokens, "temperature": 1.0, **s}),
        "responses": ("/v1/responses", {"model": model, "input": MESSAGE, "max_output_tokens": tokens, **s}),
        "responses (store=false)": ("/v1/responses", {"model": model, "input": MESSAGE, "max_output_tokens": tokens,
                                                      "store": False, **s}),
        "generate (token ids)": ("/inference/v1/generate", {"model": model, "token_ids": list(range(100, 120)),
                                                            "sampling_params": {"max_tokens": tokens},
                                                            "stream": stream}),
    }


def start_server(args, *extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "launch", "api-server", "--port", "0", "--count", "1",
                             "--model", "tiny-random", "--max-num-seqs", str(max(16, args.concurrency)), *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    for raw in proc.stdout:
        m = re.search(r"at (http://\S+) ", raw.decode())
        if m:
            return proc, m.group(1)
    raise RuntimeError("server did not start")


async def run_route(session: aiohttp.ClientSession, url: str, body: dict, n: int, conc: int, pid: int,
                    headers: dict | None = None) -> tuple[float, float]:
    """(requests/s, gateway CPU µs per request) for n requests at concurrency conc."""
    left = n
    failures = 0

    async def worker() -> None:
        nonlocal left, failures
        while left > 0:
            left -= 1
            async with session.post(url, json=body, headers=headers) as r:
                await r.read()
                failures += r.status != 200

    c0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.gather(*(worker() for _ in range(conc)))
    wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - c0
    if failures:
        raise RuntimeError(f"{failures} of {n} requests to {url} failed")
    return n / wall, cpu / n * 1e6


TENANT_KEY = "sk-bench-tenant-key"


def tenants_file(path: Path) -> Path:
    from zserve.tenants import key_digest

    path.write_text(f'[[tenant]]\nname = "bench"\nkey_sha256 = ["{key_digest(TENANT_KEY)}"]\n'
                    "requests_per_minute = 100000000\ntokens_per_minute = 1000000000\nmax_concurrent = 100000\n")
    return path


async def bench(base: str, args, keyed: str | None = None,
                tenanted: str | None = None) -> dict[str, list[tuple[float, float]]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency)) as session:
        auth = {"Authorization": f"Bearer {args.api_key}"}
        async with session.get(base + "/load") as r:
            pid = (await r.json())["pid"]
        async with session.get(base + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        targets = {name: (base, path, body, pid, None) for name, (path, body) in
                   payloads(model, args.tokens, args.stream).items()}
        if keyed is not None:
            async with session.get(keyed + "/load", headers=auth) as r:
                keyed_pid = (await r.json())["pid"]
            path, body = payloads(model, args.tokens, args.stream)["chat"]
            targets["chat (--api-key)"] = (keyed, path, body, keyed_pid, auth)
        if tenanted is not None:
            tenant_auth = {"Authorization": f"Bearer {TENANT_KEY}"}
            async with session.get(tenanted + "/load", headers=tenant_auth) as r:
                tenant_pid = (await r.json())["pid"]
            path, body = payloads(model, args.tokens, args.stream)["chat"]
            targets["chat (--tenants)"] = (tenanted, path, body, tenant_pid, tenant_auth)
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in targets}
        for url, path, body, gw, headers in targets.values():  # warm-up: tokenizer caches, store file, code paths
            await run_route(session, url + path, body, 20, 4, gw, headers)
        for _ in range(args.rounds):
            for name, (url, path, body, gw, headers) in targets.items():
                results[name].append(await run_route(session, url + path, body, args.requests, args.concurrency, gw,
                                                     headers))
        return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=1, help="max tokens per request")
    p.add_argument("--stream", action="store_true", help="stream every response (SSE)")
    p.add_argument("--api-key", default=None, help="also measure chat on a server started with this --api-key")
    p.add_argument("--tenants", action="store_true", help="also measure chat on a server with a tenants file")
    args = p.parse_args()
    procs = []
    try:
        proc, base = start_server(args)
        procs.append(proc)
        keyed = None
        if args.api_key:
            proc, keyed = start_server(args, "--api-key", args.api_key)
            procs.append(proc)
        tenanted = None
        if args.tenants:
            import tempfile

            with tempfile.TemporaryDirectory() as d:
                proc, tenanted = start_server(args, "--tenants", str(tenants_file(Path(d) / "tenants.toml")))
            procs.append(proc)
        results = asyncio.run(bench(base, args, keyed, tenanted))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    rps0 = statistics.median(r for r, _ in results["chat"])
    cpu0 = statistics.median(c for _, c in results["chat"])
    print(f"1 gateway, tiny-random engine, {args.requests} requests x {args.rounds} rounds, concurrency "
          f"{args.concurrency}, max tokens {args.tokens}, {'streamed' if args.stream else 'not streamed'}, "
          "temperature 1.0 (medians)")
    print(f"{'route':26} {'req/s':>8} {'vs chat':>8} {'gateway CPU/req':>16} {'vs chat':>8}")
    for name, rows in results.items():
        rps = statistics.median(r for r, _ in rows)
        cpu = statistics.median(c for _, c in rows)
        print(f"{name:26} {rps:8.0f} {rps / rps0:7.2f}x {cpu:13.0f} µs {cpu / cpu0:7.2f}x")


if __name__ == "__main__":
    main()
