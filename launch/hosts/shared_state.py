"""The cluster control state shared by every gateway host, in Redis (``--state-url redis://…``).

Without it each host is its own cluster: ``/pause`` pauses the gateways of the host that got it. With it, the
supervisor of every host keeps, in one Redis (the one the Responses store uses):

- ``zserve:control``: a hash ``{version, paused, loras}``, the state every host follows: ``paused`` is the JSON list
  of the models an operator paused (null: every model), ``loras`` the LoRA adapters served (``[name, model, path]``
  each: every host's engines load them, ``launch.ops.lora``). A new version is a change: a Redis restarted without its
  data counts from 1 again, and until something is written hosts keep theirs;
- ``zserve:hosts``: a hash host id → ``{"seen": unix time, "applied": version}``, written every heartbeat;
- a pub/sub channel ``zserve:control`` that says "changed", so hosts apply a change at once rather than at
  their next heartbeat;
- ``zserve:aborts``: the last 64 aborts asked through any host (``POST /abort_requests``: ``{"key", "ids"}`` each);
  every other host ends those requests on its gateways and writes which it found to the hash
  ``zserve:aborted:KEY`` (host → ids, kept a minute), which the asking host merges into its answer.

A control request on any host (``/pause``, ``/resume``, a LoRA load or unload) writes the state and is answered
only once every host heard from within the liveness window has applied that version (its own gateways acknowledged
it, its engines loaded the adapters), as one host's gateways are waited for. Redis going away never stops a host:
it keeps the last state it knew, logs loudly once (and once more when Redis is back), and takes the shared state
again on recovery. A control request while Redis is away takes effect on this host only, and its reply says so.

The subscriber is a thread (redis-py's pub/sub blocks); it only wakes the supervisor's loop, which does every
read and write itself with short socket timeouts.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import orjson

from protocol.cluster import LoraInfo
from zserve.proc import redact_url

log = logging.getLogger("zserve.launch")

KEY, HOSTS, CHANNEL = "zserve:control", "zserve:hosts", "zserve:control"
ABORTS, ABORTED = "zserve:aborts", "zserve:aborted:"
KEPT_ABORTS = 64  # the aborts the list keeps (a host reads them when told of a change)
TIMEOUT_S = 0.5  # each Redis call; a host whose Redis hangs stalls its loop at most this long per call
LIVE_S = 10.0  # a host not seen for this long is not waited for


def is_redis(url: str | None) -> bool:
    return bool(url) and url.split("://", 1)[0].lower() in ("redis", "rediss", "unix")


class SharedControl:
    def __init__(self, url: str, wake: Callable[[], None], interval: float):
        import redis  # only deployments with a Redis URL pay for the import

        self.errors = (redis.RedisError, OSError)  # what "Redis is away" looks like
        self.url = url
        self.host = f"{socket.gethostname()}:{os.getpid()}"
        self.interval = interval
        self.client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        self.wake = wake
        self.version = 0  # of the shared state this host applied last
        self.paused: frozenset[str | None] | None = None  # the models paused (None: every one); None until read
        self.loras: tuple[LoraInfo, ...] = ()  # the LoRA adapters served, as last read or written
        self.changed = threading.Event()
        self.up: bool | None = None
        self.last_beat = 0.0
        self.reported = 0  # the version this host last said it applied
        self.aborts_seen: set[str] | None = None  # the abort keys read (None: none read yet, the old ones are not ours)
        self.aborts: list[tuple[str, tuple[str, ...]]] = []  # other hosts' aborts to carry out here
        self.stopping = False
        threading.Thread(target=self._listen, name="zserve-shared-state", daemon=True).start()

    # -- the subscriber thread --------------------------------------------------------------------------------
    def _listen(self) -> None:
        while not self.stopping:
            try:
                sub = self.client.pubsub(ignore_subscribe_messages=True)
                sub.subscribe(CHANNEL)
                self.changed.set()  # (re)subscribed: read the state, it may have changed meanwhile
                self.wake()
                while not self.stopping:
                    if sub.get_message(timeout=1.0) is not None:
                        self.changed.set()
                        self.wake()
            except self.errors:
                time.sleep(1.0)

    # -- the supervisor's loop ------------------------------------------------------------------------------
    def _failed(self, e: Exception) -> None:
        if self.up is not False:
            log.error("the shared control state at %s is unreachable (%s): this host keeps its last state (%s) and "
                      "control requests take effect here only, until it is back", redact_url(self.url), e,
                      "paused" if self.paused else "serving")
        self.up = False

    def _ok(self) -> None:
        if self.up is False:
            log.warning("the shared control state at %s is reachable again", redact_url(self.url))
        self.up = True

    def poll(self, now: float, applied: Callable[[], bool]
             ) -> tuple[frozenset[str | None], tuple[LoraInfo, ...]] | None:
        """The models paused and the LoRA adapters served, to apply when the shared state changed (None: nothing
        new); and the heartbeat that tells the others which version this host applied (``applied``: its gateways
        acknowledged it and its engines have the adapters)."""
        new = None
        if self.up is False and now - self.last_beat < self.interval:
            return None  # away: try again once a heartbeat interval, not on every turn of the loop
        if self.changed.is_set() or self.up is not True:
            self.changed.clear()
            try:
                got = self.client.hgetall(KEY)
                self._ok()
            except self.errors as e:
                self._failed(e)
                self.last_beat = now
                return None
            self._read_aborts()
            if not got:  # a Redis that lost its data (restarted empty): keep ours; what is written next counts
                self.version = self.reported = 0
            else:
                version, paused = int(got.get(b"version", 0)), _paused(got.get(b"paused"))
                loras = _loras(got.get(b"loras"))
                if version != self.version:  # (lower too: a restarted Redis counts from 1 again)
                    self.version, self.paused, self.loras, new = version, paused, loras, (paused, loras)
        done = self.version if applied() else self.version - 1
        if now - self.last_beat >= self.interval or done > self.reported:
            self.last_beat = now
            try:
                self.client.hset(HOSTS, self.host, orjson.dumps({"seen": time.time(), "applied": done}))
                if done > self.reported:
                    self.client.publish(CHANNEL, b"applied")  # the host that asked answers now, not in a second
                self.reported = done
                self._ok()
            except self.errors as e:
                self._failed(e)
        return new

    def publish(self, paused: frozenset[str | None], loras: tuple[LoraInfo, ...] | None = None) -> int | None:
        """Write a new state for every host (``loras`` None: the adapters as they are); its version, or None when
        Redis is away (this host only)."""
        loras = self.loras if loras is None else loras
        try:
            pipe = self.client.pipeline()
            pipe.hincrby(KEY, "version", 1)
            pipe.hset(KEY, "paused", orjson.dumps(sorted(paused, key=lambda m: m or "")))
            pipe.hset(KEY, "loras", orjson.dumps([[a.name, a.model, a.path] for a in loras]))
            version = int(pipe.execute()[0])
            self.client.publish(CHANNEL, str(version))
            self._ok()
        except self.errors as e:
            self._failed(e)
            return None
        self.version, self.paused, self.loras = version, paused, loras
        return version

    # -- aborts ------------------------------------------------------------------------------------------------
    def post_abort(self, ids: tuple[str, ...]) -> str | None:
        """Ask every other host to abort ``ids``; the key their answers come under (None: Redis is away)."""
        key = f"{self.host}:{time.time_ns()}"
        try:
            pipe = self.client.pipeline()
            pipe.rpush(ABORTS, orjson.dumps({"key": key, "ids": list(ids)}))
            pipe.ltrim(ABORTS, -KEPT_ABORTS, -1)
            pipe.execute()
            self.client.publish(CHANNEL, b"abort")
            self._ok()
        except self.errors as e:
            self._failed(e)
            return None
        if self.aborts_seen is not None:
            self.aborts_seen.add(key)
        return key

    def _read_aborts(self) -> None:
        try:
            raw = self.client.lrange(ABORTS, 0, -1)
        except self.errors:
            return
        entries = []
        for line in raw:
            try:
                e = orjson.loads(line)
                entries.append((str(e["key"]), tuple(str(i) for i in e["ids"])))
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
        if self.aborts_seen is None:  # (aborts asked before this host came are not its business)
            self.aborts_seen = {k for k, _ in entries}
            return
        for key, ids in entries:
            if key not in self.aborts_seen and not key.startswith(self.host + ":"):
                self.aborts.append((key, ids))
            self.aborts_seen.add(key)
        keys = {k for k, _ in entries}
        self.aborts_seen &= keys | {k for k, _ in self.aborts}

    def take_aborts(self) -> list[tuple[str, tuple[str, ...]]]:
        """Other hosts' aborts not carried out here yet (key, ids)."""
        out, self.aborts = self.aborts, []
        return out

    def answer_abort(self, key: str, found: list[str]) -> None:
        """This host's answer to abort ``key``: the ids its gateways were serving."""
        try:
            pipe = self.client.pipeline()
            pipe.hset(ABORTED + key, self.host, orjson.dumps(found))
            pipe.expire(ABORTED + key, 60)
            pipe.execute()
            self.client.publish(CHANNEL, b"aborted")
        except self.errors as e:
            self._failed(e)

    def abort_answers(self, key: str) -> tuple[set[str], set[str]]:
        """The ids the other hosts found for abort ``key``, and which hosts have answered."""
        try:
            got = self.client.hgetall(ABORTED + key)
        except self.errors as e:
            self._failed(e)
            return set(), set()
        found, hosts = set(), set()
        for host, raw in got.items():
            try:
                found.update(str(i) for i in orjson.loads(raw))
            except (orjson.JSONDecodeError, TypeError):
                continue
            hosts.add(host.decode(errors="replace"))
        return found, hosts

    def live_hosts(self) -> set[str]:
        """The other hosts heard from within the liveness window."""
        try:
            hosts = self.client.hgetall(HOSTS)
        except self.errors as e:
            self._failed(e)
            return set()
        now, live = time.time(), set()
        for host, raw in hosts.items():
            try:
                seen = float(orjson.loads(raw)["seen"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            name = host.decode(errors="replace")
            if name != self.host and now - seen <= LIVE_S:
                live.add(name)
        return live

    def applied_by_all(self, version: int) -> list[str]:
        """The live hosts (other than this one) that have not applied ``version`` yet; [] when Redis is away."""
        try:
            hosts = self.client.hgetall(HOSTS)
        except self.errors as e:
            self._failed(e)
            return []
        now, behind = time.time(), []
        for host, raw in hosts.items():
            try:
                h = orjson.loads(raw)
                seen, applied = float(h["seen"]), int(h["applied"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            name = host.decode(errors="replace")
            if name != self.host and now - seen <= LIVE_S and applied < version:
                behind.append(f"host {name}")
        return behind

    def leave(self) -> None:
        self.stopping = True
        try:
            self.client.hdel(HOSTS, self.host)
        except self.errors:
            pass


def _paused(raw: bytes | None) -> frozenset[str | None]:
    """The models paused, as the shared state writes them (anything unreadable: none)."""
    try:
        models = orjson.loads(raw or b"[]")
    except orjson.JSONDecodeError:
        return frozenset()
    if not isinstance(models, list):
        return frozenset()
    return frozenset(m for m in models if m is None or isinstance(m, str))


def _loras(raw: bytes | None) -> tuple[LoraInfo, ...]:
    """The LoRA adapters served, as the shared state writes them (an unreadable entry is left out)."""
    try:
        entries = orjson.loads(raw or b"[]")
    except orjson.JSONDecodeError:
        return ()
    out = []
    for e in entries if isinstance(entries, list) else ():
        try:
            out.append(LoraInfo(*e))
        except TypeError:
            continue
    return tuple(out)
