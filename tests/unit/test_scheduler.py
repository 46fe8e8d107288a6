"""The scheduler's bookkeeping with a fake runner: batching, chunked prefill, finishing, aborts."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_worker.runner import SampleOut
from engine_worker.scheduler import Scheduler, Sequence
from protocol import SamplingParams


@dataclass
class FakeRunner:
    max_model_len: int = 64
    eos_token_ids: list[int] = field(default_factory=lambda: [2])
    slots: list[int] = field(default_factory=lambda: [0, 1])
    freed: list[int] = field(default_factory=list)

    def allocate_slot(self):
        return self.slots.pop(0) if self.slots else None

    def free_slot(self, slot):
        self.freed.append(slot)
        self.slots.append(slot)

    def make_generator(self, seed):
        return ("gen", seed)


def _seq(rid, n_prompt=3, **sp):
    return Sequence(rid, b"client", list(range(10, 10 + n_prompt)), SamplingParams(**{"max_tokens": 4, **sp}))


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


def test_finish_on_max_tokens_eos_and_stop_ids_frees_the_slot():
    r = FakeRunner()
    s = Scheduler(r, max_num_seqs=2, max_num_batched_tokens=16)
    s.add(_seq("len", max_tokens=2))
    _run_step(s)
    _, outs = _run_step(s)
    assert outs[0][1].finish_reason == "length" and r.freed == [0]
    for rid, token, sp in [("eos", 2, {}), ("stopid", 9, {"stop_token_ids": (9,)})]:
        s.add(_seq(rid, **sp))
        _, outs = _run_step(s, token=token)
        assert outs[0][1].finish_reason == "stop", rid
    assert len(r.freed) == 3 and not s.has_work


def test_ignore_eos_and_min_tokens_keep_generating_past_eos():
    s = Scheduler(FakeRunner(), max_num_seqs=2, max_num_batched_tokens=16)
    s.add(_seq("ignored", ignore_eos=True, max_tokens=2))
    s.add(_seq("min", min_tokens=2, max_tokens=3))
    _, outs = _run_step(s, token=2)
    assert [o.finish_reason for _, o in outs] == [None, None]
    _, outs = _run_step(s, token=2)
    assert [o.finish_reason for _, o in outs] == ["length", "stop"]


def test_waiting_requests_start_when_a_slot_frees():
    r = FakeRunner(slots=[0])
    s = Scheduler(r, max_num_seqs=4, max_num_batched_tokens=16)
    s.add(_seq("first", max_tokens=1))
    s.add(_seq("second", max_tokens=1))
    step, outs = _run_step(s)
    assert [q.request_id for q in step.seqs] == ["first"] and len(s.waiting) == 1
    step, outs = _run_step(s)
    assert [q.request_id for q in step.seqs] == ["second"]
    assert not s.has_work and r.slots == [0]


def test_abort_frees_running_and_waiting_requests():
    r = FakeRunner(slots=[0])
    s = Scheduler(r, max_num_seqs=4, max_num_batched_tokens=16)
    s.add(_seq("run"))
    s.add(_seq("wait"))
    _run_step(s)
    assert s.abort("run").finish_reason == "abort" and r.slots == [0]
    assert s.abort("wait") is not None and s.abort("nope") is None
    assert not s.has_work


def test_prompt_longer_than_the_context_is_refused():
    s = Scheduler(FakeRunner(max_model_len=8), max_num_seqs=2, max_num_batched_tokens=16)
    assert "context" in s.add(_seq("big", n_prompt=8))
    assert s.add(_seq("ok", n_prompt=7)) is None
    assert "already" in s.add(_seq("ok", n_prompt=2))
