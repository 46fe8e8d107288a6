"""The multi-host response store: one Redis (or Valkey) that every gateway process, on any host, uses.

Keys, all under ``prefix`` (``zserve:resp:``):

* ``<prefix>r:<key>``: the record's JSON; the key's own expiry (PX) is the record's TTL.
* ``<prefix>created``: sorted set of keys scored by a creation counter (``<prefix>seq``), for
  evicting the oldest; ``ZREMRANGEBYRANK`` trims it.
* ``<prefix>expires``: sorted set of keys scored by expiry time, so the entries of records Redis has
  already expired are dropped from ``created`` (lazily, a bounded batch per put) and stop counting.

``put`` is one Lua script, so the write, the index updates and the eviction are one atomic step
(scripts see the server's clock, so gateway hosts need not agree on the time). ``transition`` is an
optimistic compare-and-set: read, check the status and merge in Python, then a script stores the new
record only if the stored one still hashes the same, else hands back what is stored now to retry on.
(Merging in Lua would re-encode the JSON with cjson, which changes it, e.g. ``[]`` into ``{}``.)

The scripts name keys they compute (evicted records), so this wants a single Redis, not a Cluster,
and Redis >= 5 (scripts that read the clock, replicated by their effects).

Every failure to reach Redis raises ``StoreUnavailable``, after at most the socket timeouts:
redis-py's own retries are off, so that a non-idempotent call (the compare-and-set) is never sent
twice; ``get`` and ``put``, which are idempotent, are retried once here on a dropped connection.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable, Collection
from typing import TypeVar

import orjson
import redis.asyncio as aioredis
from redis import exceptions as rx
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .base import ResponseStore, StoreUnavailable, encode_record, status_allows

T = TypeVar("T")

PREFIX = "zserve:resp:"
CONNECT_TIMEOUT_S = 2.0  # an unreachable Redis fails a request within this, never hangs it
SOCKET_TIMEOUT_S = 3.0  # per read/write on an established connection
MAX_CONNECTIONS = 32  # per store, i.e. per gateway process
PURGE_BATCH = 64  # expired index entries dropped per put: bounded work, more than a put adds
CAS_ATTEMPTS = 50  # transition retries when other writers keep changing the record under it

# Error replies meaning "Redis cannot serve now" rather than "this call is wrong": redis-py raises
# some as their own classes (stripping the code from the message), the rest as plain ResponseError.
_UNAVAILABLE_ERRORS = tuple(getattr(rx, name) for name in (
    "ReadOnlyError", "OutOfMemoryError", "MasterDownError", "ClusterDownError", "TryAgainError") if hasattr(rx, name))
_UNAVAILABLE_REPLIES = {"OOM", "READONLY", "MISCONF", "LOADING", "BUSY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN"}

# KEYS: 1 record, 2 created index, 3 expires index, 4 creation counter
# ARGV: 1 data, 2 ttl ms, 3 max items, 4 member (the response key), 5 record-key prefix, 6 purge batch
_PUT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local prefix = ARGV[5]
local dead = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, tonumber(ARGV[6]))
for _, m in ipairs(dead) do
  redis.call('DEL', prefix .. m)
  redis.call('ZREM', KEYS[2], m)
  redis.call('ZREM', KEYS[3], m)
end
local existed = redis.call('EXISTS', KEYS[1]) == 1
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
if not existed or not redis.call('ZSCORE', KEYS[2], ARGV[4]) then
  redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), ARGV[4])
end
redis.call('ZADD', KEYS[3], now + ttl, ARGV[4])
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if excess > 0 then
  for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, excess - 1)) do
    redis.call('DEL', prefix .. m)
    redis.call('ZREM', KEYS[3], m)
  end
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, excess - 1)
end
return excess
"""

# KEYS: 1 record, 2 expires index
# ARGV: 1 sha1 hex of the value the caller read, 2 new data, 3 ttl ms, 4 member
# Returns 1 when stored; otherwise the current value (nil when absent or expired).
_CAS = """
local cur = redis.call('GET', KEYS[1])
if not cur then return nil end
if redis.sha1hex(cur) ~= ARGV[1] then return cur end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[4])
return 1
"""

