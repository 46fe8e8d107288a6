"""Requests survive their engine: a running request whose engine is lost moves to another engine of its model and
its stream goes on, with the official ``openai`` client reading it.

One server (2 gateways, 2 engines of the tiny random model) takes 32 streams of four kinds (greedy completions,
seeded chat, JSON-schema constrained chat, forced tool calls) and 6 of the other families (Anthropic Messages,
Responses, completions with n=2 and logprobs), first uninterrupted, then with one engine killed (SIGKILL) while
they stream: every stream completes with the text (logprobs included) and usage of its uninterrupted run. A stream
moves at most ``--migration-limit`` times; an engine that hangs is killed by the supervisor and its streams move;
a scale-down whose drain reaches ``--shutdown-timeout`` hands its streams to the engine that stays. With SmolLM2,
the real default model, the same kinds survive the loss of the server's only engine: they wait for its
replacement. ``--migration-limit 0`` keeps the old behaviour (tests/e2e/test_supervisor.py); an engine host cut
off from a gateway host: tests/e2e/test_remote_engines.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.helpers import (
    LAUNCH,
    ROOT,
    TINY,
    Server,
    close_streams,
    metric,
    procs,
    ready_pids,
    streams_go_on,
    wait_until,
)
from zserve.catalog import DEFAULT_CHAT_MODEL

KINDS = ("greedy", "seeded", "schema", "tools")
# Every other generation family, through its own SDK: Anthropic Messages and Responses (greedy), and completions
# with n=2 and logprobs (seeded; each choice is an engine request of its own and moves on its own).
FAMILIES = ("messages", "responses", "n2-logprobs")
SCHEMA = {"type": "object", "properties": {
    "words": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 12, "maxItems": 16},
    "done": {"type": "boolean"}}, "required": ["words", "done"], "additionalProperties": False}
# Seeded requests sample among their 40 best tokens. Over the tiny random model's whole vocabulary (49,152 nearly
# equal probabilities) the draw would sit near some token's boundary in the cumulative sum at every step, and an
# engine's float32 sums are not the same bit for bit in every batch (nor is a rerun's: tests/bench/bench_migration.py
# --rerun saw one part before any kill); among 40 candidates a near tie is rare.
TOP_K = 40
TOOL = {"type": "function", "function": {"name": "record", "description": "Record some words.", "parameters": SCHEMA}}


@dataclass
class Stream:
    """What one streamed request wrote, as its client read it."""

    text: str = ""
    calls: dict[int, list[str]] = field(default_factory=dict)  # tool calls by index: [name, arguments]
    logprobs: dict[int, list[float]] = field(default_factory=dict)  # every logprob of each choice, in order
    finish: str | None = None
    usage: tuple[int, int] | None = None  # (prompt, completion) tokens
    error: str | None = None
    chunks: int = 0
    leave: threading.Event = field(default_factory=threading.Event)

    @property
    def written(self) -> tuple:
        return self.text, self.calls, self.finish, self.usage


def _request(client: openai.OpenAI, model: str, kind: str, i: int, max_tokens: int) -> openai.Stream:
    if kind in ("schema", "tools"):
        max_tokens = 4 * max_tokens  # room for the whole value: its grammar ends it
    question = f"Request {i}: list a few words about the weather in town number {i * 7 % 13}."
    chat = dict(model=model, stream=True, stream_options={"include_usage": True}, max_tokens=max_tokens,
                messages=[{"role": "user", "content": question}])
    if kind == "greedy":
        return client.completions.create(model=model, prompt=question, max_tokens=max_tokens, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    if kind == "seeded":
        return client.chat.completions.create(**chat, temperature=1.0, seed=1000 + i,
                                              extra_body={"ignore_eos": True, "top_k": TOP_K})
    if kind == "schema":
        return client.chat.completions.create(**chat, temperature=1.0, seed=2000 + i, extra_body={"top_k": TOP_K},
                                              response_format={"type": "json_schema", "json_schema": {
                                                  "name": "words", "schema": SCHEMA, "strict": True}})
    return client.chat.completions.create(**chat, temperature=1.0, seed=3000 + i, extra_body={"top_k": TOP_K},
                                          tools=[TOOL],
                                          tool_choice={"type": "function", "function": {"name": "record"}})


def _other_family(url: str, model: str, kind: str, i: int, max_tokens: int, out: Stream) -> None:
    question = f"Request {i}: tell a story about town number {i * 7 % 13}."
    if kind == "messages":
        client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=300)
        with client.messages.stream(model=model, max_tokens=max_tokens, extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": question}]) as events:
            for piece in events.text_stream:
                out.text += piece
                out.chunks += 1
            final = events.get_final_message()
        u = final.usage  # (input_tokens leaves out what the prefix cache held, which the first run filled)
        out.finish, out.usage = final.stop_reason, (u.input_tokens + (u.cache_read_input_tokens or 0), u.output_tokens)
        return
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    if kind == "responses":
        for event in client.responses.create(model=model, input=question, max_output_tokens=max_tokens,
                                             temperature=0, stream=True):
            if event.type == "response.output_text.delta":
                out.text += event.delta
                out.chunks += 1
            elif event.type in ("response.completed", "response.incomplete"):
                u = event.response.usage
                out.finish, out.usage = event.response.status, (u.input_tokens, u.output_tokens)
        return
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model=model, prompt=question, max_tokens=max_tokens, n=2, logprobs=2,
                                           temperature=1.0, seed=4000 + i, stream=True, extra_body={"top_k": TOP_K},
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            out.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        for c in chunk.choices:
            out.chunks += 1
            lps = c.logprobs
            texts[c.index] = texts.get(c.index, "") + c.text + (repr([lps.tokens, [sorted(t) for t in
                                                                                   lps.top_logprobs]]) if lps else "")
            if lps:  # compared within float tolerance: the moved request's KV cache was computed in one prefill
                out.logprobs.setdefault(c.index, []).extend(
                    [x for t in lps.top_logprobs for x in sorted(t.values())] + lps.token_logprobs)
            out.finish = c.finish_reason or out.finish
    out.text = repr(sorted(texts.items()))


def stream(url: str, model: str, kind: str, i: int, max_tokens: int, out: Stream) -> Stream:
    if kind in FAMILIES:
        try:
            _other_family(url, model, kind, i, max_tokens, out)
        except (openai.APIError, anthropic.APIError) as e:
            out.error = str(e)
        return out
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    try:
        for chunk in _request(client, model, kind, i, max_tokens):
            if chunk.usage is not None:
                out.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            for c in chunk.choices:
                out.chunks += 1
                if kind == "greedy":
                    out.text += c.text
                else:
                    out.text += c.delta.content or ""
                    for call in c.delta.tool_calls or ():
                        name_args = out.calls.setdefault(call.index, ["", ""])
                        name_args[0] += call.function.name or ""
                        name_args[1] += call.function.arguments or ""
                out.finish = c.finish_reason or out.finish
            if out.leave.is_set():
                break
    except openai.APIError as e:
        out.error = str(e)
    return out


def run_all(url: str, model: str, per_kind: int, max_tokens: int, during=None,
            families: int = 0) -> dict[tuple[str, int], Stream]:
    """``per_kind`` streams of every kind and ``families`` of every other family at once; ``during(streams)`` runs
    meanwhile (the kill)."""
    streams = {(k, i): Stream() for k in KINDS for i in range(per_kind)}
    streams |= {(k, i): Stream() for k in FAMILIES for i in range(families)}
    with ThreadPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(stream, url, model, k, i, max_tokens, s) for (k, i), s in streams.items()]
        if during is not None:
            during(streams)
        for f in futures:
            f.result(timeout=600)
    return streams


def check_kinds(streams: dict[tuple[str, int], Stream], max_tokens: int) -> None:
    for (kind, i), s in streams.items():
        assert s.error is None and s.finish is not None and s.usage is not None, (kind, i, s)
        if kind in ("greedy", "seeded"):
            assert s.finish == "length" and s.usage[1] == max_tokens, (kind, i, s)
        elif kind in FAMILIES:
            assert s.text and s.usage[1] > 0, (kind, i, s)
        elif kind == "schema":
            jsonschema.validate(json.loads(s.text), SCHEMA)
        else:
            assert s.finish == "tool_calls" and s.calls, (kind, i, s)
            for name, arguments in s.calls.values():
                assert name == "record"
                jsonschema.validate(json.loads(arguments), SCHEMA)


def settled_metric(url: str, name: str, since: float, enough) -> float:
    """How much ``name`` grew from ``since``, once ``enough(growth)`` holds: the scrape's gateway flushes its own
    counts first, but another gateway's lag up to its FLUSH_INTERVAL (gateway/metrics.py). The growth is returned as
    read when the deadline passes, for the test's assertion to show."""
    deadline = time.monotonic() + 10
    while not enough(grown := metric(url, name) - since) and time.monotonic() < deadline:
        time.sleep(0.1)
    return grown


