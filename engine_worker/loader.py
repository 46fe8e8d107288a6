"""Build a ready-to-run model from a catalog ``ModelSource``: GGUF files, Hugging Face directories
and seeded random weights.

Hugging Face (``weights == "hf"``): ``config.json`` picks the architecture from the registry
(``models/__init__.py``); ``*.safetensors`` (one file or shards listed by
``model.safetensors.index.json``) are read through a memory map by the small reader below, so a
tensor is paged in only when it is copied into the model. EOS ids come from
``generation_config.json`` / ``config.json``. The tokenizer files are the gateway's business.

GGUF (``weights == "gguf"``): every tensor is dequantized to fp32 with ``gguf.quants.dequantize``
and mapped to Hugging Face names; llama.cpp stores the Q and K projections in a per-head permuted
row order (for its interleaved RoPE), which is undone here so the model can use rotate-half RoPE.
Mixing the two layouts fails silently (garbage text, no error), hence the exactness tests.

Random (``weights == "random"``): a ``LlamaConfig`` from the catalog's ``random_config`` and
weights drawn from a ``torch.Generator`` seeded with its ``seed``, so every engine (and every test
run) builds the very same model.

Scalar GGUF metadata is read by a small header scanner (``read_gguf_metadata``) rather than
``GGUFReader``: the reader parses the ~100k tokenizer strings and takes ~2 s, which would make
the tiny random model (which only needs the EOS id) slow to start.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine_worker.gguf_quant import QuantParts
from engine_worker.host_memory import release_free_memory
from engine_worker.models import config_from_hf
from engine_worker.models.llama import LlamaConfig, LlamaForCausalLM
from zserve.catalog import ModelSource
from zserve.config import QUANTIZATIONS

ProgressFn = Callable[[str, int, int], None]

log = logging.getLogger(__name__)

DEFAULT_EOS_TOKEN_ID = 2  # SmolLM2's <|im_end|>, used when no tokenizer metadata says otherwise


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: LlamaConfig
    eos_token_ids: list[int]
    vocab_size: int
    model_id: str
    quantization: str = "none"  # what load_model was asked for (a reload asks the same: engine_worker.residency)


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               progress: ProgressFn | None = None, expert_share: tuple[int, int] | None = None,
               quantization: str = "none") -> LoadedModel:
    """Load ``source`` onto ``device`` in ``dtype``, calling ``progress(stage, done, total)`` per tensor.

    ``expert_share``: ``(member, size)`` of an expert-parallel group: load only that member's experts of each
    MoE layer (``expert_parallel.expert_shard``; the others are never read), from a Hugging Face directory.
    ``quantization``: ``auto`` keeps a GGUF file's quantized linear weights (and embedding) quantized
    (``engine_worker.gguf_quant``, ``models.quant_linear``); ``none`` dequantizes every tensor to ``dtype``."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {quantization!r}")
    if expert_share is not None:
        if source.weights != "hf":
            raise NotImplementedError(f"model {source.model_id!r}: expert parallelism needs a Hugging Face "
                                      f"(safetensors) checkpoint, not {source.weights} weights")
        return _load_hf(source, dtype, device, progress, expert_share)
    if source.weights == "gguf":
        meta = read_gguf_metadata(source.path)
        if quantized_source(source, quantization, meta):
            loaded = _convert_gguf(source, meta, dtype, device, progress, None, quantize=True)
            loaded.quantization = quantization
            return loaded
        return _load_gguf(source, meta, dtype, device, progress)
    if source.weights == "random":
        return _load_random(source, dtype, device, progress)
    if source.weights == "hf":
        return _load_hf(source, dtype, device, progress)
    raise ValueError(f"model {source.model_id!r}: unknown weights format {source.weights!r}")


# -- GGUF metadata ------------------------------------------------------------------------------

