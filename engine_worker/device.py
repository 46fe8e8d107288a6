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

    ``auto`` is bf16 on CUDA (the usual serving precision) and float32 on the CPU: fp32 is what the
    exactness tests compare against, and float16 matmuls on CPU are slow.
    """
    key = name.strip().lower()
    if key == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[key]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(DTYPE_CHOICES)}") from None


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
