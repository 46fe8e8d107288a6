"""Weighted fairness between tenants in the scheduler (engine_worker.fairness), with a fake runner and a real block
manager: a flood does not push another tenant's requests behind it, weights share the tokens, idle time is no credit,
preemption takes from the tenant above its share; without tenants (or with fifo) the order is the usual one."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from engine_worker.fairness import LINGER, Fairness
from engine_worker.runner import SampleOut
from engine_worker.scheduler import FAIR_CHUNK, Scheduler
from engine_worker.sequence import Sequence
from protocol import SamplingParams


@dataclass
class FakeRunner:
    max_model_len: int = 256
    eos_token_ids: list[int] = field(default_factory=lambda: [2])
    num_blocks: int = 256
    block_size: int = 4


def seq(rid: str, tenant: str = "", weight: float = 1.0, n_prompt: int = 8, max_tokens: int = 8,
        priority: int = 0) -> Sequence:
    # (a first token of its own, the same in every run: str's hash() changes with the process, and two prompts that
    # met in it shared their cached blocks, which changed the schedule in some runs)
    return Sequence(rid, [1000 + zlib.crc32(rid.encode()) % 1_000_000, *range(11, 10 + n_prompt)],
                    SamplingParams(max_tokens=max_tokens, priority=priority), tenant=tenant, weight=weight)


def step(s: Scheduler) -> list[str]:
    st = s.schedule()
    outs = s.update(st, [SampleOut(7, None, None, None) if i.sample else None for i in st.inputs])
    return [o.request_id for _, o in outs if o.finish_reason is not None]


def finish_order(s: Scheduler, steps: int = 1000) -> list[str]:
    done: list[str] = []
    for _ in range(steps):
        if not s.has_work:
            break
        done += step(s)
    return done


def flood_then_b(fair: bool) -> list[str]:
    s = Scheduler(FakeRunner(), max_num_seqs=2, max_num_batched_tokens=64, fair=fair)
    for i in range(20):
        s.add(seq(f"a{i}", "a"))
    step(s)  # A's first two are running
    s.add(seq("b0", "b"))
    s.add(seq("b1", "b"))
    return finish_order(s)


def test_a_flood_does_not_push_another_tenants_requests_behind_it():
    fair, fifo = flood_then_b(True), flood_then_b(False)
    assert fair.index("b0") < 4 and fair.index("b1") < 6, fair  # served as soon as slots free
    assert fifo.index("b0") == 20 and fifo.index("b1") == 21, fifo  # FIFO: behind the whole flood
    assert sorted(fair) == sorted(fifo)  # (everything is served either way)


def test_backlogged_tenants_share_tokens_by_weight():
    s = Scheduler(FakeRunner(), max_num_seqs=1, max_num_batched_tokens=64)
    for i in range(40):
        s.add(seq(f"h{i}", "heavy", weight=2.0))
        s.add(seq(f"l{i}", "light", weight=1.0))
    done = [rid for _ in range(150) for rid in step(s)]
    heavy, light = sum(r[0] == "h" for r in done), sum(r[0] == "l" for r in done)
    assert heavy and light and abs(heavy / light - 2.0) < 0.35, (heavy, light)


def test_a_tenant_returning_from_idle_gets_no_banked_credit():
    s = Scheduler(FakeRunner(), max_num_seqs=1, max_num_batched_tokens=64)
    s.add(seq("a-old", "a"))
    finish_order(s)  # a was served a little, long ago
    for i in range(40):
        s.add(seq(f"c{i}", "c"))  # c: busy alone for a long time
    for _ in range(100):
        step(s)
    for i in range(10):
        s.add(seq(f"a{i}", "a"))  # a returns: lifted to c's counter (less a step's credit), not its old, far lower one
    assert s.fairness.counter("a") >= s.fairness.counter("c") - 64 - 30  # (c's running request's tokens aside)
    later = finish_order(s)[:8]
    assert sum(r.startswith("a") for r in later) <= 5 and sum(r.startswith("c") for r in later) >= 3, later


def test_without_tenants_or_with_fifo_the_order_is_priority_then_arrival():
    for fair in (True, False):
        s = Scheduler(FakeRunner(), max_num_seqs=1, max_num_batched_tokens=64, fair=fair)
        for i, p in enumerate([0, 0, -1, 5, 0]):
            s.add(seq(f"r{i}", "" if fair else ("x" if i % 2 else "y"), priority=p))
        assert finish_order(s) == ["r2", "r0", "r1", "r4", "r3"]


def test_preemption_takes_from_the_tenant_furthest_above_its_share():
    # 8 blocks of 4: two requests of 8-token prompts and 16 tokens each cannot both finish without a preemption
    s = Scheduler(FakeRunner(num_blocks=9), max_num_seqs=2, max_num_batched_tokens=64)
    s.fairness.served("rich", 1.0, 1000, 0)  # rich has had far more than its share
    s.add(seq("p", "poor", max_tokens=16))
    s.add(seq("r", "rich", max_tokens=16))
    preempted = []
    for _ in range(60):
        if not s.has_work:
            break
        step(s)
        preempted += [q.request_id for q in s.waiting if q.num_preemptions and q.request_id not in preempted]
    assert preempted == ["r"], preempted


def test_a_light_tenant_goes_before_the_floods_prompt_chunks_and_takes_a_slot_from_it():
    # A's long prompts take several steps each (chunked prefill); both slots are A's, still in their prompts
    s = Scheduler(FakeRunner(), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(6):
        s.add(seq(f"a{i}", "a", n_prompt=100))
    step(s)
    step(s)
    assert len(s.running) == 2 and s.running[1].num_computed < 64  # both slots a's, a1 still in its prompt
    s.add(seq("b0", "b", n_prompt=8))
    st = s.schedule()
    by_id = {q.request_id: len(i.new_token_ids) for q, i in zip(st.seqs, st.inputs)}
    assert by_id.get("b0") == 8, by_id  # b's whole prompt this step: a slot taken from a, and before a's chunks
    assert s.preemptions == 1 and s.waiting[0].request_id == "a1" and s.waiting[0].num_preemptions == 1
    for _ in range(3):
        st = s.schedule()  # a's prompts, while b is here: short chunks
        assert sum(len(i.new_token_ids) for q, i in zip(st.seqs, st.inputs) if q.request_id.startswith("a")
                   and q.num_computed < q.total_len - 1) <= 64 * FAIR_CHUNK
        s.update(st, [SampleOut(7, None, None, None) if i.sample else None for i in st.inputs])


def test_prompt_chunks_of_one_tenant_alone_are_not_capped():
    s = Scheduler(FakeRunner(), max_num_seqs=2, max_num_batched_tokens=32)
    s.add(seq("a0", "a", n_prompt=60))
    s.add(seq("a1", "a", n_prompt=60))
    st = s.schedule()
    assert [len(i.new_token_ids) for i in st.inputs] == [32]
    s = Scheduler(FakeRunner(), max_num_seqs=2, max_num_batched_tokens=32, fair=False)
    for t in "ab":
        s.add(seq(f"{t}0", t, n_prompt=60))  # fifo: two tenants, no cap either
    assert [len(i.new_token_ids) for i in s.schedule().inputs] == [32]


def test_counters_lift_and_forget():
    f = Fairness(credit=3.0)
    f.arrived("a")
    f.served("a", 2.0, 10, 5)
    f.arrived("c")  # c arrives while a is active: starts at a's counter less the credit
    assert f.counter("c") == f.counter("a") - 3.0 and f.contended
    assert f.over_share(0.0) == {"a"}  # a is above the lowest counter: its prompts run in short chunks
    f.left("c")
    assert f.over_share(f.idle_since["c"] + 1.0) == {"a"}  # c left a moment ago: still counted
    assert f.over_share(f.idle_since["c"] + LINGER) == set() and not f.idle_since  # then forgotten


def test_counters_lift_and_forget_without_credit():
    f = Fairness()
    f.arrived("a")
    f.served("a", 2.0, 10, 5)
    assert f.counter("a") == (10 * 1.0 + 5 * 2.0) / 2.0
    f.arrived("b")  # b arrives while a is active: starts at a's counter
    assert f.counter("b") == f.counter("a") and f.contended
    f.left("a")
    f.left("b")
    assert not f.active and not f.contended
