"""Build a ready-to-run model from a catalog ``ModelSource``: GGUF files and seeded random weights.

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

import mmap
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine_worker.models.llama import LlamaConfig, LlamaForCausalLM
from zserve.catalog import ModelSource

ProgressFn = Callable[[str, int, int], None]

DEFAULT_EOS_TOKEN_ID = 2  # SmolLM2's <|im_end|>, used when no tokenizer metadata says otherwise


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: LlamaConfig
    eos_token_ids: list[int]
    vocab_size: int
    model_id: str


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device, progress: ProgressFn | None = None) -> LoadedModel:
    """Load ``source`` onto ``device`` in ``dtype``, calling ``progress(stage, done, total)`` per tensor."""
    if source.weights == "gguf":
        return _load_gguf(source, dtype, device, progress)
    if source.weights == "random":
        return _load_random(source, dtype, device, progress)
    if source.weights == "hf":
        raise NotImplementedError(
            f"model {source.model_id!r}: loading Hugging Face directories ({source.path}) is not supported yet; "
            "serve a .gguf file, the catalog's SmolLM2-135M-Instruct, or tiny-random"
        )
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


def eos_ids_from_metadata(meta: dict) -> list[int]:
    """EOS (and, when distinct, end-of-turn) token ids named by GGUF tokenizer metadata."""
    ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    ids = list(dict.fromkeys(ids))
    return ids or [DEFAULT_EOS_TOKEN_ID]


def config_from_gguf_metadata(meta: dict, *, tied: bool, vocab_size: int) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (only 'llama')")

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
    )


# -- GGUF tensors -------------------------------------------------------------------------------

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
}


def hf_name_for_gguf(name: str) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")  # blk.<i>.<kind>.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.weight"
    raise NotImplementedError(f"GGUF tensor {name!r} is not supported by the Llama loader")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation so rotate-half RoPE applies.

    llama.cpp interleaves the two halves of every head's rows (pairs (i, i + D/2) become adjacent
    rows 2i, 2i+1); viewing the rows as (heads, D/2, 2) and swapping the last two axes restores
    the Hugging Face order.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_gguf(source: ModelSource, dtype: torch.dtype, device: torch.device, progress: ProgressFn | None) -> LoadedModel:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    meta = read_gguf_metadata(source.path)
    reader = GGUFReader(source.path)
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"{source.path} has no token_embd.weight")
    cfg = config_from_gguf_metadata(meta, tied="output.weight" not in tensors, vocab_size=int(embd.shape[-1]))
    model = LlamaForCausalLM(cfg, dtype, device)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        total = len(tensors)
        for i, (name, t) in enumerate(tensors.items()):
            arr = dequantize(t.data, t.tensor_type)
            # F32 tensors come back as read-only views of the mmapped file: copy them.
            arr = np.asarray(arr, dtype=np.float32)
            w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
            hf = hf_name_for_gguf(name)
            if name.endswith("attn_q.weight"):
                w = unpermute_qk(w, cfg.num_heads)
            elif name.endswith("attn_k.weight"):
                w = unpermute_qk(w, cfg.num_kv_heads)
            yield hf, w
            if progress is not None:
                progress("load", i + 1, total)

    model.load_weights(weights())
    model.eval()
    return LoadedModel(model, cfg, eos_ids_from_metadata(meta), cfg.vocab_size, source.model_id)


# -- random weights -----------------------------------------------------------------------------

RANDOM_INIT_STD = 0.02


def _load_random(source: ModelSource, dtype: torch.dtype, device: torch.device, progress: ProgressFn | None) -> LoadedModel:
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
