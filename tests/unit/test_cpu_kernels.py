"""The native CPU kernels against the torch code they replace, and the engine without them.

Decode attention has its own test beside the other attention paths (test_engine_paged.py); here
are the fused elementwise kernels (in their AVX-512 and portable versions) and the fallback when
the kernels cannot be built or are switched off.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine_worker import cpu_kernels
from engine_worker.models.layers import RotaryEmbedding, apply_rope

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels did not build here")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
VERSIONS = pytest.mark.parametrize("portable", [False, True], ids=["vectorised", "portable"])
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def version(portable):
    cpu_kernels.set_portable_only(portable)
    yield
    cpu_kernels.set_portable_only(False)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # bf16: one unit in the last place (2^-8 relative) for a different summation order.
    tol = 1e-5 if got.dtype == torch.float32 else 2 ** -7
    return got.dtype == want.dtype and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """What RMSNorm computes without the kernel (transformers' rounding)."""
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


@needs_kernels
@VERSIONS
@DTYPES
@pytest.mark.parametrize("hidden", [576, 40])  # a multiple of 16 (vector path) and not
def test_add_rms_norm_matches_the_unfused_ops_and_updates_the_residual(dtype, hidden, portable, version):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=g) * 3).to(dtype)
    residual = torch.randn(7, hidden, generator=g).to(dtype)
    w = (1 + torch.randn(hidden, generator=g) / 4).to(dtype)
    want_sum = x + residual
    want = torch_rms_norm(want_sum, w, 1e-5)
    got = cpu_kernels.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(residual, want_sum)  # x + residual, rounded to the dtype, in place
    assert close(got, want), (got.float() - want.float()).abs().max()
    assert close(cpu_kernels.add_rms_norm(x, None, w, 1e-5), torch_rms_norm(x, w, 1e-5))
    strided = torch.randn(7, 2 * hidden, generator=g).to(dtype)[:, :hidden]  # rows of a wider tensor
    assert close(cpu_kernels.add_rms_norm(strided, None, w, 1e-5), torch_rms_norm(strided, w, 1e-5))


@needs_kernels
@VERSIONS
@DTYPES
@pytest.mark.parametrize("inter", [1536, 24])
def test_silu_and_mul_matches_torch_over_the_whole_range(dtype, inter, portable, version):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(5, 2 * inter, generator=g) * 8).to(dtype)
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -200.0])  # saturation, no overflow
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    want = F.silu(gate) * up
    got = cpu_kernels.silu_and_mul(gate_up)
    assert close(got, want), (got.float() - want.float()).abs().max()
    assert torch.isfinite(got).all()