# GGUF value types -> struct format of a scalar (8 = string, 9 = array are handled apart).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | Path) -> dict[str, int | float | bool | str]:
    """Every scalar and string key of a GGUF file's header (arrays, e.g. the vocabulary, are skipped)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, _n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (big-endian or too old?)")
        off = 24
        out: dict[str, int | float | bool | str] = {}

        def read_str(o: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, o)
            return buf[o + 8 : o + 8 + n].decode("utf-8", errors="replace"), o + 8 + n

        for _ in range(n_kv):
            key, off = read_str(off)
            (vtype,) = struct.unpack_from("<I", buf, off)
            off += 4
            if vtype == _STRING:
                out[key], off = read_str(off)
            elif vtype == _ARRAY:
                etype, count = struct.unpack_from("<IQ", buf, off)
                off += 12
                if etype == _STRING:
                    for _ in range(count):
                        (n,) = struct.unpack_from("<Q", buf, off)
                        off += 8 + n
                elif etype in _SCALAR_FORMATS:
                    off += count * struct.calcsize("<" + _SCALAR_FORMATS[etype])
                else:
                    raise ValueError(f"{path}: nested GGUF arrays in {key!r} are not supported")
            elif vtype in _SCALAR_FORMATS:
                fmt = "<" + _SCALAR_FORMATS[vtype]
                (out[key],) = struct.unpack_from(fmt, buf, off)
                off += struct.calcsize(fmt)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {vtype} for {key!r}")
        return out


# general.file_type values of files whose tensors are not quantized: F32, F16, BF16 (llama.cpp's LLAMA_FTYPE_*).
_UNQUANTIZED_FILE_TYPES = {0, 1, 32}


def gguf_quantized(meta: dict) -> bool:
    """Whether a GGUF file's header says its weights are quantized (``general.file_type``; absent: assumed so)."""
    return meta.get("general.file_type") not in _UNQUANTIZED_FILE_TYPES


def quantized_source(source: ModelSource, quantization: str, meta: dict | None = None) -> bool:
    """Whether ``load_model(source, ..., quantization=quantization)`` keeps weights quantized (``meta``: the file's
    header, when already read)."""
    return quantization == "auto" and source.weights == "gguf" and gguf_quantized(
        meta if meta is not None else read_gguf_metadata(source.path))


def eos_ids_from_metadata(meta: dict) -> list[int]:
    """EOS (and, when distinct, end-of-turn) token ids named by GGUF tokenizer metadata."""
    ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    ids = list(dict.fromkeys(ids))
    return ids or [DEFAULT_EOS_TOKEN_ID]


def config_from_gguf_metadata(meta: dict, *, tied: bool, vocab_size: int) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (only {', '.join(_GGUF_ARCHS)})")

    def get(key: str, default=None):
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return v

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise NotImplementedError("partial rotary embeddings are not supported")
    if f"{arch}.rope.scaling.type" in meta and meta[f"{arch}.rope.scaling.type"] not in ("none", ""):
        raise NotImplementedError(f"RoPE scaling {meta[f'{arch}.rope.scaling.type']!r} is not supported")
    return LlamaConfig(
        num_layers=int(get("block_count")),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_size)),
        max_position_embeddings=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=tied,
        architecture=_GGUF_ARCHS[arch],
        attention_bias=arch == "qwen2",
        num_experts=int(meta.get(f"{arch}.expert_count", 0)),
        num_experts_per_tok=int(meta.get(f"{arch}.expert_used_count", 0)),
    )


# -- GGUF tensors -------------------------------------------------------------------------------

# llama.cpp architecture -> the registry's; llama.cpp files Mistral and Mixtral as "llama".
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "block_sparse_moe.gate",
}
# Stacked expert tensors [E, rows, cols] -> per-expert HF names (Mixtral's w1/w3/w2).
_GGUF_EXPERT_NAMES = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}


def hf_name_for_gguf(name: str) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")  # blk.<i>.<kind>.weight|bias
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise NotImplementedError(f"GGUF tensor {name!r} is not supported by the Llama-family loader")


