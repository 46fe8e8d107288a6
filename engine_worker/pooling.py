"""Pooling requests (embeddings, classification, cross-encoder scores) on BERT-family encoders.

``PoolingRunner`` is what an engine worker runs for them: it owns one encoder
(``models/bert.py``) and turns a list of tokenized inputs (token ids with the special tokens
already added, as the gateway's tokenizer produced them) into one fp32 CPU tensor per input:
a pooled embedding, or classification logits.

Batching across requests. Inputs are sorted by length and cut into forward passes of at most
``max_batch_tokens`` real tokens. Within a pass every linear layer runs on the packed tokens
(no padding), and attention alone regroups them into a ``[batch, longest]`` buffer with a key
mask (``EncoderLayout``). Measured for all-MiniLM-L6-v2 in fp32 on this project's 2-core CPUs
(inputs of 10-60 words, ~15-65 tokens; inputs/s, best of 4, same functional model for each):

    ==========================================  =======  ========  ========
    strategy                                    batch 1  batch 16  batch 64
    ==========================================  =======  ========  ========
    whole model padded to the longest input        70       99       112
    same, sorted and split to <10% padding         65      110       155
    packed linears + padded attention (kept)       65      155       172
    one packed sequence, block-diagonal mask       66      126        75
    ==========================================  =======  ========  ========

Batch 1 is the same computation for all of them (the spread is noise on a shared machine);
with more inputs the packed layout does no work on padding, and the block-diagonal mask loses
once its attention (quadratic in the pass's total tokens) dominates. Jagged nested tensors have
no CPU attention kernel in torch 2.13. On a CPU the linear weights are oneDNN-prepacked
(``layers.Linear``): ~15% faster at batch 1, the same at 16 and 64; a smaller token budget per
pass (1024) measured the same as 8192.

Pooling follows the model directory's sentence-transformers files when present
(``modules.json``: the ``Pooling`` module's ``config.json`` gives mean / CLS / last token, a
``Normalize`` module turns on L2 normalisation, ``sentence_bert_config.json`` caps the input
length); without them an embedding model pools the mean over its tokens and normalises.
Checkpoints with a sequence-classification head classify instead, and one with a single label
is a cross-encoder: ``score`` is the sigmoid of its logit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_worker.models.bert import BertEncoder, EncoderLayout, load_encoder
from zserve.catalog import is_encoder_dir

__all__ = ["PoolingConfig", "PoolingRunner", "is_pooling_model", "read_pooling_config", "shape_embedding",
           "truncate_dimensions"]

log = logging.getLogger(__name__)

POOLING_MODES = ("mean", "cls", "last")
# sentence-transformers' Pooling config flags -> our modes
_ST_POOLING_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                     "pooling_mode_lasttoken": "last"}
_ST_UNSUPPORTED_FLAGS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")


def is_pooling_model(model_dir: str | Path) -> bool:
    """Whether a Hugging Face directory holds an encoder that ``PoolingRunner`` serves (rather than
    a causal LM for ``loader.load_model``); decided by ``config.json``'s ``model_type``."""
    return is_encoder_dir(model_dir)


@dataclass(frozen=True)
class PoolingConfig:
    """How hidden states become one embedding: ``mode`` is one of POOLING_MODES."""

    mode: str = "mean"
    normalize: bool = True
    max_seq_length: int | None = None  # sentence_bert_config.json's limit, when given

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode {self.mode!r} is not one of {', '.join(POOLING_MODES)}")


def read_pooling_config(model_dir: str | Path) -> PoolingConfig:
    """The pooling a sentence-transformers directory declares; mean + normalise without one."""
    root = Path(model_dir)
    max_len = None
    st_config = root / "sentence_bert_config.json"
    if st_config.is_file():
        value = _read_json(st_config).get("max_seq_length")
        max_len = int(value) if value else None
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig("mean", True, max_len)
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} is not a list of modules")
    mode, normalize = "mean", False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            if m.get("path", ""):
                raise NotImplementedError(f"{modules_file}: a Transformer module in a subdirectory "
                                          f"({m['path']!r}) is not supported")
        elif kind == "Pooling":
            mode = _pooling_mode(root / m.get("path", "") / "config.json")
        elif kind == "Normalize":
            normalize = True
        else:  # Dense, LayerNorm, ...: ignoring them would give wrong vectors without an error
            raise NotImplementedError(f"{modules_file}: sentence-transformers module {m.get('type')!r} "
                                      "is not supported (only Transformer, Pooling, Normalize)")
    return PoolingConfig(mode, normalize, max_len)


