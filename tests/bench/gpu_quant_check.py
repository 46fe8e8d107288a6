"""Quantized GGUF weights on CUDA (issue 32): held in 4-bit memory, the same greedy text, and their speed.

Usage:
    # here: a SmolLM2 cut to its first --layers layers (the device takes 64 MiB of files at most), its text's ids
    .venv/bin/python tests/bench/gpu_quant_check.py --prepare .gpu
    # on the GPU machine (its python3 has torch; carry .gpu with the wheels of gguf and orjson unpacked in .gpu/site)
    python3 tests/bench/gpu_quant_check.py --run .gpu

The run loads the cut model three times on the GPU: dequantized float32 (the reference), dequantized bf16
(``--quantization none``, the path before) and kept quantized (``--quantization auto``, bf16 activations), and
prints for each: the GPU memory its weights hold, whether the 4-bit matrices took torch's int4 kernel (tinygemm),
teacher-forced agreement with the reference over 2,000 tokens of ``eval_text.md`` (prefill chunks of 512, and one
token a step), and decode tokens/s at batch 1, 8 and 32 (greedy, EOS ignored, CUDA graphs as served). Exits 1 if
the quantized path's agreement is under 98% or its weights are not smaller than bf16's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def prepare(out: Path, layers: int) -> None:
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from engine_worker.loader import read_gguf_metadata
    from zserve.catalog import smollm2_gguf_path
    from zserve.tokenizer import Tokenizer

    src = smollm2_gguf_path()
    out.mkdir(parents=True, exist_ok=True)
    meta = read_gguf_metadata(src)
    arch = meta["general.architecture"]
    w = GGUFWriter(str(out / "cut.gguf"), arch)
    for key, value in meta.items():
        if key in ("general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"):
            continue
        if key == f"{arch}.block_count":
            value = layers
        if isinstance(value, bool):
            w.add_key_value(key, value, GGUFValueType.BOOL)
        elif isinstance(value, int):
            w.add_key_value(key, value, GGUFValueType.UINT32)
        elif isinstance(value, float):
            w.add_key_value(key, value, GGUFValueType.FLOAT32)
        else:
            w.add_key_value(key, value, GGUFValueType.STRING)
    for t in GGUFReader(src).tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and int(parts[1]) >= layers:
            continue
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ids = Tokenizer.from_gguf(src).encode((ROOT / "tests/bench/eval_text.md").read_text())[:2001]
    (out / "ids.json").write_text(json.dumps(ids))
    print(f"wrote {out / 'cut.gguf'} ({(out / 'cut.gguf').stat().st_size / 2**20:.1f} MiB) and {len(ids)} ids")


def run(folder: Path) -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.append(str(folder / "site"))  # (the image lacks gguf and orjson; a local run has its own)
    import torch

    from engine_worker.loader import load_model
    from engine_worker.runner import ModelRunner
    from engine_worker.scheduler import Scheduler, run_until_done
    from engine_worker.sequence import Sequence
    from protocol.messages import SamplingParams
    from zserve.catalog import ModelSource

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ids = json.loads((folder / "ids.json").read_text())
    path = str(folder / "cut.gguf")
    source = ModelSource("cut", "gguf", path, path)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")

    def build(dtype, quantization: str, graphs: bool = True):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        loaded = load_model(source, dtype, device, quantization=quantization)
        held = (torch.cuda.memory_allocated() - before) if device.type == "cuda" else 0
        model = loaded.model
        quant = [m for m in model.modules() if type(m).__name__ == "QuantWeight"]
        tiny = sum(q.int4_packed is not None for q in quant)
        runner = ModelRunner(loaded, device, dtype, 32, 4096, kv_cache_bytes=1 << 30,
                             cuda_graphs=graphs if device.type == "cuda" else False)
        return runner, held, f"{tiny} of {len(quant)} on tinygemm" if quant else "dense"

    def forced(runner, chunk: int) -> list[int]:
        sched = Scheduler(runner, 1, chunk, enable_prefix_caching=False)
        sched.add(Sequence("eval", list(ids), SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)))
        return list(run_until_done(sched)["eval"][0].prompt_top_logprobs.token_ids)

    def decode_rate(runner, batch: int, tokens: int = 64) -> float:
        sched = Scheduler(runner, batch, 512, enable_prefix_caching=False)
        for i in range(batch):
            sched.add(Sequence(f"r{i}", ids[i * 7:i * 7 + 32], SamplingParams(temperature=0.0, max_tokens=tokens,
                                                                               ignore_eos=True)))
        sched.step()  # the prompts
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        run_until_done(sched)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return batch * (tokens - 1) / (time.perf_counter() - t)

    reference = None
    failed = False
    rows = {}
    for name, dtype, quantization in (("fp32 dequantized", torch.float32, "none"),
                                      ("bf16 dequantized", torch.bfloat16, "none"),
                                      ("quantized (bf16 activations)", torch.bfloat16, "auto")):
        runner, held, how = build(dtype, quantization)
        top512 = forced(runner, 512)
        top1 = forced(runner, 1)
        if reference is None:
            reference = top512
        agree = [sum(a == b for a, b in zip(t, reference)) / len(reference) for t in (top512, top1)]
        rates = [decode_rate(runner, b) for b in (1, 8, 32)]
        rows[name] = (held, agree, rates)
        print(f"{name}: weights {held / 2**20:.1f} MiB ({how}); agreement {agree[0]:.4f} (chunks of 512), "
              f"{agree[1]:.4f} (a token a step); decode tok/s at 1/8/32: " + " / ".join(f"{r:.0f}" for r in rates),
              flush=True)
        del runner
    q, b = rows["quantized (bf16 activations)"], rows["bf16 dequantized"]
    print(f"quantized / bf16: memory {q[0] / max(1, b[0]):.2f}x, decode " +
          " / ".join(f"{x / y:.2f}x" for x, y in zip(q[2], b[2])))
    if device.type == "cuda" and not q[0] < b[0]:
        print("FAIL: the quantized weights are not smaller than bf16's")
        failed = True
    if min(q[1]) < 0.98:
        print(f"FAIL: agreement {min(q[1]):.4f} < 0.98 (bf16 dequantized: {min(b[1]):.4f})")
        failed = min(q[1]) < min(b[1]) - 0.01 or failed  # bf16 activations: judged beside bf16's own
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", type=Path)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--run", type=Path)
    args = ap.parse_args()
    if args.prepare:
        sys.path.insert(0, str(ROOT))
        os.chdir(ROOT)
        prepare(args.prepare, args.layers)
        return 0
    if args.run:
        return run(args.run)
    ap.error("--prepare or --run")
    return 2


if __name__ == "__main__":
    sys.exit(main())
