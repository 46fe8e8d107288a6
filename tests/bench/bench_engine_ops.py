"""What the engine operations cost while serving, and what sleep frees: resident memory of every engine before, asleep
and awake (levels 1 and 2), and a weight update's pause (admission held while every engine swaps) beside the cluster
state's own round trip in the same run (``POST /pause`` + ``/resume``: every gateway applies a version, no engine).

Usage:
    .venv/bin/python tests/bench/bench_engine_ops.py [--model SmolLM2-135M-Instruct] [--gateways 2] [--engines 2]
        [--rounds 5] [--streams 16]

A server (``launch api-server --count GATEWAYS --engines ENGINES``) is started; ``--streams`` streamed, sampled
(temperature 1.0) completions with 256-token prompts run throughout. Each round: sleep level 1 and wake, sleep level 2
and wake, update the weights to the served checkpoint again (a new version each time), pause and resume. Reported:
memory per level (MiB, from the engines' replies), and the median update pause and round trip (ms) with their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from zserve.catalog import resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.helpers

from tests.helpers import Server  # noqa: E402


def post(client: httpx.Client, path: str, body: dict | None = None) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = client.post(path, json=body)
    ms = (time.perf_counter() - t0) * 1000
    assert r.status_code == 200, r.text
    return r.json(), ms


def traffic(url: str, model: str, stop: threading.Event, failures: list[str]) -> None:
    with httpx.Client(base_url=url, timeout=600) as c:
        while not stop.is_set():
            with c.stream("POST", "/v1/completions", json={"model": model, "prompt": "tell me a story " * 64,
                                                           "max_tokens": 32, "stream": True}) as r:
                if r.status_code != 200:
                    failures.append(r.read().decode()[:200])
                for _ in r.iter_lines():
                    pass


def mib(n: int) -> str:
    return f"{n / (1 << 20):7.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--gateways", type=int, default=2)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=16)
    args = ap.parse_args()
    path = resolve(args.model).path
    server = Server("--count", str(args.gateways), "--engines", str(args.engines), "--model", args.model,
                    "--scaling-wait", "120", log_name="bench-engine-ops", ready_timeout=600)
    stop, failures = threading.Event(), []
    streams = [threading.Thread(target=traffic, args=(server.url, args.model, stop, failures), daemon=True)
               for _ in range(args.streams)]
    memory: dict[str, list[tuple[int, int, int]]] = {"level 1": [], "level 2": []}
    pauses, trips, updates, swaps = [], [], [], []
    try:
        with httpx.Client(base_url=server.url, timeout=1200) as c:
            for t in streams:
                t.start()
            time.sleep(2)  # (the streams reach the engines)
            for i in range(args.rounds):
                for level in (1, 2):
                    slept, _ = post(c, "/sleep", {"level": level})
                    woke, _ = post(c, "/wake_up")
                    for s, w in zip(slept["engines"], woke["engines"]):
                        memory[f"level {level}"].append((s["before"]["rss_bytes"], s["after"]["rss_bytes"],
                                                         w["after"]["rss_bytes"]))
                updated, ms = post(c, "/update_weights", {"path": path, "version": f"round-{i}"})
                pauses.append(updated["pause_s"] * 1000)
                swaps += [e["seconds"] * 1000 for e in updated["engines"]]  # each engine's swap itself
                updates.append(ms)
                _, p = post(c, "/pause")
                _, r = post(c, "/resume")
                trips.append(p + r)
    finally:
        stop.set()
        server.stop()
    print(f"{args.model}: {args.gateways} gateways, {args.engines} engines, {args.streams} streams, "
          f"{args.rounds} rounds; failed requests: {len(failures)}")
    for level, rows in memory.items():
        before, asleep, awake = (statistics.median(r[k] for r in rows) for k in range(3))
        print(f"  sleep {level}: resident MiB per engine  before {mib(before)}  asleep {mib(asleep)}  "
              f"awake {mib(awake)}  (freed {mib(before - asleep)})")
    pause, trip = statistics.median(pauses), statistics.median(trips)
    print(f"  update_weights: admission held median {pause:.1f} ms (the running requests finish on the old weights, "
          f"then each engine swaps: median {statistics.median(swaps):.1f} ms); whole call median "
          f"{statistics.median(updates):.1f} ms; pause+resume round trip {trip:.1f} ms; held / round trip = "
          f"{pause / trip:.2f}x")


if __name__ == "__main__":
    main()
