"""Native CPU kernels for the decode step, built on first use and called through ctypes.

torch has no CPU kernel that reads a paged KV cache in place, so decode attention in plain torch
gathers every row's keys and values into a contiguous copy each step and layer, then runs two
batched matmuls and a softmax over it: three passes over the whole context. ``kernels.cpp`` does
it in one pass, reading the blocks through the block table with an online softmax.

``qgemm.cpp`` multiplies by weights kept quantized as GGUF stores them (``engine_worker.models.quant_linear``).
``decode_layers.cpp`` runs a decode step's decoder layers through these kernels in one call
(``engine_worker.models.native_decode``).

Build: ``g++ -O3 -march=native -fopenmp -shared`` (a few seconds, no torch headers), cached under
the user's cache directory keyed by the source, the compiler and the CPU's flags, and renamed
into place atomically so engines starting together never see half a library. With no compiler,
a failed build, or ``ZSERVE_CPU_KERNELS=0``, ``available()`` is False and the engine keeps its
torch path (same results, slower); the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from zserve.paths import private_dir, user_cache_dir

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(f) for f in ("kernels.cpp", "qgemm.cpp", "decode_layers.cpp"))
ABI_VERSION = 4
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-std=c++20", "-shared", "-fPIC"]
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the activations the kernels take, by name suffix

__all__ = ["LoraKernel", "add_rms_norm", "available", "decode_attention", "lora_shrink_expand", "qgemm",
           "rope_and_store", "silu_and_mul", "supports", "supports_lora"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    cxx = os.environ.get("CXX") or "g++"
    return shutil.which(cxx)


def _build(cxx: str) -> Path:
    sources = [path.read_bytes() for path in SOURCES]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([*sources, " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode()]))
    base = user_cache_dir()
    # The library is loaded as code: its directory must be this user's alone.
    out_dir = Path(private_dir(os.path.join(base, "kernels") if base
                               else os.path.join(tempfile.gettempdir(), f"zserve-kernels-{os.getuid()}")))
    target = out_dir / f"zserve_cpu_{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=target.stem, suffix=".tmp.so")
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def library_path() -> str | None:
    """The loaded kernel library's file, or None."""
    lib = _library()
    return None if lib is None else lib._name


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("ZSERVE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        log.info("native CPU kernels disabled by ZSERVE_CPU_KERNELS")
        return None
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler (g++ or $CXX) found: decode attention uses the slower torch path")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cxx)))
        if lib.zs_abi_version() != ABI_VERSION:
            raise RuntimeError("stale kernel library")
    except Exception as e:  # any build or load trouble: the torch path always works
        log.warning("native CPU kernels unavailable (%s): decode attention uses the slower torch path", e)
        return None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "decode_attention": ([p, i64, p, i64, p, i64, p, p, i32, i32, i32, i32, i32, f32, i32], ctypes.c_int),
        "add_rms_norm": ([p, i64, p, p, p, i64, i32, f32], None),
        "silu_and_mul": ([p, p, i64, i32], None),
        "rope_and_store": ([p, i64, i64, p, p, p, p, i64, p, i32, i32, i32], ctypes.c_int),
        "lora_shrink_expand": ([p, i64, p, i64, p, i64, p, i32, p, i32, i32, p, p, p, p, i32, i32, i32, i64],
                               ctypes.c_int),
    }
    for name, (args, ret) in signatures.items():
        for suffix in DTYPES.values():
            fn = getattr(lib, f"zs_{name}_{suffix}")
            fn.argtypes, fn.restype = args, ret
    lib.zs_set_portable_only.argtypes = [i32]
    lib.zs_qgemm_f32.argtypes = [p, i64, p, i64, i64, p, p, p, i32, i64, i64, i32, i32]
    lib.zs_qgemm_f32.restype = ctypes.c_int
    lib.zs_qgemm_bf16.argtypes = [p, i64, p, i64, i64, p, p, p, i32, i64, i64, i32, i32]
    lib.zs_qgemm_bf16.restype = ctypes.c_int
    for suffix in DTYPES.values():
        fn = getattr(lib, f"zs_decode_layers_{suffix}")
        fn.argtypes = [p, p, i64, p, i32, i32, i32, i32, i32, i32, f32, p, p, p, p, i64, p, i64, p, i32, f32, i32]
        fn.restype = ctypes.c_int
    lib.zs_qgemm_set_portable.argtypes = [i32]
    lib.zs_qgemm_set_few_rows.argtypes = [i32]
    return lib


@functools.cache
def _fn(name: str, dtype: torch.dtype):
    """The kernel ``name`` for ``dtype`` (looked up once: these calls are in every layer of every step)."""
    return getattr(_library(), f"zs_{name}_{DTYPES[dtype]}")


def set_portable_only(on: bool) -> None:
    """Use the portable kernels even where a vectorised one exists (for tests)."""
    lib = _library()
    if lib is not None:
        lib.zs_set_portable_only(int(on))
        lib.zs_qgemm_set_portable(int(on))


