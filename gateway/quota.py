"""Each tenant's limits as one count for every gateway: token buckets for requests and tokens per minute, and the
requests in flight (``zserve.tenants``, docs/tenants.md).

A bucket refills continuously at its rate and holds at most ``BURST_SECONDS`` of it; it starts full. ``admit`` takes
one request and a concurrency slot and needs the tokens bucket to be above zero, all or nothing; ``charge`` takes
tokens as they become known (so the tokens bucket can go into debt); ``release`` gives the slot back.

Two stores, chosen by ``open_quota``:

- ``HostQuota``, the gateways of one host: one small file per tenant in the supervisor's private run directory,
  mapped into every gateway's memory and changed under ``flock``. A check is a few microseconds and needs no other
  process (a supervisor in the path would add a round trip per request, and would be a process every request
  depends on); the kernel's lock makes it exact whatever the spread over gateways. Times are ``CLOCK_MONOTONIC``,
  one clock for every process of the host. In-flight counts are kept per process, in a cell that names the pid: a
  process that opens a tenant's file clears the cells of processes that are gone, so a killed gateway's requests
  stop counting as soon as its replacement (or any gateway) touches the tenant, while a gateway draining through a
  rolling restart keeps its own.
- ``RedisQuota``, gateway hosts sharing ``--state-url redis://``: the same buckets in a Redis hash per tenant,
  refilled and taken by one Lua script on Redis's own clock (``TIME``: hosts' clocks may differ), so it is atomic
  across hosts. In-flight requests are a sorted set of leases whose score is an expiry 30 s ahead, renewed every
  10 s by the gateway that holds them: a host that dies frees its tenants' slots within 30 s. Redis unreachable
  (a call failing or taking more than 0.25 s): the host's ``HostQuota`` serves with every limit divided by the
  gateway hosts last seen alive, a warning is logged once, Redis is tried again every 2 s and a line is logged when
  it answers.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import itertools
import logging
import math
import mmap
import os
import socket
import struct
import time
from dataclasses import dataclass

from zserve.tenants import BURST_SECONDS, Tenant

log = logging.getLogger("zserve.gateway")


@dataclass(frozen=True)
class Rules:
    """One tenant's limits; None: no limit."""

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrent: int | None = None

    @classmethod
    def of(cls, tenant: Tenant, slot: bool = True) -> Rules:
        """``slot``: the request takes one of the tenant's concurrent slots (False: its concurrency is not checked)."""
        return cls(tenant.requests_per_minute, tenant.tokens_per_minute, tenant.max_concurrent if slot else None)

    def divided(self, n: int) -> Rules:
        """Each limit shared by ``n`` hosts (concurrency rounded up, at least 1)."""
        if n <= 1:
            return self
        return Rules(None if self.requests_per_minute is None else self.requests_per_minute / n,
                     None if self.tokens_per_minute is None else self.tokens_per_minute / n,
                     None if self.max_concurrent is None else max(1, math.ceil(self.max_concurrent / n)))


