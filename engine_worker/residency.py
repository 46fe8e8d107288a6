"""Where a generating engine's memory lives: the weights and the KV cache freed for sleep and brought back on wake,
and the weights replaced by another checkpoint's (``POST /update_weights``).

Every tensor of the model is reached the same way (``_slots``: each module's parameters, buffers and plain tensor
attributes such as oneDNN-packed weights), so one loop moves, drops or swaps all of them and ties (a tied LM head
and embedding are one tensor in two slots) survive. The KV pool keeps its tensor objects (attention backends and
decode graphs hold views of it): on a CPU its anonymous mapping is handed back to the kernel page by page
(``madvise(MADV_DONTNEED)``: zero pages again on the next touch); on a GPU its storage is resized to nothing and
back. After any change of addresses on a GPU the decode graphs are captured again.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from zserve.catalog import ModelNotFound, ModelSource, resolve

from .host_memory import release_free_memory
from .loader import LoadedModel, load_model
from .runner import ModelRunner

log = logging.getLogger("zserve.engine")

# What must be equal for a checkpoint to replace the served weights: every shape the runner, the KV cache and the
# adapters were built for.
SHAPE_FIELDS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                "vocab_size", "tie_word_embeddings", "attention_bias", "num_experts", "num_experts_per_tok")


class WeightsRefused(ValueError):
    """A checkpoint that cannot replace the served weights (bad input: nothing changed)."""


def device_bytes(device: torch.device) -> int | None:
    """Device memory this process holds (allocated by torch), or None on a CPU."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_reserved(device))


def _slots(model: nn.Module) -> Iterator[tuple[dict, str]]:
    """Every place a tensor of ``model`` is kept: (the dict that holds it, its key), in module order."""
    for m in model.modules():
        for d in (m._parameters, m._buffers):
            for k, v in d.items():
                if v is not None:
                    yield d, k
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor) and not k.startswith("_"):
                yield m.__dict__, k


