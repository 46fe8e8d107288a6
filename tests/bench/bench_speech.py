"""Speech to text: zserve's speech engine against faster-whisper alone on the same weights, alternating (issue 34).

Usage:
    .venv/bin/python tests/bench/bench_speech.py [--model whisper-base] [--rounds 2] [--concurrency 1 8]
    .venv/bin/python tests/bench/bench_speech.py --make-run-cost

Needs ``faster-whisper`` (``pip install -e '.[peers]'``) and espeak-ng. The recordings: espeak-ng reading
``tests/speech.py``'s sentences, cut into recordings of about 45 s (two windows each; different text in each so
no cache helps). Both sides decode as faster-whisper does by default, except the beam: greedy (``beam_size=1``,
the OpenAI API's way), with the temperature fallback, the previous window's text as context, segment timestamps,
no voice-activity filter, int8 weights on the CPU with as many threads as cores.

- ``zserve``: ``launch api-server --count 1 --model MODEL`` (one gateway, one speech engine); each request is the
  openai SDK's ``audio.transcriptions.create`` of one recording from a thread of its own.
- ``faster-whisper``: ``WhisperModel(dir, compute_type="int8", cpu_threads=cores)`` in this process, each request
  one ``transcribe`` from a thread of its own. With ``num_workers=1`` (its default) concurrent calls take turns;
  ``faster-whisper xN`` is the same with ``num_workers=N`` (N model replicas' worth of workers, each with
  cores/N threads), the way to run it concurrently. The better of the two is the baseline at concurrency N.

The figure is the real-time factor: seconds of audio transcribed per second of wall time, over ``2 x concurrency``
requests (at least 4). zserve's server is stopped while faster-whisper runs, and the other way round.

``--make-run-cost``: what ``make run``'s models cost with and without the speech model: seconds from ``launch
api-server`` to the ready line, and the resident memory (PSS) of all its processes after one request to each model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.helpers import Server  # noqa: E402
from tests.speech import SENTENCES, concat_wavs, duration, speak, wer, words  # noqa: E402
from zserve.catalog import resolve  # noqa: E402


def recordings(root: Path, n: int) -> list[tuple[Path, str, float]]:
    """``n`` recordings of ~45 s: (path, script, seconds). Each starts at another sentence."""
    parts = [speak(s, root / f"part{i}.wav") for i, s in enumerate(SENTENCES)]
    out = []
    for k in range(n):
        chosen = [(k * 5 + j) % len(SENTENCES) for j in range(9)]
        path = concat_wavs([parts[i] for i in chosen], root / f"rec{k}.wav")
        out.append((path, " ".join(SENTENCES[i] for i in chosen), duration(path)))
    return out


def run_zserve(url: str, recs, concurrency: int) -> tuple[float, float]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def one(rec):
        with open(rec[0], "rb") as f:
            return client.audio.transcriptions.create(model=model, file=f).text

    return timed(one, recs, concurrency)


def run_faster_whisper(model, recs, concurrency: int) -> tuple[float, float]:
    def one(rec):
        segments, _ = model.transcribe(str(rec[0]), beam_size=1, vad_filter=False)
        return "".join(s.text for s in segments)

    return timed(one, recs, concurrency)


def timed(one, recs, concurrency: int) -> tuple[float, float]:
    """(real-time factor, mean word error rate) of every recording, ``concurrency`` at a time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        texts = list(pool.map(one, recs))
    wall = time.perf_counter() - start
    return sum(r[2] for r in recs) / wall, statistics.mean(wer(r[1], t) for r, t in zip(recs, texts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="whisper-base")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--make-run-cost", action="store_true")
    args = ap.parse_args()
    if args.make_run_cost:
        make_run_cost()
        return
    from faster_whisper import WhisperModel

    cores = len(os.sched_getaffinity(0))
    source = resolve(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-speech-"))
    n = max(4, 2 * max(args.concurrency))
    recs = recordings(work, n)
    print(f"{n} recordings, {sum(r[2] for r in recs):.0f} s of audio; {args.model}; {cores} cores", flush=True)
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for rnd in range(args.rounds):
        server = Server("--count", "1", "--model", args.model, log_name="bench-speech")
        try:
            run_zserve(server.url, recs[:1], 1)  # warm-up
            for c in args.concurrency:
                results.setdefault(("zserve", c), []).append(run_zserve(server.url, recs[: max(4, 2 * c)], c))
                print(f"round {rnd} zserve c={c}: {results[('zserve', c)][-1]}", flush=True)
        finally:
            server.stop()
        for c in args.concurrency:
            for workers in sorted({1, c}):
                model = WhisperModel(source.path, device="cpu", compute_type="int8",
                                     cpu_threads=max(1, cores // workers), num_workers=workers)
                run_faster_whisper(model, recs[:1], 1)  # warm-up
                name = "faster-whisper" if workers == 1 else f"faster-whisper x{workers}"
                results.setdefault((name, c), []).append(run_faster_whisper(model, recs[: max(4, 2 * c)], c))
                print(f"round {rnd} {name} c={c}: {results[(name, c)][-1]}", flush=True)
                del model
    print("\n| concurrency | server | real-time factor (median) | vs faster-whisper | word error rate |")
    print("|---|---|---|---|---|")
    for c in args.concurrency:
        names = [k[0] for k in results if k[1] == c]
        best = max(statistics.median(r[0] for r in results[(nm, c)]) for nm in names if nm != "zserve")
        for nm in names:
            rtf = statistics.median(r[0] for r in results[(nm, c)])
            err = statistics.mean(r[1] for r in results[(nm, c)])
            print(f"| {c} | {nm} | {rtf:.1f}x | {rtf / best:.2f}x | {err:.1%} |")


def tree_pss(pid: int) -> float:
    """MiB of proportional set size of a process and its descendants."""
    total = 0
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total / (1 << 20)


def make_run_cost() -> None:
    import httpx

    speech = Path(tempfile.mkdtemp()) / "hello.wav"
    speak(SENTENCES[0], speech)
    base = ["SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"]
    for models in (base, [*base, "whisper-base"]):
        args = [a for m in models for a in ("--model", m)]
        t0 = time.monotonic()
        server = Server("--count", "2", *args, log_name="make-run-cost")
        ready = time.monotonic() - t0
        try:
            httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
                "model": base[0], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
            httpx.post(server.url + "/v1/embeddings", timeout=120, json={"model": base[1], "input": "hi"})
            if len(models) > 2:
                r = httpx.post(server.url + "/v1/audio/transcriptions", timeout=120, data={"model": models[2]},
                               files={"file": ("hello.wav", speech.read_bytes())})
                assert words(r.json()["text"]), r.text
            pss = tree_pss(server.proc.pid)
        finally:
            server.stop()
        print(f"{' + '.join(models)}: ready in {ready:.1f} s, {pss:.0f} MiB PSS (all processes)", flush=True)


if __name__ == "__main__":
    threading.excepthook = lambda a: print(a, file=sys.stderr)
    main()
