"""Failover figures for the supervisor: how fast an engine's death is seen, and how fast it is replaced.

Starts `launch api-server --engines 2`, runs 4 long streams, kills the engine serving the most,
and reports (over --rounds rounds):
  - death → error event on each stream that was on the dead engine (client-side clock), with migration off
    (``--migration-limit 0``; with it on, the streams move instead: ``bench_migration.py`` times that);
  - death → the replacement engine ready (as `launch status` reports it);
  - death → the replacement engine answering a request routed to it.
Then scales gateways 2→3→1 and engines 1→2→1 under a client loop and reports failed requests.

    .venv/bin/python tests/bench/bench_failover.py --model tiny-random --rounds 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.helpers import LAUNCH, Server, StreamResult, procs, run_stream, stream_body, wait_until  # noqa: E402


def _loaded(s: Server) -> list[dict] | None:
    e = procs(s, "engine")
    return e if sum(p.get("running", 0) for p in e) >= 4 else None


def one_round(s: Server, model: str) -> tuple[list[float], float, float]:
    results = [StreamResult() for _ in range(4)]
    body = {**stream_body(100000), "model": model, "max_tokens": 1500}
    threads = [threading.Thread(target=run_stream, args=(s.url, body, r)) for r in results]
    for t in threads:
        t.start()
    wait_until(lambda: all(r.chunks > 2 for r in results), 60, what="streams")
    engines = wait_until(lambda: _loaded(s), 15, what="engines to report the streams")
    victim = max(engines, key=lambda p: p.get("running", 0))
    t0 = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until(lambda: any(p["index"] == victim["index"] and p["state"] == "ready" and p["pid"] != victim["pid"]
                           for p in procs(s, "engine")), 120, interval=0.02)
    ready = time.monotonic() - t0
    # the replacement takes traffic: send until its generated-token counter moves
    import httpx

    def served() -> bool:
        httpx.post(s.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=60)
        text = httpx.get(s.url + "/metrics").text
        key = f'zserve_engine_generated_tokens_total{{engine="{victim["index"]}",model="{victim["model"]}"}}'
        return any(line.startswith(key) and float(line.split()[-1]) > 0 for line in text.splitlines())

    wait_until(served, 120, interval=0.0)
    serving = time.monotonic() - t0
    for t in threads:
        t.join(300)
    fails = [r.ended_at - t0 for r in results if r.error]
    return fails, ready, serving


def scaling(s: Server, model: str) -> list[tuple[str, int, int]]:
    import httpx

    out = []
    stop = threading.Event()
    tally = {"ok": 0, "failed": 0}

    def load():
        while not stop.is_set():
            with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as c:
                try:
                    r = c.post(s.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 16})
                    tally["ok" if r.status_code == 200 else "failed"] += 1
                except httpx.HTTPError:
                    tally["failed"] += 1

    clients = [threading.Thread(target=load) for _ in range(3)]
    for c in clients:
        c.start()
    for tier, n in [("api-server", 3), ("api-server", 1), ("engine", 2), ("engine", 1), ("api-server", 2)]:
        before = dict(tally)
        subprocess.run([*LAUNCH, "scale", tier, str(n), "--port", str(s.port)], cwd=ROOT, check=True,
                       capture_output=True)
        time.sleep(1.0)  # keep the load running a moment after the tier reached its size
        out.append((f"{tier} → {n}", tally["ok"] - before["ok"], tally["failed"] - before["failed"]))
    stop.set()
    for c in clients:
        c.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    s = Server("--count", "2", "--engines", "2", "--model", a.model, "--dtype", "float32", "--migration-limit", "0",
               log_name="bench-failover")
    try:
        fails, ready, serving = [], [], []
        for _ in range(a.rounds):
            f, r, sv = one_round(s, _model(s))
            fails += f
            ready.append(r)
            serving.append(sv)
        s.stop()
        s = Server("--count", "2", "--model", a.model, "--dtype", "float32", log_name="bench-scaling")
        steps = scaling(s, _model(s))
    finally:
        s.stop()
    print(f"\nmodel {a.model}, {a.rounds} engine kills, 4 streams each")
    print(f"death → error on its streams: n={len(fails)} median {statistics.median(fails) * 1000:.0f} ms, "
          f"max {max(fails) * 1000:.0f} ms")
    print(f"death → replacement ready:    median {statistics.median(ready):.2f} s, max {max(ready):.2f} s")
    print(f"death → replacement serving:  median {statistics.median(serving):.2f} s, max {max(serving):.2f} s")
    print("scaling step                 ok  failed")
    for name, ok, failed in steps:
        print(f"{name:26} {ok:5} {failed:7}")


def _model(s: Server) -> str:
    import httpx

    return httpx.get(s.url + "/v1/models").json()["data"][0]["id"]


if __name__ == "__main__":
    main()
