"""Serving benchmark: zserve end to end over HTTP beside transformers `generate`, in one run.

Measures, on the same machine and dtype, one after the other (never concurrently — they would
share the cores):
  - start-up: `launch api-server` spawn → the "serving" line;
  - single-stream decode tokens/s (one streaming request, ignore_eos, N new tokens);
  - total tokens/s with C concurrent streams;
  - transformers `generate` at batch 1 and batch C on the same GGUF, same prompt length.
and prints ratios against the transformers baseline. Rerun with:

    .venv/bin/python tests/bench/bench_serving.py --dtype float32 --new-tokens 128 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPT = "Write a long story about a robot who learns to paint. Once upon a time"


def start_server(args) -> tuple[subprocess.Popen, str, float]:
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "launch", "api-server", "--port", "0", "--count", str(args.count),
                             "--dtype", args.dtype, "--max-num-seqs", str(max(8, args.concurrency))],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    for raw in proc.stdout:
        m = re.search(r"at (http://\S+) ", raw.decode())
        if m:
            return proc, m.group(1), time.monotonic() - t0
    raise RuntimeError("server did not start")


async def one_stream(client, model: str, n: int) -> tuple[int, float, float]:
    t0 = time.monotonic()
    first = None
    tokens = 0
    stream = await client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for c in stream:
        if c.choices and c.choices[0].text and first is None:
            first = time.monotonic()
        if c.usage:
            tokens = c.usage.completion_tokens
    end = time.monotonic()
    return tokens, (first or end) - t0, end - t0


async def bench_zserve(url: str, n: int, conc: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    await one_stream(client, model, 8)  # warm-up
    tokens, ttft, total = await one_stream(client, model, n)
    single = (tokens - 1) / (total - ttft)
    t0 = time.monotonic()
    res = await asyncio.gather(*(one_stream(client, model, n) for _ in range(conc)))
    wall = time.monotonic() - t0
    return {"ttft_s": ttft, "single_tok_s": single, "concurrent_tok_s": sum(r[0] for r in res) / wall,
            "concurrent_ttft_max_s": max(r[1] for r in res)}


def bench_transformers(dtype: str, n: int, conc: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zserve.catalog import smollm2_gguf_path

    path = smollm2_gguf_path()
    torch.set_num_threads(os.cpu_count() or 1)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dt).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    out = {}
    for bs, key in ((1, "single_tok_s"), (conc, "concurrent_tok_s")):
        batch = ids.repeat(bs, 1)
        with torch.inference_mode():
            model.generate(batch, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
            t0 = time.monotonic()
            model.generate(batch, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out[key] = bs * n / (time.monotonic() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--count", type=int, default=2)
    a = p.parse_args()
    proc, url, startup = start_server(a)
    try:
        z = asyncio.run(bench_zserve(url, a.new_tokens, a.concurrency))
    finally:
        proc.terminate()
        proc.wait()
    hf = bench_transformers(a.dtype, a.new_tokens, a.concurrency)
    print(f"\nSmolLM2-135M, {a.dtype}, {a.new_tokens} new tokens, {os.cpu_count()} cores")
    print(f"zserve start-up to ready: {startup:.1f}s   first-token latency (single): {z['ttft_s'] * 1000:.0f} ms")
    print(f"{'':28}{'zserve':>10}{'transformers':>14}{'ratio':>8}")
    for key, label in (("single_tok_s", "single stream tok/s"),
                       ("concurrent_tok_s", f"{a.concurrency} streams total tok/s")):
        print(f"{label:28}{z[key]:>10.1f}{hf[key]:>14.1f}{z[key] / hf[key]:>8.2f}")


if __name__ == "__main__":
    main()
