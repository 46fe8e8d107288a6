"""Migration figures: what a client sees when an engine dies under its stream, and what seeded sampling costs.

When an engine is SIGKILLed, each gateway moves the requests it was streaming from it to another engine of the
model (prompt + tokens so far); the stream goes on. This measures, each part beside a baseline from the same run:

  --gap     `launch api-server --count 2 --engines 2`, 16 seeded streams at T=1 with a long prompt; the engine with
            the most running requests is killed mid-stream. Per moved stream: the longest inter-chunk gap at the
            kill (spanning it, or beginning within a second after it: tokens sent before the death may still come
            after it), p50/p99/max, against the run's other inter-chunk intervals and the stream's own median one.
            Every stream must end with a finish_reason, no error event and all its tokens. --rerun: each moved
            request again without a kill (the same seed), to compare the texts.
  --soak    clients streaming back to back while a ready engine is killed every --every seconds; requests ok and
            failed, beside the same soak with --migration-limit 0 (streams on a killed engine fail). A kill is left
            out (and counted) when no other engine is ready (unless --kill-last), or when it would be its slot's
            5th death in 60 s, which the supervisor takes for a crash loop (--every 5: the last kills of 60 s).
  --seeded  the sampler in process (32 rows, vocabulary 49,152, T=1): a step of unseeded rows, of seeded rows
            (seeded_uniform), and of seeded rows drawing from a torch.Generator each, as before migration.
            --seeded-e2e adds one server's output tokens/s for 16 streams with and without a seed.

With no part named, all run (--seeded-e2e only when given). Rerun with:

    .venv/bin/python tests/bench/bench_migration.py --gap --rounds 3
    .venv/bin/python tests/bench/bench_migration.py --soak 60 --every 5 --clients 8
    .venv/bin/python tests/bench/bench_migration.py --seeded --seeded-e2e
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.children import CRASH_LOOP_FAILURES, CRASH_LOOP_WINDOW  # noqa: E402
from tests.helpers import Server, procs, wait_until  # noqa: E402

PROMPT = ("The old lighthouse keeper climbed the spiral stairs each evening, counting the steps, listening to the "
          "sea against the rocks below and the gulls above, and wrote down the weather in a leather book. ")
Table = list[tuple[str, str, str, str]]  # (measure, figure, baseline, ratio)


# -- streaming client ------------------------------------------------------------------------------------------

@dataclass
class Stream:
    """One streamed completion as the client saw it: each chunk's arrival (monotonic clock) and how it ended."""

    body: dict = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # each chunk's text
    finish: str | None = None
    tokens: int | None = None  # usage.completion_tokens
    error: str | None = None

    def ok(self, max_tokens: int) -> bool:
        return self.error is None and self.finish is not None and self.tokens == max_tokens

    def why(self) -> str:
        """How a stream that is not ok went wrong."""
        return self.error or f"finish_reason {self.finish}, {self.tokens} tokens"


def completion(model: str, prompt: str, max_tokens: int, seed: int | None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    return body if seed is None else {**body, "seed": seed}


async def stream(session: aiohttp.ClientSession, url: str, body: dict, out: Stream) -> Stream:
    """Read one SSE completion into ``out``, timing each chunk that carries a choice."""
    out.body = body
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.text())[:80]}"
                return out
            async for raw in r.content:
                _chunk(raw, out, time.monotonic())
    except (TimeoutError, aiohttp.ClientError) as e:
        out.error = f"{type(e).__name__}: {str(e)[:80]}"
    if out.error is None and out.finish is None:
        out.error = "stream ended without a finish_reason"
    return out


def _chunk(raw: bytes, out: Stream, now: float) -> None:
    line = raw.strip()
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
        return
    msg = orjson.loads(line[6:])
    if "error" in msg:
        out.error = str(msg["error"].get("message", msg["error"]))[:80]
        return
    if msg.get("usage"):
        out.tokens = msg["usage"]["completion_tokens"]
    for choice in msg.get("choices") or ():
        out.times.append(now)
        out.pieces.append(choice.get("text") or "")
        out.finish = choice.get("finish_reason") or out.finish


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=300),
                                 connector=aiohttp.TCPConnector(limit=0))


