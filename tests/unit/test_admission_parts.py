"""A request's parts (choices, pooled inputs) are admitted whole: engines announce how many requests they queue,
the gateway reads the model's limit from that, and ``serving.pooling.pool`` serves its inputs whole or refuses
them whole."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from gateway.engine_client import EngineClient, EngineConnection, EnginesBusy, ModelEngines
from gateway.errors import APIError
from gateway.serving.pooling import pool
from protocol import EngineHello, decode, encode


def _hello(rank: int, max_waiting: int | None) -> EngineHello:
    return EngineHello(rank, "m", 8, 64, 100, (2,), 1, "cpu", "float32", max_waiting=max_waiting)


def test_an_engine_announces_its_queue_and_the_model_takes_the_smallest():
    assert decode(encode(_hello(0, 4096))).max_waiting == 4096
    assert decode(encode(_hello(0, None))).max_waiting is None
    client = EngineClient([])
    for rank, limit in enumerate((16, 8, None)):
        eng = EngineConnection(f"e{rank}", None, None)  # type: ignore[arg-type]
        eng.hello = _hello(rank, limit)
        client.engines[eng.endpoint] = eng
    client._update_ready()
    assert ModelEngines(client, None).max_waiting == 8
    client.engines.pop("e1")
    client._update_ready()
    assert ModelEngines(client, None).max_waiting == 16


def test_when_one_input_is_refused_the_others_are_aborted_and_the_request_is_one_429():
    waiting: set[str] = set()
    aborted: list[str] = []

    class Engines:
        async def pool(self, rid: str, ids, task, normalize, dimensions, pair_start):
            if rid.endswith("-1"):
                raise EnginesBusy("every engine of the model has a full queue")
            waiting.add(rid)
            try:
                await asyncio.get_running_loop().create_future()  # queued behind others' work
            finally:
                aborted.append(rid)  # EngineClient.pool aborts its input in the engine here

    async def main() -> APIError:
        with pytest.raises(APIError) as refused:
            await pool(SimpleNamespace(engines=Engines()), "embd-x", [[1], [2], [3]], "embed")  # type: ignore[arg-type]
        for _ in range(100):  # cancellations run on the next turns of the loop (a bounded wait: no hang if none)
            if len(aborted) == len(waiting):
                break
            await asyncio.sleep(0)
        # (checked here: leaving asyncio.run would cancel whatever is left, and so abort it)
        assert waiting == {"embd-x-0", "embd-x-2"} and sorted(aborted) == ["embd-x-0", "embd-x-2"]
        return refused.value

    err = asyncio.run(main())
    assert err.status == 429 and err.headers["Retry-After"] == "1"
