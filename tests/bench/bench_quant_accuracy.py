"""How closely the quantized path follows the dequantized fp32 model (issue 32's accuracy figures).

Usage:
    .venv/bin/python tests/bench/bench_quant_accuracy.py [--gguf FILE ...] [--tokens 2000] [--chunk 512 1]

A fixed text (``eval_text.md``: a frozen copy of the project's architecture notes, prose, tables and code) is read
teacher-forced through the engine (scheduler, paged runner, prompt logprobs): at every position, the most likely
next token and the logprob of the text's own token. Each variant is compared with the reference, the fp32 model
with dequantized weights (``--quantization none --dtype float32``):

- **agreement**: the share of positions where the variant's most likely token is the reference's;
- **perplexity** of the text, and its difference from the reference's.

Variants: the dequantized bf16 path (``--quantization none`` on a bf16 CPU), the quantized path (``--quantization
auto``) with float32 activations (its default on a CPU) and with bf16 ones (``--dtype bfloat16``), each with prompt
chunks of every ``--chunk`` size: 512 runs the prompt as prefill chunks (the large-batch kernel), 1 feeds one token a
step (the decode kernel a batch-1 stream runs on). ``--gguf`` takes any number of files (default: the SmolLM2 Q4_1
file the catalog installs); ``tests/bench/make_quants.py`` writes the file in
other quantization types.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from engine_worker.loader import load_model
from engine_worker.runner import ModelRunner
from engine_worker.scheduler import Scheduler, run_until_done
from engine_worker.sequence import Sequence
from protocol.messages import SamplingParams
from zserve.catalog import ModelSource, smollm2_gguf_path
from zserve.tokenizer import Tokenizer

TEXT = Path(__file__).with_name("eval_text.md")
CPU = torch.device("cpu")


def text_ids(gguf: Path, n: int) -> list[int]:
    ids = Tokenizer.from_gguf(gguf).encode(TEXT.read_text())
    if len(ids) < n + 1:
        raise SystemExit(f"{TEXT} has {len(ids)} tokens, fewer than --tokens {n} + 1")
    return ids[: n + 1]


def teacher_forced(gguf: Path, ids: list[int], dtype: torch.dtype, quantization: str,
                   chunk: int) -> tuple[list[int], list[float], float]:
    """(most likely token at each position, logprob of the text's token there, seconds) over ``ids``."""
    source = ModelSource(model_id="eval", path=str(gguf), weights="gguf", tokenizer_path=str(gguf))
    loaded = load_model(source, dtype, CPU, quantization=quantization)
    runner = ModelRunner(loaded, CPU, dtype, max_num_seqs=1, max_model_len=len(ids) + 8)
    sched = Scheduler(runner, 1, chunk, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    assert sched.add(Sequence("eval", list(ids), params)) is None
    t = time.perf_counter()
    (first, *_) = run_until_done(sched)["eval"]
    elapsed = time.perf_counter() - t
    top = first.prompt_top_logprobs
    assert top is not None and first.prompt_logprobs is not None
    return list(top.token_ids), list(first.prompt_logprobs), elapsed


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, nargs="+", default=None)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--chunk", type=int, nargs="+", default=[512, 1])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| file | path | chunk | agreement | perplexity | vs fp32 | s |")
    print("|---|---|---|---|---|---|---|")
    for gguf in args.gguf or [smollm2_gguf_path()]:
        ids = text_ids(gguf, args.tokens)
        ref_top, ref_lp, t = teacher_forced(gguf, ids, torch.float32, "none", 512)
        ref_ppl = perplexity(ref_lp)
        print(f"| {gguf.name} | fp32 dequantized (reference) | 512 | 1 | {ref_ppl:.4f} | | {t:.1f} |", flush=True)
        variants = [("bf16 dequantized (--quantization none)", torch.bfloat16, "none"),
                    ("quantized, float32 activations (--quantization auto)", torch.float32, "auto"),
                    ("quantized, bf16 activations (auto, --dtype bfloat16)", torch.bfloat16, "auto")]
        for name, dtype, quant in variants:
            for chunk in args.chunk:
                top, lp, t = teacher_forced(gguf, ids, dtype, quant, chunk)
                agree = sum(a == b for a, b in zip(top, ref_top)) / len(ref_top)
                ppl = perplexity(lp)
                print(f"| {gguf.name} | {name} | {chunk} | {agree:.4f} | {ppl:.4f} | {ppl / ref_ppl - 1:+.2%} "
                      f"| {t:.1f} |", flush=True)


if __name__ == "__main__":
    main()
