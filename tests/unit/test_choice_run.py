"""``serving.choices.ChoiceRun`` against an engine client whose socket is a list: what reaches the engine when a
request's choices fail."""

from __future__ import annotations

import asyncio
import gc
import weakref
from types import SimpleNamespace

import pytest

from gateway.engine_client import ModelEngines
from gateway.generation import TextOptions
from gateway.serving.choices import Choice, ChoiceRun
from protocol import AbortRequest, RequestOutput, SamplingParams, StepOutputs, encode

from .fake_engine import fake_engine_client


def _aborted(sent: list) -> set[str]:
    return {rid for m in sent if isinstance(m, AbortRequest) for rid in m.request_ids}


def test_a_choice_whose_delta_cannot_be_written_is_aborted_in_its_engine():
    """The client went away and the engine reader found out first, writing a delta: every choice, the one whose
    write failed included, is aborted in the engine (that one was left generating to max_tokens before)."""
    async def main():
        client, eng, sent = fake_engine_client()
        state = SimpleNamespace(engines=ModelEngines(client, None), eos_token_ids=frozenset(), stream_interval=1,
                                lora=None, model=SimpleNamespace(model_id="m"))

        def on_delta(choice: Choice, delta) -> None:
            raise ConnectionResetError("the client closed the connection")

        choices = [Choice(j, [1, 2], SamplingParams(max_tokens=4000)) for j in range(2)]
        run = ChoiceRun(state, "cmpl-x", choices, TextOptions(stop=[], detokenize=False), on_delta)  # type: ignore[arg-type]
        run.start()
        client._dispatch(eng, encode(StepOutputs(0, (RequestOutput("cmpl-x-0", (5,)),))))
        with pytest.raises(ConnectionResetError):
            await run.wait()
        return client, sent

    client, sent = asyncio.run(main())
    assert _aborted(sent) == {"cmpl-x-0", "cmpl-x-1"}
    assert client.in_flight == 0


@pytest.mark.parametrize("streamed", [False, True])
def test_a_finished_run_is_freed_by_reference_counting_alone(streamed):
    """A request's run, its choices' pipelines and detokenizers go the moment the request ends, with the cycle
    collector off: a reference cycle among them (the run's sinks pointing back at it) left every request's objects
    to the collector, whose passes cost a busy gateway a sixth of its CPU and paused it for tens of milliseconds."""
    async def main() -> list[weakref.ref]:
        client, eng, _ = fake_engine_client()
        state = SimpleNamespace(engines=ModelEngines(client, None), eos_token_ids=frozenset(), stream_interval=1,
                                lora=None, model=SimpleNamespace(model_id="m"))
        got: list = []
        on_delta = (lambda c, d: got.append(d.token_ids)) if streamed else Choice.collect
        choices = [Choice(j, [1, 2], SamplingParams(max_tokens=2)) for j in range(2)]
        run = ChoiceRun(state, "cmpl-x", choices, TextOptions(stop=[], detokenize=False), on_delta)  # type: ignore[arg-type]
        run.start()
        for finish in (None, "length"):
            client._dispatch(eng, encode(StepOutputs(0, tuple(RequestOutput(f"cmpl-x-{j}", (5 + j,), finish)
                                                              for j in range(2)))))
        await run.wait()
        assert client.in_flight == 0
        assert (got if streamed else [c.token_ids for c in choices]) == ([[5], [6], [5], [6]] if streamed
                                                                         else [[5, 5], [6, 6]])
        return [weakref.ref(run), *(weakref.ref(c) for c in choices)]

    gc.collect()
    gc.disable()
    try:
        refs = asyncio.run(main())
        assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()


@pytest.mark.parametrize("ending", ["finished", "cancelled"])
def test_a_flush_counts_the_tokens_of_streams_in_flight_and_an_ended_stream_leaves_the_recorder(ending):
    """A streamed token adds only to its request's own timer, which the recorder folds into its buffers at each
    flush: a scrape in mid-stream counts the tokens so far, and a request that ended (or was cancelled) is no longer
    among the recorder's streaming requests."""
    from prometheus_client import REGISTRY

    from gateway.metrics import RECORDER

    def generated() -> float:
        return REGISTRY.get_sample_value("zserve_generation_tokens_total") or 0.0

    async def main() -> None:
        client, eng, _ = fake_engine_client()
        state = SimpleNamespace(engines=ModelEngines(client, None), eos_token_ids=frozenset(), stream_interval=1,
                                lora=None, model=SimpleNamespace(model_id="m"))
        choices = [Choice(j, [1, 2], SamplingParams(max_tokens=3)) for j in range(2)]
        run = ChoiceRun(state, "cmpl-y", choices, TextOptions(stop=[], detokenize=False), lambda c, d: None)  # type: ignore[arg-type]
        timers = set(run._timers)
        run.start()
        RECORDER.flush()
        before = generated()
        for _ in range(2):
            client._dispatch(eng, encode(StepOutputs(0, tuple(RequestOutput(f"cmpl-y-{j}", (5,), None)
                                                              for j in range(2)))))
        assert timers <= RECORDER.streaming
        RECORDER.flush()
        assert generated() - before == 4  # two tokens of each choice, neither finished
        if ending == "finished":
            client._dispatch(eng, encode(StepOutputs(0, tuple(RequestOutput(f"cmpl-y-{j}", (6,), "length")
                                                              for j in range(2)))))
            await run.wait()
        else:
            run.cancel()
        assert not timers & RECORDER.streaming
        RECORDER.flush()
        assert generated() - before == (6 if ending == "finished" else 4)

    asyncio.run(main())
