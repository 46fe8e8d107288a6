"""Batched multi-LoRA in the engine: greedy tokens equal transformers + PEFT in fp32, token for token.

Adapters are written by PEFT itself (``get_peft_model`` → random non-zero A and B → ``save_pretrained``, in
``tests.lora_adapters``) on a Hugging Face Llama with the catalog's tiny-random shape, and the oracle reads them
back with ``PeftModel.from_pretrained``: a wrong scaling, fused-projection block, row map, slot swap or
prefix-cache key changes the tokens. The adapters differ in rank, target modules (list and regex forms,
per-layer), and one uses rsLoRA.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine_worker import cpu_kernels
from engine_worker.engine import Engine
from engine_worker.loader import load_model
from engine_worker.lora import LoraError, LoraManager, read_adapter
from engine_worker.models.llama import LlamaConfig
from engine_worker.scheduler import run_until_done
from engine_worker.sequence import Sequence
from protocol.messages import SamplingParams
from tests.lora_adapters import hf_llama_config, write_adapter
from zserve.catalog import ModelSource
from zserve.config import EngineConfig

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
NEW_TOKENS = 32
EOS = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)  # min: as min_new_tokens
# name -> LoraConfig keywords: different ranks, list / regex / per-layer targets, one rsLoRA.
ADAPTERS = {
    "qv": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all-rs": {"r": 4, "lora_alpha": 8, "use_rslora": True,
               "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
    "mlp-o": {"r": 16, "lora_alpha": 32, "target_modules": ["o_proj", "gate_proj", "down_proj"]},
    "regex": {"r": 2, "lora_alpha": 4, "target_modules": r".*\.layers\.1\.self_attn\.k_proj|.*\.mlp\.up_proj"},
}
PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712],
    [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 378, 2365],
    [1604, 3987, 46477, 24, 94, 727, 472, 585, 304, 2067, 216, 34, 42, 448, 1003, 304, 472],
    [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28],
    [3, 17, 42, 5, 77],
]
BACKENDS = [pytest.param("native", marks=pytest.mark.skipif(not cpu_kernels.available(),
                                                              reason="native CPU kernels did not build here")),
            "gather"]


# -- the base model and the adapters, written once ---------------------------------------------------------


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """An HF Llama directory with the tiny-random shape (weights drawn by transformers, wide enough that the
    greedy choice is decisive)."""
    transformers = pytest.importorskip("transformers")
    cfg = hf_llama_config(max_position_embeddings=2048, eos_token_id=EOS, initializer_range=0.2)
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("tiny-llama-hf")
    transformers.LlamaForCausalLM(cfg).save_pretrained(root, safe_serialization=True)
    return root


def hf_base(base_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(hf_base(base_dir), root / name, seed, **kw)
            for seed, (name, kw) in enumerate(ADAPTERS.items())}


class Reference:
    """transformers (+ PEFT) greedy tokens per ``(adapter or None, prompt index)``, each computed on first use."""

    def __init__(self, base_dir: Path, adapters: dict[str, Path]):
        self.base_dir, self.adapters = base_dir, adapters
        self.models: dict[str | None, object] = {}
        self.tokens: dict[tuple[str | None, int], list[int]] = {}

    def __getitem__(self, key: tuple[str | None, int]) -> list[int]:
        if key not in self.tokens:
            name, i = key
            if name not in self.models:
                model = hf_base(self.base_dir)
                if name is not None:
                    import peft

                    model = peft.PeftModel.from_pretrained(model, str(self.adapters[name])).eval()
                self.models[name] = model
            ids = torch.tensor([PROMPTS[i]])
            with torch.inference_mode():
                gen = self.models[name].generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                                 pad_token_id=EOS)
            self.tokens[key] = gen[0, ids.shape[1]:].tolist()
        return self.tokens[key]


@pytest.fixture(scope="module")
def reference(base_dir, adapters) -> Reference:
    pytest.importorskip("peft")
    return Reference(base_dir, adapters)


def test_every_adapter_changes_the_reference_output(reference, adapters):
    for name in adapters:
        for i in (0, 1):
            assert reference[(name, i)] != reference[(None, i)], (name, i)


# -- the engine --------------------------------------------------------------------------------------------


def make_engine(base_dir: Path, adapters: dict[str, Path], max_loras: int = 4, budget: int = 512,
                attention: str | None = None, **lora_options) -> Engine:
    loaded = load_model(ModelSource(base_dir.name, "hf", str(base_dir), str(base_dir)), torch.float32, CPU)
    engine = Engine.generation(loaded, CPU, torch.float32,
                               EngineConfig(max_num_seqs=8, max_model_len=128, block_size=4,
                                            max_num_batched_tokens=budget),
                               num_blocks=256, attention=attention, max_loras=max_loras, max_lora_rank=16,
                               **lora_options)
    for name, path in adapters.items():
        engine.runner.loras.load(name, path)
    return engine


def generate(engine: Engine, requests: list[tuple[str | None, int]]) -> list[list[int]]:
    """Greedy tokens for ``(adapter, prompt index)`` requests, all queued at once."""
    sched = engine.scheduler
    for j, (name, i) in enumerate(requests):
        assert sched.add(Sequence(f"r{j}", list(PROMPTS[i]), GREEDY, lora=name)) is None
    outs = run_until_done(sched)
    return [[t for o in outs[f"r{j}"] for t in o.new_token_ids] for j in range(len(requests))]


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_an_adapter_alone_matches_peft(base_dir, adapters, reference, name):
    engine = make_engine(base_dir, adapters)
    for i in (0, 1):
        assert generate(engine, [(name, i)]) == [reference[(name, i)]], (name, i)


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("budget", [512, 7], ids=["whole-prefill", "chunked-prefill"])
def test_four_adapters_and_the_base_model_in_one_batch_match_peft(base_dir, adapters, reference, attention,
                                                                  budget):
    engine = make_engine(base_dir, adapters, attention=attention, budget=budget)
    # "qv" twice and the base model twice, apart: an adapter's rows are not one range (the index path).
    requests = [("qv", 0), ("all-rs", 1), (None, 2), ("qv", 3), ("mlp-o", 4), ("regex", 0), (None, 1)]
    got = generate(engine, requests)
    for req, tokens in zip(requests, got):
        assert tokens == reference[(req[0], req[1])], req


LORA_PATHS = [pytest.param("kernel", marks=pytest.mark.skipif(not cpu_kernels.available(),
                                                               reason="native CPU kernels did not build here")),
              "torch"]


@pytest.mark.parametrize("path", LORA_PATHS)
def test_adapters_of_one_shape_share_one_batched_matmul_and_match_peft(base_dir, adapters, tmp_path, monkeypatch,
                                                                       path):
    """Two adapters of the same rank and targets, interleaved in decode steps: the grouped path writes what PEFT
    writes for each. In torch, one ``torch.bmm`` for both (rows padded to equal counts); with the native kernel,
    one ``lora_shrink_expand`` call per projection for both (the prefill's long segments still batch in torch)."""
    both = {"qv": adapters["qv"], "qv2": write_adapter(hf_base(base_dir), tmp_path / "qv2", 9, **ADAPTERS["qv"])}
    ref = Reference(base_dir, both)
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "supports_lora", lambda *a: False)
    engine = make_engine(base_dir, both)
    assert engine.runner.loras.native == (path == "kernel")
    calls, kernel_segments = [], []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(1) or bmm(*a, **k))
    call = cpu_kernels.LoraKernel.__call__
    monkeypatch.setattr(cpu_kernels.LoraKernel, "__call__",
                        lambda self, x, y, rows, segs: kernel_segments.append(segs.shape[0]) or call(self, x, y, rows,
                                                                                                     segs))
    requests = [("qv", 0), ("qv2", 1), ("qv", 2), ("qv2", 3), (None, 4), ("qv2", 0)]
    assert generate(engine, requests) == [ref[r] for r in requests]
    assert calls  # (the grouped path ran: in prefill, and in every decode step for torch)
    if path == "kernel":
        assert 2 in kernel_segments  # (both adapters in one kernel call)
    else:
        assert not kernel_segments
    assert ref[("qv2", 0)] != ref[("qv", 0)]