def _gguf_tensors(name: str, w: torch.Tensor, cfg: LlamaConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors for one GGUF tensor (expert stacks split into one tensor per expert)."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_EXPERT_NAMES:
        for e in range(w.shape[0]):
            yield f"model.layers.{parts[1]}.block_sparse_moe.experts.{e}.{_GGUF_EXPERT_NAMES[parts[2]]}.weight", w[e]
        return
    hf = hf_name_for_gguf(name)
    # llama.cpp permutes Q/K rows only for its "llama" architecture (interleaved RoPE).
    if cfg.architecture in ("LlamaForCausalLM",):
        if parts[-2] == "attn_q":
            w = unpermute_qk(w, cfg.num_heads)
        elif parts[-2] == "attn_k":
            w = unpermute_qk(w, cfg.num_kv_heads)
    yield hf, w


# The GGUF tensors kept quantized with --quantization auto: the dense linears and the embedding (experts are not).
_QUANTIZABLE_GLOBAL = {"token_embd.weight", "output.weight"}
_QUANTIZABLE_LAYER = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}


def _quantizable(name: str) -> bool:
    parts = name.split(".")
    return name in _QUANTIZABLE_GLOBAL or (len(parts) == 4 and parts[0] == "blk" and parts[2] in _QUANTIZABLE_LAYER
                                           and parts[3] == "weight")


def unpermute_qk(w, n_heads: int):
    """Undo llama.cpp's Q/K row permutation so rotate-half RoPE applies.

    llama.cpp interleaves the two halves of every head's rows (pairs (i, i + D/2) become adjacent
    rows 2i, 2i+1); viewing the rows as (heads, D/2, 2) and swapping the last two axes restores
    the Hugging Face order.
    """
    if isinstance(w, QuantParts):  # codes and scales are per row: the same reordering
        return w.rows(lambda t: unpermute_qk(t, n_heads))
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_gguf(source: ModelSource, meta: dict, dtype: torch.dtype, device: torch.device,
               progress: ProgressFn | None) -> LoadedModel:
    cache = _weight_cache_for(source, dtype)
    if cache is not None:
        loaded = _load_gguf_cached(source, meta, dtype, device, progress, *cache)
        if loaded is not None:
            return loaded
    return _convert_gguf(source, meta, dtype, device, progress, cache)


def _weight_cache_for(source: ModelSource, dtype: torch.dtype) -> tuple[Path, dict[str, str]] | None:
    """(cache file, key) for this GGUF source and dtype, or None when the cache is off or unusable."""
    from engine_worker import weight_cache

    if not weight_cache.enabled():
        log.info("weight cache disabled by ZSERVE_WEIGHT_CACHE")
        return None
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    min_bytes = weight_cache.min_bytes()
    if os.path.getsize(source.path) < min_bytes:
        log.debug("weight cache: %s is under %d bytes, converted without caching", source.path, min_bytes)
        return None
    directory = weight_cache.cache_dir()
    if directory is None:
        return None
    key = weight_cache.source_key(source.path, dtype)
    return weight_cache.cache_path(directory, key), key


def _load_gguf_cached(source: ModelSource, meta: dict, dtype: torch.dtype, device: torch.device,
                      progress: ProgressFn | None, path: Path, key: dict[str, str]) -> LoadedModel | None:
    """The model from the weight cache; None (reason logged) when the file is missing or unusable."""
    from engine_worker import weight_cache

    try:
        info = weight_cache.read_info(path, key)
        cfg = config_from_gguf_metadata(meta, tied=info.get("tied") == "1", vocab_size=int(info["vocab_size"]))
        model = LlamaForCausalLM(cfg, dtype, device)
        layout = _layout(model)

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(weight_cache.read_tensors(path, key, layout, dtype)):
                yield item
                if progress is not None:
                    progress("load", i + 1, len(layout))

        model.load_weights(weights())
    except FileNotFoundError:
        log.info("weight cache: no converted weights for %s (%s) yet; converting the GGUF file", source.path,
                 key["dtype"])
        return None
    except (weight_cache.CacheError, OSError, KeyError, ValueError) as e:
        log.warning("weight cache: %s is unusable (%s); converting the GGUF file again", path, e)
        return None
    model.eval()
    log.info("weight cache: loaded %s from %s", source.model_id, path)
    return LoadedModel(model, cfg, eos_ids_from_metadata(meta), cfg.vocab_size, source.model_id)


