"""What a LoRA load costs while serving: from ``POST /v1/load_lora_adapter`` to its answer (every engine of the model
loaded the adapter, every gateway serves it), beside the cluster state's own round trip in the same run (``POST
/pause`` + ``/resume``: every gateway applies a new version and acknowledges it, no engine involved).

Usage:
    .venv/bin/python tests/bench/bench_lora_load.py [--model SmolLM2-135M-Instruct] [--gateways 2] [--engines 2]
        [--rank 16] [--rounds 10] [--busy]

A server (``launch api-server --count GATEWAYS --engines ENGINES --enable-lora --lora-dir DIR``) is started; adapters
of rank ``--rank`` on every projection are written into DIR (``bench_lora.write_adapter``). Each round loads a fresh
adapter, unloads it, then pauses and resumes admission. With ``--busy``, 16 streamed requests of the base model run
throughout (the engines read the adapter between two of their steps). Reported: median and p90 of each, in ms, and
the load's median over the pause's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from bench_lora import write_adapter

from zserve.catalog import resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.helpers

from tests.helpers import Server  # noqa: E402


def timed(client: httpx.Client, path: str, body: dict | None = None) -> float:
    t0 = time.perf_counter()
    r = client.post(path, json=body)
    ms = (time.perf_counter() - t0) * 1000
    assert r.status_code == 200, r.text
    return ms


def busy(url: str, model: str, stop: threading.Event) -> None:
    """Base-model traffic: one streamed request after another until ``stop``."""
    with httpx.Client(base_url=url, timeout=300) as c:
        while not stop.is_set():
            with c.stream("POST", "/v1/completions", json={"model": model, "prompt": "hello " * 64,
                                                           "max_tokens": 64, "stream": True}) as r:
                for _ in r.iter_lines():
                    pass


def summary(ms: list[float]) -> str:
    q = statistics.quantiles(ms, n=10) if len(ms) >= 2 else ms * 9
    return f"median {statistics.median(ms):7.1f} ms  p90 {q[-1]:7.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--gateways", type=int, default=2)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--busy", action="store_true", help="base-model traffic throughout (16 streams)")
    args = ap.parse_args()
    import torch

    from engine_worker.loader import load_model  # (the model's config, for the adapters' shapes)

    cfg = load_model(resolve(args.model), torch.float32, torch.device("cpu")).config
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i in range(args.rounds):
            write_adapter(root / f"a{i}", cfg, args.rank, seed=i)
        size = sum(f.stat().st_size for f in (root / "a0").iterdir()) / (1 << 20)
        server = Server("--count", str(args.gateways), "--engines", str(args.engines), "--model", args.model,
                        "--enable-lora", "--max-loras", "2", "--lora-dir", str(root), log_name="bench-lora-load",
                        ready_timeout=600)
        stop = threading.Event()
        traffic = [threading.Thread(target=busy, args=(server.url, args.model, stop), daemon=True)
                   for _ in range(16 if args.busy else 0)]
        for t in traffic:
            t.start()
        loads, unloads, pauses = [], [], []
        try:
            with httpx.Client(base_url=server.url, timeout=600) as c:
                for i in range(args.rounds):
                    loads.append(timed(c, "/v1/load_lora_adapter", {"lora_name": f"a{i}", "lora_path": f"a{i}"}))
                    unloads.append(timed(c, "/v1/unload_lora_adapter", {"lora_name": f"a{i}"}))
                    pauses.append(timed(c, "/pause") + timed(c, "/resume"))
        finally:
            stop.set()
            server.stop()
    print(f"{args.model}: {args.gateways} gateways, {args.engines} engines, adapters of rank {args.rank} on every "
          f"projection ({size:.1f} MiB each), {args.rounds} rounds{', 16 streams running' if args.busy else ''}")
    print(f"  load (request -> every engine has it, every gateway serves it)  {summary(loads)}")
    print(f"  unload                                                          {summary(unloads)}")
    print(f"  pause + resume (the cluster state's round trip, baseline)       {summary(pauses)}")
    print(f"  load / pause+resume: {statistics.median(loads) / statistics.median(pauses):.2f}x")


if __name__ == "__main__":
    main()