# -- server helpers ------------------------------------------------------------------------------------------

def start(model: str, engines: int, *extra: str, log_name: str) -> Server:
    return Server("--count", "2", "--engines", str(engines), "--model", model, "--dtype", "float32", *extra,
                  log_name=log_name)


def served_model(s: Server) -> str:
    import httpx

    return httpx.get(s.url + "/v1/models").json()["data"][0]["id"]


def ready_engines(s: Server) -> list[dict]:
    return [p for p in procs(s, "engine") if p["state"] == "ready"]


def wait_engines_ready(s: Server, n: int, timeout: float = 180) -> None:
    wait_until(lambda: len(ready_engines(s)) >= n, timeout, interval=0.2, what=f"{n} ready engines")


def metric(s: Server, name: str) -> float:
    """The sum of a counter over its labels, from the gateways' /metrics (0 if absent)."""
    import httpx

    text = httpx.get(s.url + "/metrics", timeout=30).text
    pat = re.compile(rf"^{name}(?:{{[^}}]*}})? (\S+)$")
    return sum(float(m.group(1)) for line in text.splitlines() if (m := pat.match(line)))


def migrations(s: Server) -> tuple[int, int]:
    """(requests moved, requests that lost their engine and failed) so far."""
    time.sleep(1.5)  # gateways flush their buffered counters about once a second
    return int(metric(s, "zserve_migrations_total")), int(metric(s, "zserve_migrations_exhausted_total"))


def pct(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1); nan for no data."""
    if not xs:
        return math.nan
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f} ms"


def ratio(a: float, b: float) -> str:
    return "-" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.2f}x"


# -- 1. the gap at a kill ------------------------------------------------------------------------------------

@dataclass
class GapRound:
    streams: list[Stream]
    killed_at: float
    victim_running: int
    moved: int  # zserve_migrations_total over the round
    exhausted: int
    replayed: list[tuple[int, int] | None] | None = None  # per moved stream, ``divergence`` from a rerun


async def gap_round(s: Server, model: str, n: int, max_tokens: int, warm_chunks: int, seed0: int) -> GapRound:
    before = migrations(s)
    streams = [Stream() for _ in range(n)]
    async with session() as http:
        tasks = [asyncio.create_task(stream(http, s.url, completion(model, f"Story {seed0 + i}: " + PROMPT * 8,
                                                                   max_tokens, seed0 + i), out))
                 for i, out in enumerate(streams)]  # (PROMPT * 8: about 300 tokens)
        while not all(len(x.times) >= warm_chunks or x.error for x in streams):
            await asyncio.sleep(0.05)
        victim = await asyncio.to_thread(_busiest_engine, s, n)
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        await asyncio.gather(*tasks)
    after = migrations(s)
    await asyncio.to_thread(_replaced, s, victim)
    return GapRound(streams, killed_at, victim.get("running") or 0, after[0] - before[0], after[1] - before[1])


def _busiest_engine(s: Server, n: int) -> dict:
    """The ready engine with the most running requests, once the engines report the streams (or after 15 s)."""
    deadline = time.monotonic() + 15
    while True:
        engines = ready_engines(s)
        if sum(p.get("running") or 0 for p in engines) >= n or time.monotonic() > deadline:
            return max(engines, key=lambda p: p.get("running") or 0)
        time.sleep(0.1)


def _replaced(s: Server, victim: dict) -> None:
    wait_until(lambda: any(p["index"] == victim["index"] and p["state"] == "ready" and p["pid"] != victim["pid"]
                           for p in procs(s, "engine")), 180, interval=0.2, what="the killed engine's replacement")


@dataclass
class StreamGap:
    stream: Stream
    gap: float  # the longest inter-chunk interval around the kill (``stream_gap``)
    start: float  # when that interval began, from the kill (< 0: it spans the kill)
    own_median: float  # the stream's median interval, that one left out
    others: list[float]  # its other intervals

    @property
    def ratio(self) -> float:
        return self.gap / self.own_median if self.own_median > 0 else math.inf


WINDOW = 1.0  # seconds after the kill in which a moved stream's gap may begin


def stream_gap(st: Stream, killed_at: float) -> StreamGap | None:
    """The longest interval of ``st`` that ends after the kill and begins before it or less than WINDOW after it:
    tokens the engine sent just before it died may still come after the kill, and the gap follows them. None for a
    stream that ended before the kill or had no chunk before it."""
    t = st.times
    near = [i for i in range(len(t) - 1) if t[i + 1] > killed_at and t[i] < killed_at + WINDOW]
    if not t or t[0] > killed_at or not near:
        return None
    i = max(near, key=lambda i: t[i + 1] - t[i])
    others = [b - a for j, (a, b) in enumerate(zip(t, t[1:])) if j != i]
    return StreamGap(st, t[i + 1] - t[i], t[i] - killed_at, statistics.median(others) if others else math.nan, others)


def moved_gaps(r: GapRound) -> tuple[list[StreamGap], list[float]]:
    """(the gaps of the streams that were on the killed engine, every other inter-chunk interval of the round).
    Moved streams: the ``r.moved`` streams whose gap is largest against their own median interval (the gateways'
    count), or those whose gap is over 5x it if the count is missing."""
    gaps = [g for st in r.streams if (g := stream_gap(st, r.killed_at))]
    gaps.sort(key=lambda g: g.ratio, reverse=True)
    moved = gaps[:r.moved] if r.moved else [g for g in gaps if g.ratio > 5]
    ordinary = [d for g in gaps for d in g.others] + [g.gap for g in gaps if g not in moved]
    for st in r.streams:
        if stream_gap(st, r.killed_at) is None:  # no chunk before the kill, or none after it
            ordinary += [b - a for a, b in zip(st.times, st.times[1:])]
    return moved, ordinary


async def replay(url: str, moved: list[StreamGap]) -> list[Stream]:
    """Each moved stream's request again (the same seed), with no kill."""
    async with session() as http:
        return await asyncio.gather(*(stream(http, url, g.stream.body, Stream()) for g in moved))