def _map(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace every tensor of ``model`` by ``fn(tensor)``, once per tensor (tied slots stay tied)."""
    done: dict[int, torch.Tensor] = {}
    for d, k in list(_slots(model)):
        t = d[k]
        if id(t) not in done:
            new = fn(t)
            done[id(t)] = nn.Parameter(new, requires_grad=False) if isinstance(t, nn.Parameter) else new
        d[k] = done[id(t)]


def _transplant(dst: nn.Module, src: nn.Module) -> None:
    """Give ``dst`` every tensor of ``src`` (a model of the same configuration, prepared the same way)."""
    pairs = list(zip(list(_slots(dst)), list(_slots(src)), strict=False))
    if len(pairs) != sum(1 for _ in _slots(src)) or any(a[1] != b[1] for a, b in pairs):
        raise WeightsRefused("the new model's layout differs from the served one")
    for (d, k), (s, sk) in pairs:
        d[k] = s[sk]


@dataclass
class Staged:
    """A checkpoint read beside the served weights, ready to replace them."""

    loaded: LoadedModel
    source: ModelSource
    version: str


class Residency:
    """Sleep, wake and weight replacement of one ``ModelRunner``; ``source``: where its weights were read from (a
    level-2 wake reads them again from there)."""

    def __init__(self, runner: ModelRunner, source: ModelSource | None,
                 expert_share: Callable[[], tuple[int, int] | None] = lambda: None):
        self.runner = runner
        self.source = source
        self.expert_share = expert_share  # an expert-parallel member's (member, size) now: the experts it reads
        self.asleep: set[str] = set()  # what is freed now: "weights", "kv_cache"
        self.level = 0
        self.staged: Staged | None = None
        self._host_weights = False  # level 1 on a GPU: the weights wait in host memory

    # -- sleep -----------------------------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Free the KV cache, and the weights: moved to host memory (level 1: where a CPU engine's already are)
        or dropped (level 2). The caller makes sure no request holds a KV block."""
        r = self.runner
        if "kv_cache" not in self.asleep:
            self._free_kv()
            self.asleep.add("kv_cache")
        if "weights" not in self.asleep:
            if level >= 2:
                _map(r.model, lambda t: torch.empty(0, dtype=t.dtype) if t.layout == torch.strided else
                     torch.empty(0))
                self.asleep.add("weights")
            elif r.device.type != "cpu":
                _map(r.model, lambda t: t.to("cpu").pin_memory())
                self._host_weights = True
                self.asleep.add("weights")
            # (a CPU engine's weights at level 1 are already in host memory: nothing moves, nothing is freed)
        self.level = max(self.level, level)
        if r.device.type == "cuda":
            torch.cuda.empty_cache()
        release_free_memory()

    def wake(self, tags: tuple[str, ...]) -> None:
        """Bring back what ``tags`` name (weights, kv_cache) of what sleep freed."""
        r = self.runner
        if "weights" in tags and "weights" in self.asleep:
            if self._host_weights:
                _map(r.model, lambda t: t.to(r.device))
                self._host_weights = False
            else:
                if self.source is None:
                    raise RuntimeError("this engine does not know where its weights came from")
                self._install(self._read(self.source, r.device))
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self._restore_kv()
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.level = 0
            self._recapture()

    def _free_kv(self) -> None:
        kv = self.runner.kv
        buf = getattr(kv, "buffer", None)
        if isinstance(buf, mmap.mmap):
            buf.madvise(mmap.MADV_DONTNEED)  # the pages go back; the mapping (and every view of it) stays
        else:
            kv.kv.untyped_storage().resize_(0)

    def _restore_kv(self) -> None:
        kv = self.runner.kv
        if not isinstance(getattr(kv, "buffer", None), mmap.mmap):
            kv.kv.untyped_storage().resize_(kv.kv.numel() * kv.kv.element_size())
            kv.kv.zero_()

    def _recapture(self) -> None:
        r = self.runner
        if r.graphs is not None and r.device.type == "cuda":
            r.graphs = r._capture_graphs(-(-r.max_model_len // r.block_size), scratch_block=r.num_blocks)

    # -- weights ---------------------------------------------------------------------------------------------
    def stage(self, path: str, version: str) -> Staged:
        """Read checkpoint ``path`` beside the served weights (to host memory while asleep); ``WeightsRefused`` when
        it is none or does not fit the served model's architecture."""
        r = self.runner
        try:
            found = resolve(path)
        except ModelNotFound as e:
            raise WeightsRefused(f"{path!r} is not a checkpoint: {e}") from None
        if found.weights not in ("hf", "gguf"):
            raise WeightsRefused(f"{path!r} is not a checkpoint directory or .gguf file")
        served = self.source
        source = ModelSource(served.model_id if served else found.model_id, found.weights, found.path,
                             served.tokenizer_path if served else found.tokenizer_path)
        try:
            loaded = self._read(source, torch.device("cpu") if self.asleep else r.device)
        except (OSError, ValueError, KeyError, RuntimeError, NotImplementedError) as e:
            raise WeightsRefused(f"{path!r} could not be read: {e}") from None
        ours, theirs = r.model.config, loaded.config
        differ = [f"{f} {getattr(theirs, f)} (served: {getattr(ours, f)})" for f in SHAPE_FIELDS
                  if getattr(ours, f) != getattr(theirs, f)]
        if differ:
            raise WeightsRefused(f"{path!r} does not fit the served model's architecture: {', '.join(differ)}")
        if theirs.max_position_embeddings < r.max_model_len:
            raise WeightsRefused(f"{path!r} has a context of {theirs.max_position_embeddings} tokens, less than the "
                                 f"served {r.max_model_len}")
        self.staged = Staged(loaded, source, version)
        return self.staged

    def commit(self) -> Staged:
        """Serve the staged weights (the caller makes sure no request runs). Asleep at level 2, they are only
        remembered: the wake reads them."""
        staged = self.staged
        if staged is None:
            raise RuntimeError("no weights are staged")
        self.staged = None
        if "weights" in self.asleep and not self._host_weights:
            self.source = staged.source
            return staged
        self._install(staged.loaded)
        self.source = staged.source
        self._recapture()
        return staged

    def discard(self) -> None:
        self.staged = None
        release_free_memory()

    def _read(self, source: ModelSource, device: torch.device) -> LoadedModel:
        r = self.runner
        loaded = load_model(source, r.dtype, device, expert_share=self.expert_share(), quantization=r.quantization)
        model = loaded.model
        model.dtype = r.dtype
        if r.packed:
            model.pack_for_cpu()
        model.use_native_kernels(r.model.native)
        return loaded

    def _install(self, loaded: LoadedModel) -> None:
        r = self.runner
        _transplant(r.model, loaded.model)
        del loaded
        release_free_memory()  # (the replaced weights)
        group = r.group
        if group is not None:
            r.model.set_expert_group(group)
        log.info("engine weights of %s replaced", r.model_id)
