"""What each control-socket command does (``launch scale/status/stop/pause/resume/reload``, and the admin routes
every gateway forwards): the ``ControlServer``'s dispatch, and ``launch status``'s view of the server.

A pause or resume goes to the admission owner and, with ``--state-url redis://…``, to every other gateway host
through the shared state (``launch.hosts.shared_state``); it is answered once every gateway applied it
(``AwaitAcks``). A resize, a rolling restart and a LoRA load or unload (``launch.ops.lora``) are answered when they
are done (``Later``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

from protocol.cluster import LoraInfo
from protocol.control import (
    AbortCommand,
    ControlMessage,
    ElasticScaleCommand,
    ElasticScaleReply,
    ErrorReply,
    LoraLoadCommand,
    LoraUnloadCommand,
    OperationCommand,
    PauseCommand,
    PauseReply,
    ProcessStatus,
    ReloadCommand,
    ReloadReply,
    ResumeCommand,
    ScaleCommand,
    ScaleReply,
    StatusCommand,
    StatusReply,
    StopCommand,
    StopReply,
)
from zserve.config import MAX_ENGINES_PER_MODEL

from ..control_server import AwaitAcks, Later
from ..hosts.shared_state import SharedControl
from ..ops.aborts import Aborts
from ..ops.elastic import ElasticGroup
from ..ops.engine_ops import EngineOperations
from ..ops.lora import LoraAdapters
from ..ops.reload import RollingRestart
from ..tiers import ModelTier
from .admission import Admission
from .arbiter import Arbiter
from .publisher import ClusterPublisher

log = logging.getLogger("zserve.launch")


def _scale_reply(model: str, reply: ControlMessage) -> ControlMessage:
    """``launch scale engine`` of an expert-parallel tier gets the answer a scale command expects."""
    assert isinstance(reply, ElasticScaleReply)
    if reply.outcome == "ok":
        return ScaleReply("engine", reply.size, model)
    return ErrorReply(reply.message)


class Server(Protocol):
    """What the commands act on: the supervisor's parts (``server.Supervisor``)."""

    tiers: list[ModelTier]
    arbiter: Arbiter
    publisher: ClusterPublisher
    admission: Admission
    elastic: dict[int, ElasticGroup]
    shared: SharedControl | None
    loras: LoraAdapters
    operations: EngineOperations
    aborts: Aborts
    url: str
    started_at: float
    reload: Callable[[], RollingRestart]

    @property
    def run_dir(self) -> str: ...

    @property
    def model_ids(self) -> str: ...

    @property
    def render_only(self) -> bool: ...