def divergence(first: Stream, again: Stream, killed_at: float) -> tuple[int, int] | None:
    """None if the two texts are the same, else (the chunk of ``first`` where they part, ``first``'s chunks before
    the kill). The engines run in float32 with other batch mates on a rerun, so a near tie between two tokens can
    part them anywhere; a part at the kill points at a token lost or repeated by the move."""
    a, b = "".join(first.pieces), "".join(again.pieces)
    if a == b:
        return None
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    end, chunk = 0, len(first.pieces)
    for i, piece in enumerate(first.pieces):
        end += len(piece)
        if end > at:
            chunk = i
            break
    return chunk, sum(t <= killed_at for t in first.times)


def run_gap(model: str, rounds: int, n: int, max_tokens: int, warm_chunks: int, rerun: bool) -> Table:
    s = start(model, 2, log_name="bench-migration-gap")
    results: list[GapRound] = []
    try:
        m = served_model(s)
        for k in range(rounds):
            wait_engines_ready(s, 2)
            r = asyncio.run(gap_round(s, m, n, max_tokens, warm_chunks, seed0=1000 * (k + 1)))
            results.append(r)
            failed = [st.why() for st in r.streams if not st.ok(max_tokens)]
            starts = [g.start for g in moved_gaps(r)[0]]
            print(f"round {k + 1}: killed an engine running {r.victim_running}; moved {r.moved}, "
                  f"failed to move {r.exhausted}; streams failed {len(failed)}; the moved ones' gaps began "
                  f"{ms(min(starts, default=math.nan))} to {ms(max(starts, default=math.nan))} from the kill",
                  flush=True)
            for why in Counter(failed).most_common(5):
                print(f"    {why[1]} x {why[0]}")
            if rerun:
                moved = moved_gaps(r)[0]
                again = asyncio.run(replay(s.url, moved))
                r.replayed = [divergence(g.stream, x, r.killed_at) for g, x in zip(moved, again)]
                parts = [f"chunk {d[0]} (kill after chunk {d[1]})" for d in r.replayed if d]
                print(f"    rerun: {len(moved) - len(parts)} of {len(moved)} moved streams the same"
                      + (f"; the others part at {', '.join(parts)}" if parts else ""), flush=True)
        if any(not st.ok(max_tokens) for r in results for st in r.streams):
            print("server log tail:\n" + s.tail(), flush=True)
    finally:
        s.stop()
    return gap_table(results, max_tokens)


