"""Migration of a running request, part by part: the wire carries the tokens it generated, an engine goes on after
them exactly as the uninterrupted run would, and the gateway's engine client moves a request its engine lost (died,
drained past its timeout, lost its expert-parallel group) to another engine, within ``--migration-limit``.
End to end, with processes killed under load: ``tests/e2e/test_migration.py``."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from engine_worker.engine import Engine
from engine_worker.loader import load_model
from engine_worker.scheduler import Scheduler, run_until_done
from engine_worker.sequence import Sequence
from gateway.engine_client import EngineClient, EngineConnection, EngineRequestError, NoEngineAvailable
from protocol import (
    AddRequest,
    EngineHello,
    ErrorMessage,
    ProtocolError,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    decode,
    encode,
)
from protocol.constants import ERR_ENGINE_DRAINING, ERR_GROUP_LOST
from zserve.catalog import resolve
from zserve.config import EngineConfig

CPU = torch.device("cpu")
PROMPT = list(range(5, 60))


# -- the wire --------------------------------------------------------------------------------------------------
def test_an_add_request_carries_the_tokens_generated_elsewhere_after_its_prompt():
    msg = AddRequest("r", (1, 2, 3), SamplingParams(max_tokens=8, seed=5), "trace", (7, 8))
    back = decode(encode(msg))
    assert back == msg and back.output_token_ids == (7, 8) and back.prompt_token_ids == (1, 2, 3)
    plain = AddRequest("r", (1, 2, 3))
    assert decode(encode(plain)) == plain and "n_output" not in encode(plain)[0].decode()


def test_the_wire_refuses_generated_tokens_that_leave_nothing_to_generate_or_do_not_add_up():
    with pytest.raises(ProtocolError, match="at least one token"):
        AddRequest("r", (1,), SamplingParams(max_tokens=2), None, (3, 4))
    frames = encode(AddRequest("r", (1, 2, 3), SamplingParams(max_tokens=8), None, (7, 8)))
    with pytest.raises(ProtocolError, match="n_output"):
        decode([frames[0].replace(b'"n_output":2', b'"n_output":3'), frames[1]])
    with pytest.raises(ProtocolError, match="n_output"):
        decode([frames[0].replace(b'"n_output":2', b'"n_output":0'), frames[1]])


# -- the engine ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runner():
    loaded = load_model(resolve("tiny-random"), torch.float32, CPU)
    return Engine.generation(loaded, CPU, torch.float32, EngineConfig(max_num_seqs=8, max_model_len=256),
                             num_blocks=256).runner


def _generate(runner, sampling: SamplingParams, done: list[int] = (), rid: str = "r") -> list[RequestOutput]:
    sched = Scheduler(runner, 8, 64)  # a small step budget: the resumed prefill takes several chunks
    sched.add(Sequence("mate", PROMPT[::-1], SamplingParams(max_tokens=30, temperature=1.0)))  # not alone
    assert sched.add(Sequence(rid, list(PROMPT), sampling, output_ids=list(done))) is None
    return run_until_done(sched)[rid]


SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=40, temperature=1.0, seed=1234, ignore_eos=True),
    "seeded-top-p-penalties": SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=-5, min_tokens=30,
                                            frequency_penalty=0.5, repetition_penalty=1.2),
}


@pytest.mark.parametrize("kind", list(SAMPLINGS))
def test_a_request_resumed_after_n_tokens_goes_on_as_the_uninterrupted_run(runner, kind):
    sp = SAMPLINGS[kind]
    whole_outs = _generate(runner, sp)
    whole = [t for o in whole_outs for t in o.new_token_ids]
    assert whole_outs[0].num_prompt_tokens == len(PROMPT)
    for cut in (1, 13, len(whole) - 1):
        outs = _generate(runner, sp, whole[:cut])
        rest = [t for o in outs for t in o.new_token_ids]
        assert whole[:cut] + rest == whole, (kind, cut)
        assert outs[-1].finish_reason == whole_outs[-1].finish_reason
        assert outs[0].num_prompt_tokens == 0  # the prompt was counted where the request began


def test_an_engine_refuses_a_resumed_request_longer_than_its_context(runner):
    sched = Scheduler(runner, 8, 64)
    err = sched.add(Sequence("r", list(PROMPT), SamplingParams(max_tokens=1000), output_ids=[3] * 201))
    assert err is not None and "201 generated" in err


# -- the gateway's engine client -------------------------------------------------------------------------------
class Engines:
    """An ``EngineClient`` with ready fake engines whose sockets are lists (what the client sent each, decoded)."""

    def __init__(self, names: list[str], limit: int = 3, wait: float = 0.0):
        self.client = EngineClient([])
        self.client.migration_limit, self.client.migration_wait = limit, wait
        self.moves: list[tuple[str, bool]] = []
        self.client.on_migration = lambda cause, moved: self.moves.append((cause, moved))
        self.sent: dict[str, list] = {}
        for i, name in enumerate(names):
            self.add(name, i)
        self.client._send_now = lambda e, frames: self.sent[e.endpoint].append(decode(frames))  # type: ignore

    def add(self, name: str, rank: int) -> EngineConnection:
        eng = EngineConnection(name, None, None)  # type: ignore[arg-type]
        eng.hello = EngineHello(rank, "m", 8, 512, 100, (2,), 1, "cpu", "float32")
        self.client.engines[name] = eng
        self.sent[name] = []
        self.client._update_ready()
        return eng

    def __getitem__(self, name: str) -> EngineConnection:
        return self.client.engines[name]

    def emit(self, name: str, rid: str, tokens: tuple[int, ...], finish: str | None = None) -> None:
        self.client._dispatch(self[name], encode(StepOutputs(0, (RequestOutput(rid, tokens, finish),))))

    def lose(self, name: str) -> None:
        """The engine's connection dropped (what ``_lost`` does after the socket monitor says so)."""
        eng = self[name]
        eng.hello = None
        self.client._update_ready()
        self.client._fail_streams(eng, f"lost engine {name}")

    def where(self, rid: str) -> str:
        return self.client._streams[rid].engine.endpoint


