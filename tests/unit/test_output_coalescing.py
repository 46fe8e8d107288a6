"""Outputs that queue up for a busy consumer come merged (gateway/engine_client.py ``_Inbox``)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.engine_client import EngineRequestError, _Inbox, merge_outputs
from protocol import RequestOutput, TopLogprobs


def out(ids, finish=None, **kw) -> RequestOutput:
    return RequestOutput("r1", tuple(ids), finish, **kw)


def test_merge_concatenates_tokens_logprobs_and_tops():
    a = out([1, 2], logprobs=(-0.1, -0.2), top_logprobs=TopLogprobs(1, (1, 2), (-0.1, -0.2)), num_prompt_tokens=5,
            prompt_logprobs=(-1.0,), num_cached_tokens=3)
    b = out([3], "length", logprobs=(-0.3,), top_logprobs=TopLogprobs(1, (3,), (-0.3,)))
    m = merge_outputs(a, b)
    assert m.new_token_ids == (1, 2, 3)
    assert m.finish_reason == "length"
    assert m.logprobs == (-0.1, -0.2, -0.3)
    assert m.top_logprobs == TopLogprobs(1, (1, 2, 3), (-0.1, -0.2, -0.3))
    assert (m.num_prompt_tokens, m.prompt_logprobs, m.num_cached_tokens) == (5, (-1.0,), 3)


def test_merge_without_logprobs_stays_without():
    m = merge_outputs(out([1]), out([2]))
    assert m.new_token_ids == (1, 2) and m.logprobs is None and m.top_logprobs is None and m.finish_reason is None


def test_take_outputs_merges_up_to_the_finish():
    box = _Inbox()
    for o in (out([1]), out([2]), out([3], "stop"), out([4])):
        box.put_nowait(o)
    merged = asyncio.run(box.get(coalesce=True))
    assert merged.new_token_ids == (1, 2, 3) and merged.finish_reason == "stop"
    assert list(box.items) == [out([4])]  # nothing after a finish is folded in


def test_take_outputs_stops_at_a_failure_which_get_then_raises():
    box = _Inbox()
    failure = EngineRequestError("engine lost")
    for o in (out([1]), out([2]), failure, out([3])):
        box.put_nowait(o)
    merged = asyncio.run(box.get(coalesce=True))
    assert merged.new_token_ids == (1, 2)
    with pytest.raises(EngineRequestError, match="engine lost"):
        asyncio.run(box.get(coalesce=True))


def test_without_coalescing_outputs_come_one_by_one():
    box = _Inbox()
    for o in (out([1]), out([2], "length")):
        box.put_nowait(o)
    assert asyncio.run(box.get()).new_token_ids == (1,)
    assert asyncio.run(box.get()).new_token_ids == (2,)


def test_get_waits_for_the_reader():
    async def main():
        box = _Inbox()
        getter = asyncio.create_task(box.get())
        await asyncio.sleep(0)
        assert not getter.done()
        asyncio.get_running_loop().call_soon(box.put_nowait, out([7]))
        return await asyncio.wait_for(getter, 5)

    assert asyncio.run(main()) == out([7])


def test_a_sink_that_fails_still_ends_its_request_and_aborts_it_in_the_engine():
    """A bug handling one output must not leave the request hanging: its sink hears a failure, the engine an
    abort, and the reader goes on with the other requests."""
    from protocol import AbortRequest, SamplingParams, StepOutputs, encode

    from .fake_engine import fake_engine_client

    class Broken:
        def __init__(self):
            self.failed: list[Exception] = []

        def output(self, out):
            raise RuntimeError("a bug")

        def fail(self, error):
            self.failed.append(error)

    class Fine(Broken):
        def output(self, out):
            self.got = out

    async def main():
        client, eng, sent = fake_engine_client()
        broken, fine = Broken(), Fine()
        client.submit("r1", [1, 2], SamplingParams(), broken)
        client.submit("r2", [1, 2], SamplingParams(), fine)
        client._dispatch(eng, encode(StepOutputs(0, (RequestOutput("r1", (5,)), RequestOutput("r2", (6,))))))
        return client, broken, fine, sent

    client, broken, fine, sent = asyncio.run(main())
    assert len(broken.failed) == 1 and isinstance(broken.failed[0], EngineRequestError)
    assert fine.got.new_token_ids == (6,) and not fine.failed
    assert [type(m) for m in sent][-1] is AbortRequest and sent[-1].request_ids == ("r1",)
    assert client.in_flight == 1  # r2 still runs
