"""zserve against llama.cpp's Python server on the same GGUF file, alternating, through the openai SDK (issue 32).

Usage:
    .venv/bin/python tests/bench/bench_llamacpp.py [--types Q4_1 Q8_0] [--rounds 2] [--concurrency 1 8 32]

Needs ``llama-cpp-python`` (``pip install -e '.[peers]'``, built from source); files other than the shipped Q4_1
are written by ``tests/bench/make_quants.py``. Each round starts, per file, the servers one after the other (never
together: they would share the 2 cores) and sends each the same traffic:

- ``zserve``: ``launch api-server --count 1 --model FILE`` (``--quantization auto``, the default: weights kept
  quantized; ``--dtype auto``: bf16 activations on a CPU with native bf16, the weights formed as bf16 in the kernel);
- ``zserve-f32``: the same with ``--dtype float32`` (float32 activations: the dequantized float32 model's numbers;
  not run unless named in ``--servers``);
- ``zserve-dequant``: the same with ``--quantization none`` (every weight dequantized to bf16: the path before);
- ``llama.cpp``: ``python -m llama_cpp.server --model FILE --n_threads 2``.

The traffic users send: completions streamed, sampled (temperature 1.0), each with a long prompt of its own (about
400 tokens, distinct from its first token so no prefix cache serves another's), EOS banned by ``logit_bias`` so
every request writes exactly ``--max-tokens``. At concurrency 1: each stream's TTFT and its decode rate after the
first token (median of ``--streams``); at 8 and 32: the aggregate output tokens/s of ``2 x concurrency`` requests.
The engine's resident memory (zserve's engine process, llama.cpp's server) is read after the warm-up request and
after the traffic; zserve's KV cache is ``--kv-cache-memory`` (default 1GiB) for both of its paths.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.make_quants import DEFAULT_DIR, make  # noqa: E402
from tests.helpers import free_port  # noqa: E402

STORY = ("The harbour town kept its lamps lit through the winter, and every evening the keeper walked the length of "
         "the quay to trim each wick, counting the boats that had come home and the ones that had not. ")
EOS = 2  # SmolLM2's <|im_end|>


def prompt(i: int) -> str:
    return f"Story {i}. " + STORY * 9 + "Tell what happened next, in detail."


def start(kind: str, path: Path, port: int, max_seqs: int, kv_cache_memory: str) -> subprocess.Popen:
    if kind == "llama.cpp":
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--n_threads", "2",
               "--n_threads_batch", "2", "--n_ctx", "8192", "--host", "127.0.0.1", "--port", str(port)]
    else:
        cmd = [sys.executable, "-m", "launch", "api-server", "--host", "127.0.0.1", "--port", str(port), "--count",
               "1", "--model", str(path), "--max-num-seqs", str(max_seqs), "--kv-cache-memory", kv_cache_memory,
               "--quantization", "none" if kind == "zserve-dequant" else "auto",
               *(["--dtype", "float32"] if kind == "zserve-f32" else [])]
    log = Path(tempfile.gettempdir()) / f"bench-llamacpp-{kind}-{port}.log"  # (its log, for a server that fails)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


def engine_rss(proc: subprocess.Popen) -> float:
    """MiB resident in the process that holds the weights: the largest of the server and its descendants."""
    root = psutil.Process(proc.pid)
    return max(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20


async def stream(client, model: str, i: int, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT, decode seconds after the first token, tokens) of one streamed completion."""
    t0 = time.monotonic()
    first = last = None
    tokens = 0
    async for c in await client.completions.create(model=model, prompt=prompt(i), max_tokens=max_tokens,
                                                   temperature=1.0, stream=True, logit_bias={str(EOS): -100}):
        if c.choices and c.choices[0].text:
            last = time.monotonic()
            first = first or last
            tokens += 1
    return (first or t0) - t0, (last or t0) - (first or t0), tokens