def duration(seconds: float) -> str:
    """OpenAI's reset format: ``120ms``, ``6s``, ``1m30s``, ``2h0m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m}m{s}s" if h else f"{m}m{s}s" if m else f"{s}s"


@dataclass(frozen=True)
class Verdict:
    """Whether a request may start, and what the tenant's buckets hold (OpenAI's rate-limit headers)."""

    allowed: bool
    reason: str = ""  # "" | "requests" | "tokens" | "concurrency"
    retry_after: float = 0.0
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float | None = None
    lease: object | None = None  # the concurrency slot taken, for ``release``

    def headers(self) -> dict[str, str]:
        h: dict[str, str] = {}
        if self.limit_requests is not None:
            h["x-ratelimit-limit-requests"] = str(self.limit_requests)
            h["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            h["x-ratelimit-reset-requests"] = duration(self.reset_requests or 0.0)
        if self.limit_tokens is not None:
            h["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            h["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            h["x-ratelimit-reset-tokens"] = duration(self.reset_tokens or 0.0)
        if not self.allowed:
            h["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return h


def verdict(rules: Rules, reason: str, requests: float, tokens: float, lease: object | None) -> Verdict:
    """The verdict of buckets holding ``requests`` and ``tokens`` after the decision (refused: ``reason``)."""
    rpm, tpm = rules.requests_per_minute, rules.tokens_per_minute
    retry = 0.0
    if reason == "requests":
        retry = (1 - requests) * 60 / rpm  # type: ignore[operator]
    elif reason == "tokens":
        retry = (1 - tokens) * 60 / tpm  # type: ignore[operator]
    elif reason == "concurrency":
        retry = 1.0
    return Verdict(not reason, reason, max(0.0, retry),
                   None if rpm is None else math.ceil(rpm), None if rpm is None else max(0, math.floor(requests)),
                   None if rpm is None else max(0.0, (rpm * BURST_SECONDS / 60 - requests) * 60 / rpm),
                   None if tpm is None else math.ceil(tpm), None if tpm is None else max(0, math.floor(tokens)),
                   None if tpm is None else max(0.0, (tpm * BURST_SECONDS / 60 - tokens) * 60 / tpm),
                   lease)


def refilled(level: float, since: float, now: float, per_minute: float, fresh: bool) -> float:
    cap = per_minute * BURST_SECONDS / 60
    return cap if fresh else min(cap, level + max(0.0, now - since) * per_minute / 60)


class Quota:
    """A store of tenants' buckets (``HostQuota``, ``RedisQuota``)."""

    async def admit(self, tenant: str, rules: Rules) -> Verdict:
        raise NotImplementedError

    async def charge(self, tenant: str, rules: Rules, tokens: int) -> None:
        raise NotImplementedError

    async def release(self, lease: object) -> None:
        raise NotImplementedError

    async def usage(self, tenant: str, rules: Rules) -> dict:
        raise NotImplementedError

    async def close(self) -> None:
        pass


