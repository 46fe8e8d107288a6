"""What a streamed token costs a gateway in Python, in one process, without sockets (issue 32's per-token floor).

The engine reader's whole path for a step of 64 streams, one token each, 256 steps: the codec decodes the engine's
``StepOutputs`` frame, ``EngineClient`` delivers each output to its choice, the choice's ``TextPipeline`` turns it
into text (SmolLM2's tokenizer, token timers on), the chat shape writes the chunk (``ChatShape.delta_json``) and a
real ``EventWriter`` frames it for a transport that drops it. The same frames decoded alone are the share the
forward echo app pays too (``bench_gateway.py --stream-tokens``: its floor); the rest is zserve's own. Stable to a
few percent from run to run, unlike the CPU of a server beside its engine, so it is the figure to watch while
changing this path; what a server pays in situ adds the send system call, the request's own cost spread over its
tokens, and caches the engine's steps leave cold (about 1.5x these numbers here).

    .venv/bin/python tests/bench/bench_stream_path.py [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.engine_client import ModelEngines  # noqa: E402
from gateway.generation import TextOptions  # noqa: E402
from gateway.serving.choices import Choice, ChoiceRun  # noqa: E402
from gateway.serving.completions import ChatShape  # noqa: E402
from gateway.serving.tools import NO_TOOLS  # noqa: E402
from gateway.sse import EventWriter  # noqa: E402
from protocol import RequestOutput, SamplingParams, StepOutputs, decode, encode  # noqa: E402
from tests.unit.fake_engine import fake_engine_client  # noqa: E402
from zserve.catalog import smollm2_gguf_path  # noqa: E402
from zserve.tokenizer import Tokenizer  # noqa: E402

STREAMS, STEPS = 64, 256


class NullTransport:
    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False


def event_writer() -> EventWriter:
    request = SimpleNamespace(transport=NullTransport(), protocol=SimpleNamespace(writing_paused=False),
                              writer=SimpleNamespace(send_headers=lambda: None))
    return EventWriter(request, SimpleNamespace(headers={"Transfer-Encoding": "chunked"}, compression=None))  # type: ignore[arg-type]


def frames(finishing: bool) -> list[list[bytes]]:
    """One frame per step, a token for every stream (ids spread over the vocabulary; the last step finishes)."""
    return [encode(StepOutputs(0, tuple(
        RequestOutput(f"r{s}-0", (1000 + (t * 7919 + s * 104729) % 40000,),
                      "length" if finishing and t == STEPS - 1 else None) for s in range(STREAMS))))
        for t in range(STEPS)]


async def one_pass(tokenizer: Tokenizer, profile: cProfile.Profile | None) -> float:
    client, eng, _ = fake_engine_client()
    state = SimpleNamespace(engines=ModelEngines(client, None), eos_token_ids=frozenset(), stream_interval=1,
                            lora=None, model=SimpleNamespace(model_id="m"), tokenizer=tokenizer)
    shape = ChatShape(None, False, NO_TOOLS)  # type: ignore[arg-type]
    for s in range(STREAMS):  # what serving.completions.respond does for each streamed chunk
        head, events = shape.chunk_head(f"chatcmpl-{s}", 1700000000, "m"), event_writer()

        def on_delta(c: Choice, d, head=head, events=events) -> None:
            c.take(d)
            entries = shape.delta_json(c, d)
            if entries is not None:
                events.data(head + entries + b"}")

        run = ChoiceRun(state, f"r{s}", [Choice(0, [1, 2], SamplingParams(max_tokens=STEPS))],  # type: ignore[arg-type]
                        TextOptions(stop=[]), on_delta)
        run.start()
    steps = frames(finishing=True)
    if profile is not None:
        profile.enable()
    t0 = time.perf_counter()
    for f in steps:
        client._dispatch(eng, f)
    dt = time.perf_counter() - t0
    if profile is not None:
        profile.disable()
    return dt / (STREAMS * STEPS) * 1e6


def decode_alone() -> float:
    steps = frames(finishing=False)
    t0 = time.perf_counter()
    for f in steps:
        decode(f)
    return (time.perf_counter() - t0) / (STREAMS * STEPS) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="also print where the time goes (cProfile, one pass)")
    args = ap.parse_args()
    tokenizer = Tokenizer.from_gguf(smollm2_gguf_path())
    asyncio.run(one_pass(tokenizer, None))  # warm: the tokenizer's byte table, code paths
    path, codec = [], []
    for _ in range(args.rounds):
        path.append(asyncio.run(one_pass(tokenizer, None)))
        codec.append(decode_alone())
    p, c = statistics.median(path), statistics.median(codec)
    print(f"{STREAMS} streams x {STEPS} tokens, medians of {args.rounds} rounds, µs per streamed token:")
    print(f"  the whole path {p:.2f}; the codec alone {c:.2f} (the forward echo app's share too); "
          f"zserve's own {p - c:.2f}")
    if args.profile:
        prof = cProfile.Profile()
        asyncio.run(one_pass(tokenizer, prof))
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