async def traffic(url: str, model: str, concurrency: int, n: int, max_tokens: int, base: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int):
        async with sem:
            return await stream(client, model, base + i, max_tokens)

    t = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.monotonic() - t
    await client.close()
    return {"ttft": statistics.median(r[0] for r in results),
            "decode": statistics.median((r[2] - 1) / r[1] for r in results if r[1] > 0),
            "aggregate": n * max_tokens / wall}


def run_server(kind: str, path: Path, args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(kind, path, port, max(args.concurrency), args.kv_cache_memory)
    try:
        wait_ready(url, proc)
        import httpx

        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        asyncio.run(traffic(url, model, 1, 1, 8, 10_000))  # warm-up
        out = {"idle_rss": engine_rss(proc)}
        for c in args.concurrency:
            n, tokens = (args.streams, args.max_tokens) if c == 1 else (2 * c, args.max_tokens // 2)
            out[c] = asyncio.run(traffic(url, model, c, n, tokens, 1000 * c))
        out["rss"] = engine_rss(proc)
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--streams", type=int, default=4, help="streams at concurrency 1")
    ap.add_argument("--max-tokens", type=int, default=128, help="per request at concurrency 1 (half above it)")
    ap.add_argument("--servers", nargs="+", default=["zserve", "zserve-dequant", "llama.cpp"])
    ap.add_argument("--kv-cache-memory", default="1GiB", help="zserve's KV cache (float32 with --dtype float32 on "
                    "a CPU, bf16 dequantized: half the tokens for the same bytes)")
    args = ap.parse_args()
    files = {kind: make(kind, DEFAULT_DIR) for kind in args.types}
    rows: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for kind, path in files.items():
            for server in args.servers:
                res = run_server(server, path, args)
                rows.setdefault((kind, server), []).append(res)
                c1 = res.get(1)
                print(f"round {r + 1} {kind} {server}: " + (f"c=1 decode {c1['decode']:.1f} tok/s, TTFT "
                      f"{c1['ttft'] * 1000:.0f} ms; " if c1 else "") + "; ".join(
                      f"c={c} {res[c]['aggregate']:.0f} tok/s" for c in args.concurrency if c != 1)
                      + f"; RSS {res['idle_rss']:.0f} MiB after one request, {res['rss']:.0f} after all", flush=True)
    print("\nMedians over rounds; ratios against llama.cpp (decode at c=1) and against zserve-dequant (aggregate).")
    print("| file | server | c=1 decode tok/s | vs llama.cpp | TTFT ms | "
          + " | ".join(f"c={c} tok/s | vs dequant" for c in args.concurrency if c != 1)
          + " | engine RSS MiB (one request / all) |")
    print("|---|---|---|---|---|" + "---|---|" * (len(args.concurrency) - 1) + "---|")
    med = {key: {c: {m: statistics.median(x[c][m] for x in v) for m in ("decode", "ttft", "aggregate")}
                 for c in args.concurrency} | {k: statistics.median(x[k] for x in v) for k in ("rss", "idle_rss")}
           for key, v in rows.items()}
    for (kind, server), m in med.items():
        peer, base = med.get((kind, "llama.cpp")), med.get((kind, "zserve-dequant"))
        cells = [f"{m[1]['decode']:.1f}", f"{m[1]['decode'] / peer[1]['decode']:.2f}x" if peer else "",
                 f"{m[1]['ttft'] * 1000:.0f}"] if 1 in args.concurrency else ["", "", ""]
        for c in args.concurrency:
            if c != 1:
                ratio = f"{m[c]['aggregate'] / base[c]['aggregate']:.2f}x" if base else ""
                cells += [f"{m[c]['aggregate']:.0f}", ratio]
        print(f"| {kind} | {server} | " + " | ".join(cells) + f" | {m['idle_rss']:.0f} / {m['rss']:.0f} |")


if __name__ == "__main__":
    main()
