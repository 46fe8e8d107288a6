"""The supervisor's side of an expert-parallel engine tier: forming its group, resizing it, re-forming it.

One ``ElasticGroup`` per model served with ``--expert-parallel``. It is a state machine the supervisor's
reconcile loop turns (``tick``), so a resize never blocks the loop; its phase is part of the cluster state
(``ClusterState.scaling``), so every gateway reports the same ``/is_scaling_elastic_ep``; while it pauses
admission it holds the model's new requests (a ``resizing`` hold, ``protocol.holds``), and only that model's.
vLLM keeps that flag in its one API server; here it lives in the cluster state, so any number of gateways serve
through a resize. The group sees the supervisor only through ``launch.interfaces``: the processes, the cluster
publisher and the admission owner.

A resize from S to T members (``ElasticScaleCommand``, ``launch scale engine``):

1. **starting** (growing only): the new members start and load their share of the experts for T while
   the old group keeps serving. One that dies or does not load abandons the resize: nothing changed.
2. **draining**: admission pauses on every gateway (requests wait there, up to ``--scaling-wait``). Once
   every gateway applied the pause, each member gets ``GroupFreeze``: it finishes the requests it has and
   reports ``frozen``, after which it starts no group step of its own (a request still on its way waits in
   its queue). Not all frozen within ``drain_timeout``: they thaw, admission resumes, the new members stop,
   nothing changed (408).
3. **regrouping**: leavers stop; members 0..T-1 get a ``GroupCommand`` for the next generation: they
   re-shard their experts (keep, load, release) and meet at a fresh rendezvous file in the private run
   directory. When all report ``formed``, admission resumes. The pause is stages 2 and 3 only.

If a member dies while serving (or reports ``lost``), the group is broken: admission pauses
("recovering"), the survivors have already ended their requests with an error, the slot restarts as any
engine's does, and the group is formed again at its size once every member is loaded; if the slot is
crash-looping, at the largest size whose members are all alive. A resize whose re-forming fails recovers
the same way, at the old size.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field

from protocol.control import ELASTIC_OUTCOMES, ElasticScaleReply, GroupCommand, GroupFreeze, GroupReport

from ..children import Child
from ..control_server import Later
from ..interfaces import Holds, Processes, Publisher
from ..tiers import ModelTier

log = logging.getLogger("zserve.launch")

FORM_TIMEOUT_S = 90.0  # a formation that has not completed by then failed (the engines' join timeout is 60 s)


@dataclass
class Resize:
    old: int
    target: int
    drain_timeout: float
    answer: Later
    phase: str = "starting"
    since: float = field(default_factory=time.monotonic)
    paused_at: float | None = None
    freeze_sent: bool = False


def num_experts(tier: ModelTier) -> int:
    """The model's experts per layer from its ``config.json`` (the supervisor does not import torch)."""
    import orjson

    try:
        with open(os.path.join(tier.source.path, "config.json"), "rb") as f:
            return int(orjson.loads(f.read()).get("num_local_experts") or 0)
    except (OSError, ValueError, TypeError):
        return 0


