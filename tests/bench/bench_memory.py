"""Memory of a running server: every process of `launch api-server ARGS`, by role, after it served a few
requests of each model it serves (so lazily built state is counted).

    .venv/bin/python tests/bench/bench_memory.py                      # what `make run` serves
    .venv/bin/python tests/bench/bench_memory.py --model SmolLM2-135M-Instruct   # the chat model alone

RSS counts shared pages (torch's libraries, the weight cache's mapped files) once per process; PSS
splits each shared page among the processes that map it, so the PSS total is what the server costs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import Server  # noqa: E402

MIB = 1 << 20


def exercise(url: str) -> None:
    """One chat and one embedding request per model that does them (a 400 for the other task is fine)."""
    for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]:
        if "generate" in m["tasks"]:
            httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "model": m["id"], "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}]})
        if "embed" in m["tasks"]:
            httpx.post(url + "/v1/embeddings", json={"model": m["id"], "input": ["hello"] * 8}, timeout=120)


def role(p: psutil.Process) -> str:
    title = " ".join(p.cmdline()).strip()
    return title.removeprefix("zserve: ") if title.startswith("zserve: ") else "supervisor"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="as launch api-server takes it (default: make run's two)")
    ap.add_argument("--count", default="2")
    a, rest = ap.parse_known_args()
    models = a.model or ["SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"]
    args = ["--count", a.count, *[x for m in models for x in ("--model", m)], *rest]
    server = Server(*args, log_name="bench-memory")
    try:
        exercise(server.url)
        root = psutil.Process(server.proc.pid)
        rows = []
        for p in [root, *root.children(recursive=True)]:
            mem = p.memory_full_info()
            rows.append((role(p), p.pid, mem.rss / MIB, mem.pss / MIB))
        print(f"launch api-server {' '.join(args)}")
        print(f"{'process':28} {'pid':>7} {'RSS MiB':>9} {'PSS MiB':>9}")
        for name, pid, rss, pss in sorted(rows):
            print(f"{name:28} {pid:>7} {rss:9.0f} {pss:9.0f}")
        print(f"{'total':28} {'':>7} {sum(r[2] for r in rows):9.0f} {sum(r[3] for r in rows):9.0f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
