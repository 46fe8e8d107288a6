"""The contract every store backend implements (``ResponseStore``) and what the backends share; the
package's docstring gives the semantics. The backends import this module, never the package, so that
the package can pick one (``open_store``) without an import circle."""

from __future__ import annotations

import abc
from collections.abc import Collection

import orjson

MAX_RECORD_BYTES = 16 * 1024 * 1024  # the largest record's JSON; the HTTP layer answers 400 past it

class StoreUnavailable(RuntimeError):
    """The store cannot be reached or used right now (the HTTP layer answers 503)."""


class ResponseStore(abc.ABC):
    """Records keyed by response id, shared by every gateway process (see the module docstring)."""

    @abc.abstractmethod
    async def put(self, key: str, record: dict) -> None:
        """Insert or replace ``key``'s record; restarts its expiry clock, may evict the oldest records."""

    @abc.abstractmethod
    async def get(self, key: str) -> dict | None:
        """``key``'s record, or ``None`` when it is absent, expired or evicted."""

    @abc.abstractmethod
    async def transition(self, key: str, from_statuses: Collection[str], patch: dict) -> tuple[bool, dict | None]:
        """Atomically: if ``key``'s record exists and its ``status`` is in ``from_statuses``, store
        ``{**record, **patch}`` and return ``(True, new_record)``; otherwise change nothing and return
        ``(False, current_record_or_None)``."""

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """Remove ``key``'s record; whether a live (unexpired) one was there."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections and threads; the store is unusable afterwards."""


def encode_record(record: dict) -> bytes:
    """The record's JSON, refused with ``ValueError`` when it is not a dict or exceeds ``MAX_RECORD_BYTES``."""
    if not isinstance(record, dict):
        raise ValueError(f"a stored response must be a JSON object, not {type(record).__name__}")
    data = orjson.dumps(record)
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"response object is {len(data)} bytes as JSON; the limit is {MAX_RECORD_BYTES}")
    return data


def status_allows(record: dict, from_statuses: Collection[str]) -> bool:
    return record.get("status") in from_statuses