def gap_table(results: list[GapRound], max_tokens: int) -> Table:
    moved: list[StreamGap] = []
    ordinary: list[float] = []
    for r in results:
        mv, od = moved_gaps(r)
        moved += mv
        ordinary += od
    gaps = [g.gap for g in moved]
    own = [g.ratio for g in moved]
    streams = [st for r in results for st in r.streams]
    failed = sum(not st.ok(max_tokens) for st in streams)
    tokens = sum(st.tokens or 0 for st in streams)
    expected = len(streams) * max_tokens
    p50, p99 = pct(ordinary, 0.5), pct(ordinary, 0.99)
    rows = [
        (f"gap at a kill: streams moved ({len(results)} kills)", f"{len(moved)} of {len(streams)}", "", ""),
        ("gap at a kill p50 (vs interval p50)", ms(pct(gaps, 0.5)), ms(p50), ratio(pct(gaps, 0.5), p50)),
        ("gap at a kill p99 (vs interval p99)", ms(pct(gaps, 0.99)), ms(p99), ratio(pct(gaps, 0.99), p99)),
        ("gap at a kill max (vs interval p99)", ms(pct(gaps, 1.0)), ms(p99), ratio(pct(gaps, 1.0), p99)),
        ("gap / the stream's own median p50, max", f"{pct(own, 0.5):.1f}x, {pct(own, 1.0):.1f}x", "1.0x", ""),
        ("streams failed (must be 0)", str(failed), "", ""),
        ("tokens received (vs expected)", str(tokens), str(expected), f"{tokens / expected:.3f}x"),
    ]
    replayed = [d for r in results if r.replayed is not None for d in r.replayed]
    if replayed:
        same = sum(d is None for d in replayed)
        rows.append(("moved streams the same as a rerun", f"{same} of {len(replayed)}", "", ""))
    return rows


# -- 2. repeated kills ---------------------------------------------------------------------------------------

@dataclass
class Soak:
    ok: int = 0
    failed: Counter = field(default_factory=Counter)
    kills: int = 0
    skipped: Counter = field(default_factory=Counter)  # kills left out, by why
    moved: int = 0
    exhausted: int = 0

    @property
    def share(self) -> float:
        total = self.ok + sum(self.failed.values())
        return self.ok / total if total else math.nan


async def soak_client(http: aiohttp.ClientSession, url: str, model: str, i: int, max_tokens: int, until: float,
                      tally: Soak) -> None:
    n = 0
    while time.monotonic() < until:
        n += 1
        st = await stream(http, url, completion(model, f"Client {i}, request {n}: " + PROMPT, max_tokens, None),
                          Stream())
        if st.ok(max_tokens):
            tally.ok += 1
        else:
            tally.failed[st.why()] += 1


def pick_victim(engines: list[dict], turn: int, deaths: dict[int, list[float]], kill_last: bool) -> dict | str:
    """Of the ready ``engines``, the one whose turn it is (alternating by slot) or another; or why none is killed:
    only one is ready (a moved request would have nowhere to go but a replacement; unless ``kill_last``), or the
    kill would make its slot crash-looping."""
    if not engines:
        return "none ready"
    if len(engines) < 2 and not kill_last:
        return "only one ready"
    now = time.monotonic()
    for p in sorted(engines, key=lambda p: (p["index"] < turn, p["index"])):  # slot `turn` first, then on round
        recent = [t for t in deaths.get(p["index"], []) if now - t < CRASH_LOOP_WINDOW]
        if len(recent) < CRASH_LOOP_FAILURES - 1:
            return p
    return "crash-loop guard"


