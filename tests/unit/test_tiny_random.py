"""The tiny random model: fast, deterministic, and served by the same runner path as real models.

Because it is cheap, this module also checks the runner's batching mechanics (mixed prefill and
decode, chunked prefill, slot layouts) against running each sequence alone.
"""

from __future__ import annotations

import time

import pytest
import torch

from engine_worker.kv_cache import SlotKVCache
from engine_worker.loader import load_model
from engine_worker.runner import ModelRunner, SampleOut, SeqInput
from protocol.messages import SamplingParams
from zserve.catalog import ModelSource, resolve

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, logprobs=5)
PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356],
    [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 378],
    [6403, 1980],
    [1604],
    [3987, 46477, 24, 94, 727, 472, 585, 304, 2067, 216, 34, 42, 448],
]


@pytest.fixture(scope="module")
def loaded():
    return load_model(resolve("tiny-random"), torch.float32, CPU)


def make_runner(loaded, max_num_seqs: int = 8, max_model_len: int = 128) -> ModelRunner:
    return ModelRunner(loaded, CPU, torch.float32, max_num_seqs=max_num_seqs, max_model_len=max_model_len)


def generate_alone(runner: ModelRunner, prompt: list[int], n: int, params: SamplingParams = GREEDY,
                   generator: torch.Generator | None = None) -> list[SampleOut]:
    """``n`` steps of one sequence on its own: a prefill, then decodes."""
    slot = runner.allocate_slot()
    out: list[SampleOut] = []
    new, pos, past = list(prompt), 0, []
    for _ in range(n):
        o = runner.execute([SeqInput(slot, new, pos, params, list(past), list(prompt), generator=generator)])[0]
        out.append(o)
        pos += len(new)
        new = [o.token_id]
        past.append(o.token_id)
    runner.free_slot(slot)
    return out


def assert_same_steps(got: list[SampleOut], want: list[SampleOut], what: str = "") -> None:
    """Same tokens and the same top-5 distribution (to fp32 rounding) at every step."""
    assert [o.token_id for o in got] == [o.token_id for o in want], what
    for g, w in zip(got, want):
        assert g.top_ids == w.top_ids, what
        assert g.top_logprobs == pytest.approx(w.top_logprobs, abs=1e-5), what


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
    assert generate_alone(make_runner(first), PROMPTS[0], 6) == generate_alone(make_runner(again), PROMPTS[0], 6)


def test_cached_decode_equals_recomputing_the_whole_sequence(loaded):
    """Each decode step (reading keys/values from the cache) gives the distribution that a fresh
    prefill of prompt + generated tokens gives for its last position."""
    prompt = PROMPTS[1]
    steps = generate_alone(make_runner(loaded), prompt, 6)
    tokens = [o.token_id for o in steps]
    for i in range(1, len(steps)):
        fresh = generate_alone(make_runner(loaded), prompt + tokens[:i], 1)
        assert_same_steps(fresh, steps[i : i + 1], f"step {i}")


def test_mixed_batch_matches_each_sequence_alone(loaded):
    """Sequences join at different steps, so prefills and decodes share execute calls."""
    n_new = 8
    alone = [generate_alone(make_runner(loaded), p, n_new) for p in PROMPTS]

    runner = make_runner(loaded)
    idle = None
    state = []  # [slot, prompt, new, pos, outputs, prompt index]
    pending = list(enumerate(PROMPTS))
    mixed_steps = 0
    while pending or any(len(s[4]) < n_new for s in state):
        if pending:  # one newcomer per step
            i, p = pending.pop(0)
            state.append([runner.allocate_slot(), p, list(p), 0, [], i])
            if idle is None:  # an idle slot after the first one: decoding slots have a hole
                idle = runner.allocate_slot()
        active = [s for s in state if len(s[4]) < n_new]
        outs = runner.execute([SeqInput(s[0], s[2], s[3], GREEDY, [o.token_id for o in s[4]], s[1]) for s in active])
        kinds = {len(s[2]) > 1 for s in active}
        mixed_steps += kinds == {True, False}
        for s, o in zip(active, outs):
            s[4].append(o)
            s[3] += len(s[2])
            s[2] = [o.token_id]
    runner.free_slot(idle)
    assert mixed_steps >= 3  # prefills and decodes really shared forward passes
    for s in state:
        assert_same_steps(s[4], alone[s[5]], f"prompt {s[5]}")


