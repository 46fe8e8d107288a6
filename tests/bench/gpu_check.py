"""One script for a machine with a GPU: check the CUDA decode paths, then time them.

Usage (on the GPU machine, from the repository root, after ``make install-test``):
    .venv/bin/python tests/bench/gpu_check.py [--concurrency 1 8 32] [--new-tokens 128]

1. Correctness, float32: the same greedy requests through three engines that differ only in
   decode attention — torch's gather path, the Triton paged kernel, Triton inside CUDA graphs —
   must give the same tokens (and the engine's own start-up self-checks must have passed).
2. Speed, the serving dtype: tokens/s of the Triton + CUDA-graph engine against the same engine
   with ``--enforce-eager`` and against the gather path, in one run, at each concurrency.

Exits 1 if a check fails. On a machine without CUDA it runs the same code on the CPU (graphs
emulated), which only checks that the script itself works.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import make_workload, run_zserve  # noqa: E402

from engine_worker.device import resolve_dtype, select_device  # noqa: E402
from engine_worker.loader import load_model  # noqa: E402
from engine_worker.runner import ModelRunner  # noqa: E402
from engine_worker.scheduler import Scheduler, run_until_done  # noqa: E402
from engine_worker.sequence import Sequence  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from zserve.catalog import resolve  # noqa: E402


def engine(loaded, device, dtype, max_seqs: int, variant: str) -> ModelRunner:
    """variant: "gather" (torch path), "triton" (eager), "graphs" (Triton + CUDA graphs)."""
    return ModelRunner(loaded, device, dtype, max_num_seqs=max_seqs, max_model_len=1024,
                       cuda_graphs=variant == "graphs", attention="gather" if variant == "gather" else None)


def greedy_tokens(runner: ModelRunner, work) -> list[list[int]]:
    sched = Scheduler(runner, runner.max_num_seqs, 512)
    for i, (prompt, n) in enumerate(work):
        sched.add(Sequence(f"r{i}", list(prompt), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
    outs = run_until_done(sched)
    return [[t for o in outs[f"r{i}"] for t in o.new_token_ids] for i in range(len(work))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    device = select_device(None)
    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'no CUDA'}), "
          f"torch {torch.__version__}")
    failed = False

    # 1. correctness in float32
    loaded = load_model(resolve(args.model), torch.float32, device)
    work = make_workload(8, 48, 48, seed=7)
    runs = {}
    for variant in ("gather", "triton", "graphs"):
        runner = engine(loaded, device, torch.float32, 8, variant)
        print(f"  {variant:7s}: attention = {runner.attention_backend}")
        if variant == "graphs" and runner.graphs is None:
            print("  FAIL: CUDA graphs were not enabled (see the warning above)")
            failed = True
        if variant != "gather" and device.type == "cuda" and runner.attention.name != "triton":
            print("  FAIL: the Triton kernel failed its self-check")
            failed = True
        runs[variant] = greedy_tokens(runner, work)
        del runner
    for variant in ("triton", "graphs"):
        same = sum(a == b for a, b in zip(runs[variant], runs["gather"]))
        print(f"  {variant} vs gather, float32 greedy: {same}/{len(work)} requests identical")
        failed |= same != len(work)

    # 2. speed in the serving dtype
    dtype = resolve_dtype("auto", device)
    loaded = load_model(resolve(args.model), dtype, device)
    max_c = max(args.concurrency)
    print(f"\n| concurrency | graphs tok/s | eager (Triton) tok/s | gather tok/s | graphs / eager |   ({dtype})")
    print("|---|---|---|---|---|")
    runners = {v: engine(loaded, device, dtype, max_c, v) for v in ("graphs", "triton", "gather")}
    for c in args.concurrency:
        load = make_workload(c, args.new_tokens, args.new_tokens, seed=0)
        run_zserve(runners["graphs"], make_workload(c, 4, 4, seed=1), max_c, 512)  # warm-up
        tok = {v: run_zserve(r, load, max_c, 512)["tok_s"] for v, r in runners.items()}
        print(f"| {c} | {tok['graphs']:.1f} | {tok['triton']:.1f} | {tok['gather']:.1f} | "
              f"{tok['graphs'] / tok['triton']:.2f}x |")
    print("\nFAILED" if failed else "\nall checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