def _layout(model: LlamaForCausalLM) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight name and shape, in ``weight_names()`` order (``weight_shape`` per name would
    rebuild the target table each time: a quarter second for SmolLM2)."""
    targets = model._targets()
    return [(n, model._shape(n, dest)) for n, (dest, _row) in targets.items()]


def _convert_gguf(source: ModelSource, meta: dict, dtype: torch.dtype, device: torch.device,
                  progress: ProgressFn | None, cache: tuple[Path, dict[str, str]] | None,
                  quantize: bool = False) -> LoadedModel:
    """Dequantize every tensor (the slow part) into a new model, streaming them into the weight
    cache file too when ``cache`` is given. With ``quantize``, the linear weights and the embedding of a type
    ``gguf_quant`` decodes are kept quantized instead (``LlamaForCausalLM.use_quantized``)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from engine_worker import weight_cache
    from engine_worker.gguf_quant import DECODED, quant_parts

    reader = GGUFReader(source.path)
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"{source.path} has no token_embd.weight")
    tied = "output.weight" not in tensors
    cfg = config_from_gguf_metadata(meta, tied=tied, vocab_size=int(embd.shape[-1]))
    model = LlamaForCausalLM(cfg, dtype, device)
    writer = None
    if cache is not None:
        layout = _layout(model)
        try:
            writer = weight_cache.Writer(cache[0], cache[1], {"tied": "1" if tied else "0",
                                                              "vocab_size": str(int(embd.shape[-1]))}, layout, dtype)
        except OSError as e:
            log.warning("weight cache: cannot write %s (%s)", cache[0], e)

    kept = {}
    if quantize:
        for name, t in tensors.items():
            if t.tensor_type in DECODED and len(t.shape) == 2 and _quantizable(name):
                parts = quant_parts(t.data, t.tensor_type, (int(t.shape[1]), int(t.shape[0])))
                for hf, p in _gguf_tensors(name, parts, cfg):
                    kept[hf] = p
        used = model.use_quantized(kept)
        kept.clear()
        release_free_memory()  # (the codes as read, before tiling: malloc keeps freed pages resident otherwise)
        log.info("model %s: %d of %d tensors kept quantized (%s)", source.model_id, len(used), len(tensors),
                 ", ".join(model.quantized_kinds()) or "none")
    else:
        used = set()

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        total = len(tensors)
        for i, (name, t) in enumerate(tensors.items()):
            # Kept quantized: skipped. (A part of a fused linear whose other parts were not kept is not in ``used``.)
            if used and _quantizable(name) and hf_name_for_gguf(name) in used:
                if progress is not None:
                    progress("load", i + 1, total)
                continue
            arr = dequantize(t.data, t.tensor_type)
            # F32 tensors come back as read-only views of the mmapped file: copy them.
            arr = np.asarray(arr, dtype=np.float32)
            w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
            for hf, tensor in _gguf_tensors(name, w, cfg):
                if writer is not None:
                    writer.add(hf, tensor)
                yield hf, tensor
            if progress is not None:
                progress("load", i + 1, total)

    try:
        model.load_weights(weights(), skip=used)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None and writer.commit():
        log.info("weight cache: wrote %s", cache[0])
    model.eval()
    return LoadedModel(model, cfg, eos_ids_from_metadata(meta), cfg.vocab_size, source.model_id)