def test_chunked_prefill_equals_whole_prefill(loaded):
    prompt = PROMPTS[1] + PROMPTS[4]
    ref = generate_alone(make_runner(loaded), prompt, 5)
    runner = make_runner(loaded)
    slot = runner.allocate_slot()
    chunks = [prompt[:7], prompt[7:15], prompt[15:]]
    pos = 0
    for c in chunks[:-1]:
        assert runner.execute([SeqInput(slot, c, pos, GREEDY, [], prompt, sample=False)]) == [None]
        pos += len(c)
    out, new = [], chunks[-1]
    for _ in range(5):
        o = runner.execute([SeqInput(slot, new, pos, GREEDY, [t.token_id for t in out], prompt)])[0]
        out.append(o)
        pos += len(new)
        new = [o.token_id]
    assert_same_steps(out, ref)


def test_widely_spread_decode_slots_take_the_gather_path(loaded):
    """Decoders in slots 0 and 7 only: attention gathers the two slots instead of a range view."""
    ref = [generate_alone(make_runner(loaded), p, 4) for p in PROMPTS[:2]]
    runner = make_runner(loaded)
    slots = [runner.allocate_slot() for _ in range(8)]
    for s in slots[1:7]:
        runner.free_slot(s)
    use = [slots[0], slots[7]]
    new = [list(p) for p in PROMPTS[:2]]
    pos, got = [0, 0], [[], []]
    for _ in range(4):
        outs = runner.execute([SeqInput(use[j], new[j], pos[j], GREEDY, [o.token_id for o in got[j]], PROMPTS[j])
                               for j in range(2)])
        for j, o in enumerate(outs):
            pos[j] += len(new[j])
            new[j] = [o.token_id]
            got[j].append(o)
    for j in range(2):
        assert_same_steps(got[j], ref[j], f"prompt {j}")


def test_slots_are_bounded_and_freed(loaded):
    runner = make_runner(loaded, max_num_seqs=2, max_model_len=16)
    a, b = runner.allocate_slot(), runner.allocate_slot()
    assert {a, b} == {0, 1} and runner.allocate_slot() is None
    runner.free_slot(a)
    assert runner.allocate_slot() == a
    with pytest.raises(ValueError):
        runner.free_slot(5)
    with pytest.raises(ValueError, match="max_model_len"):
        runner.execute([SeqInput(b, list(range(10)), 10, GREEDY, [], [])])


def test_seeded_requests_keep_one_generator_across_steps(loaded):
    """Without a generator in SeqInput the runner keeps one per seeded request: the tokens equal
    those drawn with one explicit generator made from the seed, and repeat run after run."""
    params = SamplingParams(temperature=1.0, seed=11)
    implicit = generate_alone(make_runner(loaded), PROMPTS[0], 6, params)
    runner = make_runner(loaded)
    explicit = generate_alone(runner, PROMPTS[0], 6, params, generator=runner.make_generator(11))
    assert [o.token_id for o in implicit] == [o.token_id for o in explicit]
    assert implicit == generate_alone(make_runner(loaded), PROMPTS[0], 6, params)
    other = generate_alone(make_runner(loaded), PROMPTS[0], 6, SamplingParams(temperature=1.0, seed=12))
    assert [o.token_id for o in other] != [o.token_id for o in implicit]


def _prefill_logits(lm, prompt: list[int]) -> torch.Tensor:
    cfg = lm.config
    kv = SlotKVCache(cfg.num_layers, 1, cfg.num_kv_heads, 32, cfg.head_dim, torch.float32, CPU)
    layout = kv.plan([(kv.allocate(), 0, len(prompt))])
    with torch.inference_mode():
        return lm.model.compute_logits(lm.model(torch.tensor(prompt), layout, kv))


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


def test_hugging_face_directories_are_refused_clearly():
    with pytest.raises(NotImplementedError, match="Hugging Face"):
        load_model(ModelSource("x", "hf", "/nonexistent", "/nonexistent"), torch.float32, CPU)
