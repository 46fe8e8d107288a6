"""Embedding throughput: zserve's ``PoolingRunner`` beside transformers ``AutoModel`` + mean pooling.

Usage:
    .venv/bin/python tests/bench/bench_embeddings.py [--model all-MiniLM-L6-v2] [--batch 1 16 64]
        [--inputs 128] [--rounds 5] [--threads N] [--dtype fp32|bf16] [--max-batch-tokens 8192]

Inputs are sentences of 10-60 words drawn from the model's vocabulary (seeded), tokenized with the
model's ``tokenizer.json`` (padding off, truncation at the model's limit). For each batch size B
the same ``--inputs`` inputs are embedded in groups of B by both sides, in the same process,
dtype and thread count:

- zserve: ``PoolingRunner.embed(group)`` (packed tokens, padded attention only; see
  ``engine_worker/pooling.py``);
- transformers: the group padded to its longest input with an attention mask, ``AutoModel``
  forward (its default SDPA attention) under ``inference_mode``, then the sentence-transformers
  recipe: mean over the mask, L2 normalisation.

Rounds alternate the two sides so both see the same machine load; the table reports the best
round of each (inputs/s and real, unpadded tokens/s) and the largest difference between their
vectors.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_worker.pooling import PoolingRunner
from zserve.catalog import resolve

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(model_dir: Path, n: int, max_len: int, seed: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_len)
    words = [w for w in (model_dir / "vocab.txt").read_text().split("\n") if w.isalpha() and len(w) > 2]
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(10, 60))) + "." for _ in range(n)]
    return [e.ids for e in tok.encode_batch(texts)]


def hf_embed(model, group: list[list[int]]) -> torch.Tensor:
    longest = max(map(len, group))
    ids = torch.tensor([x + [0] * (longest - len(x)) for x in group])
    mask = torch.tensor([[1] * len(x) + [0] * (longest - len(x)) for x in group])
    with torch.inference_mode():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask[..., None].to(hidden.dtype)
        return F.normalize(((hidden * m).sum(1) / m.sum(1)).float(), dim=-1)


def timed(fn, groups: list[list[list[int]]]) -> tuple[float, list[torch.Tensor]]:
    t0 = time.perf_counter()
    out = [fn(g) for g in groups]
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--inputs", type=int, default=128, help="inputs embedded per round and batch size")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoModel

    torch.set_num_threads(args.threads)
    dtype, cpu = DTYPES[args.dtype], torch.device("cpu")
    model_dir = Path(resolve(args.model).path)
    runner = PoolingRunner(model_dir, cpu, dtype, max_batch_tokens=args.max_batch_tokens)
    hf = AutoModel.from_pretrained(str(model_dir), dtype=dtype).eval()
    inputs = make_inputs(model_dir, args.inputs, runner.max_model_len, args.seed)
    tokens = sum(map(len, inputs))
    print(f"{args.model}: {len(inputs)} inputs, {tokens} tokens ({min(map(len, inputs))}-"
          f"{max(map(len, inputs))} per input), {args.dtype}, {args.threads} threads, best of {args.rounds} rounds, "
          f"zserve oneDNN-packed={runner.packed}\n")

    rows = []
    for b in args.batch:
        groups = [inputs[i : i + b] for i in range(0, len(inputs), b)]
        sides = {"zserve": runner.embed, "transformers": lambda g: hf_embed(hf, g)}
        for fn in sides.values():  # warm-up: first-call allocations and kernel selection
            fn(groups[0])
        best = {name: float("inf") for name in sides}
        outs: dict[str, list] = {}
        for _ in range(args.rounds):
            for name, fn in sides.items():
                seconds, outs[name] = timed(fn, groups)
                best[name] = min(best[name], seconds)
        ours = torch.stack([v for g in outs["zserve"] for v in g])
        ref = torch.cat(outs["transformers"])
        diff = (ours - ref).abs().max().item()
        rows.append((b, best["zserve"], best["transformers"], diff))

    print("| batch | zserve inputs/s | zserve tokens/s | transformers inputs/s | transformers tokens/s | speed-up "
          "| max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b, ours, theirs, diff in rows:
        print(f"| {b} | {len(inputs) / ours:.1f} | {tokens / ours:.0f} | {len(inputs) / theirs:.1f} "
              f"| {tokens / theirs:.0f} | {theirs / ours:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
