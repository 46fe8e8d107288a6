"""fp32 SmolLM2 through the engine (scheduler + paged runner) gives transformers' greedy tokens:
alone and batched, with chunked prefill on and off, prefix caching on and off, and under a KV
budget so small that requests are preempted and recomputed; and through a LoRA adapter on every
projection, batched with the base model, PEFT's.

transformers loads the same GGUF (its own dequantization and Q/K un-permutation) and is the
oracle: a wrong RoPE layout, norm, GQA grouping or KV-cache bookkeeping changes the tokens.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from engine_worker.loader import load_model
from engine_worker.runner import ModelRunner
from engine_worker.scheduler import Scheduler, run_until_done
from engine_worker.sequence import Sequence
from protocol.messages import SamplingParams
from zserve.catalog import resolve, smollm2_gguf_path

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
NEW_TOKENS = 12
FRANCE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
          8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
FRANCE_ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris." EOS
PROMPTS = [
    FRANCE,
    # "The quick brown fox jumps over the lazy dog. The quick brown fox"
    [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 378, 2365, 6354, 16438],
    # "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
    [1604, 3987, 46477, 24, 94, 727, 472, 585, 304, 2067, 216, 34, 42, 448, 1003, 304, 472, 1003],
    # "Once upon a time, in a small village by the sea,"
    [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28],
]
# The same system prompt as FRANCE (24 tokens), another question: shares FRANCE's first blocks.
SAME_SYSTEM = FRANCE[:24] + [6403, 1980, 253, 655, 28, 281, 253, 1165, 2, 198, 1, 520, 9531, 198]
EOS = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5)


@pytest.fixture(scope="module")
def hf():
    """SmolLM2 in transformers, fp32, from the same GGUF (loaded once). transformers' own GGUF loader reads the
    file twice (the config, then the tensors) and builds gguf-py's tensor-name map again for each of its ~400
    modules, ~12 s of a ~19 s load: both are memoized for the load, which changes nothing it computes."""
    transformers = pytest.importorskip("transformers")
    import gguf

    path = smollm2_gguf_path()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(gguf.GGUFReader))
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                 dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(hf):
    """transformers' greedy continuations and first-step log-probs, computed once."""
    tokens, first_logprobs = [], []
    with torch.inference_mode():
        for p in PROMPTS + [SAME_SYSTEM]:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                              pad_token_id=EOS)
            tokens.append(_until_eos(out[0, len(p):].tolist()))
            first_logprobs.append(torch.log_softmax(hf(ids).logits[0, -1].float(), -1))
    return tokens, first_logprobs


@pytest.fixture(scope="module")
def loaded():
    return load_model(resolve("SmolLM2-135M-Instruct"), torch.float32, CPU)


def make_runner(loaded, **kw) -> ModelRunner:
    return ModelRunner(loaded, CPU, torch.float32, max_num_seqs=8, max_model_len=kw.pop("max_model_len", 256), **kw)


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def run(runner: ModelRunner, prompts: list[list[int]], budget: int = 512, params: SamplingParams = GREEDY,
        sched: Scheduler | None = None, prefix_caching: bool = True):
    """Run ``prompts`` to the end through ``sched`` (default: a fresh scheduler, so an empty prefix cache)."""
    sched = sched or Scheduler(runner, 8, budget, enable_prefix_caching=prefix_caching)
    for i, p in enumerate(prompts):
        assert sched.add(Sequence(f"r{i}", list(p), params)) is None
    outs = run_until_done(sched)
    return [outs[f"r{i}"] for i in range(len(prompts))], sched


