"""What an open web console costs the gateway it polls (issue 33): `launch api-server --model tiny-random --count 1`,
the gateway's CPU time (utime + stime from /proc) over equal windows, idle:

1. before any console was opened (nothing is sampled);
2. after one: the gateway samples the cluster's load every second (``gateway.series``), nobody polling;
3. one open page: what the page asks, as it asks it (``/ui/api/series?since=…`` every second, ``/server_info`` and
   ``/status`` every 2 s), over one keep-alive connection;
4. four open pages at once.

Each window is repeated (``--rounds``), medians reported: % of one core, and the CPU per poll of a page above the
sampling alone. Rerun with:

    .venv/bin/python tests/bench/bench_console.py --window 30 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench.procstat import cpu_seconds, find_titled  # noqa: E402
from tests.helpers import TINY, Server  # noqa: E402


def page(url: str, stop: threading.Event, polls: list[int]) -> None:
    """One open console: the requests its cluster view makes, on its schedule."""
    since, tick = 0.0, 0
    with httpx.Client(timeout=30) as client:
        next_at = time.monotonic()
        while not stop.is_set():
            samples = client.get(url + "/ui/api/series", params={"since": since}).json()["samples"]
            if samples:
                since = samples[-1]["t"]
            polls[0] += 1
            if tick % 2 == 0:
                client.get(url + "/server_info")
                client.get(url + "/status")
                polls[0] += 2
            tick += 1
            next_at += 1.0
            stop.wait(max(0.0, next_at - time.monotonic()))


def window(gateway: int, seconds: float, url: str | None = None, pages: int = 0) -> tuple[float, int]:
    """The gateway's CPU seconds over ``seconds`` with ``pages`` consoles open, and the requests they made."""
    stop, polls = threading.Event(), [0]
    threads = [threading.Thread(target=page, args=(url, stop, polls)) for _ in range(pages)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # (the pages' first requests, outside the window)
    c0, n0 = cpu_seconds(gateway), polls[0]
    time.sleep(seconds)
    cpu, n = cpu_seconds(gateway) - c0, polls[0] - n0
    stop.set()
    for t in threads:
        t.join()
    return cpu, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=float, default=30.0, help="seconds per measured window")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    server = Server("--count", "1", *TINY, log_name="bench-console")
    try:
        gateway = find_titled(server.proc.pid, "zserve: gateway ")["zserve: gateway 0"]
        rows: dict[str, list[tuple[float, int]]] = {"idle, no console opened yet": []}
        for _ in range(args.rounds):
            rows["idle, no console opened yet"].append(window(gateway, args.window))
        httpx.get(server.url + "/ui/api/series")  # a console opened: sampling starts
        for _ in range(args.rounds):
            for name, pages in [("sampling, no page polling", 0), ("1 open page", 1), ("4 open pages", 4)]:
                rows.setdefault(name, []).append(window(gateway, args.window, server.url, pages))
    finally:
        server.stop()
    base = statistics.median(c for c, _ in rows["sampling, no page polling"])
    print(f"gateway CPU over {args.window:.0f} s windows, {args.rounds} rounds (medians); tiny-random, 1 gateway, idle")
    print(f"{'':28} {'% of a core':>11} {'requests':>9} {'µs per request':>15}")
    for name, got in rows.items():
        cpu = statistics.median(c for c, _ in got)
        n = statistics.median(k for _, k in got)
        per = f"{(cpu - base) / n * 1e6:15.0f}" if n else f"{'':>15}"
        print(f"{name:28} {cpu / args.window * 100:10.2f}% {n:9.0f} {per}")
    print("(µs per request: the gateway CPU above sampling alone, per request the pages made: a series poll a second, "
          "/server_info and /status every 2 s)")


if __name__ == "__main__":
    main()