def busiest_engine(server: Server, at_least: int = 1) -> dict:
    def loaded():
        e = [p for p in procs(server, "engine") if p["state"] == "ready"]
        return max(e, key=lambda p: p.get("running", 0)) if sum(p.get("running", 0) for p in e) >= at_least \
            else None

    return wait_until(loaded, 30, 0.1, "the engines to report the streams")


def wait_replaced(server: Server, victim: dict) -> None:
    wait_until(lambda: any(p["index"] == victim["index"] and p["state"] == "ready" and p["pid"] != victim["pid"]
                           for p in procs(server, "engine")), 120, 0.2, f"engine {victim['index']} to be replaced")


@pytest.fixture(scope="module")
def server():
    s = Server("--count", "2", "--engines", "2", *TINY, "--max-num-seqs", "64", "--max-model-len", "8192",
               "--tool-call-parser", "hermes", "--migration-limit", "1", "--shutdown-timeout", "1",
               "--heartbeat-timeout", "4",
               log_name="migration")
    yield s
    s.stop()


def test_streams_of_every_kind_survive_a_killed_engine_and_write_what_they_would_have(server):
    tokens = 128
    reference = run_all(server.url, "tiny-random", 8, tokens, families=2)
    check_kinds(reference, tokens)
    before = metric(server.url, 'zserve_migrations_total{cause="engine_lost"}')
    # Least-loaded routing spreads the 38 streams over both engines: either one holds a share of them.
    victim = next(p for p in procs(server, "engine") if p["state"] == "ready")

    def kill(streams):
        wait_until(lambda: sum(s.chunks >= 3 for s in streams.values()) >= 30, 120, 0.02, "the streams to flow")
        os.kill(victim["pid"], signal.SIGKILL)

    moved = run_all(server.url, "tiny-random", 8, tokens, kill, families=2)
    check_kinds(moved, tokens)
    for key, s in moved.items():
        assert s.written == reference[key].written, key  # text (tokens, top tokens), finish reason and usage
        assert s.logprobs.keys() == reference[key].logprobs.keys(), key
        for index, lps in s.logprobs.items():
            assert lps == pytest.approx(reference[key].logprobs[index], abs=1e-4), (key, index)
    migrations = settled_metric(server.url, 'zserve_migrations_total{cause="engine_lost"}', before, lambda g: g >= 4)
    assert migrations >= 4, f"only {migrations} streams moved"  # the killed engine held a share of the 38
    assert "moved from engine" in server.tail(200000)
    wait_replaced(server, victim)