def test_the_prefix_cache_is_not_shared_across_adapters(base_dir, adapters, reference):
    engine = make_engine(base_dir, adapters)
    cached = []
    for name in ("qv", None, "all-rs", "qv"):
        seq = Sequence(f"r-{len(cached)}", list(PROMPTS[0]), GREEDY, lora=name)
        assert engine.scheduler.add(seq) is None
        outs = run_until_done(engine.scheduler)[seq.request_id]
        assert [t for o in outs for t in o.new_token_ids] == reference[(name, 0)], name
        cached.append(outs[0].num_cached_tokens)
    # Only the second "qv" request finds blocks: the first one's, not the base model's or "all-rs"'s.
    assert cached[:3] == [0, 0, 0] and cached[3] > 0


def test_two_slots_serve_four_adapters_by_swapping_between_steps(base_dir, adapters, reference):
    engine = make_engine(base_dir, adapters, max_loras=2)
    runner = engine.runner
    per_step: list[set[str]] = []
    execute = runner.execute

    def spy(seqs):
        per_step.append({s.lora for s in seqs if s.lora is not None})
        return execute(seqs)

    runner.execute = spy
    requests = [("qv", 0), ("all-rs", 1), ("mlp-o", 2), ("regex", 3), (None, 4)]
    got = generate(engine, requests)
    for req, tokens in zip(requests, got):
        assert tokens == reference[req], req
    assert max(len(s) for s in per_step) == 2
    assert runner.loras.slot_fills >= 4


