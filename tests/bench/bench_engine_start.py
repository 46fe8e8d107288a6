"""Engine start to ready, cold and warm: how long a new (or replacement) engine takes to serve.

Starts ``python -m engine_worker`` alone (no supervisor, no gateway) with a fresh cache directory
(``$XDG_CACHE_HOME``), so the first start is cold: it converts the GGUF and writes the weight cache.
The next ``--warm`` starts read it. Each start is timed from ``exec`` to the engine's Ready message
on its status pipe (what the supervisor waits for), and the engine's own log line splits off the
time spent before ``main`` ran (interpreter start and imports). A start with the weight cache off
(``ZSERVE_WEIGHT_CACHE=0``) is the old behaviour, measured in the same run.

    .venv/bin/python tests/bench/bench_engine_start.py [--model SmolLM2-135M-Instruct] [--warm 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from zserve.catalog import resolve  # noqa: E402
from zserve.launch_spec import EngineLaunch  # noqa: E402


def start_once(model: str, cache_home: str, weight_cache: bool) -> tuple[float, float]:
    """(exec → Ready on the status pipe, seconds the engine's log says loading took)."""
    source = resolve(model)
    r, w = os.pipe()
    env = {**os.environ, "XDG_CACHE_HOME": cache_home, "ZSERVE_WEIGHT_CACHE": "1" if weight_cache else "0"}
    with tempfile.TemporaryDirectory() as run:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine_worker", "--launch",
             EngineLaunch(0, f"ipc://{run}/e.sock", source).to_json(), "--status-fd", str(w)],
            cwd=ROOT, env=env, pass_fds=(w,), stderr=subprocess.PIPE, text=True)
        os.close(w)
        try:
            with os.fdopen(r, "rb", buffering=0) as status:
                while True:
                    line = status.readline()
                    if not line:
                        raise RuntimeError(f"engine exited before Ready: {proc.wait()}")
                    if b'"t":"ready"' in line:
                        break
            ready = time.monotonic() - t0
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=60)
    m = re.search(r"ready: .* in ([0-9.]+)s", err)
    return ready, float(m.group(1)) if m else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--warm", type=int, default=3, help="warm starts after the cold one")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache_home:
        rows = [("cold (empty cache)", *start_once(a.model, cache_home, True))]
        rows += [(f"warm {i + 1}", *start_once(a.model, cache_home, True)) for i in range(a.warm)]
        rows.append(("weight cache off", *start_once(a.model, cache_home, False)))
    print(f"\n{a.model}: engine exec → Ready\n\n| start | exec → Ready (s) | of which in main: load + KV (s) |")
    print("|---|---|---|")
    for name, ready, load in rows:
        print(f"| {name} | {ready:.2f} | {load:.2f} |")
    warm = [ready for name, ready, _ in rows if name.startswith("warm")]
    if warm:
        print(f"\nwarm median {statistics.median(warm):.2f} s; cold {rows[0][1]:.2f} s; cache off {rows[-1][1]:.2f} s")


if __name__ == "__main__":
    main()
