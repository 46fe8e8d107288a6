"""Where stored OpenAI Responses-API objects live, shared by every gateway process.

Gateways are stateless and share one port, so ``POST /v1/responses`` may land on one process while
``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and a later request chaining on it
(``previous_response_id``) land on others. The record therefore lives outside the process: in a
SQLite file in the supervisor's private run directory (one host, the default) or in Redis (several
hosts). Handlers see only ``ResponseStore``; ``open_store`` picks the backend from a URL.

Records are JSON objects (``dict``), stored as orjson bytes. Semantics, the same for both backends:

* Expiry: a record expires ``ttl_s`` seconds after its last successful ``put`` or ``transition``
  (each one restarts the clock). An expired record is never returned (``get`` answers ``None``,
  ``transition`` treats it as absent) and its space is reclaimed lazily, a bounded amount per
  ``put``.
* Size bound: at most ``max_items`` records. A ``put`` that creates a record beyond the bound evicts
  the oldest records *by creation* (replacing a record, or transitioning it, keeps its place in that
  order: the bound caps how many responses are kept, not how recently they were touched).
  Expired records not yet reclaimed still count, which only makes the bound stricter.
* ``MAX_RECORD_BYTES``: a record whose JSON is larger is refused with ``ValueError`` (by ``put``,
  and by ``transition`` when the patch would make it larger), and nothing is stored.
* ``transition`` is the one read-modify-write, atomic across processes and hosts: "cancel only if
  still queued/in_progress", "write the final result unless it was cancelled meanwhile".
* A store that cannot be reached (Redis down or timing out, SQLite I/O errors or a lock held past
  the busy timeout) raises ``StoreUnavailable``, which the HTTP layer answers with 503. No call waits
  longer than a few seconds.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from .base import MAX_RECORD_BYTES, ResponseStore, StoreUnavailable

__all__ = ["DEFAULT_MAX_ITEMS", "DEFAULT_TTL_S", "MAX_RECORD_BYTES", "ResponseStore", "SCHEMES",
           "StoreUnavailable", "check_store_url", "open_store"]

SCHEMES = ("sqlite", "redis", "rediss", "unix")
DEFAULT_TTL_S = 3600.0  # a stored response lives an hour after its last change (--responses-ttl)
DEFAULT_MAX_ITEMS = 10_000  # the oldest stored responses go first past this (--responses-max-items)


def open_store(url: str | None, default_path: str, *, ttl_s: float, max_items: int) -> ResponseStore:
    """The store ``url`` names: ``None`` or ``sqlite:///abs/path.db`` for SQLite (``None``: the file
    ``default_path``), ``redis://host:port/db``, ``rediss://...`` or ``unix:///path.sock?db=N`` for Redis.

    SQLite is opened (and its file created, mode 0600) here, so a bad path fails at start-up;
    Redis connects on first use. The ``redis`` package is imported only for a Redis URL.
    """
    if not ttl_s > 0:
        raise ValueError(f"response store ttl_s must be > 0, got {ttl_s!r}")
    if max_items < 1:
        raise ValueError(f"response store max_items must be >= 1, got {max_items!r}")
    if url is None:
        from .sqlite import SqliteStore
        return SqliteStore(default_path, ttl_s=ttl_s, max_items=max_items)
    scheme, path = check_store_url(url)
    if scheme == "sqlite":
        from .sqlite import SqliteStore
        return SqliteStore(path, ttl_s=ttl_s, max_items=max_items)
    from .redis import RedisStore  # imports the redis package: only deployments that use it pay
    return RedisStore(url, ttl_s=ttl_s, max_items=max_items)


def check_store_url(url: str) -> tuple[str, str]:
    """(scheme, SQLite path or "") of a store URL, or ValueError saying which forms are accepted."""
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme == "sqlite":
        path = url[len("sqlite://"):]
        if not path.startswith("/") or path == "/":
            raise ValueError(f"response store URL {url!r}: write an absolute path, sqlite:///abs/path.db")
        return scheme, os.path.normpath(path)
    if scheme in ("redis", "rediss", "unix"):
        return scheme, ""
    raise ValueError(f"response store URL {url!r}: unknown scheme; accepted: sqlite:///abs/path.db, "
                     "redis://host:port/db, rediss://host:port/db, unix:///path/to/redis.sock")