def test_a_stream_moves_as_often_as_the_limit_allows_then_fails(server):
    """A hang the supervisor ends moves the hung engine's streams; the next loss of their engine fails them
    (--migration-limit 1) and moves the streams that had not moved yet."""
    streams = [Stream() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        # Long enough to outlast both losses (a stream alone on an engine runs fast); the clients leave at the end.
        futures = [pool.submit(stream, server.url, "tiny-random", "greedy", i, 7000, s)
                   for i, s in enumerate(streams)]
        wait_until(lambda: all(s.error or s.chunks > 3 for s in streams), 60, what="the streams to flow")
        assert not any(s.error for s in streams), [s.error for s in streams]
        exhausted = metric(server.url, "zserve_migrations_exhausted_total")
        for loss in ("hang", "kill"):
            running = sum(s.finish is None and not s.error for s in streams)
            victim = busiest_engine(server, running)  # every stream is on it after the first loss
            at = [s.chunks for s in streams]
            if loss == "hang":  # stopped: no heartbeat, so the supervisor kills it (--heartbeat-timeout 4)
                os.kill(victim["pid"], signal.SIGSTOP)
                wait_replaced(server, victim)  # the kill's streams that had not moved move to the replacement
            else:
                os.kill(victim["pid"], signal.SIGKILL)
            streams_go_on(streams, at, f"the streams to go on after the {loss}")
            if loss == "hang":
                assert not any(s.error for s in streams), [s.error for s in streams]
        failed = [s for s in streams if s.error]
        close_streams(streams, futures)
    # The hung engine's streams had moved once: the kill fails them, as --migration-limit 1 says; the others moved.
    assert failed and all("lost engine" in s.error for s in failed)
    assert settled_metric(server.url, "zserve_migrations_exhausted_total", exhausted,
                          lambda g: g >= len(failed)) == len(failed)
    assert "no migration left" in server.tail(400000)


def test_a_scale_down_whose_drain_times_out_moves_its_streams_to_the_engine_that_stays(server):
    wait_until(lambda: len(ready_pids(server, "engine")) == 2, 60, what="two ready engines")

    last: dict[int, list] = {}  # each gateway's view of the engines, as /status last gave it

    def both_route_to_both() -> bool:  # (an engine replaced by the test before is ready before gateways reach it)
        seen = {}
        for _ in range(20):
            st = httpx.get(server.url + "/status", headers={"Connection": "close"}, timeout=10).json()
            seen[st["gateway"]] = sum(e["routable"] for e in st["engines"])
            last[st["gateway"]] = st["engines"]
        return seen == {0: 2, 1: 2}

    try:
        wait_until(both_route_to_both, 60, 0.1, "both gateways to route to both engines")
    except AssertionError as e:
        raise AssertionError(f"{e}; the gateways' engines: {last}") from None
    streams = [Stream() for _ in range(8)]
    before = metric(server.url, 'zserve_migrations_total{cause="drain_timeout"}')
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, server.url, "tiny-random", "seeded", i, 3000, s)
                   for i, s in enumerate(streams)]
        wait_until(lambda: all(s.error or s.chunks > 3 for s in streams), 60, what="the streams to flow")
        assert not any(s.error for s in streams), [s.error for s in streams]
        busiest_engine(server, 8)
        # The engine the scale-down drains (the last) holds streams when it is told to.
        wait_until(lambda: any(p["index"] == 1 and p.get("running", 0) > 0 for p in procs(server, "engine")), 30,
                   0.1, "engine 1 to run streams")
        r = subprocess.run([*LAUNCH, "scale", "engine", "1", "--port", str(server.port), "--timeout", "60"], cwd=ROOT,
                           capture_output=True, text=True, timeout=90)
        assert r.returncode == 0, r.stderr
        at = [s.chunks for s in streams]
        streams_go_on(streams, at, "the streams to go on after the drain")
        close_streams(streams, futures)
    assert not [s.error for s in streams if s.error]
    assert settled_metric(server.url, 'zserve_migrations_total{cause="drain_timeout"}', before, lambda g: g >= 1) >= 1
    assert "drain timeout (1s) reached; handed" in server.tail(400000)


