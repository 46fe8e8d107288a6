"""Expert parallelism below the engine loop: how experts are shared out, loading only a member's share,
re-sharding in place, and a real group of processes whose MoE layers equal one process holding every expert."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_worker.expert_parallel import ExpertGroup, expert_shard
from engine_worker.loader import hf_tensor_reader, load_model

from .ep_member import tokens
from .hf_checkpoints import CONFIGS, EXPERTS, source, write_checkpoint

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ep") / "mixtral", "mixtral")


@pytest.mark.parametrize("experts", [1, 4, 7, 8, 64])
def test_shards_cover_every_expert_once_in_contiguous_near_equal_blocks(experts):
    for size in range(1, experts + 1):
        shards = [expert_shard(experts, size, r) for r in range(size)]
        assert [e for s in shards for e in s] == list(range(experts))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_a_group_larger_than_the_experts_is_refused():
    with pytest.raises(ValueError, match="at least one expert"):
        expert_shard(4, 5, 0)


def experts_of(model) -> dict[str, torch.Tensor]:
    """Every expert weight a model holds, by HF name (gate rows and up rows apart)."""
    out = {}
    for i, layer in enumerate(model.layers):
        for name, (dest, row) in layer.mlp.targets(f"model.layers.{i}.block_sparse_moe.").items():
            if ".experts." in name:
                out[name] = dest[row: row + layer.mlp.inter if name.endswith(("w1.weight", "w3.weight"))
                                 else None].clone()
    return out


def test_a_member_loads_only_its_experts(mixtral):
    full = experts_of(load_model(source(mixtral), torch.float32, CPU).model)
    lm = load_model(source(mixtral), torch.float32, CPU, expert_share=(1, 2))
    assert lm.model.expert_ids == [2, 3] and all(len(layer.mlp.experts) == 2 for layer in lm.model.layers)
    mine = experts_of(lm.model)
    assert set(mine) == {n for n in full if ".experts.2." in n or ".experts.3." in n}
    assert all(torch.equal(w, full[n]) for n, w in mine.items())


def test_a_dense_model_cannot_be_split(tmp_path):
    with pytest.raises(ValueError, match="no experts"):
        load_model(source(write_checkpoint(tmp_path / "llama", "llama")), torch.float32, CPU, expert_share=(0, 2))


@pytest.mark.parametrize("pack", [False, True])
def test_resharding_keeps_loads_and_releases_experts_as_a_fresh_load_would(mixtral, pack):
    lm = load_model(source(mixtral), torch.float32, CPU, expert_share=(0, 2))  # experts 0, 1
    kept = lm.model.layers[0].mlp.experts[1]
    if pack:
        assert lm.model.pack_for_cpu()
    lm.model.reshard(expert_shard(EXPERTS, 3, 0), hf_tensor_reader(source(mixtral)))  # → experts 0, 1
    assert lm.model.layers[0].mlp.experts[1] is kept  # nothing reloaded
    lm.model.reshard(expert_shard(EXPERTS, 4, 3), hf_tensor_reader(source(mixtral)))  # → expert 3 only
    fresh = load_model(source(mixtral), torch.float32, CPU, expert_share=(3, 4)).model
    assert lm.model.expert_ids == fresh.expert_ids == [3]
    x = torch.randn(5, CONFIGS["mixtral"]["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for ours, want in zip(lm.model.layers, fresh.layers):
            torch.testing.assert_close(ours.mlp(x), want.mlp(x))


def test_a_reshard_whose_read_fails_leaves_the_model_as_it_was(mixtral):
    lm = load_model(source(mixtral), torch.float32, CPU, expert_share=(0, 2))
    read = hf_tensor_reader(source(mixtral))
    calls = []

    def flaky(names):
        calls.append(names)
        if len(calls) == 2:  # the second layer's experts
            raise OSError("the checkpoint went away")
        return read(names)

    before = [list(layer.mlp.experts) for layer in lm.model.layers]
    with pytest.raises(OSError):
        lm.model.reshard(expert_shard(EXPERTS, 2, 1), flaky)
    assert lm.model.expert_ids == [0, 1] and [list(layer.mlp.experts) for layer in lm.model.layers] == before
    assert all(layer.mlp.expert_ids == [0, 1] for layer in lm.model.layers)


def test_a_group_of_one_changes_nothing(mixtral):
    lm = load_model(source(mixtral), torch.float32, CPU)
    x = torch.randn(4, CONFIGS["mixtral"]["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = [layer.mlp(x) for layer in lm.model.layers]
        group = ExpertGroup.form("/nonexistent", 0, 1, 1, CPU)
        lm.model.set_expert_group(group)
        assert group.begin_step(4) == 4 and group.idle_step(lm.model) == 0
        assert all(torch.equal(layer.mlp(x), w) for layer, w in zip(lm.model.layers, want))


@pytest.mark.parametrize("size", [2, 3])
def test_a_group_of_processes_computes_the_moe_layers_of_one_process(mixtral, tmp_path, size):
    """Real processes over gloo: member r has 3r tokens (member 0 none: its empty step); every member's output
    rows equal the full MoE layer on every member's tokens together."""
    procs = [subprocess.Popen([sys.executable, "-m", "tests.unit.ep_member", str(mixtral), str(tmp_path / "store"),
                               str(r), str(size), str(tmp_path / f"out-{r}.json")], cwd=ROOT)
             for r in range(size)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    outs = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(size)]
    assert [e for o in outs for e in o["experts"]] == list(range(EXPERTS))
    assert all(o["counts"] == [3 * r for r in range(size)] and o["total"] == 3 * sum(range(size)) for o in outs)
    full = load_model(source(mixtral), torch.float32, CPU).model
    hidden = CONFIGS["mixtral"]["hidden_size"]
    x = torch.cat([tokens(r, hidden) for r in range(size)])
    with torch.inference_mode():
        want = [layer.mlp(x) for layer in full.layers]
    assert outs[0]["out"] == []
    at = 0
    for r in range(1, size):
        for layer, got in enumerate(outs[r]["out"]):
            torch.testing.assert_close(torch.tensor(got), want[layer][at: at + 3 * r], rtol=1e-5, atol=1e-5)
        at += 3 * r
