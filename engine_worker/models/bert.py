"""BERT-family encoders in plain torch: BERT, RoBERTa and XLM-RoBERTa, with no head (embeddings)
or a sequence-classification head (classifiers and cross-encoder scorers).

The three share one graph (post-norm transformer layers with GELU MLPs and learned absolute
positions); what differs is read from ``config.json`` into ``EncoderConfig``:

- RoBERTa and XLM-RoBERTa number positions from ``pad_token_id + 1`` (a pad token inside the
  input keeps position ``pad_token_id``), exactly as transformers' ``create_position_ids_from_input_ids``;
- the classification head: BERT's pooler (dense + tanh on the first token) then ``classifier``;
  RoBERTa's ``classifier.dense`` + tanh + ``classifier.out_proj`` on the ``<s>`` token.

Like the Llama family, the model works on one *flattened* batch: all tokens of all inputs go
through every linear layer together as ``[num_tokens, hidden]``, so padding costs nothing there.
Only attention needs sequence boundaries: ``EncoderLayout`` scatters q/k/v into a
``[batch, longest, ...]`` buffer for ``F.scaled_dot_product_attention`` with a key mask and
gathers the real rows back (a no-op when every input has the same length, e.g. a batch of one).
On the MiniLM benchmark this beat both padding the whole model per batch and one packed sequence
with a block-diagonal mask (whose attention grows with the square of the *total* token count);
see ``engine_worker/pooling.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.models.layers import Linear, copy_checkpoint, onednn_packing_available
from zserve.catalog import ENCODER_MODEL_TYPES

_ROBERTA_TYPES = ("roberta", "xlm-roberta")
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class EncoderConfig:
    """The encoder's shape and head, from a Hugging Face ``config.json`` (``encoder_config_from_hf``)."""

    model_type: str  # one of ENCODER_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    pad_token_id: int
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    # "none" (last hidden states only) or "classify" (the model type's sequence-classification head)
    head: str = "none"
    labels: tuple[str, ...] = ()  # id2label in id order; len(labels) is num_labels
    problem_type: str | None = None

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def position_offset(self) -> int:
        """Position id of the first token: RoBERTa counts from ``pad_token_id + 1``, BERT from 0."""
        return self.pad_token_id + 1 if self.model_type in _ROBERTA_TYPES else 0

    @property
    def max_tokens(self) -> int:
        """The longest input the position table allows."""
        return self.max_position_embeddings - self.position_offset


def encoder_config_from_hf(d: dict) -> EncoderConfig:
    """An ``EncoderConfig`` from a parsed ``config.json``; clear errors for what is not supported."""
    model_type = d.get("model_type")
    if model_type not in ENCODER_MODEL_TYPES:
        raise NotImplementedError(f"encoder model_type {model_type!r} is not supported; "
                                  f"supported: {', '.join(ENCODER_MODEL_TYPES)}")
    if d.get("position_embedding_type", "absolute") != "absolute":
        raise NotImplementedError(f"{model_type}: position_embedding_type "
                                  f"{d['position_embedding_type']!r} is not supported (only absolute)")
    act = d.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise NotImplementedError(f"{model_type}: activation {act!r} is not supported; "
                                  f"supported: {', '.join(_ACTIVATIONS)}")
    if d.get("is_decoder") or d.get("add_cross_attention"):
        raise NotImplementedError(f"{model_type}: decoder checkpoints are not supported")
    archs = d.get("architectures") or []
    head = "classify" if archs and str(archs[0]).endswith("ForSequenceClassification") else "none"
    labels: tuple[str, ...] = ()
    if head == "classify":
        id2label = d.get("id2label") or {i: f"LABEL_{i}" for i in range(int(d.get("num_labels", 2)))}
        try:
            by_id = {int(k): str(v) for k, v in id2label.items()}
        except (AttributeError, ValueError):
            raise ValueError(f"{model_type}: config.json id2label is not a map of label ids to names") from None
        if sorted(by_id) != list(range(len(by_id))) or not by_id:
            raise ValueError(f"{model_type}: config.json id2label ids are not 0..n-1: {sorted(by_id)[:5]}")
        labels = tuple(by_id[i] for i in range(len(by_id)))

    def need(key: str) -> int:
        if d.get(key) is None:
            raise ValueError(f"config.json of a {model_type} lacks {key!r}")
        return int(d[key])

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    if hidden % heads:
        raise ValueError(f"{model_type}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    cfg = EncoderConfig(
        model_type=model_type,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        intermediate_size=need("intermediate_size"),
        max_position_embeddings=need("max_position_embeddings"),
        type_vocab_size=int(d.get("type_vocab_size", 2)),
        pad_token_id=int(d.get("pad_token_id") if d.get("pad_token_id") is not None
                         else (1 if model_type in _ROBERTA_TYPES else 0)),
        layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
        hidden_act=act,
        head=head,
        labels=labels,
        problem_type=d.get("problem_type"),
    )
    if cfg.max_tokens < 1:
        raise ValueError(f"{model_type}: max_position_embeddings={cfg.max_position_embeddings} leaves no room "
                         f"after the position offset {cfg.position_offset}")
    return cfg