def _pooling_mode(path: Path) -> str:
    cfg = _read_json(path)
    if "pooling_mode" in cfg:  # the string form some configs use
        mode = {"mean": "mean", "cls": "cls", "lasttoken": "last"}.get(str(cfg["pooling_mode"]))
        if mode is None:
            raise NotImplementedError(f"{path}: pooling_mode {cfg['pooling_mode']!r} is not supported")
        return mode
    unsupported = [k for k in _ST_UNSUPPORTED_FLAGS if cfg.get(k)]
    modes = [mode for flag, mode in _ST_POOLING_FLAGS.items() if cfg.get(flag)]
    if unsupported or len(modes) != 1:
        raise NotImplementedError(f"{path}: pooling {unsupported + modes or 'none'} is not supported "
                                  "(exactly one of mean, cls, lasttoken)")
    return modes[0]


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None


def truncate_dimensions(vector: torch.Tensor, dimensions: int, normalize: bool) -> torch.Tensor:
    """Matryoshka-style shortening: the first ``dimensions`` values, L2-normalised again when the
    model's embeddings are normalised (a prefix of a unit vector is not one)."""
    if not 1 <= dimensions <= vector.shape[-1]:
        raise ValueError(f"dimensions must be between 1 and {vector.shape[-1]}, not {dimensions}")
    out = vector[..., :dimensions]
    return F.normalize(out, dim=-1) if normalize else out.clone()


