"""LoRA adapters served in the batch: requests for different adapters and the base model share one step.

An adapter is a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``) trained for the base
model: per adapted projection a pair ``A [r, in]``, ``B [out, r]``, and ``W x`` becomes ``W x + s·B A x`` with
``s = alpha / r`` (``alpha / sqrt(r)`` for rsLoRA). ``read_adapter`` checks everything against the base model
before anything is kept, so a bad adapter is one ``LoraError`` whose message can go back to a user in a 400.

``LoraManager`` owns the adapters of one engine by name, on three levels:

- registered: every ``load``-ed name and its directory (cheap, unbounded);
- host memory: an LRU of at most ``max_cpu_loras`` read adapters; an evicted one is read again on next use;
- compute slots: ``max_loras`` zero-padded slots per target projection on the model's device, filled from host
  memory when a step needs an adapter that is not resident (the least recently used slot not in the step goes).

The math is punica's idea in plain torch. The base matmul runs once for the whole flattened batch; then, for
each adapter present in the step, ``y[rows] += (x[rows] @ A.T) @ (s·B).T`` on that adapter's token rows
(``LoraStep``, built once per step with its index tensors and shared by every layer). The model fuses q/k/v into
one ``qkv_proj`` and gate/up into one ``gate_up_proj``: a slot of a fused projection holds the adapter's
``A.T``'s side by side (``at [in, width]``: q's columns, then k's, then v's of those it targets, each as wide as
its rank), so one matmul ``x @ at`` gives every module's ``h``, and per module its own ``(s·B).T [rank, out_m]``
(``bt[m]``), which writes only that module's output columns: no zero blocks are stored or read. A slot's used
width is the adapter's rank times the modules it targets: a rank-8 adapter of q_proj alone costs a width-8 pass,
and a projection an adapter does not target costs nothing. A step without adapter rows has no ``LoraStep``.

Adapters with the same layout in a projection (rank and targeted modules) whose slots lie close together are done
in one ``BatchedPass``: their rows are gathered slot by slot (padded to the same count, the padding masked out),
and one ``torch.bmm`` per matmul serves them all, then ``index_add_`` scatters the result (no gather or
scatter when the rows are already in place). That is decode's case, a few rows per adapter, where a matmul pair
per adapter would cost mostly call overhead. Adapters with many rows (a prefill) or alone in their layout go
through a ``SegmentPass``, one matmul pair per adapter, so a long segment is never padded.

On a CPU with the native kernels (``cpu_kernels.supports_lora``), every adapter with at most ``BATCH_ROWS`` rows
goes instead into one ``KernelPass`` per projection: ``cpu_kernels.lora_shrink_expand`` streams each adapter's
slot once for all its rows, reading its token rows in place (no gather, no padding, no scatter) and adding to
``y`` directly, with the threads splitting the weights. Adapters of any layouts share that one call. The torch
passes stay for longer segments, for CUDA, and where the kernels did not build.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine_worker import cpu_kernels

if TYPE_CHECKING:
    from engine_worker.models.layers import Linear
    from engine_worker.models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["LoraAdapter", "LoraError", "LoraManager", "LoraStep", "read_adapter"]

# The model's fused projections (``LlamaForCausalLM.lora_targets``) and the PEFT modules in each, in row order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
SUPPORTED = tuple(m for modules in FUSED.values() for m in modules)
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
KIND_OF = {m: kind for kind, modules in FUSED.items() for m in modules}

# PEFT options that change the math this module implements: refused by name, with what they are.
UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save (fully trained extra modules)",
    "lora_bias": "LoRA biases (lora_bias)", "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)", "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
    "target_parameters": "target_parameters", "exclude_modules": "exclude_modules",
    "layer_replication": "layer_replication", "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)", "use_qalora": "QA-LoRA (use_qalora)",
}
_TENSOR = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class LoraError(ValueError):
    """An adapter that cannot be served here; the message says why, for the user who asked for it."""


def module_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """``(in, out)`` features of every adaptable module of the base model."""
    q, kv, h, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter read and checked: per adapted ``(layer, module)`` its ``A [r, in]`` and ``(s·B).T [r, out]``
    (the scaling folded in at load time), on the host in the model's dtype."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules it adapts in any layer, in ``SUPPORTED`` order."""
        present = {m for _, m in self.weights}
        return tuple(m for m in SUPPORTED if m in present)

    def blocks(self, kind: str) -> list[tuple[str, int]]:
        """``(module, first column of its A.T in a slot's ``at``)`` of each module of fused projection ``kind`` it
        adapts."""
        present = [m for m in FUSED[kind] if m in self.modules]
        return [(m, i * self.rank) for i, m in enumerate(present)]


