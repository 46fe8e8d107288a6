"""Figures of tiers on several hosts, each against a baseline measured in the same run:

1. requests/s through HAProxy (deploy/haproxy/haproxy.cfg) with 1 and then 2 gateway hosts in front of one
   engine host over TCP + CURVE (`launch bench`: streamed, sampled at T=1.0, concurrent);
2. the latency a request pays for TCP + CURVE: p50/p99 of a 1-token completion through a gateway host whose
   engine is on an engine host, against one host whose engine is on ipc:// (alternating, one at a time);
3. the rolling restart's duration (`launch reload` of a host of 2 gateways + 1 engine) under streamed load,
   with the requests that failed meanwhile.

All hosts are processes on this machine (separate supervisors on their own ports), so (1) shows the cost of
the extra hop and the shared cores rather than a speed-up from more machines.

    .venv/bin/python tests/bench/bench_hosts.py --requests 400 --latency-requests 300
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.helpers import LAUNCH, Server, Traffic, engine_host_ports, free_port, free_ports, wait_until  # noqa: E402

MODEL = ("--model", "tiny-random", "--dtype", "float32")


def bench(url: str, n: int, concurrency: int, out: Path) -> dict:
    subprocess.run([*LAUNCH, "bench", "--base-url", url, "--model", "tiny-random", "--num-prompts", str(n),
                    "--random-input-len", "256", "--random-output-len", "32", "--max-concurrency", str(concurrency),
                    "--temperature", "1.0", "--result-file", str(out), "--no-progress"], cwd=ROOT, check=True,
                   capture_output=True, timeout=1800)
    return json.loads(out.read_text())["results"][0]


def haproxy(hosts: list[str], tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "ZSERVE_LB_BIND": f"127.0.0.1:{port}", "ZSERVE_LB_ADMIN_SOCKET": str(tmp / f"lb-{port}.sock"),
           "ZSERVE_HOST_1": hosts[0], "ZSERVE_HOST_2": hosts[-1]}
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(ROOT / "deploy/haproxy/haproxy.cfg")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 30, 0.1, "HAProxy")
    return proc, url


def one_token_latencies(url: str, n: int, client: httpx.Client) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        r = client.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": f"hi {i}", "max_tokens": 1})
        r.raise_for_status()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400, help="requests per HAProxy load point")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="HAProxy load points of each kind, alternated")
    p.add_argument("--latency-requests", type=int, default=300, help="1-token requests per side")
    a = p.parse_args()
    if shutil.which("haproxy") is None:
        sys.exit("haproxy is not installed")
    tmp = Path(tempfile.mkdtemp(prefix="bench-hosts-"))
    assert subprocess.run([*LAUNCH, "keys", "--dir", str(tmp / "keys")], capture_output=True).returncode == 0
    keys = str(tmp / "keys")
    servers: list[Server] = []
    procs: list[subprocess.Popen] = []
    try:
        port = free_ports(engine_host_ports())
        eng = Server(command=[*LAUNCH, "engine", *MODEL, "--count", "1", "--bind", f"tcp://127.0.0.1:{port}",
                              "--keys", keys], log_name="bench-engine-host")
        servers.append(eng)
        gw = [Server(*MODEL, "--count", "1", "--engine", eng.url, "--keys", keys, log_name=f"bench-gw-{i}")
              for i in range(2)]
        servers += gw
        local = Server(*MODEL, "--count", "1", log_name="bench-one-host")
        servers.append(local)

        # 1. HAProxy with one gateway host, then two (each point after a warm-up).
        results = {}
        points = [("1 gateway host", [gw[0].url] * 2), ("2 gateway hosts", [g.url for g in gw])] * a.rounds
        for i, (name, backends) in enumerate(points):
            lb, url = haproxy([b.removeprefix("http://") for b in backends], tmp)
            procs.append(lb)
            bench(url, 32, a.concurrency, tmp / "warm.json")
            results.setdefault(name, []).append(bench(url, a.requests, a.concurrency, tmp / f"{i}.json"))
            lb.terminate()
            lb.wait(10)
        base = statistics.median(r["request_throughput"] for r in results["1 gateway host"])
        print("HAProxy, tiny-random, streamed, T=1.0, 256-token prompts, 32 tokens out, "
              f"concurrency {a.concurrency}, {a.requests} requests a point, points alternated, medians:")
        for name, rs in results.items():
            rps = statistics.median(r["request_throughput"] for r in rs)
            each = ", ".join(f"{r['request_throughput']:.1f}" for r in rs)
            p50 = statistics.median(r["e2el_ms"]["p50"] for r in rs)
            print(f"  {name}: {rps:.1f} req/s ({rps / base:.2f}x) [{each}], failed {sum(r['failed'] for r in rs)}, "
                  f"e2e p50 {p50:.0f} ms")

        # 2. 1-token latency, ipc:// against TCP + CURVE, alternating in blocks of 50.
        lat = {"ipc": [], "tcp+curve": []}
        with httpx.Client(timeout=60) as c:
            for u in (local.url, gw[0].url):
                one_token_latencies(u, 20, c)  # warm
            for _ in range(max(1, a.latency_requests // 50)):
                lat["ipc"] += one_token_latencies(local.url, 50, c)
                lat["tcp+curve"] += one_token_latencies(gw[0].url, 50, c)
        print(f"1-token completion, {len(lat['ipc'])} requests each, one at a time:")
        for k, xs in lat.items():
            print(f"  {k}: p50 {pct(xs, 50):.2f} ms, p99 {pct(xs, 99):.2f} ms")
        print(f"  TCP + CURVE adds p50 {pct(lat['tcp+curve'], 50) - pct(lat['ipc'], 50):+.2f} ms, "
              f"p99 {pct(lat['tcp+curve'], 99) - pct(lat['ipc'], 99):+.2f} ms")

        # 3. Rolling restart of the one-host server under streamed load.
        with Traffic(local.url, "tiny-random", workers=4) as traffic:
            t0 = time.monotonic()
            r = subprocess.run([*LAUNCH, "reload", "--port", str(local.port)], cwd=ROOT, capture_output=True,
                               text=True, timeout=600)
            took = time.monotonic() - t0
        print(f"rolling restart (2 processes: 1 gateway, 1 engine): {took:.1f}s by the client "
              f"({r.stdout.strip()}); {traffic.ok} requests served, {len(traffic.failed)} failed")
    finally:
        for lb in procs:
            if lb.poll() is None:
                lb.terminate()
        for s in reversed(servers):
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
