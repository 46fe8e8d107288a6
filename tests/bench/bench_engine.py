"""Engine throughput and latency: zserve's scheduler + runner beside transformers ``generate``.

Usage:
    .venv/bin/python tests/bench/bench_engine.py [--model SmolLM2-135M-Instruct] [--dtype auto]
        [--concurrency 1 8 32 64] [--mode burst sustained] [--waves 3] [--min-new 128] [--max-new 256]
        [--threads N] [--no-hf] [--profile] [--sampling greedy t1 ...] [--rounds R] [--quantization auto]

Requests have a shared 20-token system prefix, then 20-60 random tokens (as chat traffic looks),
and each asks for a number of tokens drawn uniformly from [--min-new, --max-new] (EOS ignored, so
the work is fixed). ``--sampling`` runs each traffic shape once per preset (default: all of
``greedy``, ``t1`` = temperature 1.0, ``t07p09`` = temperature 0.7 + top_p 0.9, ``t07k40`` =
temperature 0.7 + top_k 40), zserve and transformers with the same settings.
zserve runs them through the engine's own step loop in-process
(no sockets: this measures the engine, not the wire); transformers runs them as left-padded
batches of ``generate`` with ``max_new_tokens`` = the batch's longest request, in the same
dtype, with dense (dequantized) weights. Two traffic shapes per concurrency C:

- ``burst``: C requests arrive together, and that is all. The batch drains as requests finish.
- ``sustained``: C clients, each sending its next request the moment its previous one is
  answered, C x ``--waves`` requests in all: what "C concurrent users" means for a server
  (vLLM's ``--max-concurrency``). zserve admits each new request into the running batch at once;
  transformers, batching statically, serves them as ``--waves`` batches of C, one after another
  (every client of a batch is answered when its longest request is done).

Reported per run: output tokens/s, TTFT and inter-token latency percentiles. transformers'
tokens/s is given twice: counting *every* token it generated (including those past a request's
own length, which static batching cannot avoid — this favours it) and counting only the tokens
the requests asked for (the same work zserve delivers). Two ratios follow, one per count.

``--profile`` adds, at the largest concurrency (or ``--profile-concurrency``), where a decode
step's wall time goes (linear layers, each native kernel, sampling, the rest) and the top torch
ops of one step. ``ZSERVE_CPU_KERNELS=0`` in the environment measures the torch-only path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time

import torch

from engine_worker.device import configure_cpu_threads, dtype_name, resolve_dtype, select_device
from engine_worker.engine import Engine
from engine_worker.grammar import Grammars, tokenizer_json_loader
from engine_worker.loader import load_model
from engine_worker.runner import ModelRunner
from engine_worker.scheduler import Scheduler
from engine_worker.sequence import Sequence
from protocol.messages import SamplingParams
from zserve.catalog import resolve, smollm2_gguf_path
from zserve.config import QUANTIZATIONS, EngineConfig

# --sampling presets: (temperature, top_p, top_k); zserve and transformers get the same settings.
PRESETS = {"greedy": (0.0, 1.0, 0), "t1": (1.0, 1.0, 0), "t07p09": (0.7, 0.9, 0), "t07k40": (0.7, 1.0, 40),
           "t1json": (1.0, 1.0, 0)}
# Structured-output presets (zserve only; transformers runs them unconstrained): a JSON schema that
# cannot be complete within the requested tokens, so every request still produces exactly its count.
STRUCTURED = {"t1json": ("json", json.dumps({
    "type": "array", "minItems": 1000,
    "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "id": {"type": "integer"},
                                                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
              "required": ["name", "id", "tags"], "additionalProperties": False}}))}
GRAMMARS: Grammars | None = None  # made in main() for the structured presets

SYSTEM = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2]


def make_workload(c: int, min_new: int, max_new: int, seed: int,
                  count: int | None = None) -> list[tuple[list[int], int]]:
    """``count`` (default ``c``) requests for concurrency ``c``; the first ``c`` do not depend on ``count``."""
    rng = random.Random(seed * 1000 + c)
    out = []
    for _ in range(count or c):
        user = [rng.randrange(100, 40000) for _ in range(rng.randint(20, 60))]
        out.append((SYSTEM + [198, 1, 4093, 198] + user + [2, 198, 1, 520, 9531, 198], rng.randint(min_new, max_new)))
    return out


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def run_zserve(runner: ModelRunner, work, max_num_seqs: int, budget: int, timings: dict | None = None,
               in_flight: int | None = None, preset: str = "greedy") -> dict:
    """Run ``work`` through the engine loop; at most ``in_flight`` requests at a time (a closed
    loop: the next request arrives the moment one finishes), all at once without it."""
    sched = Scheduler(runner, max_num_seqs, budget, grammars=GRAMMARS)  # a fresh one: an empty prefix cache
    pending = list(enumerate(work))[::-1]
    arrival: dict[str, float] = {}

    def arrive(now: float) -> None:
        i, (prompt, n) = pending.pop()
        arrival[f"r{i}"] = now
        temp, top_p, top_k = PRESETS[preset]
        sp = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, max_tokens=n, ignore_eos=True,
                            structured=STRUCTURED.get(preset))
        sched.add(Sequence(f"r{i}", list(prompt), sp, arrival=now))

    t0 = time.perf_counter()
    for _ in range(min(in_flight or len(work), len(work))):
        arrive(t0)
    stamps: dict[str, list[float]] = {}
    with contextlib.ExitStack() as undo:
        if timings is not None:  # split each step() into its three parts
            for owner, attr in ((sched, "schedule"), (runner, "execute"), (sched, "update")):
                setattr(owner, attr, _timed(timings, attr, getattr(owner, attr)))
                undo.callback(delattr, owner, attr)  # back to the class's method
        while sched.has_work:
            outs = sched.step()
            now = time.perf_counter()
            for out in outs:
                stamps.setdefault(out.request_id, []).append(now)
                if out.finish_reason is not None and pending:
                    arrive(now)
            if timings is not None:
                timings["steps"] += 1
    wall = time.perf_counter() - t0
    total = sum(len(v) for v in stamps.values())
    assert total == sum(n for _, n in work), "every request must produce its tokens"
    return summarise(total, wall, [v[0] - arrival[r] for r, v in stamps.items()],
                     [b - a for v in stamps.values() for a, b in zip(v, v[1:])], sched.preemptions)


def _timed(spent: dict, name: str, fn, stack: list[str] | None = None):
    """``fn``, adding the seconds each call takes to ``spent[name]``; with ``stack`` (shared by the wrappers of one
    split), a call's seconds are its own: those of timed calls inside it (a quantized matmul inside a linear layer's
    forward) are taken out of it."""
    def wrapper(*a, **kw):
        if stack is not None:
            stack.append(name)
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            dt = time.perf_counter() - t
            spent[name] += dt
            if stack is not None:
                stack.pop()
                if stack:
                    spent[stack[-1]] -= dt
    return wrapper


def run_hf(model, work, dtype, batch: int | None = None, preset: str = "greedy") -> dict:
    """transformers ``generate`` over ``work`` in static batches of ``batch`` (all at once without)."""
    batch = batch or len(work)
    generated = 0
    ttft: list[float] = []
    itl: list[float] = []
    t0 = time.perf_counter()
    for start in range(0, len(work), batch):
        wave = work[start : start + batch]
        arrived = time.perf_counter()  # every client of the batch arrives once the last batch is answered
        n, times = _hf_batch(model, wave, preset)
        generated += n
        ttft += [times[0] - arrived] * len(wave)
        itl += [b - a for a, b in zip(times, times[1:])] * len(wave)
    wall = time.perf_counter() - t0
    res = summarise(generated, wall, ttft, itl, 0)
    res["requested_tok_s"] = sum(n for _, n in work) / wall  # the tokens the requests asked for
    return res


def _hf_batch(model, work, preset: str = "greedy") -> tuple[int, list[float]]:
    """One left-padded ``generate`` batch: (tokens generated, time of each step)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Stamp(StoppingCriteria):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kw):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    width = max(len(p) for p, _ in work)
    ids = torch.full((len(work), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(work):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    new = max(n for _, n in work)
    stamp = Stamp()
    temp, top_p, top_k = PRESETS[preset]
    # top_k=0 / top_p=1.0 spelled out: the model's generation config would otherwise add top_k=50.
    how = dict(do_sample=True, temperature=temp, top_p=top_p, top_k=top_k) if temp > 0 else dict(do_sample=False)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=2,
                             stopping_criteria=StoppingCriteriaList([stamp]), **how)
    return (out.shape[1] - width) * len(work), stamp.times


def set_native(runner: ModelRunner, on: bool) -> None:
    """Switch the native CPU kernels (decode attention and the fused ops) on or off."""
    runner.use_attention("native" if on else "gather")


def summarise(tokens: int, wall: float, ttft: list[float], itl: list[float], preemptions: int) -> dict:
    return {
        "tokens": tokens, "wall": wall, "tok_s": tokens / wall,
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "preemptions": preemptions,
    }


def load_hf(dtype: torch.dtype):
    import transformers

    path = smollm2_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype,
        quantization_config=transformers.GgufConfig(dequantize=True))  # dense weights, like zserve's
    return model.eval()


