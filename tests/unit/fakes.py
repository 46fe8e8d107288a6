"""Fakes of the written interfaces an operation sees (``launch.interfaces``): the processes, the cluster publisher
and the admission owner. ``ElasticGroup`` and ``RollingRestart`` are driven against these and nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.cluster import ClusterState, EngineInfo, EngineState
from protocol.control import Heartbeat


@dataclass
class FakeSlot:
    looping: bool = False
    name: str = "engine"

    def crash_looping(self, now: float) -> bool:
        return self.looping


@dataclass
class FakeChild:
    index: int
    ready: bool = True
    draining: bool = False
    tier: str = "engine"
    pid: int = 0
    alive: bool = True
    drain_started: float | None = None
    acked_version: int = 0
    status_fd: int = -1
    killed_hung: bool = False
    started: float = 0.0
    last_beat: float = float("inf")  # never silent
    slot: object = None
    load: Heartbeat | None = field(default_factory=lambda: Heartbeat(running=0, waiting=0))
    sent: list = field(default_factory=list)
    signals: list = field(default_factory=list)
    loras: tuple[str, ...] | None = None
    lora_sent: set = field(default_factory=set)
    lora_failed: dict = field(default_factory=dict)
    condition: object = None  # an engine's EngineCondition (launch.ops.engine_ops)
    sleep_sent: bool = False

    @property
    def name(self) -> str:
        return f"{self.tier} {self.index}"

    def send(self, msg) -> bool:
        self.sent.append(msg)
        return True

    def signal(self, sig) -> None:
        self.signals.append(sig)


class FakeProcesses:
    """The arbiter (``Processes``): children by tier; ``scale_engines`` starts or drains engines at once, and
    ``replace`` stands for the arbiter filling a slot whose process drains."""

    def __init__(self, tiers, gateways: int = 0):
        self.tiers = tiers
        self.run_dir = "/run/zserve-test"
        self.num_gpus = 0
        self.ready_timeout = 60.0
        self.shutdown_timeout = 30.0
        self.children = [FakeChild(i, tier="gateway", pid=100 + i) for i in range(gateways)]
        self.children += [FakeChild(i, pid=200 + i) for t in tiers for i in t.ranks]
        self.slots: dict = {}

    def live(self, tier: str) -> list[FakeChild]:
        return [c for c in self.children if c.tier == tier and c.alive]

    def slot(self, tier: str, index: int):
        return self.slots.get((tier, index))

    def gateways_desired(self) -> int:
        return len({c.index for c in self.live("gateway")})

    def scale_engines(self, tier, count: int) -> None:
        tier.desired = count
        for c in self.children:
            if c.tier == "engine" and tier.owns(c.index) and c.index >= tier.base + count and not c.draining:
                c.draining = True
        have = {c.index for c in self.children if c.tier == "engine" and not c.draining}
        self.children += [FakeChild(i, ready=False) for i in tier.ranks if i not in have]

    def replace(self, tier: str, index: int, ready: bool = True) -> FakeChild:
        new = FakeChild(index, ready=ready, tier=tier, pid=300 + len(self.children))
        self.children.append(new)
        return new

    def engine_endpoint(self, rank: int) -> str:
        return f"ipc:///run/zserve-test/engine-{rank}.sock"

    def engine_threads(self, tier=None, size=None) -> int:
        return 1

    def member(self, index: int, tier: str = "engine") -> FakeChild:
        return next(c for c in self.children if c.tier == tier and c.index == index and not c.draining)


class FakePublisher:
    """The cluster publisher (``Publisher``): each publish is a new version; ``behind`` names who lags (every
    version, while set)."""

    def __init__(self) -> None:
        self.version = 0
        self.behind: list[str] = []

    def publish(self) -> int:
        self.version += 1
        return self.version

    def lagging(self, version: int) -> list[str]:
        return list(self.behind)


class StatePublisher(FakePublisher):
    """A publisher whose cluster state lists the fake engines of ``model``: each one's state and the adapters it
    reported (the LoRA and engine-operation state machines read it)."""

    def __init__(self, processes: FakeProcesses, model: str):
        super().__init__()
        self.processes = processes
        self.model = model

    @property
    def state(self) -> ClusterState:
        return ClusterState(self.version, tuple(
            EngineInfo(c.index, f"ipc://{c.index}", EngineState.READY if c.ready else EngineState.STARTING, c.pid,
                       self.model, c.loras or ()) for c in self.processes.live("engine")))


class FakeHolds:
    """The admission owner (``Holds``): the holds now, and each change (a hold's detail, "" for a release)."""

    def __init__(self, publisher: FakePublisher):
        self.publisher = publisher
        self.held: dict[tuple[str, str | None], str] = {}
        self.history: list[tuple[str, str | None, str]] = []

    def hold(self, reason: str, model: str | None, detail: str = "") -> int:
        self.held[(reason, model)] = detail
        self.history.append((reason, model, detail))
        return self.publisher.publish()

    def release(self, reason: str, model: str | None) -> int:
        if self.held.pop((reason, model), None) is not None:
            self.history.append((reason, model, ""))
        return self.publisher.publish()