# A tenant's file: the two buckets (level, last refill; a refill time of 0 is a bucket never used: full), then
# CELLS in-flight cells (pid, count).
_HEAD = struct.Struct("<dddd")
_CELL = struct.Struct("<qq")
CELLS = 256
_ALL_CELLS = struct.Struct(f"<{2 * CELLS}q")  # read at once: the in-flight total (unpacking cell by cell costs 10x)
_SIZE = _HEAD.size + CELLS * _CELL.size


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _TenantFile:
    """One tenant's shared counts, mapped; every change under the file's lock."""

    def __init__(self, path: str, writer: bool):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _SIZE:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    if os.fstat(fd).st_size < _SIZE:
                        os.ftruncate(fd, _SIZE)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            self.map = mmap.mmap(fd, _SIZE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.cell: int | None = None
        if writer:
            self._claim()

    def __enter__(self) -> _TenantFile:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _claim(self) -> None:
        """Clear the cells of processes that are gone and take one for this process."""
        me = os.getpid()
        with self:
            for i in range(CELLS):
                pid, count = _CELL.unpack_from(self.map, _HEAD.size + i * _CELL.size)
                if pid == me:
                    self.cell = i
                elif pid and not _alive(pid):
                    _CELL.pack_into(self.map, _HEAD.size + i * _CELL.size, 0, 0)
                    pid = 0
                if not pid and self.cell is None:
                    self.cell = i
            if self.cell is None:
                raise RuntimeError("no free in-flight cell in a tenant's quota file (256 live gateways?)")
            _CELL.pack_into(self.map, _HEAD.size + self.cell * _CELL.size, me, 0)

    def in_flight(self) -> int:
        return sum(_ALL_CELLS.unpack_from(self.map, _HEAD.size)[1::2])

    def add_own(self, n: int) -> None:
        at = _HEAD.size + self.cell * _CELL.size  # type: ignore[operator]
        pid, count = _CELL.unpack_from(self.map, at)
        _CELL.pack_into(self.map, at, pid, max(0, count + n))

    def levels(self, rules: Rules, now: float) -> tuple[float, float]:
        rl, rt, tl, tt = _HEAD.unpack_from(self.map, 0)
        requests = 0.0 if rules.requests_per_minute is None else \
            refilled(rl, rt, now, rules.requests_per_minute, rt == 0)
        tokens = 0.0 if rules.tokens_per_minute is None else refilled(tl, tt, now, rules.tokens_per_minute, tt == 0)
        return requests, tokens

    def store(self, requests: float, tokens: float, now: float) -> None:
        _HEAD.pack_into(self.map, 0, requests, now, tokens, now)


class HostQuota(Quota):
    """The gateways of one host (``slot``: this gateway's index; None: a reader such as the supervisor, which takes
    no cell and clears nothing)."""

    def __init__(self, directory: str, slot: int | None):
        self.directory = directory
        self.writer = slot is not None
        self._files: dict[str, _TenantFile] = {}

    def _file(self, tenant: str) -> _TenantFile:
        f = self._files.get(tenant)
        if f is None:
            name = hashlib.sha256(tenant.encode()).hexdigest()[:32]
            f = self._files[tenant] = _TenantFile(os.path.join(self.directory, name), self.writer)
        return f

    def admit_now(self, tenant: str, rules: Rules) -> Verdict:
        f = self._file(tenant)
        with f:
            now = time.monotonic()  # (under the lock: a time read before it may be older than the one stored)
            requests, tokens = f.levels(rules, now)
            reason = ""
            if rules.requests_per_minute is not None and requests < 1:
                reason = "requests"
            elif rules.tokens_per_minute is not None and tokens <= 0:
                reason = "tokens"
            elif rules.max_concurrent is not None and f.in_flight() >= rules.max_concurrent:
                reason = "concurrency"
            lease = None
            if not reason:
                if rules.requests_per_minute is not None:
                    requests -= 1
                if rules.max_concurrent is not None:
                    f.add_own(1)
                    lease = (self, tenant)
            f.store(requests, tokens, now)
        return verdict(rules, reason, requests, tokens, lease)

    def charge_now(self, tenant: str, rules: Rules, tokens: int) -> None:
        if rules.tokens_per_minute is None:
            return
        f = self._file(tenant)
        with f:
            now = time.monotonic()
            requests, level = f.levels(rules, now)
            f.store(requests, level - tokens, now)

    def release_now(self, lease: object) -> None:
        owner, tenant = lease  # type: ignore[misc]
        f = owner._file(tenant)
        with f:
            f.add_own(-1)

    def levels(self, tenant: str, rules: Rules) -> dict:
        f = self._file(tenant)
        with f:
            requests, tokens = f.levels(rules, time.monotonic())
            return {"requests": requests, "tokens": tokens, "concurrent": f.in_flight()}

    async def admit(self, tenant: str, rules: Rules) -> Verdict:
        return self.admit_now(tenant, rules)

    async def charge(self, tenant: str, rules: Rules, tokens: int) -> None:
        self.charge_now(tenant, rules, tokens)

    async def release(self, lease: object) -> None:
        self.release_now(lease)

    async def usage(self, tenant: str, rules: Rules) -> dict:
        return self.levels(tenant, rules)

    def close_now(self) -> None:
        for f in self._files.values():
            f.map.close()
            os.close(f.fd)
        self._files.clear()

    async def close(self) -> None:
        self.close_now()


# -- across hosts ----------------------------------------------------------------------------------------------------
PREFIX = "zserve:quota:"
HOSTS = "zserve:hosts"  # the supervisors' heartbeats (launch.hosts.shared_state): host id -> {"seen": unix time}
HOST_LIVE_S = 10.0
LEASE_TTL_S, RENEW_S, RETRY_S, TIMEOUT_S = 30.0, 10.0, 2.0, 0.25

# KEYS: the tenant's hash, its lease set. ARGV: rpm, tpm, max concurrent (0: none), burst seconds, mode (admit,
# charge, peek), lease id, lease ttl, tokens. Returns {reason, requests level, tokens level, in flight}.
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rpm, tpm, maxc, burst = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local mode = ARGV[5]
local h = redis.call('HMGET', KEYS[1], 'rl', 'rt', 'tl', 'tt')
local function refill(level, ts, rate)
  local cap = rate * burst / 60
  if not level then return cap end
  return math.min(cap, tonumber(level) + math.max(0, now - tonumber(ts)) * rate / 60)
end
local rl, tl = 0, 0
if rpm > 0 then rl = refill(h[1], h[2], rpm) end
if tpm > 0 then tl = refill(h[3], h[4], tpm) end
local inflight = 0
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  inflight = redis.call('ZCARD', KEYS[2])
end
local reason = ''
if mode == 'admit' then
  if rpm > 0 and rl < 1 then reason = 'requests'
  elseif tpm > 0 and tl <= 0 then reason = 'tokens'
  elseif maxc > 0 and inflight >= maxc then reason = 'concurrency'
  else
    if rpm > 0 then rl = rl - 1 end
    if maxc > 0 then
      redis.call('ZADD', KEYS[2], now + tonumber(ARGV[7]), ARGV[6])
      redis.call('EXPIRE', KEYS[2], 3600)
      inflight = inflight + 1
    end
  end
elseif mode == 'charge' and tpm > 0 then
  tl = tl - tonumber(ARGV[8])
end
if mode ~= 'peek' then
  if rpm > 0 then redis.call('HSET', KEYS[1], 'rl', rl, 'rt', now) end
  if tpm > 0 then redis.call('HSET', KEYS[1], 'tl', tl, 'tt', now) end
  redis.call('EXPIRE', KEYS[1], 3600)
end
return {reason, tostring(rl), tostring(tl), inflight}
"""
# Renew leases: KEYS the lease sets, ARGV ttl then one lease id per key.
_RENEW = """
local t = redis.call('TIME')
local until_ = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[1])
for i, key in ipairs(KEYS) do redis.call('ZADD', key, 'XX', until_, ARGV[i + 1]) end
return #KEYS
"""


def _keys(tenant: str) -> list[str]:
    digest = hashlib.sha256(tenant.encode()).hexdigest()[:32]
    return [PREFIX + digest, PREFIX + digest + ":leases"]


def _argv(rules: Rules, mode: str, lease: str = "", tokens: int = 0) -> list:
    return [rules.requests_per_minute or 0, rules.tokens_per_minute or 0, rules.max_concurrent or 0, BURST_SECONDS,
            mode, lease, LEASE_TTL_S, tokens]


def live_hosts(raw: dict, now: float) -> int:
    """The gateway hosts seen within ``HOST_LIVE_S`` in the supervisors' heartbeat hash (at least this one)."""
    import orjson

    n = 0
    for value in raw.values():
        try:
            n += now - float(orjson.loads(value)["seen"]) <= HOST_LIVE_S
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return max(1, n)


