"""The cluster-wide control state, and the one interface every process reads it through.

The supervisor owns the state; every change bumps ``version`` and is broadcast to each gateway
(and engine) over its control pipe; the supervisor answers a control request only after every
live gateway has acknowledged that version, so when ``POST /pause`` returns, *every* gateway
already refuses new requests. Gateways never keep control state of their own.

Only this module knows the state's shape, so a multi-host deployment can later keep it in Redis
(``ClusterStore`` is the seam: ``get``/``update``/``subscribe``) without touching the handlers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

ENGINE_STATES = ("starting", "ready", "draining")


@dataclass(frozen=True)
class EngineInfo:
    rank: int
    endpoint: str
    state: str  # one of ENGINE_STATES
    pid: int = 0


@dataclass(frozen=True)
class ClusterState:
    version: int = 0
    paused: bool = False
    engines: tuple[EngineInfo, ...] = ()
    gateways_desired: int = 0
    engines_desired: int = 0
    model_id: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        d["engines"] = [asdict(e) for e in self.engines]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ClusterState":
        engines = tuple(EngineInfo(int(e["rank"]), str(e["endpoint"]), str(e["state"]), int(e.get("pid", 0)))
                        for e in d.get("engines", ()))
        return cls(version=int(d["version"]), paused=bool(d["paused"]), engines=engines,
                   gateways_desired=int(d.get("gateways_desired", 0)), engines_desired=int(d.get("engines_desired", 0)),
                   model_id=str(d.get("model_id", "")))

    def routable(self) -> set[str]:
        """Endpoints a gateway may send new requests to."""
        return {e.endpoint for e in self.engines if e.state == "ready"}


@dataclass
class ClusterStore:
    """Single-host store: the supervisor's memory. ``update`` returns the new, versioned state."""

    state: ClusterState = field(default_factory=ClusterState)

    def get(self) -> ClusterState:
        return self.state

    def update(self, **changes) -> ClusterState:
        self.state = replace(self.state, version=self.state.version + 1, **changes)
        return self.state
