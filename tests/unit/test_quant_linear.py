"""Weights kept quantized (--quantization auto): every GGUF type decodes to what ``gguf.quants.dequantize`` gives, the
native kernel (vectorised and portable, every row count it treats apart) multiplies by exactly those weights, fused
parts of different types share one matrix, and SmolLM2 served quantized answers as the dequantized float32 model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from engine_worker import cpu_kernels
from engine_worker.gguf_quant import DECODED, quant_parts
from engine_worker.loader import load_model, quantized_source
from engine_worker.models.quant_linear import QuantWeight
from zserve.catalog import resolve

CPU = torch.device("cpu")
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # gguf-py quantizes these; the K types are read only


def raw_blocks(kind: T, rows: int, k: int, seed: int) -> np.ndarray:
    """A tensor of ``kind`` in GGUF's bytes: quantized from random weights where gguf-py can, else random blocks
    whose float16 scales are finite (any bits are valid codes)."""
    rng = np.random.default_rng(seed)
    if kind in QUANTIZABLE:
        return quantize((rng.standard_normal((rows, k)) * 0.05).astype(np.float32), kind)
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows * k // block, size), dtype=np.uint8)
    halves = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[kind]
    for at in halves:  # d (and dmin) of each block: small finite float16s
        raw[:, at:at + 2] = (rng.standard_normal(len(raw)) * 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(DECODED, key=int), ids=lambda k: T(k).name)
def test_each_type_decodes_to_what_gguf_dequantizes(kind):
    raw = raw_blocks(kind, 48, 512, seed=int(kind))
    parts = quant_parts(raw, kind, (48, 512))
    expected = torch.from_numpy(np.asarray(dequantize(raw, kind), dtype=np.float32)).view(48, 512)
    assert torch.equal(parts.dequantize(), expected)
    assert parts.bits == (4 if T(kind).name.startswith("Q4") else 8)


@pytest.mark.parametrize("kind", [T.Q4_1, T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda k: k.name)
def test_the_kernel_multiplies_by_the_dequantized_weights_and_a_row_gets_the_same_numbers_in_any_batch(kind):
    """The float32 products to rounding, on every path (codes formed in registers up to 8 rows, once per tile pair
    past it, portable); and one sum order on all of them, so a row's outputs are bit for bit the same alone, among
    8 or 300 rows, on either vectorised path and on the portable one: a decode step does not change a sequence's
    numbers by the company it keeps, nor a prompt computed again (a migrated stream) by being one chunk."""
    if not cpu_kernels.available():
        pytest.skip("the native CPU kernels did not build here (no compiler)")
    n, k = 70, 512  # 70 rows: a last tile of 6, and of the last pair of tiles, a lone one
    parts = quant_parts(raw_blocks(kind, n, k, seed=1), kind, (n, k))
    weight = QuantWeight([parts], CPU)
    assert torch.equal(weight.dequantize(), parts.dequantize())
    dense = parts.dequantize().double()
    x = torch.randn(300, k + 8, generator=torch.Generator().manual_seed(0))[:, :k]  # a row stride other than K
    alone = torch.cat([weight.matmul(x[i:i + 1]) for i in range(len(x))])
    ref = x.double() @ dense.T
    assert (alone.double() - ref).abs().max() <= 1e-5 * ref.abs().max(), kind.name
    try:
        for few in (8, 0):  # registers up to 8 rows (the default), or never
            cpu_kernels.set_qgemm_few_rows(few)
            for m in (1, 3, 7, 8, 9, 15, 300):  # every block of the two paths and their rests
                y = weight.matmul(x[:m].contiguous() if m % 2 else x[:m])
                assert y.shape == (m, n) and y.dtype == torch.float32
                assert torch.equal(y, alone[:m]), (kind.name, few, m)
        cpu_kernels.set_portable_only(True)
        assert torch.equal(weight.matmul(x[:9]), alone[:9]), kind.name
    finally:
        cpu_kernels.set_portable_only(False)
        cpu_kernels.set_qgemm_few_rows(8)


@pytest.mark.parametrize("kind", [T.Q4_1, T.Q6_K, T.Q8_0], ids=lambda k: k.name)
def test_bf16_inputs_multiply_by_the_dequantized_weights_with_the_same_numbers_in_any_batch(kind):
    """bf16 activations: the codes as bf16 (exact) summed by vdpbf16ps where the CPU has it (else in float32 and back),
    the scales and mins in float32, so the weights are not rounded: only bf16's rounding of the result (and of the
    sums' terms) is left; and one order of sums on both paths."""
    if not cpu_kernels.available():
        pytest.skip("the native CPU kernels did not build here (no compiler)")
    n, k = 70, 512
    parts = quant_parts(raw_blocks(kind, n, k, seed=4), kind, (n, k))
    weight = QuantWeight([parts], CPU)
    x = torch.randn(300, k + 8, generator=torch.Generator().manual_seed(1))[:, :k].bfloat16()
    alone = torch.cat([weight.matmul(x[i:i + 1]) for i in range(len(x))])
    assert alone.dtype == torch.bfloat16
    ref = x.double() @ parts.dequantize().double().T
    assert (alone.double() - ref).abs().max() <= 8e-3 * ref.abs().max(), kind.name
    f32 = weight.matmul(x.float())  # the float32 kernel's, on the same inputs: within a bf16 step of it, everywhere
    assert ((alone.float() - f32).abs() <= f32.abs() * 2**-8 + 1e-5 * f32.abs().max()).all(), kind.name
    try:
        for few in (8, 0):
            cpu_kernels.set_qgemm_few_rows(few)
            for m in (1, 2, 5, 8, 9, 300):
                assert torch.equal(weight.matmul(x[:m]), alone[:m]), (kind.name, few, m)
    finally:
        cpu_kernels.set_qgemm_few_rows(8)


