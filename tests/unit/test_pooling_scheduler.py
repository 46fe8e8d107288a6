"""The pooling scheduler's batching and shaping, with a stand-in runner (the encoders themselves are
tested against transformers in test_encoder_models.py)."""

from __future__ import annotations

import math

import torch

from engine_worker.pooling_scheduler import PoolingScheduler
from protocol import PoolRequest


class FakeRunner:
    tasks = ("embed",)
    max_model_len = 16

    class pooling:  # noqa: N801 - stands in for PoolingConfig
        normalize = True

    def __init__(self, fail: bool = False):
        self.batches: list[list[list[int]]] = []
        self.fail = fail

    def embed(self, batch, normalize=None, token_type_ids=None):
        assert normalize is False  # the scheduler shapes vectors itself
        self.batches.append(batch)
        if self.fail:
            raise RuntimeError("boom")
        return [torch.tensor([float(len(ids)), 1.0, 2.0, 2.0]) for ids in batch]


def test_a_step_takes_the_oldest_inputs_that_fit_the_token_budget():
    runner = FakeRunner()
    s = PoolingScheduler(runner, max_num_seqs=8, max_num_batched_tokens=10)
    for i, n in enumerate([4, 4, 4, 12 - 8, 9]):
        assert s.add_pool(PoolRequest(f"r{i}", tuple(range(1, n + 1)))) is None
    assert [o.request_id for o in s.step()] == ["r0", "r1"]  # 4 + 4; a third would pass 10
    assert [o.request_id for o in s.step()] == ["r2", "r3"]
    assert [o.request_id for o in s.step()] == ["r4"]  # alone it may use the whole budget
    assert not s.has_work and s.step() == []
    assert s.stats_fields()["prompt_tokens"] == 25 and s.stats_fields()["steps"] == 3


def test_vectors_are_normalised_and_cut_as_asked():
    s = PoolingScheduler(FakeRunner(), max_num_seqs=8, max_num_batched_tokens=100)
    s.add_pool(PoolRequest("default", (1, 2, 3)))
    s.add_pool(PoolRequest("raw", (1, 2, 3), normalize=False))
    s.add_pool(PoolRequest("cut", (1, 2, 3), dimensions=2))
    out = {o.request_id: o for o in s.step()}
    assert math.isclose(sum(x * x for x in out["default"].data), 1.0, rel_tol=1e-6)
    assert out["raw"].data == (3.0, 1.0, 2.0, 2.0) and out["raw"].num_prompt_tokens == 3
    assert len(out["cut"].data) == 2 and math.isclose(out["cut"].data[0], 3 / math.sqrt(10), rel_tol=1e-6)


def test_requests_that_can_never_run_are_refused_and_a_failed_batch_fails_only_its_requests():
    s = PoolingScheduler(FakeRunner(fail=True), max_num_seqs=8, max_num_batched_tokens=100)
    assert "does not classify" in s.add_pool(PoolRequest("c", (1,), task="classify"))
    assert "at most 16" in s.add_pool(PoolRequest("long", tuple(range(1, 18))))
    assert s.add_pool(PoolRequest("a", (1, 2))) is None
    assert "already queued" in s.add_pool(PoolRequest("a", (1, 2)))
    assert s.add_pool(PoolRequest("b", (1, 2))) is None
    assert s.abort("b") is not None and s.abort("b") is None
    (out,) = s.step()
    assert out.request_id == "a" and out.data == () and "boom" in out.error
