"""Which engine of a model takes a request: ``--routing-policy prefix`` (default), ``load`` or ``round-robin``.

``prefix`` scores each engine by the prompt tokens its prefix cache would find — what the engine's own KV events
say it holds (``gateway.kv_index``), not a guess kept per gateway — against its load:

1. **The bound.** An engine whose load (its running and waiting requests as it last reported them, with this
   gateway's requests sent since, or this gateway's own requests on it if more) would pass ``max_share`` times the
   fair share (the model's load, the new request included, over its engines; rounded up) takes none: under a single
   hot prefix the engine that holds it fills to the bound and the rest spills to the others, which then hold the
   prefix too. The default, 1.75, lets uniform traffic's random peaks stay (at 1.5, two engines serving 8 requests
   spill one in 16: each spill a whole prefill and a copy that takes another prefix's room).
2. **The longest match.** Of the others, the engines holding the longest run of the prompt's leading blocks —
   unless the request would wait there behind more requests than those blocks are worth (``LOAD_TOKENS`` prompt
   tokens a request in flight): then the engine where it costs least. A conversation's short turn moves to an
   engine two requests lighter; a long shared prefix stays.
3. **A prompt mostly new to all of them** (a new prefix, or one evicted) goes to the least loaded (its prefill costs
   the same anywhere), and of those where it costs the cache least (``room``): the engine with free room for it, or
   else the one whose blocks it would evict were used longest ago (the index keeps each engine's blocks in the
   order the engine last told them: on each request's arrival). So the prefixes in use spread over the engines'
   caches as over one cache. This gateway counts the prompts it placed as held until the engine tells of them
   (``PLACED_TTL``). Engines with as much room: rendezvous hashing of the first block none holds, which every
   gateway computes the same.
4. **A prompt mostly cached on several** (a prefix several hold): if this gateway has requests of that prefix in
   flight (a hot prefix), the least loaded of them, as the load policy would; otherwise the one that has held the
   prefix's deepest common block longest (then rendezvous hashing of that block), so a copy a spill made ages out of
   the other cache instead of taking its room.

Only the inputs differ between gateways: the events each has received (the same, a step late at most), the loads,
and the prompts each placed in the last ``PLACED_TTL`` seconds. So two gateways route a cached prefix to the same
engine unless their views of the loads differ (one sees that engine at the bound or far busier; a hot prefix is
shared by load). The first requests of a new prefix that reach two gateways before its engine has told of it
(an engine tells between two steps) may go to two engines: the next requests go to the one that held it first.

A prompt shorter than one block, an engine that publishes no events (``kv_block_size`` 0, a standalone
``--engine``), and pooling requests are routed by load. Hashing walks the prompt's blocks only while some engine
holds them: a long prompt that no engine holds costs one block hash.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from protocol import EngineHello, EngineStats
from protocol.kv_events import chain_hashes, chain_root

if TYPE_CHECKING:
    from .kv_index import KvFollower


class EngineConnection(Protocol):
    """What routing reads of an engine (``engine_client.EngineConnection``; seen through this, no import circle)."""

    endpoint: str
    outstanding: int
    sent_since_stats: int
    hello: EngineHello | None
    stats: EngineStats | None

    @property
    def rank(self) -> int | None: ...

    @property
    def load(self) -> float: ...

log = logging.getLogger("zserve.gateway.routing")

ROUTING_POLICIES = ("prefix", "load", "round-robin")
DEFAULT_MAX_SHARE = 1.75  # 1.5 spills uniform traffic at random peaks (see the module docstring)
# Prompt tokens one request in flight on an engine is worth against the tokens its cache saves a request (the
# compute it holds a newcomer up by: a cached request's suffix and output): a conversation's short turn moves to an
# engine two requests lighter, a long shared prefix stays unless its engine is eight busier (the bound comes first).
LOAD_TOKENS = 128
PLACED_TTL = 2.0  # seconds a gateway counts a new prompt it placed as held, before the engine's events tell it
# Why an engine was chosen (the metric's ``reason`` label):
#   cache — it holds the longest run of the prompt's blocks; room — a prompt new to every engine, placed where it
#   evicts the least recently used blocks (or none); hash — a tie broken by rendezvous hashing (engines with as
#   much room, or a prefix several hold); bound — an engine holding more was at the bound; load — least load
#   (the load policy, a prompt under a block, no events; a cached prompt whose engine is busier than its cache is
#   worth; a new prompt; a hot prefix several engines hold); round-robin.
ROUTING_REASONS = ("cache", "room", "hash", "bound", "load", "round-robin")
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit value of ``x``, the same in every process."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def busy(eng: EngineConnection) -> int:
    """An engine's load for the bound: its running and waiting requests as it last reported them with this gateway's
    own sent since that report (every gateway sees the same reports; counting only them, all would send to an
    engine that reported little until its next report), or this gateway's requests on it if more."""
    st = eng.stats
    reported = st.running + st.waiting if st is not None else 0
    return max(eng.outstanding, reported + eng.sent_since_stats)