def read_adapter(name: str, path: str | Path, cfg: LlamaConfig, max_rank: int, dtype: torch.dtype) -> LoraAdapter:
    """Read the PEFT adapter at ``path`` and check it fits the base model ``cfg``; a LoraError says what does not."""
    root = Path(path)
    if not root.is_dir():
        raise LoraError(f"adapter {name!r}: {str(path)!r} is not a directory")
    files = [root / "adapter_config.json", root / "adapter_model.safetensors"]
    for f in files:
        if not f.is_file():
            raise LoraError(f"adapter {name!r}: {str(path)!r} has no {f.name} (a PEFT LoRA adapter directory holds "
                            "adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.loads(files[0].read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise LoraError(f"adapter {name!r}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoraError(f"adapter {name!r}: adapter_config.json is not a JSON object")
    rank, scaling, targets = _read_config(name, config, cfg, max_rank)
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(files[1]))
    except Exception as e:  # safetensors' own error type for a truncated or foreign file
        raise LoraError(f"adapter {name!r}: cannot read adapter_model.safetensors ({e})") from None
    return LoraAdapter(name, str(path), rank, _check_tensors(name, tensors, targets, rank, scaling, cfg, dtype))


def _read_config(name: str, config: dict, cfg: LlamaConfig, max_rank: int) -> tuple[int, float, set]:
    """``(rank, scaling, adapted (layer, module) pairs)`` from an adapter_config.json."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"adapter {name!r} is a {config.get('peft_type')} adapter, not LoRA")
    for key, what in UNSUPPORTED_OPTIONS.items():
        if config.get(key):
            raise LoraError(f"adapter {name!r} uses {what}, which is not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"adapter {name!r} trains biases (bias={config['bias']!r}); only bias='none' is supported")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraError(f"adapter {name!r}: r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise LoraError(f"adapter {name!r} has rank {rank}, above this engine's max_lora_rank={max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoraError(f"adapter {name!r}: lora_alpha must be a number, not {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling, _targets(name, config, cfg)


def _targets(name: str, config: dict, cfg: LlamaConfig) -> set[tuple[int, str]]:
    """The ``(layer, module)`` pairs the config adapts, matched as PEFT matches module names: a list entry is a
    module name or a dotted suffix of one, a string is a regular expression over the whole name."""
    spec = config.get("target_modules")
    keys = {(i, m): f"model.layers.{i}.{'mlp' if m in MLP_MODULES else 'self_attn'}.{m}"
            for i in range(cfg.num_layers) for m in SUPPORTED}
    if spec == "all-linear":
        chosen = set(keys)
    elif isinstance(spec, str):
        try:
            pattern = re.compile(spec)
        except re.error as e:
            raise LoraError(f"adapter {name!r}: target_modules {spec!r} is not a valid regular expression ({e})") \
                from None
        chosen = {k for k, key in keys.items() if pattern.fullmatch(key)}
    elif isinstance(spec, list) and spec and all(isinstance(s, str) for s in spec):
        for s in spec:
            if s.rsplit(".", 1)[-1] not in SUPPORTED:
                raise LoraError(f"adapter {name!r} targets {s!r}; supported target modules: {', '.join(SUPPORTED)}")
        chosen = {k for k, key in keys.items() if any(key == s or key.endswith("." + s) for s in spec)}
    else:
        raise LoraError(f"adapter {name!r}: target_modules must be a list of module names or a regular expression, "
                        f"not {spec!r}")
    layers = config.get("layers_to_transform")
    if layers is not None:
        layers = {layers} if isinstance(layers, int) else set(layers)
        chosen = {(i, m) for i, m in chosen if i in layers}
    if not chosen:
        raise LoraError(f"adapter {name!r}: target_modules {spec!r} matches none of this model's "
                        f"{', '.join(SUPPORTED)} modules")
    if cfg.num_experts and any(m in MLP_MODULES for _, m in chosen):
        raise LoraError(f"adapter {name!r} adapts the MLP, but this {cfg.architecture}'s MLP is a mixture of experts; "
                        "only attention projections (q_proj, k_proj, v_proj, o_proj) can be adapted on it")
    return chosen


def _check_tensors(name: str, tensors: dict[str, torch.Tensor], targets: set[tuple[int, str]], rank: int,
                   scaling: float, cfg: LlamaConfig, dtype: torch.dtype) -> dict:
    """The adapter's ``(A, (s·B).T)`` per target, after checking every tensor's name and shape."""
    shapes = module_shapes(cfg)
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, t in tensors.items():
        m = _TENSOR.fullmatch(key)
        module = m.group(3) if m else None
        if m is None or module not in SUPPORTED or (m.group(2) == "mlp") != (module in MLP_MODULES):
            raise LoraError(f"adapter {name!r} has tensor {key!r}; only lora_A/lora_B weights of "
                            f"{', '.join(SUPPORTED)} are supported")
        layer, which = int(m.group(1)), m.group(4)
        if layer >= cfg.num_layers:
            raise LoraError(f"adapter {name!r} has tensor {key!r} for layer {layer}, but the base model has "
                            f"{cfg.num_layers} layers (an adapter for another model?)")
        if (layer, module) not in targets:
            raise LoraError(f"adapter {name!r} has tensor {key!r}, which its target_modules does not name")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(t.shape) != want:
            raise LoraError(f"adapter {name!r}: tensor {key!r} has shape {tuple(t.shape)}, expected {want} for rank "
                            f"{rank} on this base model (an adapter for another model?)")
        found[(layer, module, which)] = t
    missing = [f"layer {i} {m}.lora_{w}" for i, m in sorted(targets) for w in "AB" if (i, m, w) not in found]
    if missing:
        raise LoraError(f"adapter {name!r}: {len(missing)} tensors missing from adapter_model.safetensors, "
                        f"e.g. {', '.join(missing[:3])}")
    return {(i, m): (found[(i, m, "A")].to(dtype).contiguous(),
                     (found[(i, m, "B")].float() * scaling).T.to(dtype).contiguous())
            for i, m in targets}


@dataclass
class ProjectionSlots:
    """One target projection's slots: ``at [max_loras, in, modules·max_rank]``, each slot's ``A.T``'s side by side
    (the adapter's modules of this projection, each ``rank`` columns wide, packed from column 0), and per module
    ``bt[j] [max_loras, max_rank, out_j]``, its ``(s·B).T`` in the first ``rank`` rows; ``cols[j]``: module j's
    output columns in the fused projection; ``kernel``: the native kernel bound to these slots (None: torch)."""

    at: torch.Tensor
    bt: tuple[torch.Tensor, ...]
    cols: tuple[slice, ...]
    kernel: cpu_kernels.LoraKernel | None = None


# A slot's layout in one projection: (rank, ((module index in FUSED[kind], first column of its A.T), ...)).
Layout = tuple[int, tuple[tuple[int, int], ...]]


@dataclass(frozen=True)
class SegmentPass:
    """Adapters done one matmul pair each: ``rows`` (a slice when in place, else indices) lists their token rows
    grouped by adapter; per adapter ``(segment of rows, slot, layout)``."""

    rows: slice | torch.Tensor
    count: int
    segments: tuple[tuple[slice, int, Layout], ...]

    def add(self, proj: ProjectionSlots, x: torch.Tensor, y: torch.Tensor) -> None:
        in_place = isinstance(self.rows, slice)
        xs = x[self.rows] if in_place else x.index_select(0, self.rows)
        ys = y[self.rows] if in_place else y.new_zeros(self.count, y.shape[1])
        for seg, slot, (rank, blocks) in self.segments:
            h = torch.mm(xs[seg], proj.at[slot, :, : rank * len(blocks)])
            for j, first in blocks:
                ys[seg, proj.cols[j]].addmm_(h[:, first : first + rank], proj.bt[j][slot, :rank])
        if not in_place:
            y.index_add_(0, self.rows, ys)


@dataclass(frozen=True)
class BatchedPass:
    """Adapters of one layout in slots ``[lo, hi)`` done together by ``torch.bmm``: ``index`` holds each slot's
    token rows in turn, padded to ``m`` per slot with a row whose update ``mask [hi-lo, m, 1]`` zeroes (None when
    nothing is padded); a slice when that is one run of rows already in place (no gather, no scatter). A slot of
    the range that is not in the pass has only padding."""

    lo: int
    hi: int
    m: int
    layout: Layout
    index: slice | torch.Tensor
    mask: torch.Tensor | None
    full: bool  # the layout adapts every module of the projection: one scatter of all its columns

    def add(self, proj: ProjectionSlots, x: torch.Tensor, y: torch.Tensor) -> None:
        rank, blocks = self.layout
        lo, hi, n = self.lo, self.hi, (self.hi - self.lo) * self.m
        in_place = isinstance(self.index, slice)
        xs = x[self.index] if in_place else x.index_select(0, self.index)
        h = torch.bmm(xs.view(hi - lo, self.m, x.shape[1]), proj.at[lo:hi, :, : rank * len(blocks)])
        if self.mask is not None:
            h.mul_(self.mask)
        outs = [torch.bmm(h[:, :, first : first + rank], proj.bt[j][lo:hi, :rank]) for j, first in blocks]
        if self.full:
            ys = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
            if in_place:
                y[self.index].add_(ys.view(n, y.shape[1]))
            else:
                y.index_add_(0, self.index, ys.view(n, y.shape[1]))
        else:
            for (j, _), out in zip(blocks, outs):
                if in_place:
                    y[self.index, proj.cols[j]].add_(out.view(n, out.shape[2]))
                else:
                    y[:, proj.cols[j]].index_add_(0, self.index, out.view(n, out.shape[2]))


@dataclass(frozen=True)
class KernelPass:
    """Adapters done by the native kernel in one call: ``rows`` (int64) their token rows, adapter by adapter,
    ``segs`` [adapters, 5] (int32) per adapter its ``begin, end`` in ``rows``, slot, rank and module mask."""

    rows: torch.Tensor
    segs: torch.Tensor

    def add(self, proj: ProjectionSlots, x: torch.Tensor, y: torch.Tensor) -> None:
        proj.kernel(x if x.stride(1) == 1 else x.contiguous(), y, self.rows, self.segs)


@dataclass
class LoraStep:
    """One step's adapters: per projection kind, the passes that add the updates of the adapters adapting it
    (built once per step by ``LoraManager.step``, index tensors included). ``Linear.forward`` calls ``add`` after
    its base matmul."""

    plan: dict[str, list[SegmentPass | BatchedPass | KernelPass]]
    slots: dict[Linear, tuple[str, ProjectionSlots]]

    def add(self, linear: Linear, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows] += (x[rows] @ A.T) @ (s·B).T`` for every adapter of the step, in place."""
        kind, proj = self.slots[linear]
        for p in self.plan[kind]:
            p.add(proj, x, y)


# A run of slots of one layout is batched (one ``torch.bmm`` for all) when no slot has more rows than this, or
# when padding every slot to the most rows adds under an eighth: decode rows (a few per adapter) are batched,
# a prefill's long segments go one adapter at a time, as padded rows would cost real matmul work.
BATCH_ROWS = 16


def _runs(slots: list[int]) -> list[list[int]]:
    """Sorted ``slots`` cut into runs that each span at most twice as many slots as they hold (a batched pass reads
    the weights of every slot in its span)."""
    runs = [[slots[0]]]
    for slot in slots[1:]:
        run = runs[-1]
        if slot + 1 - run[0] <= 2 * (len(run) + 1):
            run.append(slot)
        else:
            runs.append([slot])
    return runs


class LoraManager:
    """The adapters of one engine, by name, and the compute slots a step uses (see the module docstring)."""

    def __init__(self, model: LlamaForCausalLM, max_loras: int, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None):
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if min(max_loras, max_lora_rank, max_cpu_loras) < 1:
            raise ValueError("max_loras, max_lora_rank and max_cpu_loras must be positive")
        self.config = model.config
        self.dtype = model.dtype
        self.device = model.embed_weight.device
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self._paths: dict[str, str] = {}
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._owner: list[str | None] = [None] * max_loras  # slot -> adapter
        self._layouts: list[dict[str, Layout]] = [{} for _ in range(max_loras)]  # slot -> kind -> its layout
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        shapes = module_shapes(model.config)
        self._slots: dict[Linear, tuple[str, ProjectionSlots]] = {}
        self._layers: list[dict[str, ProjectionSlots]] = []
        self.native = cpu_kernels.supports_lora(self.device, self.dtype)  # decode steps use the native kernel
        for linears in model.lora_targets():
            layer = {}
            for kind, linear in linears.items():
                modules = FUSED[kind]
                outs = [shapes[m][1] for m in modules]
                starts = [sum(outs[:j]) for j in range(len(outs))]
                layer[kind] = ProjectionSlots(
                    torch.zeros(max_loras, shapes[modules[0]][0], max_lora_rank * len(modules), dtype=self.dtype,
                                device=self.device),
                    tuple(torch.zeros(max_loras, max_lora_rank, out, dtype=self.dtype, device=self.device)
                          for out in outs),
                    tuple(slice(start, start + out) for start, out in zip(starts, outs)))
                if self.native:
                    layer[kind].kernel = cpu_kernels.LoraKernel(layer[kind].at, layer[kind].bt)
                self._slots[linear] = (kind, layer[kind])
            self._layers.append(layer)
        # Stats for logs and tests: adapters read from disk, slots (re)filled.
        self.reads = 0
        self.slot_fills = 0

    # -- adapters by name -------------------------------------------------------------------
    def load(self, name: str, path: str | Path) -> None:
        """Register adapter ``name`` from the PEFT directory ``path``, read and checked in full first: a LoraError
        changes nothing."""
        if not isinstance(name, str) or not name:
            raise LoraError("an adapter needs a non-empty name")
        if name in self._paths:
            raise LoraError(f"adapter {name!r} is already loaded (from {self._paths[name]!r}); unload it first")
        adapter = self._read(name, str(path))
        self._paths[name] = str(path)
        self._keep(adapter)

    def unload(self, name: str) -> None:
        """Forget adapter ``name``: its host copy and its slot. Requests still running with it fail their next
        step, so a caller drains or aborts them first."""
        if name not in self._paths:
            raise LoraError(f"adapter {name!r} is not loaded")
        del self._paths[name]
        self._host.pop(name, None)
        for slot, owner in enumerate(self._owner):
            if owner == name:
                self._owner[slot], self._layouts[slot] = None, {}
                self._slot_lru.move_to_end(slot, last=False)  # refilled first

    def names(self) -> list[str]:
        return sorted(self._paths)

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    # -- one step ---------------------------------------------------------------------------
    def step(self, spans: dict[str, list[tuple[int, int]]]) -> LoraStep:
        """The ``LoraStep`` for token ranges ``[start, end)`` per adapter (in flat-batch order), after filling a
        slot for every adapter of the step that is not resident."""
        if len(spans) > self.max_loras:
            raise LoraError(f"a step holds {len(spans)} adapters; this engine has max_loras={self.max_loras}")
        for name in spans:
            if name not in self._paths:
                raise LoraError(f"adapter {name!r} is not loaded")
        rows: dict[int, list[int]] = {}  # slot -> its token rows, adapters in step order
        for name, ranges in spans.items():
            rows[self._resident(name, spans)] = [i for start, end in ranges for i in range(start, end)]
        indices: dict[tuple[int, ...], torch.Tensor] = {}  # shared by the projections of the step
        return LoraStep({kind: self._passes(kind, rows, indices) for kind in FUSED}, self._slots)

    def _passes(self, kind: str, rows: dict[int, list[int]],
                indices: dict) -> list[SegmentPass | BatchedPass | KernelPass]:
        """The passes that adapt projection ``kind``: with the native kernel, one ``KernelPass`` for every adapter
        with at most ``BATCH_ROWS`` rows; then a ``BatchedPass`` per run of slots of one layout where a batched
        matmul pays, one ``SegmentPass`` for every other adapter adapting it."""
        passes: list[SegmentPass | BatchedPass | KernelPass] = []
        if self.native:
            short = [slot for slot, slot_rows in rows.items()
                     if len(slot_rows) <= BATCH_ROWS and kind in self._layouts[slot]]
            if short:
                passes.append(self._kernel_pass(kind, short, rows, indices))
                rows = {slot: slot_rows for slot, slot_rows in rows.items() if slot not in short}
        by_layout: dict[Layout, list[int]] = {}
        for slot in sorted(rows):
            layout = self._layouts[slot].get(kind)
            if layout is not None:
                by_layout.setdefault(layout, []).append(slot)
        alone: set[int] = set()
        for layout, slots in by_layout.items():
            for run in _runs(slots):
                m = max(len(rows[s]) for s in run)
                real = sum(len(rows[s]) for s in run)
                padding = (run[-1] + 1 - run[0]) * m - real
                if len(run) > 1 and (m <= BATCH_ROWS or padding * 8 <= real):
                    passes.append(self._batched(kind, layout, run, m, rows, indices))
                else:
                    alone.update(run)
        if alone:
            flat: list[int] = []
            segments = []
            for slot, slot_rows in rows.items():
                if slot in alone:
                    segments.append((slice(len(flat), len(flat) + len(slot_rows)), slot, self._layouts[slot][kind]))
                    flat.extend(slot_rows)
            in_place = flat == list(range(flat[0], flat[0] + len(flat)))
            passes.append(SegmentPass(slice(flat[0], flat[0] + len(flat)) if in_place else
                                      self._tensor(flat, indices), len(flat), tuple(segments)))
        return passes

    def _kernel_pass(self, kind: str, slots: list[int], rows: dict[int, list[int]], indices: dict) -> KernelPass:
        flat: list[int] = []
        segs = []
        for slot in slots:
            rank, blocks = self._layouts[slot][kind]
            assert all(first == i * rank for i, (_, first) in enumerate(blocks))  # packed in module order
            segs.append([len(flat), len(flat) + len(rows[slot]), slot, rank, sum(1 << j for j, _ in blocks)])
            flat.extend(rows[slot])
        return KernelPass(self._tensor(flat, indices),
                          torch.tensor(segs, dtype=torch.int32, device=self.device))

    def _batched(self, kind: str, layout: Layout, run: list[int], m: int, rows: dict[int, list[int]],
                 indices: dict) -> BatchedPass:
        pad = rows[run[0]][0]
        flat: list[int] = []
        keep: list[int] = []
        for slot in range(run[0], run[-1] + 1):
            slot_rows = rows[slot] if slot in run else []
            flat.extend(slot_rows + [pad] * (m - len(slot_rows)))
            keep.extend([1] * len(slot_rows) + [0] * (m - len(slot_rows)))
        if all(keep):
            mask = None
            in_place = flat == list(range(flat[0], flat[0] + len(flat)))
        else:
            mask = torch.tensor(keep, dtype=self.dtype, device=self.device).view(run[-1] + 1 - run[0], m, 1)
            in_place = False
        return BatchedPass(run[0], run[-1] + 1, m, layout,
                           slice(flat[0], flat[0] + len(flat)) if in_place else self._tensor(flat, indices), mask,
                           len(layout[1]) == len(FUSED[kind]))

    def _tensor(self, flat: list[int], indices: dict) -> torch.Tensor:
        key = tuple(flat)
        if key not in indices:
            indices[key] = torch.tensor(flat, device=self.device)
        return indices[key]

    def _resident(self, name: str, step: dict) -> int:
        """The slot holding ``name``, filling the least recently used slot no adapter of ``step`` holds."""
        if name in self._owner:
            slot = self._owner.index(name)
        else:
            slot = next(s for s in self._slot_lru if self._owner[s] not in step)
            self._fill(slot, self._adapter(name))
        self._slot_lru.move_to_end(slot)
        return slot

    def _fill(self, slot: int, adapter: LoraAdapter) -> None:
        r = adapter.rank
        layouts = {kind: (r, tuple((FUSED[kind].index(m), first) for m, first in adapter.blocks(kind)))
                   for kind in FUSED if adapter.blocks(kind)}
        for layer, projections in enumerate(self._layers):
            for kind, proj in projections.items():
                proj.at[slot].zero_()
                for bt in proj.bt:
                    bt[slot].zero_()
                for j, first in layouts.get(kind, (r, ()))[1]:
                    w = adapter.weights.get((layer, FUSED[kind][j]))
                    if w is not None:  # (None: the adapter adapts this module in other layers only)
                        proj.at[slot, :, first : first + r].copy_(w[0].T)
                        proj.bt[j][slot, :r].copy_(w[1])
        self._owner[slot] = adapter.name
        self._layouts[slot] = layouts
        self.slot_fills += 1

    # -- host memory ------------------------------------------------------------------------
    def _adapter(self, name: str) -> LoraAdapter:
        """The host copy of ``name``, read again from its directory when it was evicted."""
        adapter = self._host.get(name)
        if adapter is None:
            adapter = self._read(name, self._paths[name])
            self._keep(adapter)
        self._host.move_to_end(name)
        return adapter

    def _read(self, name: str, path: str) -> LoraAdapter:
        self.reads += 1
        return read_adapter(name, path, self.config, self.max_lora_rank, self.dtype)

    def _keep(self, adapter: LoraAdapter) -> None:
        self._host[adapter.name] = adapter
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