def test_an_adapter_evicted_from_host_memory_is_read_again_and_stays_exact(base_dir, adapters, reference):
    engine = make_engine(base_dir, {}, max_loras=1, max_cpu_loras=1)
    loras = engine.runner.loras
    loras.load("qv", adapters["qv"])
    loras.load("mlp-o", adapters["mlp-o"])  # "qv" leaves host memory
    assert loras.reads == 2
    assert generate(engine, [("qv", 0)]) == [reference[("qv", 0)]]
    assert loras.reads == 3  # read again from its directory
    assert generate(engine, [("mlp-o", 1)]) == [reference[("mlp-o", 1)]]  # evicted by "qv": read again, new slot
    assert generate(engine, [("qv", 2)]) == [reference[("qv", 2)]]
    assert loras.reads == 5 and loras.slot_fills == 3
    loras.unload("qv")
    assert loras.names() == ["mlp-o"]
    assert engine.scheduler.add(Sequence("gone", [1, 2, 3], GREEDY, lora="qv")) == \
        "LoRA adapter 'qv' is not loaded on this engine"


# -- what an adapter must be -------------------------------------------------------------------------------


@pytest.fixture
def manager(base_dir) -> LoraManager:
    loaded = load_model(ModelSource(base_dir.name, "hf", str(base_dir), str(base_dir)), torch.float32, CPU)
    return LoraManager(loaded.model, max_loras=2, max_lora_rank=8)


