"""Directories zserve writes outside its run directory."""

from __future__ import annotations

import os


def user_cache_dir() -> str | None:
    """``$XDG_CACHE_HOME/zserve`` (or ``~/.cache/zserve``), created; None when it cannot be written.

    Holds what is slow to make and safe to reuse across restarts: tokenizers built from GGUF
    metadata (gateways) and compiled CPU kernels (engines).
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "zserve")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None
