"""A rolling restart (SIGHUP, ``launch reload``, systemd's ``ExecReload=``): every process replaced, one at a
time, so that an upgrade of the code or its files drops no request.

gunicorn's convention, which operators expect of SIGHUP. A state machine the supervisor's loop turns (``tick``):

- **Gateways first**, each: its replacement starts (the same index, the same inherited listening socket)
  while the old one serves; once the new one is ready, the old one drains (it stops accepting, finishes its
  in-flight requests, then exits) and only then does the next gateway's turn come.
- **Then engines**, each: the old one leaves routing and drains (it hands back what it has not started and
  finishes the rest); the slot starts a replacement once it has exited (they share the socket path); the
  next engine waits until the replacement is ready. Replacing the only ready engine of a model holds that
  model's new requests in the meantime (a ``reloading`` hold, ``protocol.holds``): gateways hold them, up to
  ``--scaling-wait``, rather than refuse them, and serve every other model throughout. With two engines or more
  a model never stops serving.

It sees the supervisor only through ``launch.interfaces``: the processes, the cluster publisher, the admission
owner.

Expert-parallel engines are left alone: replacing one member breaks its group, so those are changed with a
resize (``/scale_elastic_ep``), which re-forms the group from processes that load the new files.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from protocol.control import ReloadReply

from ..children import Child
from ..control_server import Later
from ..interfaces import Holds, Processes, Publisher
from ..tiers import ModelTier

log = logging.getLogger("zserve.launch")


@dataclass
class _Turn:
    tier: str
    index: int
    old: Child
    since: float
    signaled: bool = False
    paused: bool = False  # its model's only engine: the model's requests are held
    model: str | None = None  # an engine's model
    version: int = 0  # an engine hears SIGTERM once every gateway applied this cluster state


@dataclass
class RollingRestart:
    procs: Processes
    publisher: Publisher
    holds: Holds
    tiers: Sequence[ModelTier]
    answers: list[Later] = field(default_factory=list)
    queue: list[tuple[str, int]] = field(default_factory=list)
    turn: _Turn | None = None
    started: float = field(default_factory=time.monotonic)
    replaced: int = 0
    done: bool = False  # every process replaced and the commands that asked for it answered

    @classmethod
    def begin(cls, procs: Processes, publisher: Publisher, holds: Holds, tiers: Sequence[ModelTier]
              ) -> RollingRestart:
        queue = [("gateway", i) for i in range(procs.gateways_desired())]
        for tier in tiers:
            if tier.spec.engine.expert_parallel:
                log.warning("reload: the expert-parallel engines of %s are not replaced (resize them with "
                            "/scale_elastic_ep)", tier.model_id)
                continue
            queue += [("engine", rank) for rank in tier.ranks]
        log.info("reload: replacing %d process(es) one at a time", len(queue))
        return cls(procs, publisher, holds, tiers, queue=queue)

    def tick(self, now: float) -> None:
        if self.turn is None:
            self._next(now)
            return
        t = self.turn
        fresh = [c for c in self.procs.live(t.tier) if c.index == t.index and not c.draining]
        if t.tier == "gateway":
            if not t.signaled and fresh and fresh[0].ready:
                t.signaled = True  # the replacement serves: the old one drains now
                t.old.drain_started = now
                t.old.signal(signal.SIGTERM)
            if t.signaled and not t.old.alive:
                self._turn_over(t, fresh)
        elif not t.signaled:
            if not self.publisher.lagging(t.version):  # no gateway routes to it any more, requests are held
                t.signaled = True
                t.old.signal(signal.SIGTERM)
        elif fresh and fresh[0].ready and not t.old.alive:
            if t.paused:
                self.publisher.publish()  # gateways know the replacement before they admit requests again
                self.holds.release("reloading", t.model)
            self._turn_over(t, fresh)
        if self.turn is t and now - t.since > self.procs.ready_timeout + self.procs.shutdown_timeout + 10:
            log.error("reload: %s was not replaced in time; going on", t.old.name)
            if t.paused:
                self.holds.release("reloading", t.model)
            self.turn = None

    def _next(self, now: float) -> None:
        while self.queue:
            tier, index = self.queue.pop(0)
            old = next((c for c in self.procs.live(tier) if c.index == index and not c.draining), None)
            if old is None:
                continue  # gone meanwhile (scaled down, or restarting anyway)
            self.turn = _Turn(tier, index, old, now)
            old.draining = True  # out of its slot's count: the slot starts a replacement
            if tier == "engine":
                model = next(t for t in self.tiers if t.owns(index))
                self.turn.model = model.model_id
                others = [c for c in self.procs.live("engine") if model.owns(c.index) and c.ready and not c.draining]
                if not others:  # the model's only engine: hold its requests until the replacement is ready
                    self.turn.paused = True
                    self.holds.hold("reloading", model.model_id)
                old.drain_started = now
                # Gateways stop routing to it (and hold its model) before it hears SIGTERM (in ``tick``).
                self.turn.version = self.publisher.publish()
            log.info("reload: replacing %s (pid %d)", old.name, old.pid)
            return
        self._finish()

    def _turn_over(self, t: _Turn, fresh: list[Child]) -> None:
        log.info("reload: %s replaced (pid %d → %d)", t.old.name, t.old.pid, fresh[0].pid)
        self.replaced += 1
        self.turn = None

    def _finish(self) -> None:
        took = time.monotonic() - self.started
        log.info("reload: done, %d process(es) replaced in %.1fs", self.replaced, took)
        for answer in self.answers:
            answer.reply = ReloadReply(self.replaced, round(took, 3))
        self.answers = []
        self.done = True
