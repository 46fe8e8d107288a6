"""Which CPU matmul kernel pays for quantized weights, on the default model's shapes (issue 32's groundwork).

Usage:
    .venv/bin/python tests/bench/bench_quant_kernels.py [--threads 2] [--batches 1 8 32] [--group 32]

For each linear shape of SmolLM2-135M (attention, MLP, the tied LM head) and each batch (tokens in the step), the
time of one ``y = x @ W.T`` in bf16, with as many distinct weights of the shape as the model has layers (30; the LM
head: one) read in turn, as a forward pass reads them — a benchmark that reads one small weight again and again
measures the CPU's caches, not the memory traffic that bounds a decode step. The kernels:

- ``bf16``: today's path, the weight pre-packed for oneDNN (``engine_worker.models.layers.Linear.pack``), the
  baseline of the ratios;
- ``int4``: ``torch._weight_int4pack_mm_for_cpu`` on 4-bit weights with a bf16 scale and zero per group of
  ``--group`` columns (the layout Q4_0, Q4_1 and Q4_K's 32-wide sub-blocks map onto exactly);
- ``int8``: ``torch._weight_int8pack_mm`` on 8-bit weights with one scale per output row;
- ``qgemm``: zserve's own kernel (``engine_worker/cpu_kernels/qgemm.cpp``, what ``--quantization auto`` runs) on the
  same 4-bit codes, scales and zeros (a group minimum, as Q4_1 and Q4_K have), with float32 activations;
- ``qgemm bf16``: the same kernel with bf16 activations (``--dtype auto`` on a CPU with native bf16), against the
  bf16 baseline on the dequantized weight: the prompt matmuls that ``bench_llamacpp.py``'s concurrency rows time.

Each kernel's error against the dequantized weight is printed too (relative Frobenius norm), so a fast kernel that
computes something else shows. Weights are random: the time depends on the shapes only.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576),
          "down 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576)}


def timed(reps: int, fn, x: torch.Tensor, weights: list[tuple], *rest) -> float:
    """Mean µs of one ``fn(x, *weight, *rest)``, cycling through ``weights`` (one per layer, as a forward pass reads
    them: a weight is out of the CPU caches by the time it is read again) ``reps`` times after a warm-up pass."""
    for w in weights:
        fn(x, *w, *rest)
    t = time.perf_counter()
    for _ in range(reps):
        for w in weights:
            fn(x, *w, *rest)
    return (time.perf_counter() - t) / (reps * len(weights)) * 1e6


def int4_weights(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed 4-bit weight, scales and zeros [K/group, N, 2] in bf16, the dequantized weight, the codes [N, K]) of
    ``w`` [N, K]."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((g - low) / scale).round().clamp(0, 15).to(torch.int32)
    zero = low + 8 * scale  # the kernel computes (q - 8) * scale + zero, in bf16 scales and zeros
    scale, zero = scale.bfloat16().float(), zero.bfloat16().float()
    sz = torch.stack([scale.view(n, -1), zero.view(n, -1)], -1).transpose(0, 1).contiguous().bfloat16()
    deq = ((q.float() - 8) * scale + zero).view(n, k)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(n, k), 1), sz, deq, q.view(n, k)


def _qgemm_weight(q: torch.Tensor, sz: torch.Tensor):
    """zserve's ``QuantWeight`` of the codes and the bf16 scales and zeros of ``int4_weights`` (w = scale*q + min)."""
    from engine_worker.gguf_quant import QuantParts
    from engine_worker.models.quant_linear import QuantWeight

    scale, zero = sz[..., 0].float().T.contiguous(), sz[..., 1].float().T.contiguous()
    group = q.shape[1] // scale.shape[1]
    return QuantWeight([QuantParts(q, scale, zero - 8 * scale, group, 4, "int4")], torch.device("cpu"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--reps", type=int, default=60, help="matmuls timed per shape and batch (spread over the layers)")
    ap.add_argument("--layers", type=int, default=30, help="distinct weights of each layer shape (SmolLM2: 30)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, int4 groups of {args.group}; µs per matmul")
    print("| shape | batch | bf16 (oneDNN) | int4 | int4 / bf16 speed | int8 | int8 / bf16 speed | qgemm "
          "| qgemm speed | qgemm bf16 | qgemm bf16 speed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for name, (n, k) in SHAPES.items():
        copies = 1 if name.startswith("lm_head") else args.layers
        plain, bf, i4, i8, qg = [], [], [], [], []
        for _ in range(copies):
            w = torch.randn(n, k, generator=gen) * 0.05
            q4, sz, deq4, codes = int4_weights(w, args.group)
            s8 = w.abs().amax(1) / 127
            q8 = (w / s8[:, None]).round().to(torch.int8)
            plain.append((w, deq4, q8, s8))
            qg.append((_qgemm_weight(codes.to(torch.int8), sz),))
            bf.append((torch.ops.mkldnn._reorder_linear_weight(w.bfloat16()),))
            i4.append((q4, args.group, sz))
            i8.append((q8, s8.bfloat16()))
        reps = max(3, args.reps // copies)
        for b in args.batches:
            x = torch.randn(b, k, generator=gen).bfloat16()
            t_bf = timed(reps, torch.ops.mkldnn._linear_pointwise, x, bf, None, "none", [], "")
            t_4 = timed(reps, torch.ops.aten._weight_int4pack_mm_for_cpu, x, i4)
            t_8 = timed(reps, torch.ops.aten._weight_int8pack_mm, x, i8)
            t_q = timed(reps, lambda x, w: w.matmul(x), x.float(), qg)
            t_qb = timed(reps, lambda x, w: w.matmul(x), x, qg)
            print(f"| {name} | {b} | {t_bf:.0f} | {t_4:.0f} | {t_bf / t_4:.2f}x | {t_8:.0f} | {t_bf / t_8:.2f}x "
                  f"| {t_q:.0f} | {t_bf / t_q:.2f}x | {t_qb:.0f} | {t_bf / t_qb:.2f}x |")
        w, deq4, q8, s8 = plain[0]
        x = torch.randn(4, k, generator=gen).bfloat16()
        ref4, ref8 = x.float() @ deq4.T, x.float() @ (q8.float() * s8.bfloat16().float()[:, None]).T
        got4 = torch.ops.aten._weight_int4pack_mm_for_cpu(x, *i4[0]).float()
        got8 = torch.ops.aten._weight_int8pack_mm(x, *i8[0]).float()
        errors.append((name, ((got4 - ref4).norm() / ref4.norm()).item(), ((got8 - ref8).norm() / ref8.norm()).item()))
    print("\nkernel error against its dequantized weight (relative): "
          + "; ".join(f"{n}: int4 {e4:.4f}, int8 {e8:.4f}" for n, e4, e8 in errors))


if __name__ == "__main__":
    main()