@dataclass
class EncoderLayout:
    """Where each input's tokens lie in the flat batch, and how attention regroups them.

    ``lens`` are the inputs' lengths in flat order. ``index`` maps flat rows to rows of the
    ``[batch * longest]`` buffer attention runs on; None when every input has the same length
    (the flat batch already is that buffer). ``key_mask`` (``[batch, 1, 1, longest]``, True for
    real keys) is None when there is nothing to mask.
    """

    lens: list[int]
    starts: torch.Tensor  # [batch] first flat row of each input
    longest: int
    index: torch.Tensor | None
    key_mask: torch.Tensor | None

    @classmethod
    def build(cls, lens: list[int], device: torch.device) -> EncoderLayout:
        b, longest = len(lens), max(lens)
        lens_t = torch.tensor(lens)
        starts = torch.cumsum(lens_t, 0) - lens_t
        index = key_mask = None
        if any(n != longest for n in lens):
            seq = torch.repeat_interleave(torch.arange(b), lens_t)
            pos = torch.arange(int(lens_t.sum())) - torch.repeat_interleave(starts, lens_t)
            index = (seq * longest + pos).to(device)
            key_mask = (torch.arange(longest)[None, :] < lens_t[:, None]).view(b, 1, 1, longest).to(device)
        return cls(lens, starts.to(device), longest, index, key_mask)

    @property
    def ends(self) -> torch.Tensor:
        """Flat row of each input's last token."""
        return self.starts + torch.tensor(self.lens, device=self.starts.device) - 1


class EncoderAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.n_heads, self.head_dim, self.hidden = cfg.num_heads, cfg.hidden_size // cfg.num_heads, cfg.hidden_size
        self.qkv = Linear(3 * cfg.hidden_size, cfg.hidden_size, dtype, device, bias=True)  # rows: q | k | v
        self.out = Linear(cfg.hidden_size, cfg.hidden_size, dtype, device, bias=True)

    def forward(self, x: torch.Tensor, layout: EncoderLayout) -> torch.Tensor:
        qkv = self.qkv(x)
        b, longest = len(layout.lens), layout.longest
        if layout.index is not None:
            buf = qkv.new_zeros(b * longest, qkv.shape[1])
            buf[layout.index] = qkv
            qkv = buf
        q, k, v = qkv.view(b, longest, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.key_mask)
        o = o.transpose(1, 2).reshape(b * longest, self.hidden)
        return self.out(o if layout.index is None else o[layout.index])


class EncoderLayer(nn.Module):
    """Post-norm: ``x = norm(x + attn(x)); x = norm(x + mlp(x))``."""

    def __init__(self, cfg: EncoderConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.attention = EncoderAttention(cfg, dtype, device)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype, device=device)
        self.up = Linear(cfg.intermediate_size, cfg.hidden_size, dtype, device, bias=True)
        self.down = Linear(cfg.hidden_size, cfg.intermediate_size, dtype, device, bias=True)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype, device=device)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, layout: EncoderLayout) -> torch.Tensor:
        x = self.attn_norm(x + self.attention(x, layout))
        return self.mlp_norm(x + self.down(self.act(self.up(x))))

    def linears(self) -> tuple[Linear, ...]:
        return (self.attention.qkv, self.attention.out, self.up, self.down)


