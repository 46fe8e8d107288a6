"""The written interfaces between the supervisor's parts: what an operation (``launch.ops``: an elastic resize, a
rolling restart) may see of the processes, of the cluster publisher and of the admission owner.

An operation is a state machine the supervisor's loop turns; it sees these and nothing else of the supervisor,
so a test drives it against fakes of exactly these (``tests/unit/fakes.py``).
"""

from __future__ import annotations

from typing import Protocol

from protocol.cluster import ClusterState

from .children import Child, Slot
from .tiers import ModelTier


class Processes(Protocol):
    """The arbiter, as operations see it: the processes it runs and the counts it keeps them at."""

    run_dir: str
    num_gpus: int
    ready_timeout: float
    shutdown_timeout: float

    def live(self, tier: str) -> list[Child]:
        """The processes of ``tier`` (gateway, engine) that have not exited, draining ones included."""
        ...

    def slot(self, tier: str, index: int) -> Slot | None: ...

    def gateways_desired(self) -> int: ...

    def scale_engines(self, tier: ModelTier, count: int) -> None:
        """Change a model's desired engine count: the arbiter starts or drains engines to match."""
        ...

    def engine_endpoint(self, rank: int) -> str: ...

    def engine_threads(self, tier: ModelTier | None = None, size: int | None = None) -> int: ...


class Publisher(Protocol):
    """The cluster publisher: the one writer of the cluster state."""

    @property
    def state(self) -> ClusterState:
        """The state gateways were last sent (every engine here and on engine hosts, with what each reported)."""
        ...

    def publish(self) -> int:
        """Send the state now if it changed (engine membership, holds, phase); the version gateways must apply."""
        ...

    def lagging(self, version: int) -> list[str]:
        """Who has not applied cluster-state ``version`` yet ([] once every gateway has)."""
        ...


class Holds(Protocol):
    """The admission owner: holds on a model's new requests, keyed by (reason, model)."""

    def hold(self, reason: str, model: str | None, detail: str = "") -> int:
        """Hold ``model``'s new requests (``protocol.holds.HOLD_REASONS`` says how); the version that carries it."""
        ...

    def release(self, reason: str, model: str | None) -> int: ...