def in_loop(test):
    """Run an async test in its own event loop (the engine client needs one: parking uses its timers)."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


class Sink:
    def __init__(self):
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.error: Exception | None = None

    def output(self, out: RequestOutput) -> None:
        self.tokens += out.new_token_ids
        self.finish = out.finish_reason

    def fail(self, error: Exception) -> None:
        self.error = error


async def _submit(engines: Engines, max_tokens: int = 20) -> Sink:
    sink = Sink()
    engines.client.submit("r", PROMPT, SamplingParams(max_tokens=max_tokens, seed=9), sink, "m")
    return sink


@in_loop
async def test_a_request_its_engine_lost_goes_on_from_another_with_the_tokens_it_had():
    e = Engines(["a", "b"])
    sink = await _submit(e)
    first = e.where("r")
    other = "b" if first == "a" else "a"
    e.emit(first, "r", (11, 12))
    e.emit(first, "r", (13,))
    e.lose(first)
    moved = e.sent[other][-1]
    assert isinstance(moved, AddRequest) and moved.output_token_ids == (11, 12, 13)
    assert moved.prompt_token_ids == tuple(PROMPT) and moved.sampling.max_tokens == 20
    e.emit(first, "r", (99,))  # a late output of the lost engine is not the request's any more
    e.emit(other, "r", (14,))
    e.emit(other, "r", (15,), "stop")
    assert sink.tokens == [11, 12, 13, 14, 15] and sink.finish == "stop" and sink.error is None
    assert e.moves == [("engine_lost", True)] and not e.client._streams
    assert e[other].outstanding == 0 and e[first].outstanding == 0


@in_loop
async def test_the_migration_limit_is_per_request_and_zero_fails_it_as_before():
    e = Engines(["a", "b", "c"], limit=1)
    sink = await _submit(e)
    e.emit(e.where("r"), "r", (11,))
    e.lose(e.where("r"))
    e.emit(e.where("r"), "r", (12,))
    e.lose(e.where("r"))  # a second loss: no migration left
    assert isinstance(sink.error, EngineRequestError) and sink.tokens == [11, 12]
    assert e.moves == [("engine_lost", True), ("engine_lost", False)]

    off = Engines(["a", "b"], limit=0)
    sink = await _submit(off)
    off.emit(off.where("r"), "r", (11,))
    off.lose(off.where("r"))
    assert isinstance(sink.error, EngineRequestError) and not off.moves
    assert all(not isinstance(m, AddRequest) or not m.output_token_ids for ms in off.sent.values() for m in ms)


@in_loop
async def test_a_refusal_before_the_new_engine_sends_anything_is_a_hand_back_not_another_migration():
    e = Engines(["a", "b", "c"], limit=1)
    sink = await _submit(e)
    e.emit(e.where("r"), "r", (11,))
    e.lose(e.where("r"))
    now = e.where("r")
    e.client._dispatch(e[now], encode(ErrorMessage(ERR_ENGINE_DRAINING, "draining", "r")))
    last = e.where("r")
    assert last not in (now,) and e.sent[last][-1].output_token_ids == (11,)
    e.emit(last, "r", (12,), "length")
    assert sink.tokens == [11, 12] and sink.error is None and e.moves == [("engine_lost", True)]


@in_loop
async def test_a_drain_timeout_hands_a_running_request_back_and_it_moves():
    e = Engines(["a", "b"])
    sink = await _submit(e)
    first = e.where("r")
    e.emit(first, "r", (11, 12))
    e[first].cluster_state = "draining"
    e.client._update_ready()
    e.client._dispatch(e[first], encode(ErrorMessage(ERR_ENGINE_DRAINING, "drain timeout", "r")))
    assert e.where("r") != first and e.sent[e.where("r")][-1].output_token_ids == (11, 12)
    e.emit(e.where("r"), "r", (13,), "stop")
    assert sink.tokens == [11, 12, 13] and e.moves == [("drain_timeout", True)]


@in_loop
async def test_a_lost_expert_parallel_group_sends_its_requests_again_to_the_same_engine_once_formed():
    e = Engines(["a"])
    sink = await _submit(e)
    e.emit("a", "r", (11,))
    e.client._dispatch(e["a"], encode(ErrorMessage(ERR_GROUP_LOST, "group lost", "r")))
    assert e.where("r") == "a" and e.sent["a"][-1].output_token_ids == (11,)
    e.emit("a", "r", (12,), "stop")
    assert sink.tokens == [11, 12] and e.moves == [("group_lost", True)]


@in_loop
async def test_migration_max_len_bounds_what_is_sent_again():
    e = Engines(["a", "b"])
    e.client.migration_max_len = len(PROMPT) + 1
    sink = await _submit(e)
    e.emit(e.where("r"), "r", (11, 12))
    e.lose(e.where("r"))
    assert isinstance(sink.error, EngineRequestError) and e.moves == [("engine_lost", False)]


@in_loop
async def test_with_no_engine_left_a_migrating_request_waits_for_a_replacement_then_fails():
    e = Engines(["a"], wait=5.0)
    sink = await _submit(e)
    e.emit("a", "r", (11,))
    e.lose("a")
    assert sink.error is None and e.client._streams["r"].engine is None  # parked, not failed
    e["a"].hello = EngineHello(0, "m", 8, 512, 100, (2,), 1, "cpu", "float32")  # the replacement greets
    e.client._update_ready()
    assert e.sent["a"][-1].output_token_ids == (11,)
    e.emit("a", "r", (12,), "stop")
    assert sink.tokens == [11, 12] and sink.error is None

    short = Engines(["a"], wait=0.05)
    sink = await _submit(short)
    short.emit("a", "r", (11,))
    short.lose("a")
    await asyncio.sleep(0.2)
    assert isinstance(sink.error, NoEngineAvailable)