@pytest.mark.slow
def test_with_smollm2_streams_of_every_kind_wait_for_the_replacement_of_the_only_engine(smollm_server):
    """The real model, on which the text of tool calls and schemas depends: one stream of each kind (the other
    families move alike, above). Its only engine: the streams wait for the replacement, up to --scaling-wait."""
    model, tokens = DEFAULT_CHAT_MODEL, 48
    reference = run_all(smollm_server.url, model, 1, tokens)
    check_kinds(reference, tokens)
    before = metric(smollm_server.url, 'zserve_migrations_total{cause="engine_lost"}')
    (victim,) = [p for p in procs(smollm_server, "engine") if p["state"] == "ready"]
    unfinished: list[tuple[str, int]] = []
    shown: list[tuple[str, int]] = []  # the streams whose client had read some of the model's output at the kill
    log_at = smollm_server.log_path.stat().st_size

    def kill(streams):
        # Every stream has begun, and the greedy one (a chunk a token) is a few tokens in: none is near its end. A
        # chat stream's first chunk (the role) comes when its stream opens, before the engine sends anything, and a
        # tool call's arguments come whole: such a stream may still be in its prompt at the kill, and is then sent
        # again as it is rather than moved with its tokens (the log says both, the metric counts the moves).
        wait_until(lambda: all(s.chunks for s in streams.values()) and streams["greedy", 0].chunks >= 3, 120, 0.01,
                   "the streams to flow")
        os.kill(victim["pid"], signal.SIGKILL)
        unfinished.extend(key for key, s in streams.items() if s.finish is None)
        shown.extend(key for key, s in streams.items() if s.text or s.calls)
        wait_replaced(smollm_server, victim)

    started = time.monotonic()
    moved = run_all(smollm_server.url, model, 1, tokens, kill)
    check_kinds(moved, tokens)
    assert sorted(unfinished) == sorted(moved), "a stream had ended before the kill"
    moves = settled_metric(smollm_server.url, 'zserve_migrations_total{cause="engine_lost"}', before,
                           lambda g: g >= len(shown))
    assert len(shown) <= moves <= len(moved), (shown, moves)
    with open(smollm_server.log_path, "rb") as f:
        f.seek(log_at)
        waited = f.read().decode(errors="replace").count("(engine_lost) after")
    assert waited == len(moved), f"{waited} of {len(moved)} streams waited for the replacement"
    for key, s in moved.items():
        assert s.written == reference[key].written, (key, time.monotonic() - started)