def edited(src: Path, dest: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of adapter ``src`` with ``config`` keys replaced and ``tensors(dict)`` applied to its weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    if config:
        cfg = json.loads((dest / "adapter_config.json").read_text())
        (dest / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors:
        weights = load_file(str(dest / "adapter_model.safetensors"))
        tensors(weights)
        save_file(weights, str(dest / "adapter_model.safetensors"))
    return dest


A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _widen(weights: dict) -> None:
    weights[A0] = torch.zeros(8, 96)  # an adapter for a model with hidden size 96


def _third_layer(weights: dict) -> None:
    for key in [k for k in weights if ".layers.1." in k]:
        weights[key.replace(".layers.1.", ".layers.2.")] = weights[key].clone()


BAD = {
    "no-directory": (None, None, "is not a directory"),
    "no-weights": ("drop-weights", None, "has no adapter_model.safetensors"),
    "bad-json": ("bad-json", None, "adapter_config.json is not valid JSON"),
    "lm-head": ({"target_modules": ["q_proj", "lm_head"]}, None, "targets 'lm_head'; supported target modules"),
    "dora": ({"use_dora": True}, None, r"uses DoRA \(use_dora\), which is not supported"),
    "bias": ({"bias": "all"}, None, r"trains biases \(bias='all'\); only bias='none'"),
    "modules-to-save": ({"modules_to_save": ["lm_head"]}, None, "uses modules_to_save"),
    "rank": ({"r": 32}, None, "has rank 32, above this engine's max_lora_rank=8"),
    "hidden-size": (None, _widen, r"has shape \(8, 96\), expected \(8, 64\) for rank 8 on this base model"),
    "layers": (None, _third_layer, "for layer 2, but the base model has 2 layers"),
    "missing": (None, lambda w: w.pop(A0), r"1 tensors missing from adapter_model.safetensors, e.g. layer 0 "
                                            r"q_proj.lora_A"),
    "no-match": ({"target_modules": r"nothing\.here"}, None, "matches none of this model's"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_adapter_is_refused_with_a_clear_message_and_changes_nothing(manager, adapters, tmp_path, case):
    config, tensors, message = BAD[case]
    path = tmp_path / "adapter"
    if config == "drop-weights":
        edited(adapters["qv"], path).joinpath("adapter_model.safetensors").unlink()
    elif config == "bad-json":
        edited(adapters["qv"], path).joinpath("adapter_config.json").write_text("{not json")
    elif case != "no-directory":
        edited(adapters["qv"], path, config, tensors)
    with pytest.raises(LoraError, match=message):
        manager.load("x", path)
    assert manager.names() == [] and "x" not in manager


def test_adapters_for_the_mlp_of_a_mixture_of_experts_are_refused(adapters):
    moe = LlamaConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                      vocab_size=49152, max_position_embeddings=2048, architecture="MixtralForCausalLM",
                      num_experts=4, num_experts_per_tok=2)
    with pytest.raises(LoraError, match="MLP is a mixture of experts; only attention projections"):
        read_adapter("mlp-o", adapters["mlp-o"], moe, 16, torch.float32)
    assert read_adapter("qv", adapters["qv"], moe, 16, torch.float32).modules == ("q_proj", "v_proj")


def test_a_name_is_loaded_once_and_unknown_names_are_refused(manager, adapters):
    manager.load("qv", adapters["qv"])
    with pytest.raises(LoraError, match="'qv' is already loaded"):
        manager.load("qv", adapters["all-rs"])
    with pytest.raises(LoraError, match="'nope' is not loaded"):
        manager.unload("nope")
    with pytest.raises(LoraError, match="'nope' is not loaded"):
        manager.step({"nope": [(0, 1)]})


# -- adapters given at start, and requests that name one -----------------------------------------------------


def test_an_engine_configured_with_adapters_loads_them_before_it_serves(base_dir, adapters):
    loaded = load_model(ModelSource(base_dir.name, "hf", str(base_dir), str(base_dir)), torch.float32, CPU)
    cfg = EngineConfig(max_model_len=128, max_loras=2, max_lora_rank=8,
                       lora_modules=(("qv", str(adapters["qv"])), ("rs", str(adapters["all-rs"]))))
    loras = Engine.generation(loaded, CPU, torch.float32, cfg, num_blocks=64).runner.loras
    assert loras.names() == ["qv", "rs"] and (loras.max_loras, loras.max_lora_rank, loras.max_cpu_loras) == (2, 8, 2)
    assert Engine.generation(loaded, CPU, torch.float32, EngineConfig(max_model_len=128),
                             num_blocks=64).runner.loras is None  # (without --enable-lora: no slots at all)
    with pytest.raises(LoraError, match="adapter 'big' has rank 16, above this engine's max_lora_rank=8"):
        Engine.generation(loaded, CPU, torch.float32, cfg.replace(lora_modules=(("big", str(adapters["mlp-o"])),)),
                          num_blocks=64)


def test_a_request_for_an_adapter_the_engine_lacks_ends_with_the_code_a_gateway_answers_404(base_dir, adapters,
                                                                                              tmp_path):
    from engine_worker.server import EngineServer
    from gateway.engine_client import EngineRequestError
    from gateway.serving.engine_errors import engine_error
    from protocol import AddRequest
    from protocol.constants import ERR_LORA_NOT_LOADED

    engine = make_engine(base_dir, {"qv": adapters["qv"]}, max_loras=1)
    server = EngineServer(0, f"ipc://{tmp_path}/engine.sock", engine.runner, engine.scheduler, engine.hello)
    sent = []
    server.send = lambda client, msg: sent.append(msg)  # type: ignore[method-assign]
    try:
        server.add(b"gw", AddRequest("r1", (1, 2, 3), GREEDY, lora="nope"))
        server.add(b"gw", AddRequest("r2", (1, 2, 3), GREEDY, lora="qv"))
    finally:
        server.sock.close()
    [failed] = [o for msg in sent for o in msg.outputs]
    assert (failed.request_id, failed.finish_reason, failed.error_code) == ("r1", "error", ERR_LORA_NOT_LOADED)
    assert failed.error == "LoRA adapter 'nope' is not loaded on this engine"
    assert engine.scheduler.by_id["r2"].lora == "qv"  # a known one is queued with its adapter
    answer = engine_error(EngineRequestError(failed.error, failed.error_code))
    assert (answer.status, answer.code, answer.message) == (404, "model_not_found", failed.error)
