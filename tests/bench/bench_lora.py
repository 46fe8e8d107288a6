"""What batched LoRA costs a decode step: a batch spread over adapters beside the same batch on the base model.

Usage:
    .venv/bin/python tests/bench/bench_lora.py [--model tiny-random] [--batch 32] [--adapters 8] [--rank 16]
        [--steps 50] [--threads N]

Adapters of rank ``--rank`` on every projection (q/k/v/o/gate/up/down) are written with random weights; the
batch's requests take them in turn (request i uses adapter i mod ``--adapters``), so every adapter's rows are
scattered through the batch (the gathered path of ``LoraStep``). Two engines share the model's weights, one
with the batch on the base model, one with the mixed batch; after one prefill step each, ``--steps`` decode steps
(schedule + forward + sample) of each run in turn, and the median step time of each and the median of the paired
ratios are reported (pairs make the ratio hold up on a machine other work slows down now and then).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine_worker.device import configure_cpu_threads
from engine_worker.engine import Engine
from engine_worker.loader import load_model
from engine_worker.lora import MLP_MODULES, SUPPORTED, module_shapes
from engine_worker.sequence import Sequence
from protocol.messages import SamplingParams
from zserve.catalog import resolve
from zserve.config import EngineConfig

CPU = torch.device("cpu")


def write_adapter(root: Path, cfg, rank: int, seed: int) -> Path:
    """A PEFT-format adapter of rank ``rank`` on every supported projection."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for m, (fan_in, fan_out) in module_shapes(cfg).items():
            prefix = f"base_model.model.model.layers.{i}.{'mlp' if m in MLP_MODULES else 'self_attn'}.{m}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.01
            tensors[prefix + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(SUPPORTED), "bias": "none"}))
    save_file(tensors, str(root / "adapter_model.safetensors"))
    return root


def start_batch(engine: Engine, batch: int, adapters: list[str | None], steps: int) -> None:
    """``batch`` requests (request i on ``adapters[i % len]``), run through their one prefill step."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        prompt = [(37 * i + 11 * j) % 1000 + 3 for j in range(16)]
        assert engine.scheduler.add(Sequence(f"r{i}", prompt, params, lora=adapters[i % len(adapters)])) is None
    engine.scheduler.step()  # every prompt in one prefill step


def paired_decode_seconds(base: Engine, lora: Engine, batch: int, names: list[str], steps: int) -> list[tuple]:
    """``(base, mixed)`` wall seconds of ``steps`` decode-step pairs: the base model's batch and the mixed one on
    the same weights, one step of each in turn (alternating which goes first), so a busy machine slows both."""
    start_batch(base, batch, [None], steps)
    start_batch(lora, batch, names, steps)
    pairs = []
    for k in range(steps):
        times = {}
        for engine in (base, lora) if k % 2 else (lora, base):
            t = time.perf_counter()
            engine.scheduler.step()
            times[engine is lora] = time.perf_counter() - t
        pairs.append((times[False], times[True]))
    for engine in (base, lora):
        engine.scheduler.abort_all("abort")
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        configure_cpu_threads(args.threads)
    loaded = load_model(resolve(args.model), torch.float32, CPU)
    cfg = EngineConfig(max_num_seqs=args.batch, max_model_len=args.steps + 64, max_num_batched_tokens=args.batch * 16)
    engine = Engine.generation(loaded, CPU, torch.float32, cfg, max_loras=args.adapters, max_lora_rank=args.rank)
    base_engine = Engine.generation(loaded, CPU, torch.float32, cfg)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{k}" for k in range(args.adapters)]
        for k, name in enumerate(names):
            engine.runner.loras.load(name, write_adapter(Path(tmp) / name, loaded.config, args.rank, k))
        paired_decode_seconds(base_engine, engine, args.batch, names, 5)  # warm-up: fills the slots, first calls
        pairs = paired_decode_seconds(base_engine, engine, args.batch, names, args.steps)
    base, lora = statistics.median(b for b, _ in pairs), statistics.median(ml for _, ml in pairs)
    print(f"{args.model}: decode step of {args.batch} sequences, {engine.runner.attention_backend}")
    print(f"  base model:                         {base * 1e3:8.2f} ms")
    print(f"  {args.adapters} adapters, rank {args.rank}, all projections: {lora * 1e3:8.2f} ms")
    print(f"  ratio: {statistics.median(ml / b for b, ml in pairs):.2f}x")


if __name__ == "__main__":
    main()
