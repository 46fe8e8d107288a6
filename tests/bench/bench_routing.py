"""Prefix-affine routing against load-based routing: what each routing policy lets the prefix cache save, with both
measured in the same run.

Usage:
    .venv/bin/python tests/bench/bench_routing.py [--model SmolLM2-135M-Instruct] [--policies load prefix]
        [--engines 2] [--gateways 4] [--kv-cache-tokens 5120] [--num-prompts 128] [--concurrency 8]
        [--workloads prefix hot multi_turn kill]

For each policy a server is started as ``make run`` starts the default model, with ``--engines`` engines and
``--gateways`` gateways (``launch api-server --routing-policy POLICY``; the policy ``default`` passes no flag), and
each engine's KV cache sized to ``--kv-cache-tokens`` tokens (default: 5 prefixes' worth, so one engine cannot hold
the 8 prefixes while two can: cache-aware routing matters when the working set exceeds one engine's cache).
``launch bench`` then drives it, streamed and sampled at temperature 1.0, ``--concurrency`` requests in flight:
  - prefix: prefix_repetition, 8 prefixes of ``--prefix-len`` tokens, ``--suffix-len``-token suffixes,
    ``--output-len`` output tokens, ``--num-prompts`` prompts;
  - hot: the same with a single hot prefix (half the prompts): where affinity and load pull apart;
  - multi_turn: ``--conversations`` chats of ``--turns`` turns of ``--user-len`` tokens, answers of ``--output-len``;
  - kill: the prefix workload again (fresh prefixes) while one gateway is SIGKILLed ``--kill-after`` seconds after
    the engines start on it (the supervisor restarts it): the agreement the other gateways and the replacement
    keep, and the requests the dead gateway's connections lost.
Each workload draws its own prompts (its own --seed), so none is served from another's cache. Reported per workload
and policy: cached prompt tokens (and their share of prompt tokens), TTFT mean and p99, the per-prefix (per
conversation) engine agreement from the X-Zserve-Engine header ("-" when the server sends none), failed requests,
and each policy's ratio against the first policy's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.helpers

from tests.helpers import LAUNCH, ROOT, Server, procs, ready_pids, wait_until  # noqa: E402

NUM_PREFIXES = 8
WORKLOADS = ("prefix", "hot", "multi_turn", "kill")


def kv_bytes_per_token(model: str, dtype: str) -> int:
    """Bytes of K and V one token takes in an engine's cache: 2 x layers x KV heads x head size x element size."""
    import torch

    from engine_worker.device import resolve_dtype
    from engine_worker.loader import load_model
    from zserve.catalog import resolve

    cfg = load_model(resolve(model), torch.float32, torch.device("cpu")).config
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = torch.empty((), dtype=resolve_dtype(dtype, device)).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * size


def kv_blocks(url: str) -> list[int]:
    """KV blocks of each engine's cache, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return [int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
            if line.startswith("zserve_engine_kv_cache_blocks{")]


def bench_args(workload: str, args: argparse.Namespace) -> list[str]:
    common = ["--max-concurrency", str(args.concurrency), "--ignore-eos", "--temperature", "1.0"]
    prefix = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
              "--prefix-repetition-suffix-len", str(args.suffix_len), "--prefix-repetition-output-len",
              str(args.output_len)]
    seed = ["--seed", str(WORKLOADS.index(workload) + 1)]
    if workload in ("prefix", "kill"):
        return [*prefix, "--prefix-repetition-num-prefixes", str(NUM_PREFIXES), "--num-prompts",
                str(args.num_prompts), *common, *seed]
    if workload == "hot":
        return [*prefix, "--prefix-repetition-num-prefixes", "1", "--num-prompts", str(max(1, args.num_prompts // 2)),
                *common, *seed]
    return ["--dataset-name", "multi_turn", "--multi-turn-conversations", str(args.conversations),
            "--multi-turn-turns", str(args.turns), "--multi-turn-user-len", str(args.user_len),
            "--multi-turn-output-len", str(args.output_len), *common, *seed]


def run_bench(server: Server, workload: str, args: argparse.Namespace, out: Path) -> dict:
    """One ``launch bench`` load point of ``workload``; for "kill", one gateway dies --kill-after seconds in."""
    cmd = [*LAUNCH, "bench", "--base-url", server.url, "--no-progress", "--result-file", str(out),
           *bench_args(workload, args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if workload == "kill":  # --kill-after seconds after the engines start on the load (making prompts comes first)
        wait_until(lambda: sum(p.get("running", 0) for p in procs(server, "engine")) > 0, 600, interval=0.2,
                   what="the engines to run the load")
        time.sleep(args.kill_after)
        gateways = ready_pids(server, "gateway")
        victim = gateways[len(gateways) // 2]
        os.kill(victim, signal.SIGKILL)
        print(f"  killed gateway pid {victim} {args.kill_after:.0f}s into the run", file=sys.stderr)
    stdout, stderr = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"launch bench {workload} exited {proc.returncode}:\n{stdout}\n{stderr}")
    if workload == "kill":
        wait_until(lambda: len(ready_pids(server, "gateway")) == args.gateways, 120, interval=0.5,
                   what="the supervisor to replace the killed gateway")
    print(stdout, file=sys.stderr)
    return json.loads(out.read_text())["results"][0]


def warm_up(server: Server) -> None:
    """Short random prompts through every engine before anything is measured, so that no workload pays a fresh
    process's first steps (kernel initialisation, allocations) for the others; a prefix cache they leave behind
    holds nothing a workload's prompts start with."""
    cmd = [*LAUNCH, "bench", "--base-url", server.url, "--no-progress", "--dataset-name", "random", "--num-prompts",
           "32", "--random-input-len", "256", "--random-output-len", "8", "--max-concurrency", "8", "--seed", "99"]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True, timeout=600)


