"""fp32 SmolLM2 through ModelRunner gives transformers' greedy tokens, alone and batched.

transformers loads the same GGUF (its own dequantization and Q/K un-permutation) and is the
oracle: a wrong RoPE layout, norm, GQA grouping or KV-cache bookkeeping changes the tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine_worker.loader import load_model
from engine_worker.runner import ModelRunner, SeqInput
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
EOS = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5)


@pytest.fixture(scope="module")
def reference():
    """transformers' greedy continuations and first-step log-probs, computed once."""
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    tokens, first_logprobs = [], []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                              pad_token_id=EOS)
            tokens.append(out[0, len(p):].tolist())
            first_logprobs.append(torch.log_softmax(hf(ids).logits[0, -1].float(), -1))
    return tokens, first_logprobs


@pytest.fixture(scope="module")
def runner():
    loaded = load_model(resolve("SmolLM2-135M-Instruct"), torch.float32, CPU)
    return ModelRunner(loaded, CPU, torch.float32, max_num_seqs=8, max_model_len=256)


def _until_eos(tokens: list[int], n: int) -> list[int]:
    out = tokens[:n]
    return out[: out.index(EOS) + 1] if EOS in out else out


def test_reference_answers_the_france_question(reference):
    assert reference[0][0] == FRANCE_ANSWER


def test_each_prompt_alone_matches_transformers(runner, reference):
    ref_tokens, ref_lp = reference
    for prompt, want, lp in zip(PROMPTS, ref_tokens, ref_lp):
        slot = runner.allocate_slot()
        got, new, pos = [], list(prompt), 0
        try:
            for step in range(len(want)):
                o = runner.execute([SeqInput(slot, new, pos, GREEDY, list(got), prompt)])[0]
                if step == 0:
                    # The fp32 forward matches the oracle's to rounding, not only in its argmax.
                    assert o.top_ids == lp.topk(5).indices.tolist()
                    assert o.top_logprobs == pytest.approx(lp.topk(5).values.tolist(), abs=2e-3)
                got.append(o.token_id)
                pos += len(new)
                new = [o.token_id]
        finally:
            runner.free_slot(slot)
        assert got == want, f"prompt starting {prompt[:5]}"


def test_all_prompts_together_match_transformers(runner, reference):
    """One newcomer joins per step (its prefill shares the pass with the others' decodes); the
    last prompt is prefilled in two chunks, the first of which samples nothing."""
    ref_tokens, _ = reference
    seqs: list[dict] = []
    pending = list(range(len(PROMPTS)))
    mixed_steps = 0
    while pending or any(not s["done"] for s in seqs):
        if pending:
            i = pending.pop(0)
            p = PROMPTS[i]
            chunks = [p[:6], p[6:]] if i == len(PROMPTS) - 1 else [p]
            seqs.append({"i": i, "slot": runner.allocate_slot(), "chunks": chunks, "pos": 0, "out": [], "done": False})
        batch, live = [], []
        for s in seqs:
            if s["done"]:
                continue
            new = s["chunks"].pop(0) if s["chunks"] else [s["out"][-1]]
            batch.append(SeqInput(s["slot"], new, s["pos"], GREEDY, list(s["out"]), PROMPTS[s["i"]],
                                  sample=not s["chunks"]))
            live.append(s)
        mixed_steps += {len(b.new_token_ids) > 1 for b in batch} == {True, False}
        for s, b, o in zip(live, batch, runner.execute(batch)):
            s["pos"] += len(b.new_token_ids)
            if o is None:
                continue
            s["out"].append(o.token_id)
            want = ref_tokens[s["i"]]
            if len(s["out"]) == len(want):
                s["done"] = True
                runner.free_slot(s["slot"])
    assert mixed_steps >= 3
    for s in seqs:
        assert s["out"] == ref_tokens[s["i"]], f"prompt {s['i']}"
    assert _until_eos(seqs[0]["out"], NEW_TOKENS) == FRANCE_ANSWER
