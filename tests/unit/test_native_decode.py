"""A decode step's layers in one native call (``engine_worker.models.native_decode``) give the layer-by-layer path's
numbers bit for bit: SmolLM2 kept quantized, in float32 and in bf16, several sequences of different lengths decoding
together, greedy and sampled with a seed, the same tokens and the same logprobs either way; and a step with a prompt
in it goes the layer-by-layer way."""

from __future__ import annotations

import pytest
import torch

from engine_worker import cpu_kernels
from engine_worker.loader import load_model
from engine_worker.models import native_decode
from engine_worker.runner import ModelRunner
from engine_worker.scheduler import Scheduler, run_until_done
from engine_worker.sequence import Sequence
from protocol.messages import SamplingParams
from zserve.catalog import resolve

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels (no C++ compiler)")

CPU = torch.device("cpu")
PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198,
     1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 378, 2365, 6354, 16438],
    [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28],
]


def generate(loaded, dtype: torch.dtype, params: list[SamplingParams]) -> dict:
    runner = ModelRunner(loaded, CPU, dtype, max_num_seqs=8, max_model_len=256, block_size=16)
    sched = Scheduler(runner, 8, 512)
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        assert sched.add(Sequence(f"r{i}", list(p), sp)) is None
    outs = run_until_done(sched)
    return {rid: ([t for o in out for t in o.new_token_ids], [lp for o in out for lp in (o.logprobs or ())])
            for rid, out in outs.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_one_native_call_per_step_gives_the_layer_by_layer_numbers(dtype, monkeypatch):
    loaded = load_model(resolve("SmolLM2-135M-Instruct"), dtype, CPU, quantization="auto")
    params = [SamplingParams(temperature=0.0, max_tokens=40, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=33, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=20, logprobs=3, ignore_eos=True)]
    real, ran = native_decode.run, []

    def counted(*a, **kw):
        out = real(*a, **kw)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(native_decode, "run", counted)
    native = generate(loaded, dtype, params)
    took = sum(ran)
    monkeypatch.setattr(native_decode, "run", lambda *a, **kw: None)
    layered = generate(loaded, dtype, params)
    assert native == layered
    assert [len(native[f"r{i}"][0]) for i in range(3)] == [40, 33, 20]
    if dtype == torch.bfloat16 and not took:
        pytest.skip("this CPU has no bf16 matmul kernel: every step went layer by layer (as it must)")
    # every decode step took the one call (39: the longest stream's tokens after its first), the prefill did not
    assert took == 39 and not ran[0]
