"""Which engine of a model takes a request: ``--routing-policy prefix`` (default), ``load`` or ``round-robin``.

``prefix`` scores each engine by the prompt tokens its prefix cache would find — what the engine's own KV events
say it holds (``gateway.kv_index``), not a guess kept per gateway — against its load:

1. **The bound.** An engine whose load (its running and waiting requests as it reported them, or this gateway's
   own requests on it if more) would pass ``max_share`` times the fair share (the model's load, the new request
   included, over its engines; rounded up) takes none: under a single hot prefix the engine that holds it fills to
   the bound and the rest spills to the others, which then hold the prefix too.
2. **The longest match.** Of the others, the engines holding the longest run of the prompt's leading blocks.
3. **Ties** go to those within ``TIE_SLACK`` requests of the least loaded of them (a busier engine is not given
   new prefixes), and of those to the first by rendezvous hashing: of the first block none of them holds for a
   prompt mostly new to them; of the deepest block they all hold for one mostly cached on each (a hot prefix), so
   that such a prefix keeps one engine while loads allow (a copy a spill made ages out of the other engine's cache
   instead of taking its room). Every gateway computes the hash the same way: the first requests of a new prefix
   reach one engine from every gateway, before any event has told of it (behind a chat template every engine
   holds, too).

Only the inputs differ between gateways: the events each has received (the same, a step late at most) and the loads
(each engine reports them to every gateway; a gateway adds its own requests sent since). So two gateways route a
prefix to the same engine unless their views of the loads differ: one sees that engine at the bound, or more than
``TIE_SLACK`` busier than another that holds as much.

A prompt shorter than one block, an engine that publishes no events (``kv_block_size`` 0, a standalone
``--engine``), and pooling requests are routed by load. Hashing walks the prompt's blocks only while some engine
holds them: a long prompt that no engine holds costs one block hash.
"""

from __future__ import annotations

import logging
import math
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
    hello: EngineHello | None
    stats: EngineStats | None

    @property
    def rank(self) -> int | None: ...

    @property
    def load(self) -> float: ...

log = logging.getLogger("zserve.gateway.routing")

ROUTING_POLICIES = ("prefix", "load", "round-robin")
DEFAULT_MAX_SHARE = 1.5
TIE_SLACK = 1  # requests of load by which engines holding most of a prompt count as equally loaded
# Why an engine was chosen (the metric's ``reason`` label):
#   cache — it holds the longest run of the prompt's blocks; hash — a tie broken by rendezvous hashing (a new
#   prefix, or one several engines hold); bound — an engine holding more was at the bound; load — least load
#   (the load policy, a prompt under a block, no events, or the lightest of several holding most of the prompt);
#   round-robin.
ROUTING_REASONS = ("cache", "hash", "bound", "load", "round-robin")
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit value of ``x``, the same in every process."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def busy(eng: EngineConnection) -> int:
    """An engine's load for the bound: its running and waiting requests as it last reported them, or this gateway's
    own requests on it if more (sent since its report)."""
    st = eng.stats
    return max(eng.outstanding, st.running + st.waiting if st is not None else 0)


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
        best = max(matched[i] for i in eligible)
        tied = [i for i in eligible if matched[i] == best]
        reason = "cache" if best else "hash"
        key = hashes[min(best, len(hashes) - 1)]  # the first block none of the tied holds (or the prompt's last)
        if len(tied) > 1:
            # Several hold as much: those within TIE_SLACK of the least loaded (new prefixes are not piled onto a
            # busier engine); a prompt mostly cached on each (a prefix several hold) keeps one engine by its deepest
            # block they all hold, so a copy a spill made ages out of the other cache instead of taking its room.
            least = min(loads[i] for i in tied)
            lighter = [i for i in tied if loads[i] <= least + TIE_SLACK]
            if len(lighter) < len(tied):
                tied, reason = lighter, "load"
            if 2 * best >= len(prompt) // bs:
                key = hashes[best - 1]
        if len(tied) == 1:
            i = tied[0]
        else:
            i = max(tied, key=lambda j: (_mix(key ^ _mix(ready[j].rank or 0)), ready[j].endpoint))
            reason = "hash" if reason != "load" else reason
        if max(matched) > best:
            reason = "bound"
        return ready[i], reason
