"""Tenants' limits: how exact they are across gateways and hosts, and what a check costs.

Usage:
    .venv/bin/python tests/bench/bench_quota.py [--window 30] [--rpm 600] [--overload 3]

1. Accuracy: one host with 4 gateways, then two hosts of 2 gateways each sharing a Redis (started here), tiny-random
   engines, a tenant with ``--rpm`` requests per minute. Its burst is spent first, then ``--overload`` times its rate
   arrives for ``--window`` seconds (a new connection per request, so the kernel spreads them over every gateway, and
   alternating hosts); reported: requests that passed against rate x window, and the error.
2. Cost: microseconds per admit + charge + release of one tenant with all three limits, in one process, for this
   host's shared-memory store and for Redis (loopback); and CPU microseconds per request of the gateway's whole
   tenant layer on this host's store (``gateway.tenancy``: admission, the prompt and output charges, the metrics, the
   six headers, the release), the part of a request's gateway CPU the tenants file adds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.helpers

from gateway.quota import HostQuota, RedisQuota, Rules  # noqa: E402
from tests.helpers import TINY, Server, free_port, start_redis, stop_process, wait_until  # noqa: E402
from zserve.tenants import key_digest  # noqa: E402

KEY = "sk-bench-quota-key"


def complete(url: str) -> int:
    return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}", "Connection": "close"},
                      json={"model": "tiny-random", "prompt": "hi", "max_tokens": 1}, timeout=60).status_code


def accuracy(urls: list[str], args: argparse.Namespace) -> tuple[int, float]:
    wait_until(lambda: all(complete(u) == 429 for u in urls), 120, 0.0, "the burst to run out")
    offered, senders = args.overload * args.rpm / 60, 8
    codes: list[int] = []
    start = time.monotonic()

    def sender(k: int, n: int) -> None:
        for i in range(n):
            time.sleep(max(0.0, start + (i * senders + k) / offered - time.monotonic()))
            codes.append(complete(urls[(i + k) % len(urls)]))

    threads = [threading.Thread(target=sender, args=(k, int(args.window * offered / senders))) for k in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes.count(200), args.rpm / 60 * args.window


async def cost(quota, n: int) -> float:
    rules = Rules(6e9, 6e12, 1 << 30)
    for _ in range(50):
        v = await quota.admit("bench", rules)
        await quota.release(v.lease)
    t0 = time.perf_counter()
    for _ in range(n):
        v = await quota.admit("bench", rules)
        await quota.charge("bench", rules, 10)
        await quota.release(v.lease)
    return (time.perf_counter() - t0) / n * 1e6


async def layer_cost(directory: str, n: int) -> float:
    """CPU µs per request of the gateway's tenant layer (what the admission middleware and the engine client call)."""
    from prometheus_client import CollectorRegistry

    from gateway.tenancy import Tenancy, TenantMetrics
    from zserve.tenants import Tenant

    tenancy = Tenancy(HostQuota(directory, 0), TenantMetrics(CollectorRegistry()))
    tenant = Tenant("bench", requests_per_minute=6e9, tokens_per_minute=6e12, max_concurrent=1 << 30)

    async def one(i: int) -> None:
        served = await tenancy.admit(tenant)
        served.prompt(300)
        served.generated(16)
        served.queued(0.001)
        served.headers()
        served.ended()
        if i % 16 == 0:
            await asyncio.sleep(0)  # (the batched charges flush between requests, as in a serving event loop)

    for i in range(200):
        await one(i)
    t0 = time.process_time()
    for i in range(n):
        await one(i)
    await tenancy.close()
    return (time.process_time() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--rpm", type=float, default=600)
    ap.add_argument("--overload", type=float, default=3.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tenants = Path(d) / "tenants.toml"
        tenants.write_text(f'[[tenant]]\nname = "t"\nkey_sha256 = ["{key_digest(KEY)}"]\n'
                           f"requests_per_minute = {args.rpm:g}\n")
        port = free_port()
        redis = start_redis(port, Path(d))
        url = f"redis://127.0.0.1:{port}/0"
        rows = []
        try:
            s = Server(*TINY, "--count", "4", "--tenants", str(tenants), log_name="bench-quota")
            try:
                rows.append(("1 host, 4 gateways", *accuracy([s.url], args)))
            finally:
                s.stop()
            a = Server(*TINY, "--count", "2", "--state-url", url, "--tenants", str(tenants), log_name="bench-quota-a")
            b = Server(*TINY, "--count", "2", "--state-url", url, "--tenants", str(tenants), log_name="bench-quota-b")
            try:
                rows.append(("2 hosts x 2 gateways, Redis", *accuracy([a.url, b.url], args)))
            finally:
                a.stop()
                b.stop()
            (Path(d) / "q").mkdir()
            host_us = asyncio.run(cost(HostQuota(str(Path(d) / "q"), 0), 20000))

            async def redis_cost() -> float:
                q = RedisQuota(url, "bench", HostQuota(str(Path(d) / "q"), 0))
                try:
                    return await cost(q, 3000)
                finally:
                    await q.close()

            redis_us = asyncio.run(redis_cost())
            layer_us = asyncio.run(layer_cost(str(Path(d) / "q"), 20000))
        finally:
            stop_process(redis)
    print(f"{args.overload:g}x the rate of {args.rpm:g}/min offered for {args.window:g} s after the burst")
    print("| setup | passed | expected | error |")
    print("|---|---|---|---|")
    for name, passed, expected in rows:
        print(f"| {name} | {passed} | {expected:.0f} | {(passed - expected) / expected:+.1%} |")
    print(f"\nadmit + charge + release: this host's store {host_us:.1f} µs, Redis (loopback) {redis_us:.0f} µs")
    print(f"the gateway's tenant layer, per request (this host's store): {layer_us:.1f} CPU µs")


if __name__ == "__main__":
    main()
