"""Directories zserve writes outside its run directory."""

from __future__ import annotations

import os
import stat


def cache_path() -> str:
    """``$XDG_CACHE_HOME/zserve`` (or ``~/.cache/zserve``): where the cache is, whether or not it can be made."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "zserve")


def user_cache_dir() -> str | None:
    """``cache_path()``, created; None when it cannot be written.

    Holds what is slow to make and safe to reuse across restarts: tokenizers built from GGUF
    metadata (gateways), compiled CPU kernels and converted weights (engines).
    """
    path = cache_path()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def no_cache_warning() -> str | None:
    """What a server logs once at start when it has no cache directory, or None when it has one."""
    if user_cache_dir() is not None:
        return None
    return (f"no cache: {cache_path()} cannot be written, so engines convert their weights and compile their CPU "
            "kernels again at every start; point XDG_CACHE_HOME at a writable directory (deploy/systemd's units: "
            "CacheDirectory=zserve and XDG_CACHE_HOME=/var/cache)")


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
