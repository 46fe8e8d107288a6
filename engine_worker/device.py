"""Where the engine computes and in which precision: the one place that chooses device and dtype.

Every other engine module receives a ``torch.device`` and ``torch.dtype`` from here, so that a
later change of policy (bf16 on CPUs with AVX512_BF16, several GPUs per host) happens in one file.
"""

from __future__ import annotations

import os

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_CHOICES: tuple[str, ...] = ("auto", *_DTYPES)


def select_device(index: int | None = None) -> torch.device:
    """CUDA device ``index`` (default 0) when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        i = 0 if index is None else index
        if not 0 <= i < count:
            raise ValueError(f"CUDA device {i} does not exist: this host has {count} (0..{count - 1})")
        return torch.device("cuda", i)
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Turn ``auto|float32|bfloat16|float16`` into a torch dtype for ``device``.

    ``auto`` is bf16 on CUDA (the usual serving precision) and on CPUs with native bf16 math
    (AVX512_BF16 / AMX, as oneDNN reports): there it is ~1.5-2x faster than fp32 for the same
    memory traffic halved. Other CPUs get float32 (bf16 would be emulated, and float16 matmuls
    on CPU are slow). Exactness tests ask for float32 explicitly. Weights kept quantized follow the same
    rule: their bf16 kernel runs prompts at oneDNN's bf16 rate, the float32 one at half of it, and float32
    keeps the dequantized float32 model's greedy text where bf16 flips ~4% of a text's tokens
    (tests/bench/bench_quant_accuracy.py), as it does for a dense model.
    """
    key = name.strip().lower()
    if key == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    try:
        return _DTYPES[key]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(DTYPE_CHOICES)}") from None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (oneDNN's own check: AVX512_BF16 or AMX)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # an op missing from this build
        return False


def free_memory_bytes(device: torch.device) -> int:
    """Memory this process could still take on ``device``: CUDA's free memory, or the host's
    MemAvailable (what the kernel can give without swapping)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_memory(spec: str | float | int, device: torch.device) -> int:
    """``--kv-cache-memory``: bytes (``2147483648``, ``512MiB``, ``2GB``) or a fraction in (0, 1]
    of the device's free memory (``0.3``)."""
    text = str(spec).strip().lower()
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num):].strip()
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"memory size {spec!r}: expected bytes (e.g. 2GiB, 512MB) or a fraction like 0.3") from None
    if unit not in _UNITS:
        raise ValueError(f"memory size {spec!r}: unknown unit {unit!r}")
    if unit == "" and 0 < value <= 1:
        return int(value * free_memory_bytes(device))
    if value <= 0:
        raise ValueError(f"memory size {spec!r} must be positive")
    return int(value * _UNITS[unit])


def dtype_name(dtype: torch.dtype) -> str:
    """The short name (``float32``...) of a dtype, as engines announce it."""
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    return str(dtype).removeprefix("torch.")


def configure_cpu_threads(n: int | None = None) -> int:
    """Set torch's intra-op thread count and return it.

    The default is the number of cores this process may run on (``sched_getaffinity``), not
    ``os.cpu_count()``: in a container or under ``taskset`` the latter over-subscribes the cores
    and decode slows down several-fold.
    """
    if n is None:
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            n = os.cpu_count() or 1
    n = max(1, int(n))
    torch.set_num_threads(n)
    return n