class Router:
    """One gateway's routing. ``followers``: each engine's KV event follower by endpoint (the engine client's)."""

    def __init__(self, policy: str = "prefix", max_share: float = DEFAULT_MAX_SHARE,
                 followers: dict[str, KvFollower] | None = None,
                 on_decision: Callable[[str | None, str, int | None], None] | None = None):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}")
        self.policy = policy
        self.max_share = max_share
        self.followers = followers if followers is not None else {}
        self.on_decision = on_decision  # (model, reason, engine rank): the gateway's metrics
        self._turn = 0
        self._failed = False
        # Blocks of prompts new to every engine this gateway placed lately, by engine: (until when, blocks).
        self._placed: dict[str, deque[tuple[float, int]]] = {}
        # The last prefix pick: (the engine, the prefix it placed the prompt by: its deepest block held).
        self._last: tuple[EngineConnection, int] | None = None
        self._inflight: Counter[int] = Counter()  # this gateway's requests in flight, by that prefix

    def placed(self, eng: EngineConnection) -> int | None:
        """A request was sent to ``eng``: if the last pick chose it (not a pick without the router: one engine), count
        it in flight under its prefix, returned for ``left``."""
        last, self._last = self._last, None
        if last is None or last[0] is not eng:
            return None
        self._inflight[last[1]] += 1
        return last[1]

    def left(self, key: int) -> None:
        """A request ``placed`` returned ``key`` for ended (or went to another engine)."""
        n = self._inflight[key] - 1
        if n > 0:
            self._inflight[key] = n
        else:
            del self._inflight[key]

    def pick(self, ready: list[EngineConnection], prompt: Sequence[int] | None, model: str | None,
             lora: str | None) -> EngineConnection:
        """The engine of ``ready`` (two or more) that takes a request for ``prompt`` (None: a pooling request)."""
        eng, reason = self._choose(ready, prompt, lora)
        if self.on_decision is not None:
            self.on_decision(model, reason, eng.rank)
        return eng

    def _choose(self, ready: list[EngineConnection], prompt: Sequence[int] | None,
                lora: str | None) -> tuple[EngineConnection, str]:
        if self.policy == "round-robin":
            self._turn += 1
            return ready[self._turn % len(ready)], "round-robin"
        if self.policy == "prefix" and prompt is not None:
            try:
                chosen = self._by_prefix(ready, prompt, lora)
            except Exception:  # no request fails because of the router: it is routed by load instead
                if not self._failed:
                    log.exception("prefix routing failed; routing by load (logged once)")
                self._failed = True
                chosen = None
            if chosen is not None:
                return chosen
        return self._least_loaded(ready), "load"

    def _room(self, eng: EngineConnection, follower: KvFollower | None, need: int, now: float) -> tuple[int, float]:
        """How little ``need`` more blocks would cost ``eng`` (the least is best): ``(0, -free blocks left)`` while
        its cache has room for them, else ``(1, when it last used the last block it would evict)``. The blocks
        this gateway placed there that the engine has not told of yet count as held."""
        if follower is None:
            return (0, 0.0)
        placed = self._placed.get(eng.endpoint)
        while placed and placed[0][0] < now:
            placed.popleft()
        state = follower.state
        held = len(state.blocks) + (sum(n for _, n in placed) if placed else 0)
        total = (eng.stats.kv_blocks_total if eng.stats is not None else 0) or held
        over = held + need - total
        return (0, float(over)) if over <= 0 else (1, state.stalest(over))

    def _least_loaded(self, ready: list[EngineConnection]) -> EngineConnection:
        least = min(e.load for e in ready)
        tied = [e for e in ready if e.load == least]
        self._turn += 1  # ties rotate, so light sequential traffic still reaches every engine
        return tied[self._turn % len(tied)]

    def _by_prefix(self, ready: list[EngineConnection], prompt: Sequence[int],
                   lora: str | None) -> tuple[EngineConnection, str] | None:
        hello = ready[0].hello
        bs = hello.kv_block_size if hello is not None else 0
        if bs <= 0 or len(prompt) < bs or any(e.hello is None or e.hello.kv_block_size != bs for e in ready):
            return None
        followers = self.followers
        held = [followers.get(e.endpoint) for e in ready]
        if not any(held):
            return None
        loads = [busy(e) for e in ready]
        cap = math.ceil(self.max_share * (sum(loads) + 1) / len(ready))
        eligible = [i for i, load in enumerate(loads) if load + 1 <= cap] or list(range(len(ready)))
        # Walk the prompt's blocks while some engine holds them: matched[i] = blocks engine i would find.
        matched = [0] * len(ready)
        alive = [i for i in range(len(ready)) if held[i] is not None]
        parent = chain_root(hello.model_id, lora)  # type: ignore[union-attr]
        hashes: list[int] = []
        for b, h in enumerate(chain_hashes(prompt, bs, parent)):
            hashes.append(h)
            alive = [i for i in alive if h in held[i].state.blocks]  # type: ignore[union-attr]
            if not alive:
                break
            for i in alive:
                matched[i] = b + 1
        n = len(prompt) // bs  # the prompt's full blocks
        best = max(matched[i] for i in eligible)
        bounded = max(matched) > best  # an engine holding more is at the bound
        tied = [i for i in eligible if matched[i] == best]
        reason = "cache" if best else "hash"
        if best and 2 * best >= n:
            # Cached mostly, on engines busier than another by more requests than the tokens it saves are worth:
            # the engine where the request costs least, counting LOAD_TOKENS a request in flight.
            costs = {i: (best - matched[i]) * bs + LOAD_TOKENS * loads[i] for i in eligible}
            cheapest = min(costs.values())
            if min(costs[i] for i in tied) > cheapest:
                tied = [i for i in eligible if costs[i] == cheapest]
                best, reason = max(matched[i] for i in tied), "load"
                tied = [i for i in tied if matched[i] == best]
        # Rendezvous hashing's key: the first block none of the tied holds (or the prompt's last), the same for every
        # request of a new prefix; the prefix a request is counted in flight under: its deepest block they hold.
        hkey = hashes[min(best, len(hashes) - 1)]
        key = hashes[best - 1] if best else hkey
        mostly_new = 2 * best < n
        if len(tied) > 1 and not mostly_new:
            # Mostly cached on several. A prefix this gateway has requests of in flight (a hot one) is shared by
            # load, as the load policy would; otherwise the one holding its deepest block they all hold longest
            # keeps it (then by that block's rendezvous hash), so a copy a spill made ages out of the other cache
            # instead of taking its room.
            if self._inflight.get(key):
                least = min(ready[i].load for i in tied)
                lighter = [i for i in tied if ready[i].load == least]
                if len(lighter) < len(tied):
                    tied, reason = lighter, "load"
            held_since = [held[i].state.since.get(key, math.inf) for i in tied]  # type: ignore[union-attr]
            tied = [i for i, t in zip(tied, held_since) if t == min(held_since)]
            hkey = key
        elif len(tied) > 1:
            # Mostly new to all of them: its prefill costs the same anywhere, what it evicts does not. Of those no
            # busier than the least loaded by more than half its prefill is worth (a short prompt: none), the one
            # where it evicts what was used longest ago (or nothing).
            need = n - best
            least = min(loads[i] for i in tied)
            slack = need * bs // (2 * LOAD_TOKENS)
            if any(loads[i] > least + slack for i in tied):
                tied, reason = [i for i in tied if loads[i] <= least + slack], "load"
            if len(tied) > 1:
                now = time.monotonic()
                rooms = [self._room(ready[i], held[i], need, now) for i in tied]
                tied = [i for i, room in zip(tied, rooms) if room == min(rooms)]
                reason = "room" if len(tied) < len(rooms) else "hash"
        if len(tied) == 1:
            i = tied[0]
        else:
            i = max(tied, key=lambda j: (_mix(hkey ^ _mix(ready[j].rank or 0)), ready[j].endpoint))
            reason = "hash" if reason == "cache" else reason
        if mostly_new:
            self._placed.setdefault(ready[i].endpoint, deque()).append((time.monotonic() + PLACED_TTL, n - matched[i]))
        if bounded:
            reason = "bound"
        self._last = (ready[i], key)
        return ready[i], reason
