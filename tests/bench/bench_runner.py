"""Decode throughput of ModelRunner on SmolLM2-135M (or any catalog model), batch 1 and batch N.

Usage: .venv/bin/python tests/bench/bench_runner.py [--model SmolLM2-135M-Instruct] [--dtype float32]
       [--batch 1 8] [--new-tokens 128] [--threads N] [--plain-weights]

Each batch size: prefill every prompt in one execute call, then ``--new-tokens`` decode steps of
the whole batch (greedy, EOS ignored so every step is full). Reports decode tokens/s (all
sequences together) and the prefill time. Compare with transformers ``generate``: fp32 on 2 cores
≈ 24 tok/s at batch 1 and ≈ 124 tok/s at batch 8 (see shared/design/MODELS.md).
"""

from __future__ import annotations

import argparse
import time


from engine_worker.device import configure_cpu_threads, resolve_dtype, select_device
from engine_worker.loader import load_model
from engine_worker.runner import ModelRunner, SeqInput
from protocol.messages import SamplingParams
from zserve.catalog import resolve

CHAT_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
               19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


def run_batch(runner: ModelRunner, batch: int, new_tokens: int, sampling: SamplingParams) -> tuple[float, float]:
    slots = [runner.allocate_slot() for _ in range(batch)]
    # Vary the prompts a little so that rows differ.
    prompts = [CHAT_PROMPT[: len(CHAT_PROMPT) - (i % 4)] for i in range(batch)]
    seqs = [SeqInput(s, list(p), 0, sampling, [], list(p)) for s, p in zip(slots, prompts)]
    t0 = time.perf_counter()
    outs = runner.execute(seqs)
    t_prefill = time.perf_counter() - t0
    pos = [len(p) for p in prompts]
    gen = [[o.token_id] for o in outs]
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        step = [SeqInput(s, [g[-1]], n, sampling, g, p) for s, g, n, p in zip(slots, gen, pos, prompts)]
        for j, o in enumerate(runner.execute(step)):
            gen[j].append(o.token_id)
            pos[j] += 1
    t_decode = time.perf_counter() - t0
    for s in slots:
        runner.free_slot(s)
    return batch * (new_tokens - 1) / t_decode, t_prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=2, help="runs per batch size; the best is reported")
    ap.add_argument("--plain-weights", action="store_true", help="skip oneDNN weight packing (to compare)")
    args = ap.parse_args()

    threads = configure_cpu_threads(args.threads)
    device = select_device(None)
    dtype = resolve_dtype(args.dtype, device)
    t0 = time.perf_counter()
    loaded = load_model(resolve(args.model), dtype, device)
    print(f"loaded {loaded.model_id} in {time.perf_counter() - t0:.1f}s on {device} ({dtype}, {threads} threads)")
    if args.plain_weights:
        loaded.model.pack_for_cpu = lambda: False  # type: ignore[method-assign]
    runner = ModelRunner(loaded, device, dtype, max_num_seqs=max(args.batch), max_model_len=512)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    run_batch(runner, 1, 8, greedy)  # warm-up
    for b in args.batch:
        best = max((run_batch(runner, b, args.new_tokens, greedy) for _ in range(args.repeat)), key=lambda r: r[0])
        print(f"batch {b}{' (plain weights)' if args.plain_weights else ''}: decode {best[0]:.1f} tok/s total ({best[0] / b:.1f} per sequence), prefill {best[1] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
