"""One script for a machine with a GPU: check the CUDA decode paths, then time them.

Usage (on the GPU machine, from the repository root, after ``make install-test``):
    .venv/bin/python tests/bench/gpu_check.py [--concurrency 1 8 32] [--new-tokens 128]

1. Correctness, float32: the same greedy requests through three engines that differ only in
   decode attention — torch's gather path, the Triton paged kernel, Triton inside CUDA graphs —
   must give the same tokens (and the engine's own start-up self-checks must have passed).
2. Speed, the serving dtype: tokens/s of the Triton + CUDA-graph engine against the same engine
   with ``--enforce-eager`` and against the gather path, in one run, at each concurrency.
3. Expert parallelism (``--sections ep``): a tiny random Mixtral served by ``launch api-server
   --expert-parallel --engines 2`` (NCCL when each member has a GPU, gloo through host memory when they
   share one) must give the greedy fp32 tokens of one process holding every expert on the device; then
   ``bench_elastic_ep.py``: tokens/s at each group size against one ordinary engine, and each resize's pause.

Exits 1 if a check fails. On a machine without CUDA it runs the same code on the CPU (graphs
emulated), which only checks that the script itself works.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench_engine import make_workload, run_zserve  # noqa: E402

from engine_worker.device import resolve_dtype, select_device  # noqa: E402
from engine_worker.engine import Engine  # noqa: E402
from engine_worker.loader import load_model  # noqa: E402
from engine_worker.runner import ModelRunner  # noqa: E402
from engine_worker.scheduler import Scheduler, run_until_done  # noqa: E402
from engine_worker.sequence import Sequence  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from zserve.catalog import resolve  # noqa: E402
from zserve.config import EngineConfig  # noqa: E402


def engine(loaded, device, dtype, max_seqs: int, variant: str) -> ModelRunner:
    """variant: "gather" (torch path), "triton" (eager), "graphs" (Triton + CUDA graphs)."""
    built = Engine.generation(loaded, device, dtype, EngineConfig(max_num_seqs=max_seqs, max_model_len=1024),
                              cuda_graphs=variant == "graphs", attention="gather" if variant == "gather" else None)
    return built.runner


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
    ap.add_argument("--sections", nargs="+", choices=["decode", "ep"], default=["decode", "ep"])
    args = ap.parse_args()
    device = select_device(None)
    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'no CUDA'}), "
          f"torch {torch.__version__}")
    failed = False
    if "decode" in args.sections:
        failed |= check_decode(args, device)
    if "ep" in args.sections:
        failed |= check_expert_parallel(device)
    print("\nFAILED" if failed else "\nall checks passed")
    return 1 if failed else 0


def check_decode(args, device) -> bool:
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
    return failed


def check_expert_parallel(device) -> bool:
    """Section 3: an expert-parallel group on this machine's devices, checked and timed."""
    import tempfile
    from pathlib import Path

    import httpx
    from bench_elastic_ep import run as bench_ep

    from tests.e2e.moe_checkpoint import reference_greedy, write_moe_checkpoint
    from tests.helpers import Server

    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300], [5] * 40, list(range(10, 30))]
    print("\nexpert parallel: tiny random Mixtral, 8 experts top-2, group of 2")
    with tempfile.TemporaryDirectory() as tmp:
        root = write_moe_checkpoint(Path(tmp) / "tiny-moe")
        want = reference_greedy(root, prompts, 12, str(device))
        s = Server("--model", str(root), "--expert-parallel", "--engines", "2", "--dtype", "float32",
                   log_name="gpu-check-ep")
        try:
            got = [httpx.post(s.url + "/inference/v1/generate", timeout=120, json={
                "model": "tiny-moe", "token_ids": p,
                "sampling_params": {"temperature": 0, "max_tokens": 12, "ignore_eos": True}}
            ).json()["choices"][0]["token_ids"] for p in prompts]
            devices = sorted({line.split(" on ")[1].split(" ")[0] for line in s.tail(1 << 20).splitlines()
                              if "ready: tiny-moe" in line and " on " in line})
        finally:
            s.stop()
    same = sum(a == b for a, b in zip(got, want))
    print(f"  group of 2 vs one process on {device}, float32 greedy: {same}/{len(prompts)} requests identical "
          f"(engines on {', '.join(devices)})")
    for line in bench_ep([1, 2, 1], 32, 8, 256, 64):
        print("  " + line)
    return same != len(prompts)


if __name__ == "__main__":
    sys.exit(main())