class RedisQuota(Quota):
    """Gateway hosts sharing one Redis; ``fallback`` (this host's ``HostQuota``) serves while Redis is away."""

    def __init__(self, url: str, host_id: str, fallback: HostQuota):
        import redis.asyncio as aioredis

        from zserve.proc import redact_url

        self.url, self.shown = url, redact_url(url)
        self.client = aioredis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        self.errors = (aioredis.RedisError, OSError, asyncio.TimeoutError)
        self.script = self.client.register_script(_SCRIPT)
        self.renew_script = self.client.register_script(_RENEW)
        self.host_id = host_id
        self.fallback = fallback
        self.hosts = 1  # gateway hosts last seen alive: a limit's share while Redis is away
        self.down_until = 0.0  # Redis failed: not tried again before this (monotonic)
        self.down = False
        self._ids = itertools.count()
        self.leases: dict[str, tuple[str, str]] = {}  # lease id -> (lease set key, id): renewed until released
        self._task: asyncio.Task | None = None

    def _failed(self, e: Exception) -> None:
        self.down_until = time.monotonic() + RETRY_S
        if not self.down:
            self.down = True
            log.warning("tenant limits: Redis at %s is unreachable (%s): each limit is shared by this host's gateways "
                        "alone, divided by the %d gateway host(s) last seen alive, until it answers", self.shown,
                        type(e).__name__, self.hosts)

    def _ok(self) -> None:
        if self.down:
            self.down = False
            log.warning("tenant limits: Redis at %s answers again: limits are shared by every host", self.shown)

    def _start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._renew())

    async def _run(self, tenant: str, rules: Rules, mode: str, lease: str = "", tokens: int = 0):
        """The script's answer, or None when Redis is away (then the fallback decides)."""
        if time.monotonic() < self.down_until:
            return None
        try:
            out = await asyncio.wait_for(self.script(keys=_keys(tenant), args=_argv(rules, mode, lease, tokens)),
                                         TIMEOUT_S * 2)
        except self.errors as e:
            self._failed(e)
            return None
        self._ok()
        reason = out[0].decode() if isinstance(out[0], bytes) else str(out[0])
        return reason, float(out[1]), float(out[2]), int(out[3])

    async def admit(self, tenant: str, rules: Rules) -> Verdict:
        self._start()
        lease_id = f"{self.host_id}:{next(self._ids)}" if rules.max_concurrent is not None else ""
        out = await self._run(tenant, rules, "admit", lease_id)
        if out is None:
            return self.fallback.admit_now(tenant, rules.divided(self.hosts))
        reason, requests, tokens, _ = out
        lease = None
        if not reason and lease_id:
            key = _keys(tenant)[1]
            self.leases[lease_id] = (key, lease_id)
            lease = (self, key, lease_id)
        return verdict(rules, reason, requests, tokens, lease)

    async def charge(self, tenant: str, rules: Rules, tokens: int) -> None:
        if rules.tokens_per_minute is None:
            return
        if await self._run(tenant, rules, "charge", tokens=tokens) is None:
            self.fallback.charge_now(tenant, rules.divided(self.hosts), tokens)

    async def release(self, lease: object) -> None:
        if lease[0] is not self:  # type: ignore[index]
            self.fallback.release_now(lease)  # taken while Redis was away
            return
        _, key, lease_id = lease  # type: ignore[misc]
        self.leases.pop(lease_id, None)
        if time.monotonic() < self.down_until:
            return  # (it expires by itself)
        try:
            await asyncio.wait_for(self.client.zrem(key, lease_id), TIMEOUT_S * 2)
        except self.errors as e:
            self._failed(e)

    async def usage(self, tenant: str, rules: Rules) -> dict:
        out = await self._run(tenant, rules, "peek")
        if out is None:
            return self.fallback.levels(tenant, rules.divided(self.hosts))
        return {"requests": out[1], "tokens": out[2], "concurrent": out[3]}

    async def _renew(self) -> None:
        """Keep this gateway's leases alive, and learn how many gateway hosts are alive (a limit's share while Redis
        is away)."""
        while True:
            await asyncio.sleep(RENEW_S)
            if time.monotonic() < self.down_until:
                continue
            try:
                held = list(self.leases.values())
                if held:
                    await asyncio.wait_for(self.renew_script(keys=[k for k, _ in held],
                                                             args=[LEASE_TTL_S, *(i for _, i in held)]), TIMEOUT_S * 4)
                self.hosts = live_hosts(await asyncio.wait_for(self.client.hgetall(HOSTS), TIMEOUT_S * 2), time.time())
                self._ok()
            except self.errors as e:
                self._failed(e)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for key, lease_id in list(self.leases.values()):
            try:
                await asyncio.wait_for(self.client.zrem(key, lease_id), TIMEOUT_S)
            except self.errors:
                break
        await self.client.aclose()
        await self.fallback.close()