def shape_embedding(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """What an embedding request gets: the pooled vector (fp32), cut to ``dimensions`` when asked
    (Matryoshka-style), L2-normalised when ``normalize``."""
    v = vector.float()
    if dimensions is not None and dimensions < v.shape[-1]:
        return truncate_dimensions(v, dimensions, normalize)
    return F.normalize(v, dim=-1) if normalize else v


class PoolingRunner:
    """One encoder and its pooling; ``embed``, ``classify`` and ``score`` run a batch of inputs.

    ``tasks`` says which of them the checkpoint serves: ``("embed",)`` without a head,
    ``("classify",)`` with a classification head, ``("classify", "score")`` with a one-label head.
    """

    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype,
                 max_batch_tokens: int = 8192):
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be positive")
        self.model_dir = Path(model_dir)
        self.device, self.dtype, self.max_batch_tokens = torch.device(device), dtype, max_batch_tokens
        self.model: BertEncoder = load_encoder(self.model_dir, dtype, self.device)
        cfg = self.model.config
        # On a CPU, oneDNN-prepacked weights speed up the small matmuls of short inputs.
        self.packed = self.model.pack_for_cpu()
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        if cfg.head == "classify":
            self.pooling: PoolingConfig | None = None
            self.labels: list[str] | None = list(cfg.labels)
            self.tasks: tuple[str, ...] = ("classify", "score") if cfg.num_labels == 1 else ("classify",)
            limit = None
        else:
            self.pooling = read_pooling_config(self.model_dir)
            self.labels = None
            self.tasks = ("embed",)
            limit = self.pooling.max_seq_length
        self.max_model_len = min(cfg.max_tokens, limit) if limit else cfg.max_tokens
        log.info("pooling model %s: %s %d layers, hidden %d, tasks %s, max_model_len %d, %s on %s%s",
                 self.model_dir, cfg.model_type, cfg.num_layers, cfg.hidden_size, ",".join(self.tasks),
                 self.max_model_len, self.pooling or f"{cfg.num_labels} labels", self.device,
                 " (oneDNN-packed)" if self.packed else "")

    # -- the tasks -----------------------------------------------------------------------------

    def embed(self, batch: list[list[int]], normalize: bool | None = None,
              token_type_ids: list[list[int]] | None = None) -> list[torch.Tensor]:
        """One pooled embedding per input (fp32, CPU, ``[hidden_size]``); ``normalize`` overrides
        the model's own choice."""
        self._require("embed")
        assert self.pooling is not None
        norm = self.pooling.normalize if normalize is None else normalize
        return self._run(batch, token_type_ids, lambda hidden, layout: self._pool(hidden, layout, norm))

    def classify(self, batch: list[list[int]], token_type_ids: list[list[int]] | None = None) -> list[torch.Tensor]:
        """Classification logits per input (fp32, CPU, ``[len(labels)]``). For a text pair pass
        the tokenizer's ``token_type_ids`` (BERT tells the two segments apart by them)."""
        self._require("classify")
        return self._run(batch, token_type_ids, lambda hidden, layout: self.model.classify(hidden[layout.starts]))

    def score(self, batch: list[list[int]], token_type_ids: list[list[int]] | None = None) -> list[float]:
        """Cross-encoder relevance per (query, document) input: the sigmoid of the one logit."""
        self._require("score")
        return [torch.sigmoid(logits[0]).item() for logits in self.classify(batch, token_type_ids)]

    @property
    def activation(self) -> str:
        """How logits become probabilities: ``sigmoid`` for one label or multi-label problems, else ``softmax``."""
        cfg = self.model.config
        return "sigmoid" if cfg.num_labels == 1 or cfg.problem_type == "multi_label_classification" else "softmax"

    # -- batching ------------------------------------------------------------------------------

    def _require(self, task: str) -> None:
        if task not in self.tasks:
            raise ValueError(f"model {self.model_dir.name!r} does not support {task!r}; "
                             f"it serves {', '.join(self.tasks)}")

    def _validate(self, batch: list[list[int]], token_type_ids: list[list[int]] | None) -> None:
        if token_type_ids is not None and len(token_type_ids) != len(batch):
            raise ValueError(f"token_type_ids has {len(token_type_ids)} entries for {len(batch)} inputs")
        types = self.model.config.type_vocab_size
        for i, ids in enumerate(batch):
            if not ids:
                raise ValueError(f"input {i} is empty")
            if len(ids) > self.max_model_len:
                raise ValueError(f"input {i} has {len(ids)} tokens; this model takes at most "
                                 f"{self.max_model_len} (max_model_len)")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(f"input {i} has a token id outside 0..{self.vocab_size - 1}")
            if token_type_ids is not None:
                tt = token_type_ids[i]
                if len(tt) != len(ids):
                    raise ValueError(f"input {i} has {len(ids)} tokens but {len(tt)} token_type_ids")
                if min(tt) < 0 or max(tt) >= types:
                    raise ValueError(f"input {i} has a token type outside 0..{types - 1}")

    def _passes(self, batch: list[list[int]]) -> list[list[int]]:
        """Input indices per forward pass: sorted by length, so that attention's per-pass padding
        stays small, and cut at ``max_batch_tokens`` real tokens (an input is never split)."""
        passes: list[list[int]] = []
        tokens = 0
        for i in sorted(range(len(batch)), key=lambda i: len(batch[i])):
            if passes and tokens + len(batch[i]) <= self.max_batch_tokens:
                passes[-1].append(i)
                tokens += len(batch[i])
            else:
                passes.append([i])
                tokens = len(batch[i])
        return passes

    @torch.inference_mode()
    def _run(self, batch: list[list[int]], token_type_ids: list[list[int]] | None,
             head: Callable[[torch.Tensor, EncoderLayout], torch.Tensor]) -> list[torch.Tensor]:
        """``head(hidden, layout)`` turns each pass's hidden states into one row per input."""
        self._validate(batch, token_type_ids)
        out: list[torch.Tensor | None] = [None] * len(batch)
        for indices in self._passes(batch):
            lens = [len(batch[i]) for i in indices]
            ids = torch.tensor([t for i in indices for t in batch[i]], dtype=torch.long)
            layout = EncoderLayout.build(lens, self.device)
            positions = self.model.positions(ids, torch.tensor(lens))
            types = None
            # Token type 0 everywhere (single texts, RoBERTa) is the model's default: skip the gather.
            if token_type_ids is not None and any(any(token_type_ids[i]) for i in indices):
                types = torch.tensor([t for i in indices for t in token_type_ids[i]], dtype=torch.long)
                types = types.to(self.device, non_blocking=True)
            hidden = self.model(ids.to(self.device, non_blocking=True), positions.to(self.device, non_blocking=True),
                                types, layout)
            rows = head(hidden, layout).float().cpu()  # one transfer per pass
            for i, row in zip(indices, rows.unbind(0)):
                out[i] = row
        return out  # type: ignore[return-value]

    def _pool(self, hidden: torch.Tensor, layout: EncoderLayout, normalize: bool) -> torch.Tensor:
        """``[batch, hidden]`` fp32 embeddings of a flat batch's inputs."""
        assert self.pooling is not None
        if self.pooling.mode == "cls":
            pooled = hidden[layout.starts].float()
        elif self.pooling.mode == "last":
            pooled = hidden[layout.ends].float()
        else:
            lens = torch.tensor(layout.lens, device=hidden.device)
            seq = torch.repeat_interleave(torch.arange(len(layout.lens), device=hidden.device), lens)
            sums = hidden.new_zeros(len(layout.lens), hidden.shape[1], dtype=torch.float32)
            pooled = sums.index_add_(0, seq, hidden.float()) / lens[:, None]
        return F.normalize(pooled, dim=-1) if normalize else pooled