# KEYS: 1 record, 2 created index, 3 expires index; ARGV: 1 member. Returns 1 when a live record went.
_DELETE = """
local n = redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return n
"""


def _redact(url: str) -> str:
    return re.sub(r"//[^/@]*@", "//***@", url)


class RedisStore(ResponseStore):
    def __init__(self, url: str, *, ttl_s: float, max_items: int, prefix: str = PREFIX,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, socket_timeout_s: float = SOCKET_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.where = _redact(url)
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.max_items = int(max_items)
        self.prefix = prefix
        self._created, self._expires, self._seq = prefix + "created", prefix + "expires", prefix + "seq"
        try:
            # Connects lazily, on the first call, in that call's event loop. A bounded pool that makes
            # a call wait (up to the connect timeout) for a free connection: a burst of requests must
            # not open one Redis connection each.
            self._pool = aioredis.BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=connect_timeout_s,
                socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s,
                retry=Retry(NoBackoff(), 0), decode_responses=False)
        except ValueError as e:
            raise ValueError(f"response store URL {self.where!r}: {e}") from e
        self._r = aioredis.Redis(connection_pool=self._pool)
        self._put = self._r.register_script(_PUT)
        self._cas = self._r.register_script(_CAS)
        self._delete = self._r.register_script(_DELETE)

    def _key(self, key: str) -> str:
        return f"{self.prefix}r:{key}"

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]], *, idempotent: bool) -> T:
        for attempt in range(2 if idempotent else 1):
            try:
                return await fn()
            except (rx.ConnectionError, rx.TimeoutError, OSError, TimeoutError) as e:
                # One retry for a connection that died under us (Redis restarted, an idle socket
                # dropped); never for an auth failure or a timeout, which would only double the wait.
                if attempt == 0 and idempotent and type(e) is rx.ConnectionError:
                    continue
                raise StoreUnavailable(f"response store {self.where}: {what} failed: {e}") from e
            except rx.ResponseError as e:
                if isinstance(e, _UNAVAILABLE_ERRORS) or str(e).split(" ", 1)[0] in _UNAVAILABLE_REPLIES:
                    raise StoreUnavailable(f"response store {self.where}: {what} failed: {e}") from e
                raise
        raise AssertionError("unreachable")

    async def put(self, key: str, record: dict) -> None:
        data = encode_record(record)
        keys = [self._key(key), self._created, self._expires, self._seq]
        args = [data, self.ttl_ms, self.max_items, key, self.prefix + "r:", PURGE_BATCH]
        await self._call("put", lambda: self._put(keys=keys, args=args), idempotent=True)

    async def _get_raw(self, key: str) -> bytes | None:
        return await self._call("get", lambda: self._r.get(self._key(key)), idempotent=True)

    async def get(self, key: str) -> dict | None:
        data = await self._get_raw(key)
        return None if data is None else orjson.loads(data)

    async def transition(self, key: str, from_statuses: Collection[str], patch: dict) -> tuple[bool, dict | None]:
        data = await self._get_raw(key)
        for _ in range(CAS_ATTEMPTS):
            if data is None:
                return False, None
            record = orjson.loads(data)
            if not status_allows(record, from_statuses):
                return False, record
            new = {**record, **patch}
            args = [hashlib.sha1(data, usedforsecurity=False).hexdigest(), encode_record(new), self.ttl_ms, key]
            keys = [self._key(key), self._expires]
            reply = await self._call("transition", lambda keys=keys, args=args: self._cas(keys=keys, args=args),
                                     idempotent=False)
            if isinstance(reply, int):
                return True, new
            data = reply  # someone else wrote in between: decide again on what is stored now
        raise StoreUnavailable(f"response store {self.where}: transition of {key!r} lost {CAS_ATTEMPTS} races in a row")

    async def delete(self, key: str) -> bool:
        keys, args = [self._key(key), self._created, self._expires], [key]
        return bool(await self._call("delete", lambda: self._delete(keys=keys, args=args), idempotent=True))

    async def close(self) -> None:
        close = getattr(self._r, "aclose", None) or self._r.close  # aclose: redis-py >= 5.0.1
        await close()
        await self._pool.disconnect()  # a pool passed in is not closed with the client