def _timed_split(runner: ModelRunner, sched: Scheduler, steps: int) -> None:
    """Wall-clock split of ``steps`` decode steps by component. torch's profiler does not see the
    native kernels (ctypes calls), so each component is timed at its Python entry point."""
    import collections

    from engine_worker import cpu_kernels
    from engine_worker.models import layers, native_decode, quant_linear

    spent: collections.Counter = collections.Counter()
    stack: list[str] = []

    patches = [(cpu_kernels, n, f"{n} (native)") for n in ("decode_attention", "add_rms_norm", "rope_and_store",
                                                             "silu_and_mul")]
    patches += [(layers.Linear, "forward", "linear layers (oneDNN, or the glue around qgemm)"),
                (quant_linear.QuantWeight, "matmul", "quantized matmuls (qgemm)"),
                (runner.sampler, "sample", "sampling"), (runner.attention, "plan", "step layout (plan)"),
                (native_decode, "run", "decoder layers (one native call)")]
    with contextlib.ExitStack() as undo:
        for owner, attr, label in patches:
            orig = getattr(owner, attr)
            setattr(owner, attr, _timed(spent, label, orig, stack))
            undo.callback(setattr, owner, attr, orig)
        n = len(sched.running)
        t = time.perf_counter()
        for _ in range(steps):
            sched.step()
        total = time.perf_counter() - t
    known = sum(spent.values())
    print(f"\nwall-clock split of {steps} decode steps of {n} sequences: {total / steps * 1e3:.1f} ms a step")
    for name, sec in spent.most_common():
        print(f"  {name:28s} {sec / steps * 1e3:6.2f} ms  {100 * sec / total:5.1f}%")
    print(f"  {'other (torch glue, Python)':28s} {(total - known) / steps * 1e3:6.2f} ms  "
          f"{100 * (total - known) / total:5.1f}%")


