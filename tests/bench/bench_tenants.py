"""Fair engines under a flood: tenant B's time to first token alone, then while tenant A floods the server, with the
engines' scheduling first-come-first-served (``--scheduling fifo``) and fair (``--scheduling fair``, the default).

Usage:
    .venv/bin/python tests/bench/bench_tenants.py [--model SmolLM2-135M-Instruct] [--b-rate 0.5] [--flood 10]
        [--b-requests 24] [--prompt-len 256] [--output-len 32]

One server as ``make run`` starts the default model (one engine, two gateways), with a tenants file of two tenants
without limits (so the engine, not the gateway, decides who waits). B sends ``--b-requests`` streamed, sampled
(temperature 1.0) chat requests at ``--b-rate`` per second (Poisson arrivals), prompts of ``--prompt-len`` tokens and
``--output-len`` output tokens. Phases, each on a fresh server: B alone; B while A keeps ``--flood`` times B's rate of
the same requests arriving (more than the engine can serve: its queue grows), FIFO; the same, fair. Reported: B's
TTFT p50 / p99 / mean and A's completed requests per phase (and per second of the flood: the cost of fairness to
the flooding tenant), and B's p99 against its solo baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.helpers

from tests.helpers import Server  # noqa: E402
from zserve.tenants import key_digest  # noqa: E402

KEYS = {"a": "sk-bench-tenant-a", "b": "sk-bench-tenant-b"}


def tenants_file(directory: str) -> str:
    path = Path(directory) / "tenants.toml"
    path.write_text("".join(f'[[tenant]]\nname = "{n}"\nkey_sha256 = ["{key_digest(k)}"]\n\n' for n, k in KEYS.items()))
    return str(path)


async def one(client: httpx.AsyncClient, url: str, tenant: str, model: str, words: str, out_len: int) -> float | None:
    """One streamed chat request; its TTFT in seconds (None: it failed or was refused)."""
    body = {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": out_len,
            "temperature": 1.0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as r:
            if r.status_code != 200:
                await r.aread()
                return None
            ttft = None
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: {"):
                    chunk = orjson.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        ttft = time.perf_counter() - start
            return ttft
    except httpx.HTTPError:
        return None


async def phase(url: str, args: argparse.Namespace, flood: bool) -> dict:
    rng = random.Random(7)
    prompt = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega")) for _ in range(args.prompt_len))
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        # warm up: one request of each tenant
        for t in KEYS:
            await one(client, url, t, args.model, "warm up", 4)
        a_done, a_tasks, stop = [0], [], asyncio.Event()

        async def flooder() -> None:
            arng = random.Random(11)
            async def a_request(i: int) -> None:
                if await one(client, url, "a", args.model, f"{i} {prompt}", args.output_len) is not None:
                    a_done[0] += 1

            while not stop.is_set():
                a_tasks.append(asyncio.create_task(a_request(len(a_tasks))))
                await asyncio.sleep(arng.expovariate(args.b_rate * args.flood))

        began = time.perf_counter()
        fl = asyncio.create_task(flooder()) if flood else None
        if flood:
            await asyncio.sleep(args.warmup)  # A's backlog builds up first
        b_tasks = []
        brng = random.Random(3)
        for i in range(args.b_requests):
            b_tasks.append(asyncio.create_task(one(client, url, "b", args.model, f"b{i} {prompt}", args.output_len)))
            await asyncio.sleep(brng.expovariate(args.b_rate))
        ttfts = await asyncio.gather(*b_tasks)
        stop.set()
        elapsed = time.perf_counter() - began
        if fl is not None:
            await fl
            for t in a_tasks:
                t.cancel()
            await asyncio.gather(*a_tasks, return_exceptions=True)
    ok = sorted(t for t in ttfts if t is not None)
    p = (lambda q: ok[min(len(ok) - 1, int(q * len(ok)))]) if ok else (lambda q: float("nan"))
    return {"b_ok": len(ok), "b_failed": len(ttfts) - len(ok), "p50": p(0.5), "p99": p(0.99),
            "mean": statistics.fmean(ok) if ok else float("nan"), "a_done": a_done[0],
            "a_rate": a_done[0] / elapsed if flood else 0.0}


def run(args: argparse.Namespace, scheduling: str, flood: bool) -> dict:
    with tempfile.TemporaryDirectory() as d:
        s = Server("--model", args.model, "--count", "2", "--tenants", tenants_file(d), "--scheduling", scheduling,
                   log_name=f"bench-tenants-{scheduling}")
        try:
            return asyncio.run(phase(s.url, args, flood))
        finally:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--b-rate", type=float, default=0.5, help="B's requests per second")
    ap.add_argument("--flood", type=float, default=10, help="A's rate as a multiple of B's")
    ap.add_argument("--b-requests", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=256, help="words of each prompt (about as many tokens)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--warmup", type=float, default=10, help="seconds A floods before B starts")
    args = ap.parse_args()
    rows = [("B alone", run(args, "fair", False)), ("A floods, FIFO", run(args, "fifo", True)),
            ("A floods, fair", run(args, "fair", True))]
    solo = rows[0][1]["p99"]
    print("| phase | B ok | B failed | B TTFT p50 ms | B TTFT p99 ms | B TTFT mean ms | B p99 / solo | A completed "
          "| A completed/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['b_ok']} | {r['b_failed']} | {r['p50'] * 1e3:.0f} | {r['p99'] * 1e3:.0f} | "
              f"{r['mean'] * 1e3:.0f} | {r['p99'] / solo:.2f}x | {r['a_done']} | "
              f"{r['a_rate']:.2f} |")


if __name__ == "__main__":
    main()