def measure(policy: str, args: argparse.Namespace, kv_memory: int, tmp: Path) -> dict[str, dict]:
    flag = [] if policy == "default" else ["--routing-policy", policy]
    server = Server("--model", args.model, "--dtype", args.dtype, "--count", str(args.gateways), "--engines",
                    str(args.engines), "--kv-cache-memory", str(kv_memory), *flag, log_name=f"bench-routing-{policy}")
    try:
        print(f"{policy}: KV blocks per engine {kv_blocks(server.url)}; log {server.log_path}", file=sys.stderr)
        warm_up(server)
        return {w: run_bench(server, w, args, tmp / f"{policy}-{w}.json") for w in args.workloads}
    finally:
        server.stop()


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def table(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> str:
    base = args.policies[0]
    rows = [f"| workload | policy | cached prompt tokens | cached share | TTFT mean ms | TTFT p99 ms | agreement | "
            f"failed | cached / {base} | TTFT mean / {base} | TTFT p99 / {base} | agreement / {base} |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in args.workloads:
        b = results[base][w]
        b_agree = (b["engine_agreement"] or {}).get("share")
        for policy in args.policies:
            p = results[policy][w]
            agree = (p["engine_agreement"] or {}).get("share")
            rows.append(f"| {w} | {policy} | {p['cached_prompt_tokens']} | {p['cached_prompt_share']:.1%} | "
                        f"{_fmt(p['ttft_ms']['mean'], '.0f')} | {_fmt(p['ttft_ms']['p99'], '.0f')} | "
                        f"{_fmt(agree, '.3f')} | {p['failed']} | "
                        f"{_ratio(p['cached_prompt_tokens'], b['cached_prompt_tokens'])} | "
                        f"{_ratio(p['ttft_ms']['mean'], b['ttft_ms']['mean'])} | "
                        f"{_ratio(p['ttft_ms']['p99'], b['ttft_ms']['p99'])} | {_ratio(agree, b_agree)} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--policies", nargs="+", default=["load", "prefix"],
                    help="routing policies, the first the baseline of the ratios; 'default': the server's own, no flag")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--gateways", type=int, default=4)
    ap.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="tokens of each engine's KV cache (default: 5 prefixes' worth of --prefix-len)")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-len", type=int, default=192)
    ap.add_argument("--kill-after", type=float, default=10.0, help="seconds into the kill run")
    args = ap.parse_args()
    tokens = args.kv_cache_tokens or 5 * args.prefix_len
    per_token = kv_bytes_per_token(args.model, args.dtype)
    kv_memory = tokens * per_token
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        results = {p: measure(p, args, kv_memory, Path(tmp)) for p in args.policies}
    print(f"{args.model} ({args.dtype}), {args.engines} engines and {args.gateways} gateways, KV cache {tokens} "
          f"tokens per engine ({kv_memory / (1 << 20):.0f} MiB at {per_token} bytes a token), concurrency "
          f"{args.concurrency}, streamed, temperature 1.0; prefix: {args.num_prompts} prompts over {NUM_PREFIXES} "
          f"prefixes of {args.prefix_len} tokens + {args.suffix_len}, hot: {max(1, args.num_prompts // 2)} over one, "
          f"multi_turn: {args.conversations} x {args.turns} turns of {args.user_len}; {args.output_len} output tokens; "
          f"kill: a gateway SIGKILLed {args.kill_after:.0f}s in; {time.monotonic() - t0:.0f}s in all")
    print(table(results, args))


if __name__ == "__main__":
    main()
