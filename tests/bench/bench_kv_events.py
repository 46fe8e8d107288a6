"""What KV cache events cost an engine step: the same sampled (temperature 1.0), concurrent batch (8 requests of
~195 prompt tokens, 300 output tokens each) run with the block manager telling its events (and each step's batch
encoded, as the publisher does) and without, alternated in one process.

Usage: .venv/bin/python tests/bench/bench_kv_events.py
"""
import time

import torch

from engine_worker.engine import Engine
from engine_worker.loader import load_model
from engine_worker.scheduler import run_until_done
from engine_worker.sequence import Sequence
from protocol.kv_events import encode_batch
from protocol.messages import SamplingParams
from zserve.catalog import resolve
from zserve.config import EngineConfig

src = resolve("tiny-random")
cpu = torch.device("cpu")
eng = Engine.generation(load_model(src, torch.float32, cpu), cpu, torch.float32,
                        EngineConfig(max_num_seqs=16, kv_cache_memory="256MiB"))
def run(tag, events):
    eng.scheduler.block_manager.events = events
    for i in range(8):
        eng.scheduler.add(Sequence(f"{tag}{i}", list(range(5 + i, 200 + i)),
                                   SamplingParams(temperature=1.0, max_tokens=300, ignore_eos=True)))
    t = time.perf_counter()
    def on_step(*a):
        if events:
            encode_batch(events)
            events.clear()
    run_until_done(eng.scheduler, on_step)
    return time.perf_counter() - t
run("w", None)
for k in range(3):
    print("off", round(run(f"a{k}", None),3), "on", round(run(f"b{k}", []),3))