def is_redis_url(url: str | None) -> bool:
    return bool(url) and url.split("://", 1)[0].lower() in ("redis", "rediss", "unix")  # type: ignore[union-attr]


def open_quota(directory: str, slot: int | None, state_url: str | None) -> Quota:
    """The store of this gateway's tenants' limits: Redis with ``--state-url redis://`` (this host's files while it is
    away), else this host's files."""
    host = HostQuota(directory, slot)
    if is_redis_url(state_url):
        return RedisQuota(state_url, f"{socket.gethostname()}:{os.getppid()}:{os.getpid()}", host)  # type: ignore[arg-type]
    return host


def usage_now(directory: str, state_url: str | None, tenant: str, rules: Rules) -> dict:
    """Levels of ``tenant``'s buckets and its requests in flight, without taking anything (``launch status
    --tenants``, from the supervisor's thread): Redis's, else this host's files."""
    if is_redis_url(state_url):
        import redis

        client = redis.Redis.from_url(state_url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)  # type: ignore[arg-type]
        try:
            out = client.eval(_SCRIPT, 2, *_keys(tenant), *_argv(rules, "peek"))
            return {"requests": float(out[1]), "tokens": float(out[2]), "concurrent": int(out[3]), "store": "redis"}
        except (redis.RedisError, OSError):
            pass  # this host's share, as its gateways count it meanwhile
        finally:
            client.close()
    quota = HostQuota(directory, None)
    try:
        return {**quota.levels(tenant, rules), "store": "host"}
    finally:
        quota.close_now()