class Commands:
    def __init__(self, sup: Server):
        self.sup = sup
        self._shared_local = 0  # the cluster-state version that applied the shared state's latest
        self._shared_waits: dict[int, int] = {}  # a pause's cluster-state version → its shared version

    def find_tier(self, model: str | None) -> ModelTier:
        """The tier serving ``model`` (its id or a served name; None while one model is served)."""
        tiers = self.sup.tiers
        if model is None and len(tiers) == 1:
            return tiers[0]
        found = [t for t in tiers if model == t.model_id or model in t.names]
        if model is None or not found:
            said = "name the model" if model is None else f"no model {model!r} is served"
            raise LookupError(f"{said}: one of {self.sup.model_ids}")
        return found[0]

    def dispatch(self, cmd: ControlMessage) -> ControlMessage | AwaitAcks | Later:
        """Carry out one control-socket command (the ControlServer's dispatch)."""
        sup = self.sup
        if isinstance(cmd, StatusCommand):
            return self.status(cmd.tenants)
        if isinstance(cmd, ScaleCommand):
            if cmd.tier_name == "gateway":
                sup.arbiter.scale("gateway", cmd.count)
                return ScaleReply("gateway", cmd.count)
            if sup.render_only:
                return ErrorReply("this is a render server (launch render): it has no engine tier to scale")
            try:
                tier = self.find_tier(cmd.model)
            except LookupError as e:
                return ErrorReply(f"scale engine: {e}")
            if cmd.count > MAX_ENGINES_PER_MODEL:
                return ErrorReply(f"a model has at most {MAX_ENGINES_PER_MODEL} engines")
            group = sup.elastic.get(tier.base)
            if group is not None:  # an expert-parallel tier is resized as one group
                return group.request(cmd.count, ElasticScaleCommand(cmd.count).drain_timeout,
                                     Later(convert=partial(_scale_reply, tier.model_id)))
            sup.arbiter.scale_engines(tier, cmd.count)
            return ScaleReply("engine", cmd.count, tier.model_id)
        if isinstance(cmd, ElasticScaleCommand):
            return self._elastic_scale(cmd)
        if isinstance(cmd, (PauseCommand, ResumeCommand)):
            return self._pause(isinstance(cmd, PauseCommand), cmd.model)
        if isinstance(cmd, LoraLoadCommand):
            return sup.loras.load(cmd.name, cmd.path, cmd.model, Later())
        if isinstance(cmd, LoraUnloadCommand):
            return sup.loras.unload(cmd.name, Later())
        if isinstance(cmd, OperationCommand):
            if sup.render_only:
                return ErrorReply("this is a render server (launch render): it has no engines to operate on")
            return sup.operations.request(cmd, Later())
        if isinstance(cmd, AbortCommand):
            return sup.aborts.request(cmd, Later())
        if isinstance(cmd, ReloadCommand):
            return self._reload(cmd)
        if isinstance(cmd, StopCommand):
            sup.arbiter.stopping = True
            return StopReply()
        return ErrorReply(f"unknown command {cmd.TYPE!r}")

    def _reload(self, cmd: ReloadCommand) -> ControlMessage | AwaitAcks | Later:
        """``launch reload``: the tenants file read again (refused whole when it is malformed: nothing restarts),
        then, unless ``tenants_only``, every process replaced."""
        sup = self.sup
        if cmd.tenants_only and sup.cfg.tenants is None:
            return ErrorReply("reload --tenants-only: this server has no tenants file (--tenants)")
        if cmd.tenants_only or sup.reloading is None:
            why, version = sup.reload_tenants()
            if why is not None:
                return ErrorReply(f"reload refused: {why}")
            if cmd.tenants_only:
                return AwaitAcks(version, ReloadReply(0, 0.0))
        answer = Later()
        sup.reload(tenants=False).answers.append(answer)
        return answer

    def _pause(self, paused: bool, model: str | None) -> ControlMessage | AwaitAcks:
        """An operator's pause or resume (of one model, or every one), on every gateway host."""
        admission, shared = self.sup.admission, self.sup.shared
        if model is not None:
            try:
                model = self.find_tier(model).model_id
            except LookupError as e:
                return ErrorReply(f"{'pause' if paused else 'resume'}: {e}")
        version = admission.pause(model) if paused else admission.resume(model)
        log.info("admission %s%s by an operator (cluster state v%d)", "paused" if paused else "resumed",
                 f" for {model}" if model else "", version)
        self._shared_local = version
        reply = PauseReply(paused, version, model=model)
        if shared is None:
            return AwaitAcks(version, reply)
        shared_version = shared.publish(admission.paused)
        if shared_version is None:  # Redis is away: this host only, and said so
            return AwaitAcks(version, PauseReply(paused, version, ("the shared state (Redis)",), model))
        self._shared_waits = {v: s for v, s in self._shared_waits.items() if v > version - 64}
        self._shared_waits[version] = shared_version
        return AwaitAcks(version, reply)

    def lagging_anywhere(self, version: int) -> list[str]:
        """What has not applied cluster-state ``version`` yet: gateways here, and other gateway hosts when it
        carried a shared pause or resume."""
        behind = self.sup.publisher.lagging(version)
        shared = self._shared_waits.get(version)
        if not behind and shared is not None and self.sup.shared is not None:
            behind = [name[:64] for name in self.sup.shared.applied_by_all(shared)]
        return behind

    def follow_shared(self, now: float) -> None:
        """Apply the operators' pauses, the adapters and the aborts another gateway host wrote to the shared state."""
        shared, admission = self.sup.shared, self.sup.admission
        assert shared is not None
        loras = self.sup.loras
        state = shared.poll(now, lambda: not self.sup.publisher.lagging(self._shared_local) and not loras.adopting())
        self.sup.aborts.follow_shared(shared)  # (aborts other hosts asked for come without a new version)
        if state is None:
            return
        paused, adapters = state
        if paused != admission.paused:
            log.info("the shared control state says: paused %s", ", ".join(sorted(m or "every model" for m in paused))
                     or "nothing")
            self._shared_local = admission.set_paused(paused)
        loras.adopt(adapters)

    def share_loras(self, name: str, info: LoraInfo | None) -> int | None:
        """A load (``info``) or unload of adapter ``name`` through this host settled: write it to the shared state;
        the shared version every other host must apply, or None (no shared state, or Redis away)."""
        shared = self.sup.shared
        if shared is None:
            return None
        adapters = {a.name: a for a in shared.loras}
        adapters.pop(name, None)
        if info is not None:
            adapters[name] = info
        return shared.publish(self.sup.admission.paused, tuple(adapters.values()))

    def shared_behind(self, version: int) -> list[str]:
        shared = self.sup.shared
        return [name[:64] for name in shared.applied_by_all(version)] if shared is not None else []

    def _elastic_scale(self, cmd: ElasticScaleCommand) -> ControlMessage | Later:
        groups = list(self.sup.elastic.values())
        if cmd.model is not None:
            try:
                tier = self.find_tier(cmd.model)
            except LookupError as e:
                return ErrorReply(f"scale_elastic_ep: {e}")
            groups = [g for g in groups if g.tier is tier]
        if len(groups) != 1:
            said = (f"model {cmd.model!r} is not" if cmd.model else "no model is" if not groups else
                    "several models are")
            return ErrorReply(f"{said} served expert parallel (launch api-server --expert-parallel)"
                              + ("; name the model" if len(groups) > 1 else ""))
        return groups[0].request(cmd.size, cmd.drain_timeout, Later())

    def status(self, tenants: bool = False) -> StatusReply:
        sup, a = self.sup, self.sup.arbiter
        now = time.monotonic()
        procs = []
        for c in sorted(a.children, key=lambda c: (c.tier, c.index)):
            load = c.load.to_wire() if c.load is not None else {}
            state = c.state if c.alive else "exited"  # (not reaped yet)
            procs.append(ProcessStatus(c.tier, c.index, c.pid, state, restarts=max(0, c.slot.restarts - 1),
                                       crash_looping=c.slot.crash_looping(now), uptime_s=round(now - c.started, 1),
                                       model=self._model_of(c.tier, c.index), loras=c.loras,
                                       sleeping=c.condition.sleeping if c.condition else None,
                                       weight_version=c.condition.version if c.condition else None, **load))
        wanted = {(tier, i) for tier, indices, _ in a.wanted() for i in indices}
        for (tier, index), slot in sorted(a.slots.items()):
            if (tier, index) in wanted and not [c for c in a.children if c.slot is slot]:
                procs.append(ProcessStatus(tier, index, None, "backoff", restarts=max(0, slot.restarts - 1),
                                           crash_looping=slot.crash_looping(now), last_exit=slot.last_exit,
                                           next_start_in_s=round(max(0.0, slot.next_start - now), 1),
                                           model=self._model_of(tier, index)))
        local = {(c.index, a.engine_endpoint(c.index)) for c in a.children if c.tier == "engine"}
        st = sup.publisher.state
        for e in st.engines:
            if (e.rank, e.endpoint) not in local:  # an engine host's
                procs.append(ProcessStatus("engine", e.rank, e.pid, e.state, 0, False, model=e.model,
                                           endpoint=e.endpoint, loras=e.loras, sleeping=e.sleeping,
                                           weight_version=e.weight_version or None))
        return StatusReply(url=sup.url, models=dict(st.models) or {t.model_id: t.desired for t in sup.tiers},
                           pid=os.getpid(), run_dir=sup.run_dir, uptime_s=round(time.time() - sup.started_at, 1),
                           desired={"gateway": a.desired["gateway"],
                                    "engine": sum(st.models.values()) if st.models else a.engines_desired},
                           paused=st.paused, cluster_version=st.version, processes=tuple(procs),
                           expert_parallel={g.tier.model_id: g.status() for g in sup.elastic.values()} or None,
                           holds=st.holds, options=sup.cfg.options(),
                           tenants=sup.tenant_usage() if tenants else None)

    def _model_of(self, tier: str, index: int) -> str | None:
        return self.sup.arbiter.tier_of(index).model_id if tier == "engine" else None
