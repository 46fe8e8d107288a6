"""The scheduler's bookkeeping with a fake runner (and a real block manager): batching, chunked
prefill, finishing, aborts, KV blocks, preemption, prefix sharing."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_worker.runner import SampleOut
from engine_worker.scheduler import Scheduler
from engine_worker.sequence import Sequence, SequenceStatus
from protocol import SamplingParams


@dataclass
class FakeRunner:
    max_model_len: int = 64
    eos_token_ids: list[int] = field(default_factory=lambda: [2])
    num_blocks: int = 64
    block_size: int = 4


def _seq(rid, n_prompt=3, **sp):
    return Sequence(rid, list(range(10, 10 + n_prompt)), SamplingParams(**{"max_tokens": 4, **sp}))


def _run_step(s: Scheduler, token: int = 7):
    step = s.schedule()
    results = [SampleOut(token, None, None, None) if i.sample else None for i in step.inputs]
    return step, s.update(step, results)


def test_decodes_and_prefills_share_a_step():
    s = Scheduler(FakeRunner(), max_num_seqs=2, max_num_batched_tokens=16)
    s.add(_seq("a"))
    step, outs = _run_step(s)
    assert [len(i.new_token_ids) for i in step.inputs] == [3]
    s.add(_seq("b"))
    step, outs = _run_step(s)
    # a decodes one token while b prefills its prompt in the same forward pass
    assert [(q.request_id, len(i.new_token_ids)) for q, i in zip(step.seqs, step.inputs)] == [("a", 1), ("b", 3)]
    assert {o.request_id for _, o in outs} == {"a", "b"}


def test_long_prompt_is_chunked_under_the_budget_and_samples_only_at_the_end():
    s = Scheduler(FakeRunner(), max_num_seqs=2, max_num_batched_tokens=4)
    s.add(_seq("long", n_prompt=10))
    sizes, samples = [], []
    while s.by_id["long"].in_prefill:
        step, _ = _run_step(s)
        sizes.append(len(step.inputs[0].new_token_ids))
        samples.append(step.inputs[0].sample)
    assert sizes == [4, 4, 2] and samples == [False, False, True]
    assert s.by_id["long"].output_ids == [7]


def test_finish_on_max_tokens_eos_and_stop_ids_frees_the_blocks():
    r = FakeRunner()
    s = Scheduler(r, max_num_seqs=2, max_num_batched_tokens=16)
    s.add(_seq("len", max_tokens=2))
    _run_step(s)
    assert s.block_manager.num_used == 1
    _, outs = _run_step(s)
    assert outs[0][1].finish_reason == "length" and s.block_manager.num_used == 0
    for rid, token, sp in [("eos", 2, {}), ("stopid", 9, {"stop_token_ids": (9,)})]:
        s.add(_seq(rid, **sp))
        _, outs = _run_step(s, token=token)
        assert outs[0][1].finish_reason == "stop", rid
    assert s.block_manager.num_used == 0 and not s.has_work


def test_ignore_eos_and_min_tokens_keep_generating_past_eos():
    s = Scheduler(FakeRunner(), max_num_seqs=2, max_num_batched_tokens=16)
    s.add(_seq("ignored", ignore_eos=True, max_tokens=2))
    s.add(_seq("min", min_tokens=2, max_tokens=3))
    _, outs = _run_step(s, token=2)
    assert [o.finish_reason for _, o in outs] == [None, None]
    _, outs = _run_step(s, token=2)
    assert [o.finish_reason for _, o in outs] == ["length", "stop"]


def test_waiting_requests_start_when_a_sequence_slot_frees():
    r = FakeRunner()
    s = Scheduler(r, max_num_seqs=1, max_num_batched_tokens=16)
    s.add(_seq("first", max_tokens=1))
    s.add(_seq("second", max_tokens=1))
    step, outs = _run_step(s)
    assert [q.request_id for q in step.seqs] == ["first"] and len(s.waiting) == 1
    step, outs = _run_step(s)
    assert [q.request_id for q in step.seqs] == ["second"]
    assert not s.has_work and s.block_manager.num_used == 0


def test_waiting_requests_start_when_kv_blocks_free():
    r = FakeRunner(num_blocks=3, block_size=4)
    s = Scheduler(r, max_num_seqs=4, max_num_batched_tokens=64)
    s.add(_seq("big", n_prompt=9, max_tokens=2))  # 3 blocks
    s.add(_seq("next", n_prompt=3, max_tokens=1))
    step, _ = _run_step(s)
    assert [q.request_id for q in step.seqs] == ["big"] and s.block_manager.num_free == 0
    _run_step(s)  # big finishes
    step, _ = _run_step(s)
    assert [q.request_id for q in step.seqs] == ["next"]


def test_abort_frees_running_and_waiting_requests():
    r = FakeRunner()
    s = Scheduler(r, max_num_seqs=1, max_num_batched_tokens=16)
    s.add(_seq("run"))
    s.add(_seq("wait"))
    _run_step(s)
    assert s.block_manager.num_used == 1
    assert s.abort("run").finish_reason == "abort" and s.block_manager.num_used == 0
    assert s.abort("wait") is not None and s.abort("nope") is None
    assert not s.has_work


def test_prompt_longer_than_the_context_is_refused():
    s = Scheduler(FakeRunner(max_model_len=8), max_num_seqs=2, max_num_batched_tokens=16)
    assert "context" in s.add(_seq("big", n_prompt=8))
    assert s.add(_seq("ok", n_prompt=7)) is None
    assert "already" in s.add(_seq("ok", n_prompt=2))


def test_out_of_blocks_preempts_the_newest_and_recomputes_it_later():
    # 4 blocks of 4 tokens; two requests of 7-token prompts need 2 blocks each, then a third
    # block each once they pass 8 tokens: the newer one is preempted, the older continues.
    r = FakeRunner(num_blocks=4, block_size=4)
    s = Scheduler(r, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    s.add(_seq("old", n_prompt=7, max_tokens=6))
    s.add(_seq("new", n_prompt=7, max_tokens=6))
    _run_step(s)  # both prefill: 7 tokens each, 2 blocks each
    assert s.block_manager.num_free == 0
    step, _ = _run_step(s)  # both decode token 8 (fits in block 2)
    step, _ = _run_step(s)  # token 9 needs a third block: "new" is preempted
    assert [q.request_id for q in step.seqs] == ["old"]
    new = s.by_id["new"]
    assert s.preemptions == 1 and new.status is SequenceStatus.PREEMPTED and new in s.waiting and new.num_computed == 0
    assert new.output_ids == [7, 7] and s.num_preempted == 1
    while "old" in s.by_id:
        _run_step(s)
    step, _ = _run_step(s)  # "new" comes back: prompt + its two outputs recomputed, then samples
    assert step.seqs == [new] and step.inputs[0].new_token_ids == new.prompt_ids + [7, 7]
    assert step.inputs[0].sample and len(new.output_ids) == 3
    while s.has_work:
        _run_step(s)
    assert len(new.output_ids) == 6 and s.block_manager.num_used == 0


def test_a_prompt_prefix_in_the_cache_skips_its_prefill():
    r = FakeRunner(block_size=4)
    s = Scheduler(r, max_num_seqs=4, max_num_batched_tokens=64)
    s.add(_seq("a", n_prompt=10, max_tokens=1))
    _run_step(s)
    assert s.block_manager.num_cached == 2  # two full blocks of a's prompt
    s.add(_seq("b", n_prompt=10, max_tokens=1))
    step, outs = _run_step(s)
    assert step.inputs[0].start_pos == 8 and step.inputs[0].new_token_ids == list(range(18, 20))
    assert outs[0][1].num_cached_tokens == 8
    assert s.block_manager.hit_rate == 8 / 20


def test_same_prompt_arriving_together_shares_the_prompt_blocks():
    """n > 1 fanned out by the gateway: the copies wait one step for the first one's blocks."""
    r = FakeRunner(block_size=4)
    s = Scheduler(r, max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(3):
        s.add(_seq(f"n{i}", n_prompt=10, max_tokens=3))
    step, _ = _run_step(s)
    assert [q.request_id for q in step.seqs] == ["n0"]
    step, _ = _run_step(s)
    assert [(q.request_id, i.start_pos) for q, i in zip(step.seqs, step.inputs)] == [("n0", 10), ("n1", 8), ("n2", 8)]
    tables = [s.by_id[f"n{i}"].block_table for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # shared prompt blocks
    assert len({t[2] for t in tables}) == 3  # each writes its own last block
    assert s.block_manager.num_used == 2 + 3


def test_prefix_caching_off_computes_everything():
    r = FakeRunner(block_size=4)
    s = Scheduler(r, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    s.add(_seq("a", n_prompt=10, max_tokens=1))
    s.add(_seq("b", n_prompt=10, max_tokens=1))
    step, _ = _run_step(s)
    assert [i.start_pos for i in step.inputs] == [0, 0] and s.block_manager.num_cached == 0


def test_prompt_logprobs_rows_cover_every_prompt_token_once_across_chunks():
    s = Scheduler(FakeRunner(), max_num_seqs=2, max_num_batched_tokens=4)
    s.add(_seq("p", n_prompt=10, prompt_logprobs=2))
    rows = []
    while s.by_id["p"].in_prefill:
        step, _ = _run_step(s)
        rows.append((step.inputs[0].start_pos, step.inputs[0].prompt_logprobs_rows))
    assert rows == [(0, 4), (4, 4), (8, 1)]  # 9 = every prompt token after the first


def test_priority_orders_admission_and_preemption():
    r = FakeRunner(num_blocks=4, block_size=4)
    s = Scheduler(r, max_num_seqs=1, max_num_batched_tokens=64, enable_prefix_caching=False)
    for rid, pr in [("late-low", 5), ("urgent", -1), ("normal", 0), ("normal2", 0)]:
        s.add(_seq(rid, n_prompt=3, max_tokens=1, priority=pr))
    order = []
    while s.has_work:
        step, _ = _run_step(s)
        order += [q.request_id for q in step.seqs]
    assert order == ["urgent", "normal", "normal2", "late-low"]

    # Out of blocks, the low-priority request is preempted even though it is older.
    s = Scheduler(r, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    s.add(_seq("low", n_prompt=7, max_tokens=6, priority=1))
    s.add(_seq("high", n_prompt=7, max_tokens=6))
    _run_step(s)
    _run_step(s)
    step, _ = _run_step(s)
    assert [q.request_id for q in step.seqs] == ["high"] and s.by_id["low"].status is SequenceStatus.PREEMPTED
    assert s.waiting[0].request_id == "low"