async def killer(s: Server, every: float, until: float, kill_last: bool, tally: Soak) -> None:
    """A kill every ``every`` seconds on a fixed beat. `launch status` takes a second or two on a busy machine, so
    the ready engines come from a poll running beside it, less those already killed."""
    ready: list[dict] = []
    killed: set[int] = set()

    async def poll() -> None:
        nonlocal ready
        while True:
            ready = await asyncio.to_thread(ready_engines, s)

    poller = asyncio.create_task(poll())
    deaths: dict[int, list[float]] = {}
    turn = 0
    t0 = time.monotonic()
    for k in range(1, math.ceil((until - t0) / every)):  # kills strictly inside the soak
        await asyncio.sleep(max(0.0, t0 + k * every - time.monotonic()))
        victim = pick_victim([p for p in ready if p["pid"] not in killed], turn, deaths, kill_last)
        if isinstance(victim, str):
            tally.skipped[victim] += 1
            print(f"  {time.monotonic() - t0:5.1f} s: kill left out ({victim})", flush=True)
            continue
        os.kill(victim["pid"], signal.SIGKILL)
        print(f"  {time.monotonic() - t0:5.1f} s: killed engine {victim['index']} "
              f"(running {victim.get('running') or 0})", flush=True)
        killed.add(victim["pid"])
        deaths.setdefault(victim["index"], []).append(time.monotonic())
        tally.kills += 1
        turn = victim["index"] + 1
    poller.cancel()


async def soak_load(s: Server, model: str, seconds: float, every: float, kill_last: bool, clients: int,
                    max_tokens: int) -> Soak:
    tally = Soak()
    until = time.monotonic() + seconds
    async with session() as http:
        await asyncio.gather(killer(s, every, until, kill_last, tally),
                             *(soak_client(http, s.url, model, i, max_tokens, until, tally) for i in range(clients)))
    return tally


def run_soak(model: str, seconds: float, every: float, kill_last: bool, clients: int, max_tokens: int,
             limit: int | None) -> Soak:
    extra = ("--migration-limit", str(limit)) if limit is not None else ()
    s = start(model, 2, *extra, log_name=f"bench-migration-soak{'' if limit is None else limit}")
    try:
        m = served_model(s)
        before = migrations(s)
        tally = asyncio.run(soak_load(s, m, seconds, every, kill_last, clients, max_tokens))
        after = migrations(s)
        tally.moved, tally.exhausted = after[0] - before[0], after[1] - before[1]
        label = "migration off" if limit == 0 else "migration on"
        print(f"soak ({label}): {tally.ok} ok, {sum(tally.failed.values())} failed, kills {_kills(tally)}, "
              f"moved {tally.moved}, failed to move {tally.exhausted}", flush=True)
        for why, k in tally.failed.most_common(5):
            print(f"    {k} x {why}")
        if limit != 0 and tally.failed:
            print("server log tail:\n" + s.tail(), flush=True)
    finally:
        s.stop()
    return tally


def _kills(t: Soak) -> str:
    """"5 (1 left out: only one ready)"."""
    why = ", ".join(f"{k} {why}" if len(t.skipped) > 1 else why for why, k in t.skipped.items())
    return f"{t.kills}" + (f" ({t.skipped.total()} left out: {why})" if t.skipped else "")


def soak_table(on: Soak, off: Soak | None) -> Table:
    def share(t: Soak | None) -> str:
        return "-" if t is None else f"{t.share * 100:.1f}%"

    def counts(t: Soak | None) -> str:
        return "-" if t is None else f"{t.ok} ok / {sum(t.failed.values())} failed"

    return [
        ("soak: requests ok / failed (vs limit 0)", counts(on), counts(off), ""),
        ("soak: share completed (vs limit 0)", share(on), share(off),
         "-" if off is None else ratio(on.share, off.share)),
        ("soak: kills", _kills(on), "-" if off is None else _kills(off), ""),
        ("soak: requests moved / failed to move", f"{on.moved} / {on.exhausted}",
         "-" if off is None else f"{off.moved} / {off.exhausted}", ""),
    ]


# -- 3. the seeded path --------------------------------------------------------------------------------------