class BertEncoder(nn.Module):
    """Embeddings, the encoder layers and the optional classification head.

    ``forward`` returns the last hidden states ``[num_tokens, hidden]`` of a flat batch;
    ``classify`` turns the first-token rows of those into logits ``[batch, num_labels]``.
    """

    def __init__(self, cfg: EncoderConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size

        def table(rows: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(rows, h, dtype=dtype, device=device), requires_grad=False)

        self.word_embeddings = table(cfg.vocab_size)
        self.position_embeddings = table(cfg.max_position_embeddings)
        self.token_type_embeddings = table(cfg.type_vocab_size)
        self.embed_norm = nn.LayerNorm(h, cfg.layer_norm_eps, dtype=dtype, device=device)
        self.layers = nn.ModuleList(EncoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        # BERT: pooler.dense + tanh, then classifier. RoBERTa: classifier.dense + tanh, then out_proj.
        self.head_dense = Linear(h, h, dtype, device, bias=True) if cfg.head == "classify" else None
        self.head_out = Linear(cfg.num_labels, h, dtype, device, bias=True) if cfg.head == "classify" else None
        self.requires_grad_(False)
        self.packed = False

    @property
    def device(self) -> torch.device:
        return self.word_embeddings.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None,
                layout: EncoderLayout) -> torch.Tensor:
        x = F.embedding(input_ids, self.word_embeddings) + F.embedding(positions, self.position_embeddings)
        if token_type_ids is None:
            x = x + self.token_type_embeddings[0]
        else:
            x = x + F.embedding(token_type_ids, self.token_type_embeddings)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, layout)
        return x

    def classify(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        if self.head_dense is None:
            raise ValueError(f"this {self.config.model_type} checkpoint has no classification head")
        return self.head_out(torch.tanh(self.head_dense(first_token_hidden)))

    def positions(self, input_ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Position ids of a flat batch of inputs of lengths ``lens`` (CPU tensors in and out)."""
        cfg = self.config
        starts = torch.cumsum(lens, 0) - lens
        if cfg.model_type not in _ROBERTA_TYPES:
            return torch.arange(input_ids.shape[0]) - torch.repeat_interleave(starts, lens)
        # transformers: cumsum(ids != pad) * (ids != pad) + pad, per input
        real = (input_ids != cfg.pad_token_id).long()
        count = torch.cumsum(real, 0)
        before = torch.repeat_interleave(count[starts] - real[starts], lens)
        return (count - before) * real + cfg.pad_token_id

    def pack_for_cpu(self) -> bool:
        """Pre-pack every linear weight for oneDNN (see ``layers.Linear``); True when packed."""
        if self.packed:
            return True
        if self.device.type != "cpu" or not onednn_packing_available(self.word_embeddings.dtype):
            return False
        for layer in self.layers:
            for lin in layer.linears():
                lin.pack()
        for lin in (self.head_dense, self.head_out):
            if lin is not None:
                lin.pack()
        self.packed = True
        return True

    # -- weights -------------------------------------------------------------------------------

    def _targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Checkpoint tensor name (without the ``bert.``/``roberta.`` prefix) -> (destination, first
        row, rows): Q, K and V land in thirds of the fused ``qkv`` projection."""
        cfg, h = self.config, self.config.hidden_size

        def whole(dest: torch.Tensor) -> tuple[torch.Tensor, int, int]:
            return dest, 0, dest.shape[0]

        t: dict[str, tuple[torch.Tensor, int, int]] = {
            "embeddings.word_embeddings.weight": whole(self.word_embeddings),
            "embeddings.position_embeddings.weight": whole(self.position_embeddings),
            "embeddings.token_type_embeddings.weight": whole(self.token_type_embeddings),
            "embeddings.LayerNorm.weight": whole(self.embed_norm.weight),
            "embeddings.LayerNorm.bias": whole(self.embed_norm.bias),
        }
        for i, layer in enumerate(self.layers):
            p, a = f"encoder.layer.{i}.", layer.attention
            for j, name in enumerate(("query", "key", "value")):
                t[f"{p}attention.self.{name}.weight"] = (a.qkv.weight, j * h, h)
                t[f"{p}attention.self.{name}.bias"] = (a.qkv.bias, j * h, h)
            for src, lin in (("attention.output.dense", a.out), ("intermediate.dense", layer.up),
                             ("output.dense", layer.down)):
                t[f"{p}{src}.weight"] = whole(lin.weight)
                t[f"{p}{src}.bias"] = whole(lin.bias)
            for src, norm in (("attention.output.LayerNorm", layer.attn_norm), ("output.LayerNorm", layer.mlp_norm)):
                t[f"{p}{src}.weight"] = whole(norm.weight)
                t[f"{p}{src}.bias"] = whole(norm.bias)
        if cfg.head == "classify":
            dense, out = (("pooler.dense", "classifier") if cfg.model_type == "bert"
                          else ("classifier.dense", "classifier.out_proj"))
            for src, lin in ((dense, self.head_dense), (out, self.head_out)):
                t[f"{src}.weight"] = whole(lin.weight)
                t[f"{src}.bias"] = whole(lin.bias)
        return t

    def checkpoint_name(self, name: str) -> str | None:
        """The ``_targets`` name of a checkpoint tensor; None for tensors this model does not use
        (buffers, and the pooler / MLM heads of checkpoints loaded without a head)."""
        for prefix in ("bert.", "roberta."):
            name = name.removeprefix(prefix)
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if name.endswith(("embeddings.position_ids", "embeddings.token_type_ids")):
            return None
        if self.config.head == "none" and name.startswith(("pooler.", "cls.", "lm_head.", "classifier.")):
            return None
        return name

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in (any dtype/device); fails unless every weight arrives once."""
        if self.packed:
            raise RuntimeError("weights were packed for serving; load into a fresh model")
        targets = {name: (dest, row, (rows, *dest.shape[1:])) for name, (dest, row, rows) in self._targets().items()}
        named = ((self.checkpoint_name(raw), tensor) for raw, tensor in weights)
        copy_checkpoint(((n, t) for n, t in named if n is not None), targets,
                        f"a {self.config.num_layers}-layer {self.config.model_type}")


def load_encoder(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> BertEncoder:
    """The encoder of a Hugging Face directory (``config.json`` + ``*.safetensors``) on ``device``."""
    from engine_worker.loader import SafetensorsFile, _hf_weight_files

    root = Path(model_dir)
    try:
        d = json.loads((root / "config.json").read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{root} has no config.json") from None
    except ValueError as e:
        raise ValueError(f"{root}/config.json is not JSON: {e}") from None
    model = BertEncoder(encoder_config_from_hf(d), dtype, device)
    files = [SafetensorsFile(f) for f in _hf_weight_files(root)]
    model.load_weights((name, f.get(name)) for f in files for name in f.entries)
    return model.eval()