class ElasticGroup:
    def __init__(self, procs: Processes, publisher: Publisher, holds: Holds, tier: ModelTier):
        self.procs = procs
        self.publisher = publisher
        self.holds = holds
        self.tier = tier
        self.hold_version = 0  # the cluster-state version that carried the hold of the running pause
        self.experts = num_experts(tier)
        self.generation = 0  # the last one commanded
        self.current: int | None = None  # the generation formed and serving
        self.size = tier.desired
        self.members: dict[int, int] = {}  # engine index -> the generation it reported formed
        self.forming: tuple[int, int, float] | None = None  # (generation, size, deadline)
        self.failures: list[str] = []  # why members could not join the forming generation
        self.broken = False  # a member died or lost the group: re-form it
        self.resize: Resize | None = None
        self.frozen: set[int] = set()  # members that reported frozen for the running resize
        self.retry_at = 0.0  # after a failed formation, the next try waits a moment
        self.last_error: str | None = None
        self.last_pause_s: float | None = None

    # -- what the supervisor asks -------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        if self.resize is not None:
            return self.resize.phase
        return "recovering" if self.broken else ""

    @property
    def serving(self) -> bool:
        return self.current is not None and not self.broken and self.forming is None

    def serves(self, index: int) -> bool:
        """Whether engine ``index`` is a member of the serving group (gateways may route to it)."""
        return self.current is not None and not self.broken and self.members.get(index) == self.current

    def status(self) -> dict:
        return {"size": self.size, "generation": self.current, "phase": self.phase or None,
                "experts": self.experts, "last_error": self.last_error, "last_pause_s": self.last_pause_s}

    def share(self, index: int) -> tuple[int, int]:
        """(member, size): a new member loads its share of the experts of the size the tier is heading for."""
        return index - self.tier.base, self.tier.desired

    # -- events --------------------------------------------------------------------------------------------
    def on_report(self, child: Child, msg: GroupReport) -> None:
        if msg.event == "frozen":
            if msg.generation == self.current and self.resize is not None:
                self.frozen.add(child.index)
            return
        if self.forming is None or msg.generation != self.forming[0]:
            if msg.event == "lost" and msg.generation == self.current and not child.draining:
                self._break(f"{child.name} lost the group: {msg.reason}")
            return
        if msg.event == "formed":
            self.members[child.index] = msg.generation
        else:
            self.failures.append(f"{child.name}: {msg.reason}")

    def on_death(self, child: Child, why: str) -> bool:
        """A member exited unexpectedly. True when that is handled here (a new member of a resize that is
        being abandoned: no restart, no boot-error stop)."""
        self.members.pop(child.index, None)
        r = self.resize
        if r is not None:
            new = child.index >= self.tier.base + r.old
            self._abandon(f"{'new member ' if new else ''}{child.name} "
                          f"{'failed to start' if new and r.phase == 'starting' else 'died'} ({why})")
            if new and r.phase == "starting":
                return True  # nothing else changed: the old group serves on
        if self.forming is not None:
            self.failures.append(f"{child.name} died ({why})")
        self._break(f"{child.name} died ({why})")
        self.last_error = f"{child.name} died ({why})"  # the cause, even when a survivor's report came first
        return False

    def request(self, target: int, drain_timeout: float, answer: Later) -> Later:
        if self.resize is not None or self.broken or self.forming is not None:
            answer.set(self._reply("busy", f"the group is {self.phase or 'forming'}; try again when it is done"))
        elif not 1 <= target <= self.experts:
            answer.set(self._reply("invalid", f"an expert-parallel group of {self.tier.model_id} has 1.."
                                              f"{self.experts} members (one expert each at least), not {target}"))
        elif target == self.size:
            answer.set(self._reply("ok", f"the group already has {target} members", pause_s=0.0))
        else:
            log.info("expert-parallel group of %s: resizing %d → %d (drain timeout %.0fs)", self.tier.model_id,
                     self.size, target, drain_timeout)
            self.resize = Resize(self.size, target, drain_timeout, answer)
            self.frozen = set()
            if target > self.size:
                self.procs.scale_engines(self.tier, target)  # the new members start loading
            else:
                self._pause("draining")
            self.publisher.publish()
        return answer

    # -- the state machine ---------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if self.forming is not None:
            self._check_forming(now)
        elif self.resize is not None:
            self._advance(self.resize, now)
        elif (self.current is None or self.broken) and now >= self.retry_at:
            self._recover(now)

    def _advance(self, r: Resize, now: float) -> None:
        members = self._members()
        if r.phase == "starting":
            new = [c for c in members if c.index >= self.tier.base + r.old]
            if len(new) == r.target - r.old and all(c.ready for c in new):
                self._pause("draining")
            elif now - r.since > self.procs.ready_timeout:
                self._abandon(f"the new members were not loaded within {self.procs.ready_timeout:.0f}s")
            return
        if r.phase == "draining":
            if self.publisher.lagging(self.hold_version):
                return  # a gateway may still admit requests
            old = [c for c in members if c.index < self.tier.base + r.old]
            if not r.freeze_sent:  # every request a gateway admitted is sent: the members finish them
                r.freeze_sent = True
                for c in old:
                    c.send(GroupFreeze(self.current or 0))
            if all(c.index in self.frozen for c in old):
                r.phase = "regrouping"
                self.procs.scale_engines(self.tier, r.target)  # leavers drain (they are idle)
                self.holds.hold("resizing", self.tier.model_id, "regrouping")
                self._form(r.target, now)
            elif r.paused_at is not None and now - r.paused_at > r.drain_timeout:
                for c in old:
                    c.send(GroupFreeze(self.current or 0, frozen=False))
                busy = sum((c.load.running + c.load.waiting) if c.load else 0 for c in old)
                self._finish("drain_timeout", f"in-flight requests did not finish within the drain timeout of "
                                              f"{r.drain_timeout:g}s ({busy} running or waiting at the last "
                                              f"heartbeat); the group keeps its {r.old} members")
                self.procs.scale_engines(self.tier, r.old)

    def _members(self) -> list[Child]:
        return [c for c in self.procs.live("engine") if self.tier.owns(c.index) and not c.draining]

    def _form(self, size: int, now: float) -> None:
        self.generation += 1
        gen = self.generation
        store = os.path.join(self.procs.run_dir, f"ep-{self.tier.base}-{gen}.store")
        peers = tuple(self.procs.engine_endpoint(self.tier.base + i) for i in range(size))
        by_index = {c.index: c for c in self._members()}
        # NCCL needs a GPU per member; members that share one (or run on CPUs) use gloo.
        backend = "nccl" if self.procs.num_gpus and self.tier.first_device + size <= self.procs.num_gpus else "gloo"
        threads = None if self.tier.spec.engine.threads else self.procs.engine_threads(self.tier, size)
        self.forming = (gen, size, now + FORM_TIMEOUT_S)
        self.failures = []
        log.info("expert-parallel group of %s: forming generation %d with %d member(s)", self.tier.model_id, gen,
                 size)
        for i in range(size):
            child = by_index.get(self.tier.base + i)
            if child is None or not child.send(GroupCommand(gen, size, i, store, peers, backend, threads)):
                self.failures.append(f"engine {self.tier.base + i} is not there")

    def _check_forming(self, now: float) -> None:
        gen, size, deadline = self.forming  # type: ignore[misc]
        joined = [i for i in range(self.tier.base, self.tier.base + size) if self.members.get(i) == gen]
        if len(joined) == size:
            self.forming = None
            self.current, self.size, self.broken = gen, size, False
            log.info("expert-parallel group of %s: generation %d serving with %d member(s)", self.tier.model_id,
                     gen, size)
            r = self.resize
            self.publisher.publish()  # the members are routable again (new ones for the first time)
            if r is not None:
                pause = time.monotonic() - r.paused_at if r.paused_at is not None else 0.0
                self.last_pause_s = round(pause, 3)
                self._finish("ok", f"the expert-parallel group has {size} members (was {r.old}); admission was "
                                   f"paused for {pause:.2f}s", pause_s=pause)
            else:
                self.holds.release("resizing", self.tier.model_id)
            return
        if not self.failures and now < deadline:
            return
        why = "; ".join(self.failures) or f"not every member joined within {FORM_TIMEOUT_S:.0f}s"
        self.forming = None
        self.retry_at = now + 1.0
        log.error("expert-parallel group of %s: generation %d failed: %s", self.tier.model_id, gen, why)
        r = self.resize
        if r is not None:
            # Back to the old size: new members stop, the old ones form the group again (recovering).
            self.procs.scale_engines(self.tier, min(r.old, self.tier.desired) if r.target < r.old else r.old)
            self._finish("failed", f"the resize to {r.target} members failed ({why}); the group is formed again "
                                   f"with {self.tier.desired}", resume=False)
        self._break(why)

    def _recover(self, now: float) -> None:
        """Form the group (at start, or after it broke) once every member of the wanted size is loaded; shrink
        the wanted size past a crash-looping slot."""
        wanted = list(self.tier.ranks)
        live = {c.index: c for c in self._members() if c.ready}
        if all(i in live for i in wanted):
            if wanted:
                self._form(len(wanted), now)
            return
        first_missing = next(i for i in wanted if i not in live)
        slot = self.procs.slot("engine", first_missing)
        if slot is not None and slot.crash_looping(now) and first_missing > self.tier.base:
            size = first_missing - self.tier.base
            log.error("expert-parallel group of %s: %s is crash-looping; forming the group with %d member(s)",
                      self.tier.model_id, slot.name, size)
            self.procs.scale_engines(self.tier, size)

    # -- helpers -------------------------------------------------------------------------------------------
    def _break(self, why: str) -> None:
        """The serving group lost a member: pause admission until it is formed again (a group never formed
        has nothing to break: ``tick`` forms it once its members are loaded)."""
        if self.broken:
            return
        self.last_error = why
        if self.current is None:
            return
        log.error("expert-parallel group of %s is broken: %s; forming it again", self.tier.model_id, why)
        self.broken = True
        self.members.clear()  # (idle survivors notice nothing: they leave the old group on the next command)
        self.hold_version = self.holds.hold("resizing", self.tier.model_id, "recovering")

    def _pause(self, phase: str) -> None:
        r = self.resize
        if r is not None:
            r.phase = phase
            r.paused_at = time.monotonic()
        self.hold_version = self.holds.hold("resizing", self.tier.model_id, phase)

    def _abandon(self, why: str) -> None:
        r = self.resize
        assert r is not None
        log.error("expert-parallel group of %s: %s; the resize to %d is abandoned", self.tier.model_id, why,
                  r.target)
        self.procs.scale_engines(self.tier, r.old)
        for c in self.procs.live("engine"):  # new members: stop them now
            if self.tier.owns(c.index) and c.index >= self.tier.base + r.old and not c.draining:
                c.draining = True  # on purpose: neither a failure nor restarted
                c.signal(signal.SIGKILL)
        self._finish("failed", f"{why}; the group keeps its {r.old} members")

    def _finish(self, outcome: str, message: str, pause_s: float | None = None, resume: bool = True) -> None:
        r = self.resize
        assert r is not None
        self.resize = None
        if outcome != "ok":
            self.last_error = message
        r.answer.set(self._reply(outcome, message, pause_s))
        log.log(logging.INFO if outcome == "ok" else logging.ERROR, "expert-parallel group of %s: %s",
                self.tier.model_id, message)
        if resume:
            self.holds.release("resizing", self.tier.model_id)
        else:
            self.publisher.publish()

    def _reply(self, outcome: str, message: str, pause_s: float | None = None) -> ElasticScaleReply:
        assert outcome in ELASTIC_OUTCOMES
        return ElasticScaleReply(outcome, message, self.size,
                                 round(pause_s, 3) if pause_s is not None else None)