def profile_step(runner: ModelRunner, work, max_num_seqs: int, budget: int, preset: str = "greedy") -> None:
    """Bring C requests to steady decoding, then split ten decode steps' wall time by component
    and list the top torch ops of one."""
    print(f"\nprofile: {preset}")
    sched = Scheduler(runner, max_num_seqs, budget, grammars=GRAMMARS)
    temp, top_p, top_k = PRESETS[preset]
    for i, (prompt, n) in enumerate(work):
        sched.add(Sequence(f"p{i}", list(prompt), SamplingParams(temperature=temp, top_p=top_p, top_k=top_k,
                                                                 max_tokens=n, ignore_eos=True,
                                                                 structured=STRUCTURED.get(preset))))
    while any(s.in_prefill for s in sched.running) or sched.waiting:
        sched.step()
    for _ in range(20):  # some context, as mid-generation
        sched.step()
    _timed_split(runner, sched, 10)
    n = len(sched.running)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sched.step()
    print(f"\ntorch ops of one decode step ({n} sequences; native kernels are not listed):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    sched.abort_all("abort")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                    help="auto: a GGUF file's quantized weights stay quantized, as the server runs them")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--min-new", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--mode", nargs="+", choices=["burst", "sustained"], default=["burst", "sustained"])
    ap.add_argument("--waves", type=int, default=3, help="sustained traffic: requests per client")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="run every preset this many times, interleaved; "
                    "report medians of within-round ratios")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--torch-path", action="store_true",
                    help="also run zserve with its native CPU kernels off (the torch path), in the same run")
    ap.add_argument("--profile", action="store_true",
                    help="where a decode step's time goes, at the largest concurrency")
    ap.add_argument("--profile-concurrency", type=int, default=None, help="profile at this concurrency instead")
    ap.add_argument("--sampling", nargs="+", choices=list(PRESETS), default=[p for p in PRESETS if p not in STRUCTURED],
                    help="sampling presets, each run by both engines: greedy, t1 (temperature 1.0), t07p09 "
                         "(temperature 0.7, top_p 0.9), t07k40 (temperature 0.7, top_k 40); t1json: t1 constrained "
                         "by a JSON schema (structured output; transformers runs it unconstrained)")
    args = ap.parse_args()
    global GRAMMARS

    threads = configure_cpu_threads(args.threads)
    device = select_device(None)
    dtype = resolve_dtype(args.dtype, device)
    source = resolve(args.model)
    loaded = load_model(source, dtype, device, quantization=args.quantization)
    max_c = max(args.concurrency)
    engine = Engine.generation(loaded, device, dtype, EngineConfig(max_num_seqs=max_c, max_model_len=512,
                                                                   max_num_batched_tokens=args.max_num_batched_tokens),
                               tokenizer_json=tokenizer_json_loader(source.tokenizer_path))
    runner, GRAMMARS = engine.runner, engine.grammars
    hf = None if args.no_hf else load_hf(dtype)
    print(f"{loaded.model_id} on {device}, {dtype_name(dtype)}, {threads} threads; KV {runner.num_blocks} blocks "
          f"of {runner.block_size}; outputs {args.min_new}-{args.max_new} tokens; budget {args.max_num_batched_tokens}")

    warm = make_workload(4, 8, 8, seed=99)  # warm-up: first calls allocate and pick kernels
    run_zserve(runner, warm, max_c, args.max_num_batched_tokens)
    for preset in set(args.sampling) & set(STRUCTURED):  # and builds the grammar engine's vocabulary
        run_zserve(runner, warm, max_c, args.max_num_batched_tokens, preset=preset)
    if hf is not None:
        run_hf(hf, warm, dtype)

    rows = []
    rounds: dict[tuple[str, int, str], list[tuple[dict, dict | None]]] = {}  # per preset, (zserve, hf) by round
    for mode in args.mode:
        for c in args.concurrency:
            for _round, preset in [(r, p) for r in range(args.rounds) for p in args.sampling]:
                sustained = mode == "sustained"
                work = make_workload(c, args.min_new, args.max_new, args.seed,
                                     count=c * args.waves if sustained else c)
                timings = {"schedule": 0.0, "execute": 0.0, "update": 0.0, "steps": 0}
                z = run_zserve(runner, work, max_c, args.max_num_batched_tokens, timings,
                               in_flight=c if sustained else None, preset=preset)
                h = run_hf(hf, work, dtype, batch=c, preset=preset) if hf is not None else None
                if args.torch_path and runner.attention.name == "native":
                    set_native(runner, False)
                    z["torch_path_tok_s"] = run_zserve(runner, work, max_c, args.max_num_batched_tokens,
                                                       in_flight=c if sustained else None, preset=preset)["tok_s"]
                    set_native(runner, True)
                rows.append((mode, c, preset, len(work), z, h, timings))
                rounds.setdefault((mode, c, preset), []).append((z, h))
                print(f"  {mode} c={c} {preset}: zserve {z['tok_s']:.1f} tok/s"
                      + (f", transformers {h['tok_s']:.1f} tok/s" if h else "")
                      + (f", zserve without native kernels {z['torch_path_tok_s']:.1f} tok/s"
                         if "torch_path_tok_s" in z else ""),
                      flush=True)

    print("\n| traffic | concurrency | sampling | requests | zserve tok/s | transformers tok/s all / requested "
          "| ratio all / requested | zserve TTFT p50/p99 (s) | transformers TTFT p50 (s) | zserve ITL p50/p99 (ms) "
          "| transformers ITL p50/p99 (ms) | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, c, preset, n, z, h, _ in rows:
        hf_tok = f"{h['tok_s']:.1f} / {h['requested_tok_s']:.1f}" if h else "-"
        ratio = f"{z['tok_s'] / h['tok_s']:.2f}x / {z['tok_s'] / h['requested_tok_s']:.2f}x" if h else "-"
        hf_ttft = f"{h['ttft_p50']:.2f}" if h else "-"
        hf_itl = f"{h['itl_p50'] * 1e3:.1f} / {h['itl_p99'] * 1e3:.1f}" if h else "-"
        print(f"| {mode} | {c} | {preset} | {n} | {z['tok_s']:.1f} | {hf_tok} | {ratio} "
              f"| {z['ttft_p50']:.2f} / {z['ttft_p99']:.2f} "
              f"| {hf_ttft} | {z['itl_p50'] * 1e3:.1f} / {z['itl_p99'] * 1e3:.1f} | {hf_itl} | {z['preemptions']} |")
    if "greedy" in args.sampling and len(args.sampling) > 1:
        # Each round's runs against the same round's greedy run (noise on a shared machine comes in
        # waves; a ratio within one round cancels most of it), medians over the rounds.
        print(f"\nmedians over {args.rounds} round(s), each ratio taken within its round:\n")
        print("| traffic | concurrency | sampling | zserve tok/s | transformers tok/s | zserve sampled / greedy "
              "| transformers sampled / greedy | zserve / transformers |")
        print("|---|---|---|---|---|---|---|---|")
        med = statistics.median
        for (mode, c, preset), runs in rounds.items():
            base = rounds[(mode, c, "greedy")]
            t1 = rounds.get((mode, c, "t1"))
            zs = med(z["tok_s"] for z, _ in runs)
            z_ratio = med(z["tok_s"] / g["tok_s"] for (z, _), (g, _) in zip(runs, base))
            vs_t1 = (f" ({med(z['tok_s'] / t['tok_s'] for (z, _), (t, _) in zip(runs, t1)):.2f} of t1)"
                     if preset in STRUCTURED and t1 else "")
            if all(h is not None for _, h in runs):
                hs = f"{med(h['tok_s'] for _, h in runs):.1f}"
                h_ratio = f"{med(h['tok_s'] / gh['tok_s'] for (_, h), (_, gh) in zip(runs, base)):.2f}"
                zh = f"{med(z['tok_s'] / h['tok_s'] for z, h in runs):.2f}x"
            else:
                hs = h_ratio = zh = "-"
            print(f"| {mode} | {c} | {preset} | {zs:.1f} | {hs} | {z_ratio:.2f}{vs_t1} | {h_ratio} | {zh} |")
    print("\nzserve step time split (s): " + "; ".join(
        f"{mode} c={c}: schedule {t['schedule']:.2f}, execute {t['execute']:.2f}, update {t['update']:.2f} "
        f"over {t['steps']} steps" for mode, c, _, _, _, _, t in rows))
    if args.profile:
        c = args.profile_concurrency or max_c
        for preset in args.sampling:
            profile_step(runner, make_workload(c, args.min_new, args.max_new, args.seed + 1), max_c,
                         args.max_num_batched_tokens, preset)


if __name__ == "__main__":
    main()
