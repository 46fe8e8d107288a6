"""Elastic expert parallelism on the tiny random Mixtral: tokens/s at each group size, the pause of each resize,
and the idle CPU of the group, against the same model on one ordinary engine measured in the same run.

Usage (from the repository root, after ``make install-test``):
    .venv/bin/python tests/bench/bench_elastic_ep.py [--sizes 1 2 3 1] [--num-prompts 48] [--concurrency 8]

1. Baseline: ``launch api-server --engines 1`` (every expert in one engine): ``launch bench`` tokens/s.
2. ``--expert-parallel`` starting at the first size; at each further size ``POST /scale_elastic_ep`` (its
   ``pause_s``: admission stopped → resumed) and the same ``launch bench`` load, streamed and sampled (T=1.0).
3. At each size, the CPU all members spend over 5 idle seconds.

Also run by ``gpu_check.py`` (``run`` with ``--dtype float32`` on the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.e2e.moe_checkpoint import write_moe_checkpoint  # noqa: E402
from tests.helpers import LAUNCH, Server, procs  # noqa: E402

MODEL = "tiny-moe"


def tokens_per_s(url: str, num_prompts: int, concurrency: int, input_len: int, output_len: int) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([*LAUNCH, "bench", "--base-url", url, "--model", MODEL, "--num-prompts", str(num_prompts),
                        "--max-concurrency", str(concurrency), "--random-input-len", str(input_len),
                        "--random-output-len", str(output_len), "--ignore-eos", "--temperature", "1.0",
                        "--result-file", out.name], check=True, cwd=ROOT, capture_output=True)
        result = json.loads(Path(out.name).read_text())
    point = result["results"][0] if "results" in result else result
    return float(point["output_throughput"])


def idle_cpu(server: Server, seconds: float = 5.0) -> float:
    """CPU seconds the ready engines spend over ``seconds`` with no request."""
    pids = [p["pid"] for p in procs(server, "engine") if p["state"] == "ready"]
    before = sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)
    time.sleep(seconds)
    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids) - before


def run(sizes: list[int], num_prompts: int, concurrency: int, input_len: int, output_len: int,
        dtype: str = "float32") -> list[str]:
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        root = write_moe_checkpoint(Path(tmp) / MODEL)
        common = ["--model", str(root), "--count", "2", "--dtype", dtype, "--max-model-len", "2048"]

        def baseline() -> float:
            base = Server(*common, "--engines", "1", log_name="ep-bench-base")
            try:
                tokens_per_s(base.url, 16, concurrency, input_len, output_len)  # warm-up
                return tokens_per_s(base.url, num_prompts, concurrency, input_len, output_len)
            finally:
                base.stop()

        first = baseline()
        rows = []
        ep = Server(*common, "--expert-parallel", "--engines", str(sizes[0]), log_name="ep-bench")
        try:
            for i, size in enumerate(sizes):
                pause = "-"
                if i:
                    r = httpx.post(ep.url + "/scale_elastic_ep", json={"new_data_parallel_size": size},
                                   timeout=600)
                    r.raise_for_status()
                    pause = f"{r.json()['pause_s'] * 1000:.0f} ms"
                tokens_per_s(ep.url, 16, concurrency, input_len, output_len)  # warm-up
                tok = tokens_per_s(ep.url, num_prompts, concurrency, input_len, output_len)
                rows.append((size, tok, pause, idle_cpu(ep)))
        finally:
            ep.stop()
        last = baseline()  # again, so that drift during the run shows
    base = (first + last) / 2
    lines.append(f"baseline, one engine holding every expert: {first:.1f} tok/s before, {last:.1f} after")
    lines.append("| group size | tok/s | vs baseline (mean) | pause of the resize to it | idle CPU, all members, 5 s |")
    lines.append("|---|---|---|---|---|")
    lines += [f"| {size} | {tok:.1f} | {tok / base:.2f}x | {pause} | {idle:.3f} CPU-s |"
              for size, tok, pause, idle in rows]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 1])
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    print(f"{os.cpu_count()} CPUs; {a.num_prompts} requests, {a.concurrency} concurrent, {a.input_len} prompt + "
          f"{a.output_len} output tokens, streamed, T=1.0")
    for line in run(a.sizes, a.num_prompts, a.concurrency, a.input_len, a.output_len, a.dtype):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
