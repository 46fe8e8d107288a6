"""The prefix router's CPU cost per request in a gateway, against the load policy's pick in the same run.

Usage:
    .venv/bin/python tests/bench/bench_router_cpu.py [--engines 2] [--prompt-len 1088] [--prefix-len 1024]

Per request the prefix policy (``gateway.routing``) hashes the prompt's blocks while some engine holds them and scores
the engines; every gateway also applies each engine's KV event batches (``gateway.kv_index``): the BlockStored of the
blocks the request's prefill filled (one event per block, as the engines publish them) and later the BlockRemoved of
the blocks it evicted. Both are timed here on the prefix-repetition shape (8 prefixes; a request's prefix held by one
engine), beside the load policy's pick (its baseline).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.kv_index import EngineBlocks  # noqa: E402
from gateway.routing import Router  # noqa: E402
from protocol.kv_events import BlockRemoved, BlockStored, chain_root, encode_batch, prefix_hashes  # noqa: E402

BS = 16


def per_call(fn, n: int) -> float:
    """Microseconds per call of ``fn`` (the best of 3 runs of ``n``)."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for i in range(n):
            fn(i)
        best = min(best, time.perf_counter() - t)
    return best / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=1088)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("-n", type=int, default=2000)
    args = ap.parse_args()
    rng = random.Random(0)
    root = chain_root("m")
    prefixes = [[rng.randrange(50000) for _ in range(args.prefix_len)] for _ in range(8)]
    prompts = [p + [rng.randrange(50000) for _ in range(args.prompt_len - args.prefix_len)]
               for p in prefixes for _ in range(8)]
    engines = [SimpleNamespace(endpoint=f"e{i}", rank=i, outstanding=0, sent_since_stats=0, load=0,
                               hello=SimpleNamespace(kv_block_size=BS, model_id="m"),
                               stats=SimpleNamespace(running=2, waiting=0, kv_blocks_total=0))
               for i in range(args.engines)]
    followers = {e.endpoint: SimpleNamespace(state=EngineBlocks()) for e in engines}
    for k, p in enumerate(prefixes):  # each prefix held by one engine, as prefix routing leaves them
        held = followers[engines[k % len(engines)].endpoint].state
        held.apply(encode_batch([BlockStored(tuple(prefix_hashes(p, BS, root)), root, tuple(p), BS)]))
    prefix, load = Router("prefix", followers=followers), Router("load", followers=followers)
    pick_prefix = per_call(lambda i: prefix.pick(engines, prompts[i % len(prompts)], "m", None), args.n)
    pick_load = per_call(lambda i: load.pick(engines, prompts[i % len(prompts)], "m", None), args.n)

    # A request's events: on arrival one BlockStored of its prompt's full blocks (told again when cached: a touch),
    # and a BlockRemoved per block evicted for the blocks it filled.
    new_blocks = -(-(args.prompt_len - args.prefix_len) // BS)
    n_blocks = args.prompt_len // BS
    cached = prefix_hashes(prefixes[0], BS, root)

    def arrival(hashes):
        return encode_batch([BlockStored(tuple(hashes), root, tuple(range(BS * len(hashes))), BS)])

    stored = arrival([*cached, *(rng.getrandbits(63) for _ in range(n_blocks - len(cached)))])
    removed = encode_batch([BlockRemoved(tuple(rng.getrandbits(63) for _ in range(new_blocks)))])
    cold = arrival([rng.getrandbits(63) for _ in range(n_blocks)])
    st = EngineBlocks()
    apply_warm = per_call(lambda i: (st.apply(stored), st.apply(removed)), args.n // 4)
    apply_cold = per_call(lambda i: st.apply(cold), args.n // 4)
    print(f"{args.engines} engines, {args.prompt_len}-token prompts sharing {args.prefix_len}-token prefixes "
          f"({args.prompt_len // BS} blocks); per request, in one gateway:")
    print("| what | µs per request | / load policy's pick |")
    print("|---|---|---|")
    print(f"| load policy: pick | {pick_load:.1f} | 1.00x |")
    print(f"| prefix policy: pick (hash {args.prefix_len // BS + 1} blocks, score) | {pick_prefix:.1f} | "
          f"{pick_prefix / pick_load:.1f}x |")
    print(f"| events of a request with its prefix cached ({n_blocks} told stored, {new_blocks} removed) | "
          f"{apply_warm:.1f} | {apply_warm / pick_load:.1f}x |")
    print(f"| events of a cold request ({n_blocks} blocks stored) | {apply_cold:.1f} | "
          f"{apply_cold / pick_load:.1f}x |")


if __name__ == "__main__":
    main()