def toks(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_reference_answers_the_france_question(reference):
    assert reference[0][0] == FRANCE_ANSWER


def test_each_prompt_alone_matches_transformers(loaded, reference):
    ref_tokens, ref_lp = reference
    runner = make_runner(loaded)
    for i, prompt in enumerate(PROMPTS):
        (outs,), _ = run(runner, [prompt])
        assert toks(outs) == ref_tokens[i], f"prompt {i}"
        # The fp32 forward matches the oracle's to rounding, not only in its argmax.
        first = outs[0]
        assert list(first.top_logprobs.token_ids) == ref_lp[i].topk(5).indices.tolist()
        assert first.top_logprobs.logprobs == pytest.approx(ref_lp[i].topk(5).values.tolist(), abs=2e-3)


@pytest.mark.parametrize("budget", [512, 8], ids=["whole-prefill", "chunked-prefill"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_all_prompts_together_match_transformers(loaded, reference, budget, prefix_caching):
    ref_tokens, _ = reference
    # With the prefix cache: the gather backend and the matmul path its large decode batches take
    # (small ones use SDPA). Without: the default backend (native CPU kernels where they build).
    runner = make_runner(loaded, attention="gather" if prefix_caching else None)
    if prefix_caching:
        runner.attention.sdpa_max_decode_batch = 0
    # FRANCE twice: the copy shares its blocks
    outs, sched = run(runner, PROMPTS + PROMPTS[:1], budget, prefix_caching=prefix_caching)
    for i, o in enumerate(outs):
        assert toks(o) == ref_tokens[i % len(PROMPTS)], f"prompt {i}"
    assert (outs[-1][0].num_cached_tokens > 0) == prefix_caching


def test_preemption_under_a_small_kv_budget_changes_no_output(loaded, reference):
    ref_tokens, _ = reference
    # 20 blocks of 4 tokens = 80 token positions for 4 requests that need ~130 together.
    runner = make_runner(loaded, block_size=4, num_blocks=20, max_model_len=64)
    outs, sched = run(runner, PROMPTS)
    assert sched.preemptions > 0
    for i, o in enumerate(outs):
        assert toks(o) == ref_tokens[i], f"prompt {i}"
    assert sched.block_manager.num_used == 0


def test_a_shared_prefix_is_a_cache_hit_with_the_same_output(loaded, reference):
    ref_tokens, _ = reference
    runner = make_runner(loaded, block_size=8)
    _, sched = run(runner, [FRANCE])
    (outs,), _ = run(runner, [SAME_SYSTEM], sched=sched)
    assert outs[0].num_cached_tokens == 24  # three blocks of the shared system prompt
    assert sched.block_manager.hit_rate > 0
    assert toks(outs) == ref_tokens[len(PROMPTS)]
    (cold,), _ = run(make_runner(loaded, block_size=8), [SAME_SYSTEM], prefix_caching=False)
    assert cold[0].num_cached_tokens == 0 and toks(cold) == toks(outs)


def test_a_lora_adapter_on_every_projection_batched_with_the_base_model_matches_peft(loaded, hf, tmp_path):
    """32 greedy tokens through a rank-8 adapter on q/k/v/o/gate/up/down, two prompts through it and one through
    the base model in the same batches: what transformers + PEFT generate in fp32, token for token."""
    peft = pytest.importorskip("peft")
    from tests.lora_adapters import write_adapter

    n = 32
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    path = write_adapter(copy.deepcopy(hf), tmp_path / "smol", 5, scale=0.05, r=8, lora_alpha=16,
                         target_modules=modules)
    adapted = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(path)).eval()

    def greedy(model, prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=EOS)
        return out[0, len(prompt):].tolist()

    want = [greedy(adapted, FRANCE), greedy(adapted, PROMPTS[1]), greedy(hf, PROMPTS[2])]
    assert want[0] != greedy(hf, FRANCE)  # (the adapter changes what the model writes)
    runner = make_runner(loaded, max_loras=2)
    runner.loras.load("smol", path)
    sched = Scheduler(runner, 8, 512, loras=runner.loras)
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)  # (EOS masked, as min_new_tokens does)
    for i, (prompt, lora) in enumerate([(FRANCE, "smol"), (PROMPTS[1], "smol"), (PROMPTS[2], None)]):
        assert sched.add(Sequence(f"r{i}", list(prompt), params, lora=lora)) is None
    outs = run_until_done(sched)
    assert [toks(outs[f"r{i}"]) for i in range(3)] == want
