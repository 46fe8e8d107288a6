"""Where the supervisor keeps the cluster state, and the one interface it changes that state through.

The state's shape is wire contract and lives in ``protocol.cluster`` (``ClusterState``, ``EngineInfo``, the
phases); this module only keeps it. Every change goes through ``ClusterStore.update``, which bumps ``version``, so
a multi-host deployment can later keep the state in Redis (``ClusterStore`` is the seam: ``get``/``update``)
without touching the handlers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from protocol.cluster import ClusterState


@dataclass
class ClusterStore:
    """Single-host store: the supervisor's memory. ``update`` returns the new, versioned state."""

    state: ClusterState = field(default_factory=ClusterState)

    def get(self) -> ClusterState:
        return self.state

    def update(self, **changes) -> ClusterState:
        self.state = replace(self.state, version=self.state.version + 1, **changes)
        return self.state
