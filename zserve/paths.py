"""Directories zserve writes outside its run directory."""

from __future__ import annotations

import os
import stat


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


def private_dir(path: str) -> str:
    """Create ``path`` (mode 0700) or accept it if it already is ours and not writable by others.

    For directories whose contents are trusted later — compiled kernels are loaded as code — so a
    directory another user made first (say under a shared /tmp) is refused, not used.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{path} is not a private directory of this user; refusing to use it")
    return path
