"""Fresh ids for requests, responses and tool calls: 32 random hex digits, the shape of ``uuid4().hex``.

``os.urandom(16).hex()`` costs a quarter of ``uuid.uuid4().hex`` (no UUID object), and a request makes three
(its ``X-Request-Id``, its response id, the engine's request ids)."""

from __future__ import annotations

import os


def random_hex(n_bytes: int = 16) -> str:
    return os.urandom(n_bytes).hex()