def set_qgemm_few_rows(n: int) -> None:
    """Up to ``n`` rows (0..8) ``qgemm`` forms the codes in registers, past it once per tile pair; the numbers are
    the same either way (for tests and the benchmarks)."""
    lib = _library()
    if lib is not None:
        lib.zs_qgemm_set_few_rows(int(n))


def available() -> bool:
    """Whether the native kernels built and loaded (builds them on the first call)."""
    return _library() is not None


def supports(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether decode attention for this cache can use the native kernel."""
    return (device.type == "cpu" and dtype in DTYPES and head_dim <= 256 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= 64 and available())


def supports_lora(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a decode step's LoRA updates on this device and dtype can use ``lora_shrink_expand``."""
    return device.type == "cpu" and dtype in DTYPES and available()


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                     block_size: int, scale: float, window: int | None = None) -> torch.Tensor:
    """Attention of one query per row over its cached keys, read in place from the paged pool.

    With ``window``, each row attends to its last ``window`` keys only (sliding-window attention).
    ``q`` [B, H, D] (heads and dims contiguous in a row; rows may be strided), ``kv_layer``
    [2, KV, slots, D] contiguous, ``tables`` [B, max_blocks] int32, ``lens`` [B] int32 (keys per
    row, >= 1). Returns [B, H * D] in ``q``'s dtype.
    """
    b, h, d = q.shape
    kv_heads, slots = kv_layer.shape[1], kv_layer.shape[2]
    if (q.stride(2) != 1 or q.stride(1) != d or not kv_layer.is_contiguous() or kv_layer.dtype != q.dtype
            or tables.dtype != torch.int32 or lens.dtype != torch.int32 or not tables.is_contiguous()
            or not lens.is_contiguous() or tables.shape[0] != b or lens.shape[0] != b):
        raise ValueError("decode_attention: unsupported layout")
    out = torch.empty(b, h * d, dtype=q.dtype)
    rc = _fn("decode_attention", q.dtype)(q.data_ptr(), q.stride(0), kv_layer.data_ptr(), slots * d,
            tables.data_ptr(), tables.shape[1],
            lens.data_ptr(), out.data_ptr(), b, h, kv_heads, d, block_size, scale, window or 0)
    if rc != 0:
        raise ValueError(f"decode_attention kernel rejected its arguments (code {rc})")
    return out


_SCALE_DTYPES = (torch.float32, torch.float16)  # qgemm's scales and mins


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"{what}: unsupported tensor layout")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(x + residual)``, storing ``x + residual`` into ``residual`` (in place).

    Without ``residual``, plain ``weight * rms_norm(x)``. ``x`` [rows, hidden] (rows may be
    strided); ``residual`` contiguous like it; all one dtype.
    """
    rows, hidden = x.shape
    _check(x.stride(1) == 1 and weight.is_contiguous() and weight.shape == (hidden,) and weight.dtype == x.dtype
           and (residual is None or (residual.is_contiguous() and residual.shape == x.shape
                                     and residual.dtype == x.dtype)), "add_rms_norm")
    out = torch.empty(rows, hidden, dtype=x.dtype)
    _fn("add_rms_norm", x.dtype)(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                                 weight.data_ptr(), out.data_ptr(), rows, hidden, eps)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [rows, 2 * inter] laid out ``[gate | up]``."""
    rows, width = gate_up.shape
    _check(gate_up.is_contiguous() and width % 2 == 0, "silu_and_mul")
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    _fn("silu_and_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                   kv_layer: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> None:
    """Rotate the q and k heads of ``qkv`` ([N, (H + 2 KV) * D], contiguous) in place and store the
    step's keys and values in ``kv_layer`` ([2, KV, slots, D]) at ``slot_mapping``.

    ``cos``/``signed_sin`` are the float32 ``[positions, D]`` tables of ``RotaryEmbedding``.
    """
    n = qkv.shape[0]
    _check(qkv.is_contiguous() and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
           and kv_layer.is_contiguous() and kv_layer.dtype == qkv.dtype and kv_layer.shape[1] == num_kv_heads
           and cos.dtype == signed_sin.dtype == torch.float32 and cos.is_contiguous() and signed_sin.is_contiguous()
           and cos.shape[1] == head_dim and positions.dtype == slot_mapping.dtype == torch.int64
           and positions.shape == slot_mapping.shape == (n,), "rope_and_store")
    rc = _fn("rope_and_store", qkv.dtype)(qkv.data_ptr(), n, qkv.stride(0), positions.data_ptr(), cos.data_ptr(),
                                          signed_sin.data_ptr(), kv_layer.data_ptr(), kv_layer.shape[2] * head_dim,
                                          slot_mapping.data_ptr(), num_heads, num_kv_heads, head_dim)
    if rc != 0:
        raise ValueError(f"rope_and_store kernel rejected its arguments (code {rc})")



class LoraKernel:
    """``lora_shrink_expand`` bound to one projection's slots (checked once): a decode step's LoRA updates.

    ``at`` [slots, in, max_rank * modules] and ``bt[j]`` [slots, max_rank, out_j] contiguous, one dtype. Calling
    it with ``x`` [n, in], ``y`` [n, sum of outs] (unit column stride), ``rows`` (int64 token rows) and ``segs``
    [segments, 5] (int32: per segment ``begin, end`` into ``rows``, segments back to back from 0, ``slot``,
    ``rank`` and ``mask``) adds ``(x[rows] @ at[slot][:, :width]) @ bt[j][slot][:rank]`` to ``y[rows]``'s columns
    of module j (those after modules 0..j-1's) for each module j in ``mask``, whose ``h`` block is the next
    ``rank`` columns. Each adapter's weights are read once for all its rows: the decode case (a few rows per
    adapter); a long segment is better done by a matmul. The kernel checks slots, ranks, masks and rows.
    """

    def __init__(self, at: torch.Tensor, bt: tuple[torch.Tensor, ...]):
        slots, fan_in, width = at.shape
        max_rank = bt[0].shape[1] if bt else 0
        _check(at.device.type == "cpu" and at.dtype in DTYPES and at.is_contiguous() and 1 <= len(bt) <= 3
               and width == max_rank * len(bt)
               and all(b.is_contiguous() and b.dtype == at.dtype and b.shape[:2] == (slots, max_rank) for b in bt),
               "lora_shrink_expand")
        self.at, self.bt = at, bt  # (kept alive: the kernel reads them by address)
        self.dtype, self.fan_in, self.fan_out = at.dtype, fan_in, sum(b.shape[2] for b in bt)
        self._outs = torch.tensor([b.shape[2] for b in bt], dtype=torch.int32)
        self._fn = _fn("lora_shrink_expand", at.dtype)
        self._static = (at.data_ptr(), fan_in, width, *[b.data_ptr() for b in bt], *[None] * (3 - len(bt)),
                        self._outs.data_ptr(), len(bt), max_rank, slots)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, segs: torch.Tensor) -> None:
        _check(x.dtype == y.dtype == self.dtype and x.dim() == y.dim() == 2 and x.stride(1) == 1 and y.stride(1) == 1
               and x.shape[1] == self.fan_in and y.shape[1] == self.fan_out and x.shape[0] == y.shape[0]
               and rows.dtype == torch.int64 and segs.dtype == torch.int32 and rows.is_contiguous()
               and segs.is_contiguous() and segs.dim() == 2 and segs.shape[1] == 5, "lora_shrink_expand")
        rc = self._fn(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), rows.data_ptr(), rows.shape[0],
                      segs.data_ptr(), segs.shape[0], *self._static, x.shape[0])
        if rc != 0:
            raise ValueError(f"lora_shrink_expand kernel rejected its arguments (code {rc})")