# -- Hugging Face directories ------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsFile:
    """Read-only, memory-mapped view of one ``.safetensors`` file (8-byte header size, a JSON
    header of ``name -> dtype, shape, data_offsets``, then the raw little-endian data)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if len(self._mm) < 8:
            raise ValueError(f"{self.path} is not a safetensors file (too short)")
        (n,) = struct.unpack_from("<Q", self._mm, 0)
        if n > len(self._mm) - 8 or n > 100 << 20:
            raise ValueError(f"{self.path} is not a safetensors file (bad header size)")
        import json

        try:
            header = json.loads(bytes(self._mm[8 : 8 + n]))
        except ValueError as e:
            raise ValueError(f"{self.path}: unreadable safetensors header: {e}") from None
        header.pop("__metadata__", None)
        self._base = 8 + n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            dt = _SAFETENSORS_DTYPES.get(e.get("dtype"))
            if dt is None:
                raise NotImplementedError(f"{self.path}: tensor {name!r} has unsupported dtype {e.get('dtype')!r}")
            begin, end = e["data_offsets"]
            shape = tuple(int(x) for x in e["shape"])
            if (self._base + end > len(self._mm)
                    or end - begin != _numel(shape) * torch.empty((), dtype=dt).element_size()):
                raise ValueError(f"{self.path}: tensor {name!r} lies outside the file or has the wrong size")
            self.entries[name] = (dt, shape, self._base + begin, end - begin)

    def get(self, name: str) -> torch.Tensor:
        dt, shape, offset, nbytes = self.entries[name]
        if nbytes == 0:
            return torch.empty(shape, dtype=dt)
        import warnings

        with warnings.catch_warnings():  # the map is read-only; the tensor is only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._mm, dtype=dt, count=nbytes // torch.empty((), dtype=dt).element_size(),
                                    offset=offset)
        return flat.view(shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _hf_weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        import json

        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{root}: shards listed in model.safetensors.index.json are missing: {missing[:3]}")
        return [root / s for s in shards]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root} has no *.safetensors weights (only safetensors are supported, not .bin)")
    return files


def _hf_name(name: str) -> str | None:
    """The registry's name for a checkpoint tensor; None for tensors that are not weights."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    # transformers >= 5 saves Mixtral's MoE under mlp.* with stacked experts; handled by the caller.
    return name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")


def _hf_tensors(name: str, t: torch.Tensor, cfg: LlamaConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H], stacked by transformers >= 5
        prefix = name.removesuffix("mlp.experts.gate_up_proj") + "block_sparse_moe.experts."
        inter = cfg.intermediate_size
        for e in range(t.shape[0]):
            yield f"{prefix}{e}.w1.weight", t[e, :inter]
            yield f"{prefix}{e}.w3.weight", t[e, inter:]
        return
    if name.endswith(".mlp.experts.down_proj"):  # [E, H, I]
        prefix = name.removesuffix("mlp.experts.down_proj") + "block_sparse_moe.experts."
        for e in range(t.shape[0]):
            yield f"{prefix}{e}.w2.weight", t[e]
        return
    hf = _hf_name(name)
    if hf is not None:
        yield hf, t


def _hf_eos_ids(root: Path, config: dict) -> list[int]:
    import json

    for f in (root / "generation_config.json", None):
        d = json.loads(f.read_text()) if f is not None and f.is_file() else config if f is None else None
        if d is None:
            continue
        eos = d.get("eos_token_id")
        if isinstance(eos, int):
            return [eos]
        if isinstance(eos, list) and eos and all(isinstance(x, int) for x in eos):
            return list(dict.fromkeys(eos))
    return [DEFAULT_EOS_TOKEN_ID]


def _hf_config(source: ModelSource) -> tuple[dict, LlamaConfig]:
    import json

    root = Path(source.path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"model {source.model_id!r}: {root} has no config.json")
    try:
        config = json.loads((root / "config.json").read_text())
    except ValueError as e:
        raise ValueError(f"model {source.model_id!r}: {root}/config.json is not JSON: {e}") from None
    return config, config_from_hf(config)


def hf_tensor_reader(source: ModelSource) -> Callable[[list[str]], dict[str, torch.Tensor]]:
    """``read(names)``: those tensors of a Hugging Face directory by our HF names (experts unstacked), read
    through the memory map, so only what is asked for is touched (an expert-parallel member's new experts)."""
    _, cfg = _hf_config(source)

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        wanted, out = set(names), {}
        for path in _hf_weight_files(Path(source.path)):
            f = SafetensorsFile(path)
            for name in f.entries:
                stacked = name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))
                if stacked or _hf_name(name) in wanted:
                    out.update((n, t) for n, t in _hf_tensors(name, f.get(name), cfg) if n in wanted)
        missing = wanted - set(out)
        if missing:
            raise ValueError(f"model {source.model_id!r}: the checkpoint lacks {sorted(missing)[:3]}")
        return out

    return read


