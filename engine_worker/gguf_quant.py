"""GGUF's quantized blocks as integer codes with a scale and a minimum per group: what the engine keeps instead of
dequantized weights (``--quantization auto``).

Every type here stores a weight as ``scale * q + min`` with a small integer ``q`` and one ``scale`` (and ``min``)
per group of ``G`` consecutive inputs, once the block's own sub-scales are folded in:

============  =====  ====  ===========================  =========================
type          bits   G     scale                        min
============  =====  ====  ===========================  =========================
Q4_0          4      32    d                            -8 d
Q4_1          4      32    d                            m
Q4_K          4      32    d * sc[i]  (6-bit sc)        -dmin * mn[i]
Q5_0          8      32    d  (q - 16)                  0
Q5_1          8      32    d                            m
Q5_K          8      32    d * sc[i]                    -dmin * mn[i]
Q6_K          8      16    d * sc[i]  (int8 sc, q - 32) 0
Q8_0          8      32    d                            0
============  =====  ====  ===========================  =========================

so ``scale * q + min`` is, to the last float32 bit or one rounding of a fused multiply-add, what
``gguf.quants.dequantize`` returns (tests/unit/test_quant_linear.py checks each type against it). 4-bit codes are
kept at 4 bits; 5- and 6-bit codes in a byte. Other types (Q2_K, Q3_K, the IQ and ternary families) are not
decoded here: their tensors are dequantized at load as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

QK_K = 256


@dataclass
class QuantParts:
    """One weight matrix ``[rows, K]`` as codes and per-group scales: ``W = scale * q + min`` by group of ``G``."""

    q: torch.Tensor  # [rows, K] int8 (0..15 for 4-bit types; -128..127 otherwise)
    scale: torch.Tensor  # [rows, K // G] float32
    min: torch.Tensor | None  # [rows, K // G] float32, or None where every min is 0
    group: int
    bits: int  # 4: codes fit in 4 bits; 8: in a signed byte
    kind: str  # the GGUF type's name

    def rows(self, perm) -> QuantParts:
        """The same parts with the rows reordered by ``perm(tensor)`` (e.g. undoing llama.cpp's Q/K permutation)."""
        return QuantParts(perm(self.q), perm(self.scale), None if self.min is None else perm(self.min), self.group,
                          self.bits, self.kind)

    def dequantize(self) -> torch.Tensor:
        g = self.q.shape[1] // self.group
        w = self.q.float().view(-1, g, self.group) * self.scale[..., None]
        if self.min is not None:
            w += self.min[..., None]
        return w.view(self.q.shape)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Low nibbles of each ``width``-byte run, then its high nibbles (GGUF's order within a block)."""
    qs = qs.reshape(*qs.shape[:-1], -1, width)
    return np.stack([qs & 15, qs >> 4], axis=-2).reshape(*qs.shape[:-2], -1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and minimums: 8 of each per super-block."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _decode(kind: int, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int]:
    """(q [blocks, block], scale [blocks, groups], min or None, G, bits) of ``b`` [blocks, bytes per block]."""
    if kind == T.Q8_0:
        return b[:, 2:].view(np.int8), _f16(b[:, :2]), None, 32, 8
    if kind == T.Q4_0:
        d = _f16(b[:, :2])
        return _nibbles(b[:, 2:], 16), d, -8 * d, 32, 4
    if kind == T.Q4_1:
        return _nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4]), 32, 4
    if kind in (T.Q5_0, T.Q5_1):
        head = 2 if kind == T.Q5_0 else 4
        qh = np.ascontiguousarray(b[:, head:head + 4]).view(np.uint32)
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = (_nibbles(b[:, head + 4:], 16) | (high << 4)).astype(np.int16)
        if kind == T.Q5_0:
            return q - 16, _f16(b[:, :2]), None, 32, 8
        return q, _f16(b[:, :2]), _f16(b[:, 2:4]), 32, 8
    if kind in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        if kind == T.Q4_K:
            q = _nibbles(b[:, 16:], 32)
            bits = 4
        else:
            qh, qs = b[:, 16:48], b[:, 48:]
            high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(len(b), -1)
            q = (_nibbles(qs, 32) | (high << 4)).astype(np.int16)
            bits = 8
        return q, d * sc, -(dmin * mn), 32, bits
    if kind == T.Q6_K:
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b[:, 208:210])
        # Per 128 outputs: 64 bytes of low nibbles and 32 bytes of 2-bit highs.
        ql = ql.reshape(len(b), 2, 64)
        qh = qh.reshape(len(b), 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
        low = np.stack([ql & 15, ql >> 4], axis=2).reshape(len(b), 2, 4, 32)
        q = (low | ((qh & 3) << 4)).reshape(len(b), QK_K).astype(np.int16) - 32
        return q, d * sc.astype(np.float32), None, 16, 8
    raise KeyError(kind)


DECODED = {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K}
"""The GGUF types ``quant_parts`` decodes; a tensor of another type is dequantized at load."""


def quant_parts(data: np.ndarray, kind: int, shape: tuple[int, int]) -> QuantParts:
    """The parts of one GGUF tensor (``data``: its raw bytes as ``GGUFReader`` maps them, ``shape``: ``[rows, K]``
    in torch's order)."""
    rows, k = shape
    per_block = QK_K if kind in (T.Q4_K, T.Q5_K, T.Q6_K) else 32
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(rows * (k // per_block), -1)
    q, scale, mn, group, bits = _decode(kind, blocks)
    q = torch.from_numpy(np.ascontiguousarray(q).astype(np.int8)).view(rows, k)
    scale = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)).reshape(rows, k // group)
    mn = None if mn is None else torch.from_numpy(np.ascontiguousarray(mn, dtype=np.float32)).reshape(rows, k // group)
    return QuantParts(q, scale, mn, group, bits, T(kind).name)
