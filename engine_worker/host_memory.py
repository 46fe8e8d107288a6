"""The host process's own memory: what is resident, and handing freed heap pages back to the kernel.

Kept apart from ``residency`` (which moves a model's tensors) so the loader, which frees the codes it read, needs
neither the runner nor residency."""

from __future__ import annotations

import ctypes
import ctypes.util
import os


def resident_bytes() -> int:
    """This process's resident memory (RSS), from /proc; 0 where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_free_memory() -> None:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim``): freed weights live in malloc's arenas
    (their chunks are below the allocator's mmap threshold once it has grown), which ``free`` alone keeps resident."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:  # (not glibc: nothing to trim)
        pass
