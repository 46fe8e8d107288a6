"""A decode step's decoder layers in one native call (``cpu_kernels/decode_layers.cpp``).

At batch 1 a quantized SmolLM2 decode step is 30 layers of nine native kernels, each reached through a module call,
views and slices of torch tensors, an argument check and a ctypes conversion: about a quarter of the step
(``tests/bench/bench_engine.py --profile``). When every layer can take the native path (the CPU's native kernels,
dense MLPs, the four linears of each layer kept quantized, no biases, no LoRA adapter in the step, a step of decode
rows only, the native attention backend), the layers run in one call instead: the same kernels on the same buffers
in the same order, so the numbers are the layer-by-layer path's bit for bit (``tests/unit/test_native_decode.py``).
Anything else goes the layer-by-layer way (``run`` returns None).

The table of the layers' addresses is made again for every step: the engine moves its weights and its cache when it
sleeps or takes new weights (``engine_worker.residency``), and a table made once would point at memory they left.
"""

from __future__ import annotations

from array import array

import torch

from engine_worker import cpu_kernels
from engine_worker.attention.layout import StepLayout


def _linear_fields(lin) -> tuple[int, ...] | None:
    q = lin.quant
    if q is None or q.int4_packed is not None or lin.bias is not None or not q.codes.is_cpu:
        return None
    return (q.codes.data_ptr(), q.scales.data_ptr(), 0 if q.mins is None else q.mins.data_ptr(),
            int(q.scales.dtype == torch.float16), q.n, q.k, q.group, q.bits)


def run(model, x: torch.Tensor, layout: StepLayout, attn) -> torch.Tensor | None:
    """The decoder layers' output for decode-only step ``layout`` (what ``LlamaForCausalLM.forward`` returns, which
    calls this with its native kernels on), or None when this step cannot go this way (``x`` then untouched)."""
    n = x.shape[0]
    cache = getattr(attn, "cache", None)
    if (x.dtype not in cpu_kernels.DTYPES or not cpu_kernels.available() or layout.prefills or layout.num_decode != n
            or layout.decode_tables is None or cache is None or cache.dtype != x.dtype
            or not x.is_contiguous() or not attn.native_kernels):
        return None
    # What the kernels' Python wrappers check call by call, checked once for the step (the weights and the cache are
    # laid out so at load: contiguous, in the model's dtype, which each layer's first norm weight stands for here).
    tables, lens, positions, slots = layout.decode_tables, layout.decode_lens, layout.positions, layout.slot_mapping
    if (tables.dtype != torch.int32 or lens.dtype != torch.int32 or positions.dtype != torch.int64
            or slots.dtype != torch.int64 or not (tables.is_contiguous() and lens.is_contiguous()
                                                  and positions.is_contiguous() and slots.is_contiguous())
            or model.layers[0].input_layernorm.weight.dtype != x.dtype):
        return None
    cfg = model.config
    fields: list[int] = []
    for i, layer in enumerate(model.layers):
        a, m = layer.self_attn, layer.mlp
        gate_up = getattr(m, "gate_up_proj", None)  # a dense MLP's (a mixture of experts has none)
        if gate_up is None:
            return None
        fields += (layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                   cache.layer_views[i][0].data_ptr())
        for lin in (a.qkv_proj, a.o_proj, gate_up, m.down_proj):
            f = _linear_fields(lin)
            if f is None:
                return None
            fields += f
    table = array("q", fields)
    cos, sin = model.rope.float_tables()
    kv0 = cache.layer_views[0][0]
    out = torch.empty_like(x)
    rc = cpu_kernels.decode_layers(
        x.dtype, x.data_ptr(), out.data_ptr(), n, table.buffer_info()[0], len(model.layers), cfg.hidden_size,
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, model.layers[0].input_layernorm.eps,
        positions.data_ptr(), slots.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        kv0.shape[2] * cfg.head_dim, tables.data_ptr(), tables.shape[1], lens.data_ptr(), cache.block_size,
        cfg.head_dim ** -0.5, attn.window or 0)
    if rc == -2:  # no bf16 matmul kernel on this CPU: found at the first layer's first matmul, nothing changed yet
        return None
    if rc != 0:
        raise ValueError(f"decode_layers kernel rejected its arguments (code {rc})")
    return out + x