def seeded_micro(steps: int, warmup: int, batch: int, vocab: int) -> Table:
    import torch

    from engine_worker.sampler import Sampler
    from protocol.messages import SamplingParams

    @dataclass
    class Row:  # as tests/unit/test_sampler.py's
        sampling: SamplingParams
        prompt_ids: list[int] = field(default_factory=list)
        past_output_ids: list[int] = field(default_factory=list)
        grammar: object | None = None

    class GeneratorSampler(Sampler):
        """The draws before migration: each seeded row from its own ``torch.Generator`` (made once per request)."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.generators: dict[int, torch.Generator] = {}

        def _uniforms(self, rows, dev):
            u = torch.empty(len(rows), dtype=torch.float64, device=dev)
            shared = [i for i, r in enumerate(rows) if r.sampling.seed is None]
            if shared:
                u[shared] = torch.rand(len(shared), generator=self._shared, device=dev).double()
            for i, r in enumerate(rows):
                if r.sampling.seed is not None:
                    if id(r) not in self.generators:
                        self.generators[id(r)] = torch.Generator(device=dev).manual_seed(r.sampling.seed)
                    u[i] = torch.rand(1, generator=self.generators[id(r)], device=dev, dtype=torch.float64)[0]
            return u

    cpu = torch.device("cpu")
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3
    kinds = {
        "unseeded": (Sampler(vocab, [0], cpu), [Row(SamplingParams(temperature=1.0)) for _ in range(batch)]),
        "seeded": (Sampler(vocab, [0], cpu), [Row(SamplingParams(temperature=1.0, seed=i)) for i in range(batch)]),
        "old seeded": (GeneratorSampler(vocab, [0], cpu),
                       [Row(SamplingParams(temperature=1.0, seed=i)) for i in range(batch)]),
    }
    step: dict[str, list[float]] = {k: [] for k in kinds}
    draw: dict[str, list[float]] = {k: [] for k in kinds}
    names = list(kinds)
    for n in range(warmup + steps):
        for k in names[n % 3:] + names[:n % 3]:  # rotate the order: no kind always runs first
            sampler, rows = kinds[k]
            x = logits.clone()
            t0 = time.perf_counter()
            outs = sampler.sample(x, rows)
            t1 = time.perf_counter()
            sampler._uniforms(rows, cpu)  # the uniforms alone (the new seeded ones at the same positions again)
            t2 = time.perf_counter()
            for r, o in zip(rows, outs):
                r.past_output_ids.append(o.token_id)
            if n >= warmup:
                step[k].append(t1 - t0)
                draw[k].append(t2 - t1)
    med = {k: statistics.median(v) for k, v in step.items()}
    dmed = {k: statistics.median(v) for k, v in draw.items()}
    print(f"sampler, {batch} rows x {vocab}, T=1, median of {steps} steps: "
          + ", ".join(f"{k} {med[k] * 1000:.2f} ms (uniforms {dmed[k] * 1e6:.0f} us)" for k in names), flush=True)
    return [
        ("sampler step: seeded (vs unseeded)", f"{med['seeded'] * 1000:.2f} ms", f"{med['unseeded'] * 1000:.2f} ms",
         f"{med['seeded'] / med['unseeded']:.3f}x"),
        ("sampler step: seeded (vs old seeded)", f"{med['seeded'] * 1000:.2f} ms",
         f"{med['old seeded'] * 1000:.2f} ms", f"{med['seeded'] / med['old seeded']:.3f}x"),
        ("uniforms alone: seeded (vs unseeded)", f"{dmed['seeded'] * 1e6:.0f} us",
         f"{dmed['unseeded'] * 1e6:.0f} us", ratio(dmed["seeded"], dmed["unseeded"])),
        ("uniforms alone: seeded (vs old seeded)", f"{dmed['seeded'] * 1e6:.0f} us",
         f"{dmed['old seeded'] * 1e6:.0f} us", f"{dmed['seeded'] / dmed['old seeded']:.2f}x"),
    ]


async def burst(url: str, model: str, n: int, max_tokens: int, seeded: bool, seed0: int) -> tuple[float, int]:
    """(output tokens/s, failed streams) of ``n`` concurrent streams."""
    async with session() as http:
        t0 = time.monotonic()
        done = await asyncio.gather(*(stream(http, url, completion(model, f"Story {seed0 + i}: " + PROMPT, max_tokens,
                                                                   seed0 + i if seeded else None), Stream())
                                      for i in range(n)))
        wall = time.monotonic() - t0
    return sum(st.tokens or 0 for st in done) / wall, sum(not st.ok(max_tokens) for st in done)


def seeded_e2e(model: str, rounds: int, n: int, max_tokens: int) -> Table:
    s = Server("--count", "1", "--engines", "1", "--model", model, "--dtype", "float32",
               log_name="bench-migration-seeded")
    rates: dict[bool, list[float]] = {True: [], False: []}
    failed = 0
    try:
        m = served_model(s)
        asyncio.run(burst(s.url, m, n, 16, False, 0))  # warm up
        for k in range(rounds):
            for seeded in ((True, False) if k % 2 else (False, True)):
                rate, bad = asyncio.run(burst(s.url, m, n, max_tokens, seeded, 100 * k))
                rates[seeded].append(rate)
                failed += bad
        print("e2e tokens/s: seeded " + ", ".join(f"{x:.0f}" for x in rates[True])
              + "; unseeded " + ", ".join(f"{x:.0f}" for x in rates[False]) + f"; failed streams {failed}", flush=True)
    finally:
        s.stop()
    a, b = statistics.median(rates[True]), statistics.median(rates[False])
    return [(f"e2e output tok/s, {n} streams: seeded (vs unseeded)", f"{a:.0f}", f"{b:.0f}", f"{a / b:.3f}x")]


# -- main ------------------------------------------------------------------------------------------------------

def print_table(rows: Table) -> None:
    w = max(len(r[0]) for r in rows)
    cols = [max(len(r[i]) for r in rows + [("", "figure", "baseline", "ratio")]) for i in (1, 2, 3)]
    print(f"\n{'measure':{w}}  {'figure':>{cols[0]}}  {'baseline':>{cols[1]}}  {'ratio':>{cols[2]}}")
    for name, fig, base, rat in rows:
        print(f"{name:{w}}  {fig:>{cols[0]}}  {base:>{cols[1]}}  {rat:>{cols[2]}}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--gap", action="store_true", help="the gap a kill leaves in the streams on the killed engine")
    p.add_argument("--rounds", type=int, default=3, help="--gap: engine kills, one per round")
    p.add_argument("--streams", type=int, default=16, help="--gap: concurrent streams")
    p.add_argument("--max-tokens", type=int, default=1000, help="--gap: tokens per stream")
    p.add_argument("--warm-chunks", type=int, default=30, help="--gap: chunks every stream has before the kill")
    p.add_argument("--rerun", action="store_true",
                   help="--gap: rerun each moved stream's request without a kill and compare the texts")
    p.add_argument("--soak", type=float, nargs="?", const=60.0, default=None, metavar="SECONDS",
                   help="repeated kills under load for SECONDS (60)")
    p.add_argument("--every", type=float, default=5.0, help="--soak: seconds between kills")
    p.add_argument("--clients", type=int, default=8, help="--soak: concurrent streaming clients")
    p.add_argument("--kill-last", action="store_true",
                   help="--soak: kill the only ready engine too (moved requests then wait for its replacement, "
                        "up to the server's --scaling-wait)")
    p.add_argument("--soak-tokens", type=int, default=200, help="--soak: tokens per request")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="--soak: also soak with --migration-limit 0")
    p.add_argument("--seeded", action="store_true", help="the sampler's seeded path, in process")
    p.add_argument("--steps", type=int, default=200, help="--seeded: timed sampler steps per kind")
    p.add_argument("--seeded-e2e", action="store_true", help="output tokens/s of one server, seeded or not")
    p.add_argument("--e2e-rounds", type=int, default=3)
    a = p.parse_args()
    if not (a.gap or a.soak is not None or a.seeded or a.seeded_e2e):
        a.gap, a.soak, a.seeded = True, 60.0, True
    rows: Table = []
    if a.seeded:
        rows += seeded_micro(a.steps, warmup=20, batch=32, vocab=49152)
    if a.seeded_e2e:
        rows += seeded_e2e(a.model, a.e2e_rounds, 16, 256)
    if a.gap:
        rows += run_gap(a.model, a.rounds, a.streams, a.max_tokens, a.warm_chunks, a.rerun)
    if a.soak is not None:
        on = run_soak(a.model, a.soak, a.every, a.kill_last, a.clients, a.soak_tokens, None)
        off = run_soak(a.model, a.soak, a.every, a.kill_last, a.clients, a.soak_tokens, 0) if a.baseline else None
        rows += soak_table(on, off)
    print_table(rows)


if __name__ == "__main__":
    main()