def _load_hf(source: ModelSource, dtype: torch.dtype, device: torch.device, progress: ProgressFn | None,
             expert_share: tuple[int, int] | None = None) -> LoadedModel:
    root = Path(source.path)
    config, cfg = _hf_config(source)
    expert_ids = None
    if expert_share is not None:
        from engine_worker.expert_parallel import expert_shard

        if not cfg.num_experts:
            raise ValueError(f"model {source.model_id!r} ({cfg.architecture}) has no experts to split across "
                             "engines; --expert-parallel is for mixture-of-experts models")
        expert_ids = expert_shard(cfg.num_experts, expert_share[1], expert_share[0])
    files = [SafetensorsFile(f) for f in _hf_weight_files(root)]
    names = {n for f in files for n in f.entries}
    if cfg.tie_word_embeddings and "lm_head.weight" in names:
        names.discard("lm_head.weight")  # some tied checkpoints store the copy too
    model = LlamaForCausalLM(cfg, dtype, device, expert_ids)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        total = sum(len(f.entries) for f in files)
        done = 0
        for f in files:
            for name in f.entries:
                done += 1
                hf = _hf_name(name)
                if name in names and (hf is None or model.holds(hf)):  # (stacked experts are filtered later)
                    yield from _hf_tensors(name, f.get(name), cfg)
                if progress is not None:
                    progress("load", done, total)

    model.load_weights(weights())
    model.eval()
    return LoadedModel(model, cfg, _hf_eos_ids(root, config), cfg.vocab_size, source.model_id)


# -- random weights -----------------------------------------------------------------------------

RANDOM_INIT_STD = 0.02


def _load_random(source: ModelSource, dtype: torch.dtype, device: torch.device,
                 progress: ProgressFn | None) -> LoadedModel:
    rc = dict(source.random_config)
    try:
        seed = int(rc.pop("seed", 0))
        cfg = LlamaConfig(
            num_layers=int(rc["num_layers"]),
            hidden_size=int(rc["hidden_size"]),
            intermediate_size=int(rc["intermediate_size"]),
            num_heads=int(rc["num_heads"]),
            num_kv_heads=int(rc["num_kv_heads"]),
            head_dim=int(rc.get("head_dim", int(rc["hidden_size"]) // int(rc["num_heads"]))),
            vocab_size=int(rc["vocab_size"]),
            max_position_embeddings=int(rc["max_position_embeddings"]),
            rope_theta=float(rc.get("rope_theta", 10000.0)),
            rms_norm_eps=float(rc.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(rc.get("tie_word_embeddings", True)),
        )
    except KeyError as e:
        raise ValueError(f"model {source.model_id!r}: random_config lacks {e.args[0]!r}") from None

    model = LlamaForCausalLM(cfg, dtype, device)
    gen = torch.Generator().manual_seed(seed)  # CPU generator: identical weights on every device

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        names = model.weight_names()  # a fixed order, so the draws are reproducible
        for i, name in enumerate(names):
            shape = model.weight_shape(name)
            if name.endswith("norm.weight"):
                w = torch.ones(shape)
            else:
                w = torch.empty(shape).normal_(0.0, RANDOM_INIT_STD, generator=gen)
            yield name, w
            if progress is not None:
                progress("init", i + 1, len(names))

    model.load_weights(weights())
    model.eval()

    eos = [DEFAULT_EOS_TOKEN_ID]
    if source.tokenizer_path and Path(source.tokenizer_path).is_file() and source.tokenizer_path.endswith(".gguf"):
        eos = eos_ids_from_metadata(read_gguf_metadata(source.tokenizer_path))
    return LoadedModel(model, cfg, eos, cfg.vocab_size, source.model_id)
