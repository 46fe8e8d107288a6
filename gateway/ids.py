"""Fresh ids for requests, responses and tool calls: 32 random hex digits, the shape of ``uuid4().hex``.

The bytes come from the OS's random source (``os.urandom``, unguessable: a stored response is fetched by its
id), read 4 KiB at a time: a request makes three ids (its ``X-Request-Id``, its response id, the engine's
request ids), and each ``os.urandom`` call is a system call."""

from __future__ import annotations

import os

_CHUNK = 4096
_pool = b""
_at = 0


def random_hex(n_bytes: int = 16) -> str:
    global _pool, _at
    if _at + n_bytes > len(_pool):
        _pool, _at = os.urandom(max(_CHUNK, n_bytes)), 0
    start = _at
    _at += n_bytes
    return _pool[start:_at].hex()


def _forget_pool() -> None:  # a forked child must not hand out its parent's ids again
    global _pool, _at
    _pool, _at = b"", 0


os.register_at_fork(after_in_child=_forget_pool)
