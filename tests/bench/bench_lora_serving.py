"""Mixed-adapter serving throughput: a real server's tokens/s with requests spread over LoRA adapters beside the
same traffic on the base model, in the same run.

Usage:
    .venv/bin/python tests/bench/bench_lora_serving.py [--model SmolLM2-135M-Instruct] [--adapters 8] [--rank 16]
        [--max-loras 8 2] [--concurrency 32] [--num-prompts 96] [--input-len 256] [--output-len 64]

Adapters of rank ``--rank`` on every projection are written with random weights (``bench_lora.write_adapter``).
For each ``--max-loras`` value a server (``launch api-server --count 2``, every adapter given with
``--lora-modules``) is started, and ``launch bench`` drives it twice with the traffic users send (streamed, sampled
at temperature 1.0, ``--concurrency`` requests in flight, random prompts of ``--input-len`` tokens): once on the base
model, once with each request through one of the adapters (``launch bench --lora-modules``). Reported: output
tokens/s of both and their ratio, per ``--max-loras``, and how many times the mixed run copied an adapter into a compute
slot (``zserve_engine_lora_slot_fills_total``: evictions, when the traffic uses more adapters than ``--max-loras``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from bench_lora import write_adapter

from zserve.catalog import resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.helpers

from tests.helpers import LAUNCH, ROOT, Server  # noqa: E402


def bench(url: str, out: Path, args: argparse.Namespace, *extra: str) -> float:
    """Output tokens/s of one ``launch bench`` load point."""
    subprocess.run([*LAUNCH, "bench", "--base-url", url, "--no-progress", "--num-prompts", str(args.num_prompts),
                    "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                    "--max-concurrency", str(args.concurrency), "--ignore-eos", "--result-file", str(out), *extra],
                   cwd=ROOT, check=True, capture_output=True, timeout=1800)
    point = json.loads(out.read_text())["results"][0]
    assert point["completed"] == args.num_prompts, point
    return point["output_throughput"]


def slot_fills(url: str) -> float:
    """Adapters copied into a --max-loras compute slot so far, over every engine (``/metrics``)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("zserve_engine_lora_slot_fills_total{"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, nargs="+", default=[8, 2])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    import torch

    from engine_worker.loader import load_model  # the base model's shapes, for the adapters' tensors

    cfg = load_model(resolve(args.model), torch.float32, torch.device("cpu")).config
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"lora{i}" for i in range(args.adapters)]
        modules = [f"{n}={write_adapter(Path(tmp) / n, cfg, args.rank, seed=i)}" for i, n in enumerate(names)]
        for max_loras in args.max_loras:
            server = Server("--model", args.model, "--count", "2", "--max-loras", str(max_loras),
                            "--max-lora-rank", str(args.rank), "--lora-modules", *modules,
                            log_name=f"bench-lora-{max_loras}")
            try:
                base = bench(server.url, Path(tmp) / "base.json", args, "--model", args.model)
                fills = slot_fills(server.url)
                mixed = bench(server.url, Path(tmp) / "mixed.json", args,
                              *(a for n in names for a in ("--lora-modules", n)))
                fills = slot_fills(server.url) - fills
            finally:
                server.stop()
            rows.append((max_loras, base, mixed, fills))
    print(f"{args.model}, {args.adapters} adapters of rank {args.rank} on every projection, concurrency "
          f"{args.concurrency}, {args.num_prompts} requests of {args.input_len} + {args.output_len} tokens, "
          "streamed, temperature 1.0")
    print("| --max-loras | base tok/s | mixed adapters tok/s | ratio | slot fills (mixed run) |\n|---|---|---|---|---|")
    for max_loras, base, mixed, fills in rows:
        print(f"| {max_loras} | {base:.1f} | {mixed:.1f} | {mixed / base:.2f}x | {fills:.0f} |")


if __name__ == "__main__":
    main()
