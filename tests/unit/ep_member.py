"""One member of a real expert-parallel group, for ``test_expert_parallel.py``: ``python -m tests.unit.ep_member
CKPT STORE RANK SIZE OUT``. It loads its share of a tiny Mixtral checkpoint, forms the group (gloo over
loopback), runs each MoE layer of the model on its own tokens in one group step (member r has 3 * r of them,
so member 0 has none and takes the empty step an idle engine takes), and writes its outputs to OUT as JSON."""

from __future__ import annotations

import json
import sys

import torch

from engine_worker.expert_parallel import ExpertGroup
from engine_worker.loader import load_model
from zserve.catalog import ModelSource


def tokens(rank: int, hidden: int) -> torch.Tensor:
    return torch.randn(rank * 3, hidden, generator=torch.Generator().manual_seed(rank))


def main() -> None:
    ckpt, store, rank, size, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    lm = load_model(ModelSource("moe", "hf", ckpt, ckpt), torch.float32, torch.device("cpu"),
                    expert_share=(rank, size))
    model = lm.model
    group = ExpertGroup.form(store, rank, size, 1, torch.device("cpu"), join_timeout=60)
    model.set_expert_group(group)
    x = tokens(rank, lm.config.hidden_size)
    with torch.inference_mode():
        if x.shape[0]:  # one group step: each MoE layer on this member's tokens
            total = group.begin_step(x.shape[0])
            outs = [layer.mlp(x).tolist() for layer in model.layers]
        else:  # no tokens of its own: the empty step an idle engine takes
            total = group.idle_step(model)
            outs = []
    with open(out, "w") as f:
        json.dump({"experts": model.expert_ids, "total": total, "counts": group.counts, "out": outs}, f)
    group.close()


if __name__ == "__main__":
    main()
