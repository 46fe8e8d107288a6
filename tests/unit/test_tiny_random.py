"""The tiny random model: fast, deterministic, and served by the same scheduler/runner path as
real models.

Because it is cheap, this module also checks the engine's batching mechanics (mixed prefill and
decode, chunked prefill, paged KV layouts) against running each sequence alone.
"""

from __future__ import annotations

import time

import pytest
import torch

from engine_worker import cpu_kernels
from engine_worker.attention import SeqLayout, select_backend
from engine_worker.kv_cache import PagedKVCache
from engine_worker.loader import load_model
from engine_worker.runner import ModelRunner
from engine_worker.scheduler import Scheduler, run_until_done
from engine_worker.sequence import Sequence
from protocol.messages import RequestOutput, SamplingParams
from zserve.catalog import resolve

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356],
    [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 378],
    [6403, 1980],
    [1604],
    [3987, 46477, 24, 94, 727, 472, 585, 304, 2067, 216, 34, 42, 448],
]


# The attention backends a CPU can run; tests that compare two code paths pick one explicitly, so
# that the paths they mean to compare are the ones that run.
CPU_BACKENDS = [pytest.param("native", marks=pytest.mark.skipif(not cpu_kernels.available(),
                                                                  reason="native CPU kernels did not build here")),
                "gather"]


@pytest.fixture(scope="module")
def loaded():
    return load_model(resolve("tiny-random"), torch.float32, CPU)


def make_runner(loaded, max_num_seqs: int = 8, max_model_len: int = 128, **kw) -> ModelRunner:
    kw.setdefault("num_blocks", 64)
    return ModelRunner(loaded, CPU, torch.float32, max_num_seqs=max_num_seqs, max_model_len=max_model_len, **kw)


def generate(runner: ModelRunner, prompts: list[list[int]], params: SamplingParams = GREEDY, budget: int = 512,
             stagger: bool = False, prefix_caching: bool = True,
             sched: Scheduler | None = None) -> list[list[RequestOutput]]:
    """Run ``prompts`` through ``sched`` (default: a fresh scheduler); one newcomer per step when ``stagger``."""
    sched = sched or Scheduler(runner, runner.max_num_seqs, budget, enable_prefix_caching=prefix_caching)
    pending = list(enumerate(prompts))

    def feed(s: Scheduler) -> None:
        while pending:
            i, p = pending.pop(0)
            assert s.add(Sequence(f"r{i}", list(p), params)) is None
            if stagger:
                return

    outs = run_until_done(sched, feed)
    return [outs[f"r{i}"] for i in range(len(prompts))]


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_same_steps(got: list[RequestOutput], want: list[RequestOutput], what: str = "") -> None:
    """Same tokens and the same top-5 distribution (to fp32 rounding) at every step."""
    assert tokens(got) == tokens(want), what
    for g, w in zip(got, want):
        assert g.top_logprobs.token_ids == w.top_logprobs.token_ids, what
        assert g.top_logprobs.logprobs == pytest.approx(w.top_logprobs.logprobs, abs=1e-5), what


def test_tiny_random_loads_fast_and_reads_eos_from_the_tokenizer():
    t0 = time.perf_counter()
    lm = load_model(resolve("tiny-random"), torch.float32, CPU)
    assert time.perf_counter() - t0 < 2.0
    assert lm.eos_token_ids == [2]
    assert lm.vocab_size == 49152 and lm.config.num_layers == 2 and lm.model_id == "tiny-random"


def test_two_loads_give_identical_weights_and_outputs():
    # Fresh loads: a runner packs (and drops) the plain weights, so compare before any runner.
    first = load_model(resolve("tiny-random"), torch.float32, CPU)
    again = load_model(resolve("tiny-random"), torch.float32, CPU)
    a, b = first.model.state_dict(), again.model.state_dict()
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["embed_weight"].std().item() == pytest.approx(0.02, rel=0.05)  # the documented init
    assert generate(make_runner(first), PROMPTS[:1]) == generate(make_runner(again), PROMPTS[:1])


def test_cached_decode_equals_recomputing_the_whole_sequence(loaded):
    """Each decode step (reading keys/values from the paged cache) gives the distribution that a
    fresh prefill of prompt + generated tokens gives for its last position."""
    prompt = PROMPTS[1]
    steps = generate(make_runner(loaded), [prompt])[0]
    toks = tokens(steps)
    runner = make_runner(loaded)
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)
    for i in range(1, len(steps)):
        fresh = generate(runner, [prompt + toks[:i]], one, prefix_caching=False)[0]
        assert_same_steps(fresh, steps[i : i + 1], f"step {i}")


