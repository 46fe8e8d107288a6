"""Mixtral-style mixture of experts: a router picks the top-k of E SwiGLU experts per token.

Routing follows Mixtral (and transformers): softmax of the router logits in fp32, top-k,
renormalised to sum to 1; each expert's output is scaled by its weight and summed.

Written for expert parallelism: a ``SparseMoE`` holds only the experts in ``expert_ids`` (all of
them by default) and returns the *partial* sum over those. Splitting experts across processes
is then: give each rank a disjoint ``expert_ids``, compute routing identically everywhere (the
router is replicated), and all-reduce the partial sums (``combine``) — nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.models.layers import Linear


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


class SparseMoE(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, device: torch.device, expert_ids: Sequence[int] | None = None,
                 combine: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.expert_ids = list(range(cfg.num_experts)) if expert_ids is None else list(expert_ids)
        self.gate = Linear(cfg.num_experts, cfg.hidden_size, dtype, device)  # the router, replicated
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.intermediate_size, dtype, device)
                                     for _ in self.expert_ids)
        self.combine = combine  # e.g. an all-reduce over the expert-parallel group

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [N, k] fp32, expert ids [N, k])`` for each token."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        w, idx = probs.topk(self.top_k, dim=-1)
        return w / w.sum(dim=-1, keepdim=True), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.route(x)
        out = torch.zeros_like(x)
        hit = torch.bincount(idx.flatten(), minlength=self.num_experts).tolist()
        for local, e in enumerate(self.expert_ids):
            if not hit[e]:
                continue
            rows, slot = (idx == e).nonzero(as_tuple=True)
            y = self.experts[local](x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return self.combine(out) if self.combine is not None else out

    def linears(self) -> tuple[Linear, ...]:
        return (self.gate, *(lin for ex in self.experts for lin in (ex.gate_up_proj, ex.down_proj)))

    def targets(self, prefix: str) -> dict[str, tuple[torch.Tensor, int]]:
        """HF (Mixtral) tensor names of this block's weights -> (destination, first row)."""
        t: dict[str, tuple[torch.Tensor, int]] = {prefix + "gate.weight": (self.gate.weight, 0)}
        for local, e in enumerate(self.expert_ids):
            ex = self.experts[local]
            p = f"{prefix}experts.{e}."
            t[p + "w1.weight"] = (ex.gate_up_proj.weight, 0)
            t[p + "w3.weight"] = (ex.gate_up_proj.weight, ex.inter)
            t[p + "w2.weight"] = (ex.down_proj.weight, 0)
        return t
