"""Choosing the attention backend: once, at start-up, in a fixed order of preference.

``native`` (CPU kernels) -> ``triton`` (CUDA, after its self-check) -> ``flex`` (CUDA, no sliding
window) -> ``gather`` (plain torch, always works). The first that can serve the cache wins;
the choice and why the better ones were passed over are logged in one line.
"""

from __future__ import annotations

import logging

from engine_worker.attention.base import AttentionBackend
from engine_worker.attention.flex import FlexBackend
from engine_worker.attention.gather import GatherBackend
from engine_worker.attention.native import NativeBackend
from engine_worker.attention.triton import TritonBackend
from engine_worker.kv_cache import PagedKVCache

__all__ = ["BACKENDS", "select_backend"]

log = logging.getLogger(__name__)

# In order of preference.
BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b for b in (NativeBackend, TritonBackend, FlexBackend, GatherBackend)  # type: ignore[misc]
}


def select_backend(cache: PagedKVCache, num_heads: int | None = None, window: int | None = None,
                   want: str | None = None) -> AttentionBackend:
    """The attention backend for ``cache``: the best one that can serve it, or ``want`` (a name
    of ``BACKENDS``; ValueError when it cannot serve this cache)."""
    heads = num_heads or cache.num_kv_heads
    if want is not None:
        if want not in BACKENDS:
            raise ValueError(f"unknown attention backend {want!r}; known: {', '.join(BACKENDS)}")
        why_not = BACKENDS[want].unavailable(cache, heads, window)
        if why_not is not None:
            raise ValueError(f"attention backend {want!r} cannot serve this cache: {why_not}")
        backend = BACKENDS[want](cache, heads, window)
        log.info("attention: %s (asked for)", backend.description)
        return backend
    passed: list[str] = []
    for name, cls in BACKENDS.items():
        why_not = cls.unavailable(cache, heads, window)
        if why_not is None:
            backend = cls(cache, heads, window)
            log.info("attention: %s (%s)", backend.description,
                     "; ".join(passed) if passed else f"first choice on {cache.device.type}")
            return backend
        passed.append(f"{name}: {why_not}")
    raise AssertionError("the gather backend always works")  # pragma: no cover
