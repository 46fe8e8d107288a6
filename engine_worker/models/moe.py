"""Mixtral-style mixture of experts: a router picks the top-k of E SwiGLU experts per token.

Routing follows Mixtral (and transformers): softmax of the router logits in fp32, top-k,
renormalised to sum to 1; each expert's output is scaled by its weight and summed.

Written for expert parallelism (``engine_worker.expert_parallel``): a ``SparseMoE`` holds only the
experts in ``expert_ids`` (all of them by default) and computes the *partial* sum over those. With a
``group`` set, every member's tokens are gathered first (``group.dispatch``), routed identically
everywhere (the router is replicated), and the partial sums added up across the group, each member
keeping its own tokens' rows (``group.combine``). ``staged_experts`` and ``use_experts`` change which
experts a layer holds when the group is resized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.models.layers import Linear, StepAdapters, copy_checkpoint


class Expert(nn.Module):
    """One SwiGLU expert, gate and up fused (rows: gate | up)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.inter = inter
        self.gate_up_proj = Linear(2 * inter, hidden, dtype, device)
        self.down_proj = Linear(hidden, inter, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        return self.down_proj(F.silu(gu[:, : self.inter]) * gu[:, self.inter :])

    def targets(self, prefix: str) -> dict[str, tuple[torch.Tensor, int]]:
        """HF (Mixtral) names of this expert's weights under ``prefix`` -> (destination, first row)."""
        return {prefix + "w1.weight": (self.gate_up_proj.weight, 0),
                prefix + "w3.weight": (self.gate_up_proj.weight, self.inter),
                prefix + "w2.weight": (self.down_proj.weight, 0)}


class SparseMoE(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, device: torch.device, expert_ids: Sequence[int] | None = None):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.dtype, self.device = dtype, device
        self.expert_ids = list(range(cfg.num_experts)) if expert_ids is None else list(expert_ids)
        self.gate = Linear(cfg.num_experts, cfg.hidden_size, dtype, device)  # the router, replicated
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.intermediate_size, dtype, device)
                                     for _ in self.expert_ids)
        self.group = None  # an ExpertGroup when the experts are split across engines

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [N, k] fp32, expert ids [N, k])`` for each token."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        w, idx = probs.topk(self.top_k, dim=-1)
        return w / w.sum(dim=-1, keepdim=True), idx

    def forward(self, x: torch.Tensor, lora: StepAdapters | None = None) -> torch.Tensor:
        """``lora``: the step's adapters, ignored: experts take none (``engine_worker.lora`` refuses MLP adapters
        on a mixture of experts)."""
        group = self.group
        if group is not None:
            x = group.dispatch(x)
        out = torch.zeros_like(x)
        if x.shape[0]:
            weights, idx = self.route(x)
            hit = torch.bincount(idx.flatten(), minlength=self.num_experts).tolist()
            for local, e in enumerate(self.expert_ids):
                if not hit[e]:
                    continue
                rows, slot = (idx == e).nonzero(as_tuple=True)
                y = self.experts[local](x[rows]) * weights[rows, slot, None]
                out.index_add_(0, rows, y.to(out.dtype))
        return group.combine(out) if group is not None else out

    def linears(self) -> tuple[Linear, ...]:
        return (self.gate, *(lin for ex in self.experts for lin in (ex.gate_up_proj, ex.down_proj)))

    def targets(self, prefix: str) -> dict[str, tuple[torch.Tensor, int]]:
        """HF (Mixtral) tensor names of this block's weights -> (destination, first row)."""
        t: dict[str, tuple[torch.Tensor, int]] = {prefix + "gate.weight": (self.gate.weight, 0)}
        for local, e in enumerate(self.expert_ids):
            t.update(self.experts[local].targets(f"{prefix}experts.{e}."))
        return t

    def staged_experts(self, expert_ids: Sequence[int], prefix: str,
                       read: Callable[[list[str]], dict[str, torch.Tensor]], pack: bool) -> nn.ModuleList:
        """The experts this layer would hold as ``expert_ids``: the ones already here, the others loaded
        (``read`` returns checkpoint tensors by HF name) and packed for oneDNN when ``pack``. Nothing changes
        until ``use_experts``, so a read that fails leaves the layer as it was."""
        have = dict(zip(self.expert_ids, self.experts))
        fresh = {e: Expert(self.hidden, self.inter, self.dtype, self.device) for e in expert_ids if e not in have}
        if fresh:
            targets = {}
            for e, ex in fresh.items():
                for name, (dest, row) in ex.targets(f"{prefix}experts.{e}.").items():
                    targets[name] = (dest, row, (self.inter if name.endswith(("w1.weight", "w3.weight"))
                                                 else self.hidden, dest.shape[1]))
            copy_checkpoint(read(list(targets)).items(), targets, f"experts {sorted(fresh)} of {prefix}")
            if pack:
                for ex in fresh.values():
                    ex.gate_up_proj.pack()
                    ex.down_proj.pack()
        return nn.ModuleList(have.get(e) or fresh[e] for e in expert_ids)

    def use_experts(self, expert_ids: Sequence[int], experts: nn.ModuleList) -> None:
        """Hold ``experts`` (from ``staged_experts``) as ``expert_ids``; the ones left out are released."""
        self.expert_ids = list(expert_ids)
        self.experts = experts