def lora_shrink_expand(x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, segs: torch.Tensor, at: torch.Tensor,
                       bt: tuple[torch.Tensor, ...]) -> None:
    """One ``LoraKernel(at, bt)(x, y, rows, segs)`` call (see ``LoraKernel``)."""
    LoraKernel(at, bt)(x, y, rows, segs)


def decode_layers(dtype: torch.dtype, *args) -> int:
    """``zs_decode_layers`` for ``dtype`` (float32 or bfloat16) with ``engine_worker.models.native_decode``'s
    arguments; its return code (0, -2 for no bf16 matmul kernel on this CPU, -1 for arguments it cannot take)."""
    return _fn("decode_layers", dtype)(*args)


def qgemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, n: int, group: int,
          bits: int) -> torch.Tensor:
    """``x @ W.T`` ([M, n], in ``x``'s dtype) for ``x`` [M, K] on the CPU and ``W`` kept quantized in ``qgemm.cpp``'s
    tiled layout (``engine_worker.models.quant_linear.QuantWeight``; scales and mins float32 or float16). bfloat16
    runs the bf16 kernel (weights formed as bf16, vdpbf16ps) where the CPU has one, float32 the float32 kernel; any
    other dtype, or a bf16 ``x`` on a CPU without the bf16 kernel, goes through float32 and back.

    Called for every linear layer of a quantized model in every step (121 a decode step of SmolLM2), so it does
    only what it must: a few microseconds of Python here were 8% of a batch-1 decode step."""
    lib = _library()
    m, k = x.shape
    _check(x.is_cpu and scales.dtype in _SCALE_DTYPES and (mins is None or mins.dtype == scales.dtype), "qgemm")
    if x.stride(1) != 1:
        x = x.contiguous()
    dtype = x.dtype
    args = (codes.data_ptr(), scales.data_ptr(), None if mins is None else mins.data_ptr(),
            scales.dtype == torch.float16, n, k, group, bits)
    kernel = lib.zs_qgemm_bf16 if dtype == torch.bfloat16 else lib.zs_qgemm_f32 if dtype == torch.float32 else None
    if kernel is not None:
        y = torch.empty(m, n, dtype=dtype)
        rc = kernel(x.data_ptr(), x.stride(0), y.data_ptr(), n, m, *args)
        if rc == 0:
            return y
        if rc != -2 or dtype != torch.bfloat16:  # (-2 from the bf16 kernel: none on this CPU)
            raise ValueError(f"qgemm kernel rejected its arguments (code {rc})")
    return qgemm(x.float(), codes, scales, mins, n, group, bits).to(dtype)