@needs_kernels
@DTYPES
@pytest.mark.parametrize("head_dim", [64, 16])
def test_rope_and_store_rotates_in_place_and_fills_the_cache_slots(dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, n, slots = 6, 2, 5, 40
    rope = RotaryEmbedding(head_dim, 128, 10000.0, torch.device("cpu"))
    positions = torch.tensor([0, 1, 17, 90, 127])
    slot_mapping = torch.tensor([3, 39, 0, 12, 13])
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    cache = torch.zeros(2, kv_heads, slots, head_dim, dtype=dtype)

    heads_of = qkv.clone().view(n, heads + 2 * kv_heads, head_dim)
    cos, sin = rope(positions, dtype)
    want_qk = apply_rope(heads_of[:, : heads + kv_heads].clone(), cos, sin)
    cpu_kernels.rope_and_store(qkv, positions, *rope.float_tables(), cache, slot_mapping, heads, kv_heads, head_dim)
    got = qkv.view(n, heads + 2 * kv_heads, head_dim)
    assert close(got[:, : heads + kv_heads], want_qk)
    assert torch.equal(got[:, heads + kv_heads :], heads_of[:, heads + kv_heads :])  # v untouched
    for i, s in enumerate(slot_mapping.tolist()):
        assert torch.equal(cache[0, :, s], got[i, heads : heads + kv_heads])  # rotated keys
        assert torch.equal(cache[1, :, s], got[i, heads + kv_heads :])  # values
    untouched = [s for s in range(slots) if s not in slot_mapping.tolist()]
    assert not cache[:, :, untouched].any()


def torch_lora(x, y, rows, segs, at, bt):
    """What ``LoraStep``'s torch path adds: per segment ``h = x[rows] @ at[slot]`` then ``h_j @ bt[j][slot]``."""
    cols = [sum(b.shape[2] for b in bt[:j]) for j in range(len(bt))]
    for begin, end, slot, rank, mask in segs.tolist():
        seg_rows = rows[begin:end]
        present = [j for j in range(len(bt)) if mask >> j & 1]
        h = x[seg_rows] @ at[slot, :, : rank * len(present)]
        for i, j in enumerate(present):
            out = h[:, i * rank : (i + 1) * rank] @ bt[j][slot, :rank]
            y[seg_rows, cols[j] : cols[j] + bt[j].shape[2]] += out


@needs_kernels
@VERSIONS
@DTYPES
@pytest.mark.parametrize("in_place", [True, False], ids=["rows-in-order", "indexed-rows"])
def test_lora_shrink_expand_matches_the_torch_path(dtype, in_place, portable, version):
    """Several adapters of different ranks and modules (one of a fused projection's three, two, all), 1 to 16 rows
    each (tiles and their remainders), output widths that are not a multiple of the kernel's column tiles."""
    g = torch.Generator().manual_seed(7 + in_place)
    slots, fan_in, max_rank, outs, n = 6, 72, 16, (96, 40, 40), 40
    at = (torch.randn(slots, fan_in, max_rank * 3, generator=g) / 8).to(dtype)
    bt = tuple((torch.randn(slots, max_rank, out, generator=g) / 4).to(dtype) for out in outs)
    # (slot, rank, mask, rows): masks 0b111 (q, k, v), 0b001, 0b110, 0b101; ranks 16, 8, 5, 1.
    layout = [(4, 16, 0b111, 3), (0, 8, 0b001, 16), (2, 5, 0b110, 1), (5, 1, 0b101, 9), (1, 16, 0b010, 7)]
    order = torch.arange(n) if in_place else torch.randperm(n, generator=g)
    rows, segs, begin = [], [], 0
    for slot, rank, mask, count in layout:
        rows += order[begin : begin + count].tolist()
        segs.append([begin, begin + count, slot, rank, mask])
        begin += count
    rows_t, segs_t = torch.tensor(rows, dtype=torch.int64), torch.tensor(segs, dtype=torch.int32)
    x = torch.randn(n, 2 * fan_in, generator=g).to(dtype)[:, :fan_in]  # rows of a wider tensor
    y = torch.randn(n, sum(outs), generator=g).to(dtype)
    want = y.clone()
    torch_lora(x, want, rows_t, segs_t, at, bt)
    cpu_kernels.lora_shrink_expand(x, y, rows_t, segs_t, at, bt)
    assert close(y, want), (y.float() - want.float()).abs().max()
    untouched = [i for i in range(n) if i not in rows]
    assert torch.equal(y[untouched], want[untouched])
    # Single-module projections (o, down) and a call with no segments.
    at1, bt1 = at[:, :, :max_rank].contiguous(), (bt[0],)
    y1, want1 = y[:, : outs[0]].clone(), y[:, : outs[0]].clone()
    segs1 = torch.tensor([[0, 3, 1, 16, 1], [3, 5, 3, 4, 1]], dtype=torch.int32)
    torch_lora(x, want1, rows_t, segs1, at1, bt1)
    cpu_kernels.lora_shrink_expand(x, y1, rows_t, segs1, at1, bt1)
    assert close(y1, want1), (y1.float() - want1.float()).abs().max()
    before = y1.clone()
    cpu_kernels.lora_shrink_expand(x, y1, rows_t, segs1[:0], at1, bt1)
    assert torch.equal(y1, before)


@needs_kernels
def test_lora_shrink_expand_refuses_rows_slots_and_masks_out_of_range():
    at, bt = torch.zeros(2, 8, 4), (torch.zeros(2, 4, 8),)
    x, y = torch.zeros(3, 8), torch.zeros(3, 8)
    rows = torch.tensor([0, 1, 2])
    for seg, code in [([0, 3, 2, 4, 1], -2), ([0, 3, 0, 5, 1], -2), ([0, 3, 0, 4, 2], -2), ([1, 3, 0, 4, 1], -2),
                      ([0, 4, 0, 4, 1], -2)]:
        with pytest.raises(ValueError, match=f"code {code}"):
            cpu_kernels.lora_shrink_expand(x, y, rows, torch.tensor([seg], dtype=torch.int32), at, bt)
    with pytest.raises(ValueError, match="code -3"):
        cpu_kernels.lora_shrink_expand(x, y, torch.tensor([0, 3]), torch.tensor([[0, 2, 0, 4, 1]], dtype=torch.int32),
                                       at, bt)
    with pytest.raises(ValueError, match="layout"):
        cpu_kernels.lora_shrink_expand(x.to(torch.bfloat16), y, rows, torch.tensor([[0, 3, 0, 4, 1]],
                                                                                   dtype=torch.int32), at, bt)
    assert not y.any()


@needs_kernels
def test_layouts_the_kernels_cannot_read_are_refused_not_read():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="layout"):
        cpu_kernels.add_rms_norm(x.t(), None, torch.ones(4), 1e-5)  # columns strided
    with pytest.raises(ValueError, match="layout"):
        cpu_kernels.add_rms_norm(x, None, torch.ones(32, dtype=torch.bfloat16), 1e-5)  # mixed dtypes
    with pytest.raises(ValueError, match="layout"):
        cpu_kernels.silu_and_mul(torch.randn(4, 31))