def test_parts_of_different_types_share_one_matrix_and_bf16_inputs_come_back_bf16():
    q = quant_parts(raw_blocks(T.Q4_K, 32, 256, seed=2), T.Q4_K, (32, 256))
    v = quant_parts(raw_blocks(T.Q6_K, 16, 256, seed=3), T.Q6_K, (16, 256))
    fused = QuantWeight([q, v], CPU)
    assert (fused.bits, fused.group, fused.kinds) == (8, 16, ["Q4_K", "Q6_K"])
    dense = torch.cat([q.dequantize(), v.dequantize()])
    assert torch.equal(fused.dequantize(), dense)
    rows = torch.tensor([0, 17, 47, 31])
    assert torch.equal(fused.dequantize(rows=rows), dense[rows])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = fused.matmul(x)
    assert y.dtype == torch.bfloat16
    ref = x.double() @ dense.double().T
    assert (y.double() - ref).abs().max() <= 8e-3 * ref.abs().max()


def test_float16_and_column_strided_inputs_go_through_float32_and_come_back_in_their_dtype():
    parts = quant_parts(raw_blocks(T.Q8_0, 24, 64, seed=4), T.Q8_0, (24, 64))
    w = QuantWeight([parts], CPU)
    base = torch.randn(64, 5, generator=torch.Generator().manual_seed(6))
    strided = base.t()  # [5, 64] with a column stride of 5
    expected = w.matmul(strided.contiguous())
    assert torch.equal(w.matmul(strided), expected)
    half = w.matmul(strided.half())
    assert half.dtype == torch.float16
    assert torch.equal(half, w.matmul(strided.half().float()).half())


def test_a_gguf_files_weights_are_kept_quantized_with_auto_only():
    source = resolve("SmolLM2-135M-Instruct")
    assert quantized_source(source, "auto") and not quantized_source(source, "none")
    assert not quantized_source(resolve("tiny-random"), "auto")


@pytest.mark.slow
def test_smollm2_kept_quantized_gives_the_float32_models_logits():
    source = resolve("SmolLM2-135M-Instruct")
    quant = load_model(source, torch.float32, CPU, quantization="auto").model
    dense = load_model(source, torch.float32, CPU, quantization="none").model
    assert quant.quantized_kinds() == ["Q4_1", "Q8_0"]
    assert quant.embed_weight.numel() == 0 and quant.lm_head.quant is quant.embed_quant  # tied, one copy
    ids = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365])
    assert torch.equal(quant.embed(ids), dense.embed(ids))
    for layer_q, layer_d in zip(quant.layers[:2], dense.layers[:2]):
        for lq, ld in ((layer_q.self_attn.qkv_proj, layer_d.self_attn.qkv_proj),
                       (layer_q.mlp.down_proj, layer_d.mlp.down_proj)):
            assert torch.equal(lq.quant.dequantize(), ld.weight)  # the Q/K rows un-permuted as the dense ones
    hidden = torch.randn(4, quant.config.hidden_size)
    assert torch.allclose(quant.compute_logits(hidden), dense.compute_logits(hidden), rtol=1e-4, atol=1e-4)
