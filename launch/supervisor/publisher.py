"""The cluster publisher: the only place the cluster state changes, and where gateways' acknowledgements count.

``publish`` gathers what the state says — this host's engines (from the arbiter), the engine hosts' engines and
holds (a gateway host), the holds the admission owner decides, the expert-parallel phase — and, when any of it
changed, stores a new version and sends it to every gateway (``ClusterUpdate``), which applies it and acknowledges
the version (``Ack``). ``lagging(version)`` names who has not applied a version yet: the ready gateways here, and,
on an engine host, the gateway hosts that follow its registry. Operations wait on it before they go on (an engine
hears SIGTERM only once no gateway routes to it); the control server answers /pause with it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from protocol.cluster import ClusterState, EngineInfo, LoraInfo
from protocol.control import ClusterUpdate, EngineRegistry
from zserve.cluster import ClusterStore

from ..children import Child
from ..hosts.engine_registry import RegistryServer, RemoteEngines
from .admission import Admission

log = logging.getLogger("zserve.launch")

Membership = Callable[[], tuple[tuple[EngineInfo, ...], dict[str, int], int, int]]
"""This host's engines, each model's desired engine count, the gateways desired and this host's engines desired."""


class ClusterPublisher:
    def __init__(self, membership: Membership, gateways: Callable[[], list[Child]], phase: Callable[[], str],
                 loras: Callable[[], tuple[LoraInfo, ...]] = tuple,
                 lora_errors: Callable[[], dict[str, str]] = dict,
                 conditions: Callable[[], tuple[dict[str, int], dict[str, str]]] = lambda: ({}, {})):
        self.store = ClusterStore()
        self.admission = Admission(self.publish)
        self._membership = membership
        self._gateways = gateways  # the live gateways here
        self._phase = phase  # the expert-parallel phase ("" when none)
        self._loras = loras  # the LoRA adapters served (launch.ops.lora)
        self._lora_errors = lora_errors  # those this host's engines refused (an engine host tells gateway hosts)
        self._conditions = conditions  # the models asleep and each one's weight version (launch.ops.engine_ops)
        self.registry: RegistryServer | None = None  # an engine host's
        self.remote: list[RemoteEngines] = []  # a gateway host's engine hosts
        self._unknown_models: set[str] = set()  # served by an engine host but not here (warned once)
        self.keys_version = 0  # bumped when the tenants are reloaded: gateways read the key file again

    @property
    def state(self) -> ClusterState:
        return self.store.get()

    @property
    def version(self) -> int:
        return self.store.get().version

    def publish(self) -> int:
        """Store and send a new state when anything it says changed; the version gateways must apply."""
        local, models, gateways, engines_desired = self._membership()
        now = time.monotonic()
        engines, models = self._with_remote(local, models, now)
        self.admission.follow_remote(h for r in self.remote for h in r.holds(now) if h.model in models)
        holds, phase, loras = self.admission.holds(), self._phase(), self._loras()
        sleeping, versions = self._conditions()
        st = self.store.get()
        if (engines, models, gateways, holds, phase, loras, sleeping, versions, self.keys_version) != (
                st.engines, st.models, st.gateways_desired, st.holds, st.scaling, st.loras, st.sleeping,
                st.weight_versions, st.keys_version):
            st = self.store.update(engines=engines, models=models, gateways_desired=gateways,
                                   engines_desired=engines_desired, holds=holds, scaling=phase, loras=loras,
                                   sleeping=sleeping, weight_versions=versions, keys_version=self.keys_version)
            msg = ClusterUpdate(st)
            for c in self._gateways():
                c.send(msg)
        if self.registry is not None:
            self.registry.publish(EngineRegistry(0, local, models, self.admission.local_holds(),
                                                 self._lora_errors() or None), st.version)
        for remote in self.remote:
            if remote.fresh(now) and remote.registry is not None:
                remote.carried = (st.version, remote.registry.version)
        return st.version

    def welcome(self, gateway: Child) -> None:
        """A new gateway starts from the current state."""
        gateway.send(ClusterUpdate(self.store.get()))

    def lagging(self, version: int) -> list[str]:
        """The ready gateways (here, and the gateway hosts following this engine host) that have not applied
        cluster-state ``version`` yet."""
        behind = [c.name for c in self._gateways() if c.ready and c.acked_version < version]
        return behind + self.registry.lagging(version) if self.registry is not None else behind

    def tick(self, now: float) -> None:
        """Talk to the other hosts: say hello to engine hosts, tell them what the gateways here applied."""
        for remote in self.remote:
            remote.tick(now)
            remote.pump()  # (a send may take the descriptor's edge of a reply that came meanwhile)
            remote.applied_by_gateways(self.lagging, now)
        if self.registry is not None:
            self.registry.pump()

    def remote_lora_errors(self) -> dict[str, str]:
        """The LoRA adapters the engine hosts' engines refused (name -> why)."""
        now = time.monotonic()
        return {name: f"{why} (engine host {r.url})" for r in self.remote for name, why in r.lora_errors(now).items()}

    def pump_remote(self, remote: RemoteEngines) -> None:
        if remote.pump():
            self.publish()

    def remote_ready(self, model_ids: list[str]) -> bool:
        """A gateway host starts serving once every engine host answered and each model has a ready engine."""
        now = time.monotonic()
        ready = {e.model for r in self.remote for e in r.engines(now) if e.state == "ready"}
        return all(r.fresh(now) for r in self.remote) and all(m in ready for m in model_ids)

    def _with_remote(self, engines: tuple[EngineInfo, ...], models: dict[str, int], now: float
                     ) -> tuple[tuple[EngineInfo, ...], dict[str, int]]:
        """Add the engines of the engine hosts that answer (for the models served here) to the local ones."""
        for remote in self.remote:
            theirs = remote.models(now)
            engines += tuple(e for e in remote.engines(now) if e.model in models)
            for model, n in theirs.items():
                if model in models:
                    models[model] += n
                elif model not in self._unknown_models:
                    self._unknown_models.add(model)
                    log.warning("engine host %s serves %s, which is not served here (give it as --model): its "
                                "engines are not used", remote.url, model)
        return engines, models