def _engine_in_a_subprocess(env: dict) -> list[str]:
    """Greedy tokens of the tiny model through the runner, and the attention backend it used."""
    code = (
        "import torch, logging\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from engine_worker.engine import Engine\n"
        "from engine_worker.loader import load_model\n"
        "from engine_worker.scheduler import run_until_done\n"
        "from engine_worker.sequence import Sequence\n"
        "from protocol.messages import SamplingParams\n"
        "from zserve.catalog import resolve\n"
        "from zserve.config import EngineConfig\n"
        "cpu = torch.device('cpu')\n"
        "e = Engine.generation(load_model(resolve('tiny-random'), torch.float32, cpu), cpu, torch.float32,\n"
        "                      EngineConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64))\n"
        "r, s = e.runner, e.scheduler\n"
        "s.add(Sequence('a', [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))\n"
        "print(r.attention_backend)\n"
        "print([t for o in run_until_done(s)['a'] for t in o.new_token_ids])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines() + [done.stderr]


@pytest.mark.skipif(not cpu_kernels.available(), reason="nothing to compare the fallback with")
def test_without_a_compiler_or_when_switched_off_the_engine_runs_on_torch_with_the_same_tokens(tmp_path):
    native_backend, native_tokens, _ = _engine_in_a_subprocess({})
    assert native_backend == "native CPU kernels"
    off_backend, off_tokens, _ = _engine_in_a_subprocess({"ZSERVE_CPU_KERNELS": "0"})
    assert off_backend == "torch (gathered keys)" and off_tokens == native_tokens
    # No compiler and no cached build (a fresh cache directory): a warning, then the torch path.
    broken_backend, broken_tokens, stderr = _engine_in_a_subprocess(
        {"CXX": str(tmp_path / "no-such-compiler"), "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert broken_backend == "torch (gathered keys)" and broken_tokens == native_tokens
    assert "no C++ compiler" in stderr


def test_the_kernel_directory_must_be_private(tmp_path):
    """Kernels are loaded as code: a directory others can write to (a planted /tmp one) is refused."""
    from zserve.paths import private_dir

    mine = private_dir(str(tmp_path / "kernels"))
    assert os.stat(mine).st_mode & 0o777 == 0o700
    assert private_dir(mine) == mine  # reused
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="not a private directory"):
        private_dir(str(shared))
