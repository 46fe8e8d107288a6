"""Weighted fairness between tenants in one engine: the Virtual Token Counter of "Fairness in Serving Large Language
Models" (Sheng et al., OSDI 2024).

Each tenant (``Sequence.tenant``, from the gateway's tenants file) has a counter of the service it received: prompt
tokens computed count ``PROMPT_COST`` each and generated tokens ``OUTPUT_COST`` each (a decode step costs about what
a few prompt tokens do in a chunked batch, and the paper weighs output above input likewise), divided by the tenant's
weight. While requests of two or more tenants are here, the scheduler serves the tenant with the lowest counter
first (then priority, then arrival; ``engine_worker.scheduler`` says how: admission, prompt chunks, slots), so a
tenant that floods the queue gets its weighted share of the engine and no more, and a tenant sending at a modest
rate is served at once instead of behind the flood. A tenant that arrives with nothing queued or running has its
counter lifted to the lowest counter of the tenants that are active, less a small credit (one step's token budget,
so its first request goes before the busy tenants' next ones; never lowered): time spent idle is not credit to spend
later in a burst. When the KV cache runs out, the request preempted comes from the tenant furthest above its share.

With one tenant (or none: every request's tenant is "") nothing here changes the order: priority, then arrival.
"""

from __future__ import annotations

import time
from collections import Counter

PROMPT_COST, OUTPUT_COST = 1.0, 2.0
LINGER = 5.0  # seconds a tenant gone idle still counts for the short chunks of the others (it is likely back soon)
MAX_IDLE_COUNTERS = 4096  # counters of tenants with nothing active, kept for their return (then the oldest go)


class Fairness:
    def __init__(self, credit: float = 0.0) -> None:
        """``credit``: how far below the lowest active counter a tenant returning from idle starts (the scheduler
        gives one step's token budget): its first request goes before the busy tenants' next ones, not behind."""
        self.credit = credit
        self.counters: dict[str, float] = {}
        self.active: Counter[str] = Counter()  # tenant -> its requests waiting or running
        self.idle_since: dict[str, float] = {}  # tenant -> when its last request ended (within LINGER)

    @property
    def contended(self) -> bool:
        """Two tenants or more have requests here: the order is fairness's to decide."""
        return len(self.active) > 1

    def arrived(self, tenant: str) -> None:
        self.idle_since.pop(tenant, None)
        if not self.active[tenant]:
            live = [self.counters.get(t, 0.0) for t, n in self.active.items() if n and t != tenant]
            if live:
                self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(live) - self.credit)
        self.active[tenant] += 1

    def left(self, tenant: str) -> None:
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]
            self.idle_since[tenant] = time.monotonic()
            if len(self.counters) > MAX_IDLE_COUNTERS:
                for t in [t for t in self.counters if t not in self.active][: len(self.counters) // 2]:
                    del self.counters[t]

    def over_share(self, now: float) -> set[str]:
        """The active tenants whose prompts run in short chunks (the scheduler's ``FAIR_CHUNK``): while two tenants
        or more are active, or were within ``LINGER`` seconds, those above the lowest counter among them."""
        for t in [t for t, since in self.idle_since.items() if now - since >= LINGER]:
            del self.idle_since[t]
        if len(self.active) + len(self.idle_since) < 2:
            return set()
        floor = min(self.counter(t) for t in (*self.active, *self.idle_since))
        return {t for t in self.active if self.counter(t) > floor}

    def served(self, tenant: str, weight: float, prompt_tokens: int, output_tokens: int) -> None:
        cost = prompt_tokens * PROMPT_COST + output_tokens * OUTPUT_COST
        if cost:
            self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / weight

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def rank(self, tenant: str) -> tuple[float, int]:
        """Lower goes first: the counter, then (a tie, as a tenant lifted on arrival makes) fewer requests here."""
        return self.counter(tenant), self.active[tenant]