def test_mixed_batch_matches_each_sequence_alone(loaded):
    """Sequences join at different steps, so prefills and decodes share forward passes."""
    alone = [generate(make_runner(loaded), [p])[0] for p in PROMPTS]
    together = generate(make_runner(loaded), PROMPTS, stagger=True)
    for i, (got, want) in enumerate(zip(together, alone)):
        assert_same_steps(got, want, f"prompt {i}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_large_decode_batches_attend_like_small_ones(loaded, backend):
    """A batch of 12 decoders computes what batches of 4 do. On the gather backend that compares
    two code paths: beyond SDPA_MAX_DECODE_BATCH decoders, attention takes the batched-matmul path."""
    prompts = [PROMPTS[i % len(PROMPTS)][: 1 + i] + [7 + i] for i in range(12)]
    small = generate(make_runner(loaded, max_num_seqs=12, num_blocks=96, attention=backend),
                     prompts[:4] + prompts[4:8], budget=512)
    runner = make_runner(loaded, max_num_seqs=12, num_blocks=96, attention=backend)
    assert runner.attention.name == backend
    if backend == "gather":
        assert runner.attention.sdpa_max_decode_batch < 12
    large = generate(runner, prompts)
    for i in range(8):
        assert_same_steps(large[i], small[i], f"prompt {i}")
    alone = generate(make_runner(loaded, attention=backend), prompts[11:])[0]
    assert_same_steps(large[11], alone)


def test_chunked_prefill_equals_whole_prefill(loaded):
    prompt = PROMPTS[1] + PROMPTS[4]
    whole = generate(make_runner(loaded), [prompt])[0]
    for budget in (3, 7):
        assert_same_steps(generate(make_runner(loaded), [prompt], budget=budget)[0], whole, f"budget {budget}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_scattered_blocks_read_like_consecutive_ones(loaded, backend):
    """A request whose blocks are not consecutive in the pool computes what a lone request on
    consecutive blocks computes: on the gather backend, the gather path against the view path."""
    def spy_on_plans(runner: ModelRunner) -> list[bool]:
        """Per decode step on the gather backend: whether it read a view (True) or gathered."""
        views: list[bool] = []
        if backend == "gather":
            original = runner.attention.gather_plan
            runner.attention.gather_plan = lambda seqs: views.append(original(seqs).view is not None) or original(seqs)
        return views

    consecutive = make_runner(loaded, attention=backend)
    want_views = spy_on_plans(consecutive)
    want = generate(consecutive, [PROMPTS[1]])[0]
    runner = make_runner(loaded, attention=backend)
    assert runner.attention.name == backend
    got_views = spy_on_plans(runner)
    sched = Scheduler(runner, runner.max_num_seqs, 512, enable_prefix_caching=False)
    bm = sched.block_manager
    hold = bm.allocate(10)
    bm.free(hold[::2])  # free blocks 0, 2, 4, ...: the request gets every other block
    got = generate(runner, [PROMPTS[1]], sched=sched)[0]
    assert_same_steps(got, want)
    if backend == "gather":  # the two paths this test compares did run (a lone first block is a view too)
        assert want_views and all(want_views) and False in got_views


def test_seeded_sampling_repeats_and_differs_by_seed(loaded):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    a = tokens(generate(make_runner(loaded), PROMPTS[:1], params)[0])
    assert a == tokens(generate(make_runner(loaded), PROMPTS[:1], params)[0])
    other = SamplingParams(temperature=1.0, seed=12, max_tokens=6, ignore_eos=True)
    assert tokens(generate(make_runner(loaded), PROMPTS[:1], other)[0]) != a


def _prefill_logits(lm, prompt: list[int]) -> torch.Tensor:
    cfg = lm.config
    attn = select_backend(PagedKVCache(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU))
    layout = attn.plan([SeqLayout([0, 1], 0, len(prompt))])
    with torch.inference_mode():
        return lm.model.compute_logits(lm.model(torch.tensor(prompt), layout, attn))


def test_packed_cpu_weights_compute_what_plain_weights_do():
    plain = load_model(resolve("tiny-random"), torch.float32, CPU)
    packed = load_model(resolve("tiny-random"), torch.float32, CPU)
    if not packed.model.pack_for_cpu():
        pytest.skip("this torch has no oneDNN weight packing")
    assert packed.model.layers[0].mlp.down_proj.weight is None  # the plain copy was released
    a, b = _prefill_logits(plain, PROMPTS[1]), _prefill_logits(packed, PROMPTS[1])
    assert a.shape == (len(PROMPTS[1]), 49152)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError):
        packed.model.load_weights([])
