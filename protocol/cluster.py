"""The cluster state as it travels: what every gateway is told of the cluster (``ClusterState``), of each engine
(``EngineInfo``, ``EngineState``), and the phases a resize or a rolling restart passes through.

The supervisor owns the state; every change bumps ``version`` and is broadcast to each gateway over its control
pipe (engines get no cluster state), inside ``control.ClusterUpdate`` (and, across hosts, an engine host's
``control.EngineRegistry`` carries the same ``EngineInfo`` entries and phase). The supervisor answers a control
request only after every live gateway has acknowledged that version, so when ``POST /pause`` returns, *every*
gateway already refuses new requests. Gateways never keep control state of their own.

These are wire types: changing a field changes the control lines (``control.CONTROL_VERSION``). Where the state is
kept and how it changes is the supervisor's business (``zserve.cluster.ClusterStore``), not this module's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum

from .holds import Hold
from .messages import valid_lora_name
from .validate import is_int, is_str


class EngineState(StrEnum):
    """What gateways are told of an engine. A process that exited has no state here: it is no member any more
    (the supervisor leaves a process it found dead out of ``engines``)."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"

ELASTIC_PHASES = ("starting", "draining", "regrouping", "recovering")
"""An expert-parallel group's phases: new members load (the old group serves on); admission paused while
in-flight requests finish; the group re-forms at its new size; it re-forms after losing a member."""
SCALING_PHASES = ("", *ELASTIC_PHASES)
"""What ``ClusterState.scaling`` may say: "" (no resize), or an elastic phase. Whether requests are held is not
the phase's business but a hold's (``ClusterState.holds``)."""


@dataclass(frozen=True)
class EngineInfo:
    rank: int
    endpoint: str
    state: EngineState
    pid: int = 0
    model: str = ""  # the model id of the engine's tier (gateways route each request to its model's engines)
    # The LoRA adapters the engine has loaded, as it reported them: a request for an adapter goes only to the
    # engines that list it (one that starts later serves it once it has loaded it).
    loras: tuple[str, ...] = ()
    sleeping: int = 0  # its sleep level as it reported it (0: awake; ``control.SLEEP_LEVELS``)
    weight_version: str = ""  # the weight version it serves, as it reported it ("" until it has)
    kv_events: str = ""  # where it publishes its KV cache events (``protocol.kv_events``; "": it does not)

    def __post_init__(self) -> None:
        # The one constructor of every entry (the supervisor's, and each decoded from the wire): a state outside
        # EngineState cannot exist in an EngineInfo (ValueError, which the control codec reports for a bad line).
        object.__setattr__(self, "state", EngineState(self.state))
        if not isinstance(self.loras, list | tuple) or not all(valid_lora_name(n) for n in self.loras):
            raise TypeError("an engine's loras must be adapter names")
        object.__setattr__(self, "loras", tuple(self.loras))
        if not (is_int(self.sleeping) and 0 <= self.sleeping <= 2 and is_str(self.weight_version, 256, empty=True)
                and is_str(self.kv_events, 1024, empty=True)):
            raise TypeError("an engine's sleeping is a level 0..2, its weight_version a short str, kv_events an "
                            "endpoint")


@dataclass(frozen=True)
class LoraInfo:
    """A LoRA adapter every gateway serves: its ``name`` (a model name of requests), the base ``model`` id whose
    engines run it, and the directory ``path`` they read it from (as the supervisor resolved it)."""

    name: str
    model: str
    path: str

    def __post_init__(self) -> None:
        if not (valid_lora_name(self.name) and is_str(self.model, 1024) and is_str(self.path, 4096)):
            raise TypeError("a LoRA adapter is a name, a model id and a path")


@dataclass(frozen=True)
class ClusterState:
    version: int = 0
    engines: tuple[EngineInfo, ...] = ()
    gateways_desired: int = 0
    engines_desired: int = 0  # over every model
    models: dict[str, int] = field(default_factory=dict)  # model id → its desired engines, in serving order
    # The phase of an expert-parallel resize or recovery ("" when none; SCALING_PHASES), for
    # /is_scaling_elastic_ep.
    scaling: str = ""
    # What gateways hold or refuse, per (reason, model) (``protocol.holds``): the one input of admission.
    holds: tuple[Hold, ...] = ()
    # The LoRA adapters served (``/v1/load_lora_adapter``, ``--lora-modules``): a name here is a model name on every
    # gateway, from the version that adds it; a name taken out is a 404 from the version that takes it out.
    loras: tuple[LoraInfo, ...] = ()
    # The models asleep (``POST /sleep``: model id → level; their requests are held by a "sleeping" hold) and the
    # weight version each model serves (``POST /update_weights``; "default" until one is given).
    sleeping: dict[str, int] = field(default_factory=dict)
    weight_versions: dict[str, str] = field(default_factory=dict)
    # Bumped when the tenants were reloaded (``launch reload --tenants``, SIGHUP): gateways read the key file again.
    keys_version: int = 0

    @property
    def paused(self) -> bool:
        """Whether an operator paused every model (``/pause`` without a model)."""
        return any(h.reason == "paused" and h.model is None for h in self.holds)

    def to_json(self) -> dict:
        d = asdict(self)
        d["engines"] = [asdict(e) for e in self.engines]
        d["holds"] = [h.to_json() for h in self.holds]
        d["loras"] = [asdict(a) for a in self.loras]
        return d

    @classmethod
    def from_json(cls, d: dict) -> ClusterState:
        """Raises TypeError/KeyError/ValueError for a malformed state (the control codec reports them)."""
        engines = tuple(EngineInfo(**e) for e in d.get("engines", ()))
        holds = d.get("holds", ())
        if not isinstance(holds, list | tuple):
            raise TypeError("holds must be a list")
        loras = d.get("loras", ())
        if not isinstance(loras, list | tuple) or not all(isinstance(a, dict) for a in loras):
            raise TypeError("loras must be a list of adapters")
        state = cls(**{**d, "engines": engines, "holds": tuple(Hold.from_json(h) for h in holds),
                       "loras": tuple(LoraInfo(**a) for a in loras)})
        for name in ("version", "gateways_desired", "engines_desired", "keys_version"):
            if not is_int(getattr(state, name)):
                raise TypeError(f"{name} must be an int")
        if state.scaling not in SCALING_PHASES:
            raise ValueError(f"scaling must be one of {SCALING_PHASES}")
        for name, ok in (("models", is_int), ("sleeping", is_int), ("weight_versions", is_str)):
            value = getattr(state, name)
            if not isinstance(value, dict) or not all(isinstance(k, str) and ok(v) for k, v in value.items()):
                raise TypeError(f"{name} must map model ids to values")
        return state
