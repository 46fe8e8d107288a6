"""The messages between the supervisor and everything it supervises or answers.

Two channels, one framing — a JSON object per line, ``{"v": CONTROL_VERSION, "t": <type>, ...fields}``:

- the *pipes* of each child: child → supervisor ``Ready``, ``Heartbeat`` (with its load),
  ``Ack`` (of a cluster-state version), ``BootFailed``, from an engine ``LoraReport``, ``EngineOpReport`` and
  ``EngineCondition``, from a gateway ``AbortReport`` and, from an expert-parallel engine, ``GroupReport``;
  supervisor → child ``ClusterUpdate`` and ``AbortRequests`` (gateways), ``LoraCommand`` and ``EngineOp``
  (engines), ``GroupCommand`` and ``GroupFreeze`` (expert-parallel engines);
- the owner-only *control socket*: one command in (``StatusCommand``, ``ScaleCommand``,
  ``ElasticScaleCommand``, ``PauseCommand``, ``ResumeCommand``, ``LoraLoadCommand``, ``LoraUnloadCommand``,
  ``OperationCommand``, ``AbortCommand``, ``StopCommand``), one reply out (``StatusReply``, ``ScaleReply``,
  ``ElasticScaleReply``, ``PauseReply``, ``LoraReply``, ``OperationReply``, ``AbortReply``, ``StopReply`` or
  ``ErrorReply``).

Each message is a frozen dataclass validated when built and when decoded, like the engine protocol
in ``messages``: a malformed line raises ``ProtocolError``, which readers log and drop. Nothing here
depends on pipes or Unix sockets, so a remote supervisor can speak the same lines over TCP.
Bump ``CONTROL_VERSION`` on any incompatible change; peers reject other versions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import orjson

from .cluster import ClusterState, EngineInfo
from .holds import Hold
from .messages import valid_lora_name
from .validate import ProtocolError, check, is_int, is_nonneg, is_str, is_uint, optional

# 4: engine operations (sleep, weights, caches, profiling), aborts and the status reply's options; 3: LoRA adapters
# (cluster state, engine reports, load/unload); 2: holds per (reason, model)
CONTROL_VERSION = 5
MAX_LINE = 1 << 20  # a cluster state with many engines still fits


class ControlMessage:
    """Base of every control message: ``TYPE`` tags it; ``None`` fields are left off the wire."""

    TYPE: ClassVar[str] = ""

    def to_wire(self) -> dict:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v is not None:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_wire(cls, body: dict) -> ControlMessage:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = set(body) - names
        check(not unknown, f"unknown fields {sorted(unknown)} in {cls.TYPE}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in body.items()})


# -- child → supervisor (status pipe) ------------------------------------------------------------------
@dataclass(frozen=True)
class Ready(ControlMessage):
    """The child serves: a gateway listens, an engine has its model loaded and its socket bound."""

    TYPE: ClassVar[str] = "ready"
    index: int
    endpoint: str | None = None
    device: str | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        check(is_int(self.index, 0, 1 << 16), "index out of range")
        for name in ("endpoint", "device", "dtype"):
            check(optional(getattr(self, name), lambda v: is_str(v, 1024)), f"{name} must be a short str")


@dataclass(frozen=True)
class Heartbeat(ControlMessage):
    """A sign of life with the child's load: in-flight requests (gateway) or the batch (engine)."""

    TYPE: ClassVar[str] = "heartbeat"
    draining: bool = False
    in_flight: int | None = None
    running: int | None = None
    waiting: int | None = None
    kv_used: float | None = None  # fraction of the KV cache in use
    kv_blocks_cached: int | None = None  # blocks its prefix cache holds (what its KV events describe)

    def __post_init__(self) -> None:
        check(isinstance(self.draining, bool), "draining must be a bool")
        for name in ("in_flight", "running", "waiting", "kv_blocks_cached"):
            check(optional(getattr(self, name), is_uint), f"{name} out of range")
        check(optional(self.kv_used, lambda v: is_nonneg(v) and v <= 1.0), "kv_used out of range")


@dataclass(frozen=True)
class Ack(ControlMessage):
    """A gateway applied this cluster-state version (pause/resume replies wait for every ack)."""

    TYPE: ClassVar[str] = "ack"
    version: int

    def __post_init__(self) -> None:
        check(is_int(self.version, 0, 1 << 62), "version out of range")


@dataclass(frozen=True)
class BootFailed(ControlMessage):
    """Sent just before exiting with EXIT_BOOT_ERROR: why this configuration can never start."""

    TYPE: ClassVar[str] = "boot_failed"
    reason: str

    def __post_init__(self) -> None:
        check(is_str(self.reason), "reason must be a str of at most 4096 chars")


@dataclass(frozen=True)
class LoraReport(ControlMessage):
    """An engine's LoRA adapters: ``loaded`` (every one it serves now), sent before its ``Ready`` and after each
    ``LoraCommand``, which ``name`` names; ``error``: why that load failed (the adapter's ``LoraError``: bad input,
    which changes nothing here)."""

    TYPE: ClassVar[str] = "lora_report"
    loaded: tuple[str, ...] = ()
    name: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        check(isinstance(self.loaded, tuple) and len(self.loaded) <= 1 << 12
              and all(valid_lora_name(n) for n in self.loaded), "loaded must be adapter names")
        check(optional(self.name, valid_lora_name), "name must be an adapter name")
        check(optional(self.error, is_str), "error must be a str of at most 4096 chars")


GROUP_EVENTS = ("formed", "failed", "lost", "frozen")


@dataclass(frozen=True)
class GroupReport(ControlMessage):
    """An expert-parallel engine on its group ``generation``: ``formed`` (it serves in it, holding experts
    ``experts[0]`` .. ``experts[1] - 1``), ``failed`` (it could not join; ``reason``), ``lost`` (a collective
    failed while serving: a member died; its in-flight requests ended with an error) or ``frozen`` (after a
    ``GroupFreeze``: it has finished its requests and starts no group step of its own any more)."""

    TYPE: ClassVar[str] = "ep_report"
    generation: int
    event: str  # one of GROUP_EVENTS
    reason: str | None = None
    experts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check(is_int(self.generation, 0, 1 << 62) and self.event in GROUP_EVENTS,
              f"ep_report needs a generation and an event in {GROUP_EVENTS}")
        check(optional(self.reason, is_str), "reason must be a str of at most 4096 chars")
        check(isinstance(self.experts, tuple) and len(self.experts) in (0, 2)
              and all(is_uint(e) for e in self.experts), "experts is (first, end)")


SLEEP_LEVELS = (1, 2)
"""Sleep levels (vLLM's): 1 frees the KV cache and moves the weights to host memory (where a CPU engine's already
are); 2 frees both, and the weights are read again from the checkpoint on wake."""
WAKE_TAGS = ("weights", "kv_cache")
ENGINE_OPS = ("sleep", "wake_up", "stage_weights", "commit_weights", "discard_weights", "set_weight_version",
              "reset_prefix_cache", "reset_mm_cache", "reset_encoder_cache", "start_profile", "stop_profile")
"""What the supervisor asks of an engine (``EngineOp``): sleep and wake; a weight update in two phases (every engine
reads the new checkpoint beside the served one, then all swap, or all drop it); a new version label; cache resets;
the torch profiler."""


def _small_dict(v: object) -> bool:
    return isinstance(v, dict) and len(v) <= 64 and all(is_str(k, 64) for k in v)


@dataclass(frozen=True)
class EngineOpReport(ControlMessage):
    """An engine's answer to ``EngineOp`` ``id``: ``ok`` with what it did (``result``: memory before and after,
    a trace's path, seconds), or ``error`` (``busy``: refused for the engine's state, e.g. requests run)."""

    TYPE: ClassVar[str] = "engine_op_report"
    id: int
    op: str
    ok: bool
    result: dict | None = None
    error: str | None = None
    busy: bool = False

    def __post_init__(self) -> None:
        check(is_int(self.id, 0, 1 << 62) and self.op in ENGINE_OPS and isinstance(self.ok, bool)
              and isinstance(self.busy, bool), "engine_op_report needs an id, an op and ok")
        check(optional(self.result, _small_dict) and optional(self.error, is_str), "bad result or error")


@dataclass(frozen=True)
class EngineCondition(ControlMessage):
    """What an engine is now, beside its load: asleep (``sleeping``: its level, 0 awake; ``asleep``: what is
    still freed, of WAKE_TAGS) and the weight ``version`` it serves. Sent before Ready and after each change."""

    TYPE: ClassVar[str] = "engine_condition"
    sleeping: int = 0
    version: str = ""
    asleep: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(self.sleeping in (0, *SLEEP_LEVELS) and is_str(self.version, 256, empty=True)
              and isinstance(self.asleep, tuple) and all(t in WAKE_TAGS for t in self.asleep),
              "bad sleeping level, version or asleep tags")


@dataclass(frozen=True)
class AbortReport(ControlMessage):
    """A gateway's answer to ``AbortRequests`` ``id``: the ids among them it was serving (and has ended)."""

    TYPE: ClassVar[str] = "abort_report"
    id: int
    found: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(is_int(self.id, 0, 1 << 62) and _request_ids(self.found), "abort_report needs an id and request ids")


def _request_ids(v: object) -> bool:
    return isinstance(v, tuple) and len(v) <= MAX_ABORT_IDS and all(is_str(i, 256) for i in v)


MAX_ABORT_IDS = 1024


def _check_engines(engines: tuple) -> None:
    for e in engines:  # (an EngineInfo's state is an EngineState by construction)
        check(isinstance(e, EngineInfo) and is_int(e.rank, 0, 1 << 16) and is_str(e.endpoint, 1024)
              and is_uint(e.pid) and is_str(e.model, 1024, empty=True), f"bad engine entry {e!r}")


# -- supervisor → child (control pipe) -----------------------------------------------------------------
@dataclass(frozen=True)
class ClusterUpdate(ControlMessage):
    """The cluster state (engine membership, holds on admission) a gateway must apply and acknowledge."""

    TYPE: ClassVar[str] = "cluster"
    state: ClusterState

    def __post_init__(self) -> None:
        check(isinstance(self.state, ClusterState), "state must be a ClusterState")
        st = self.state
        check(is_int(st.version, 0, 1 << 62), "bad cluster version")
        check(isinstance(st.holds, tuple) and all(isinstance(h, Hold) for h in st.holds), "bad holds")
        _check_engines(st.engines)

    def to_wire(self) -> dict:
        return {"state": self.state.to_json()}

    @classmethod
    def from_wire(cls, body: dict) -> ClusterUpdate:
        check(set(body) == {"state"} and isinstance(body["state"], dict), "cluster needs exactly a state object")
        return cls(ClusterState.from_json(body["state"]))


LORA_ACTIONS = ("load", "unload")


@dataclass(frozen=True)
class LoraCommand(ControlMessage):
    """Load LoRA adapter ``name`` from ``path`` (a PEFT directory), or unload it: new requests for it are refused
    at once, running ones finish first. The engine answers ``LoraReport``."""

    TYPE: ClassVar[str] = "lora"
    action: str  # one of LORA_ACTIONS
    name: str
    path: str | None = None  # load's

    def __post_init__(self) -> None:
        check(self.action in LORA_ACTIONS and valid_lora_name(self.name), f"lora needs an action in {LORA_ACTIONS} "
              "and an adapter name")
        check((self.action == "load") == (self.path is not None) and optional(self.path, is_str),
              "a load (and only a load) gives a path")


@dataclass(frozen=True)
class GroupCommand(ControlMessage):
    """Join expert-parallel group ``generation`` as member ``rank`` of ``size``: leave the current group, hold
    the experts of that share, meet the others through the rendezvous file ``store`` (in the private run
    directory) and report ``GroupReport``. ``peers`` are the members' engine endpoints by member rank: an
    engine that gets work while the group idles wakes the others through them."""

    TYPE: ClassVar[str] = "ep_group"
    generation: int
    size: int
    rank: int
    store: str
    peers: tuple[str, ...]
    backend: str = "gloo"  # nccl when every member has a GPU of its own; gloo otherwise (CPUs, a shared GPU)
    threads: int | None = None  # CPU threads per member at this size, when the operator left them to us

    def __post_init__(self) -> None:
        check(self.backend in ("gloo", "nccl"), "backend must be gloo or nccl")
        check(optional(self.threads, lambda v: is_int(v, 1, 1025)), "threads must be an integer in 1..1024")
        check(is_int(self.generation, 0, 1 << 62) and is_int(self.size, 1, MAX_SCALE + 1)
              and is_int(self.rank, 0, self.size), "ep_group needs a generation, a size and a rank below it")
        check(is_str(self.store, 4096), "store must be a path")
        check(isinstance(self.peers, tuple) and len(self.peers) == self.size
              and all(is_str(p, 1024) for p in self.peers), "peers are one endpoint per member")


@dataclass(frozen=True)
class GroupFreeze(ControlMessage):
    """The drain before a resize, exact on the engine's side: finish every request already here (stepping
    with the group as long as any member does), then start no group step of its own (requests that arrive
    later wait in the queue) and report ``frozen``. ``frozen=False`` undoes it (the resize was called off)."""

    TYPE: ClassVar[str] = "ep_freeze"
    generation: int
    frozen: bool = True

    def __post_init__(self) -> None:
        check(is_int(self.generation, 0, 1 << 62) and isinstance(self.frozen, bool),
              "ep_freeze needs a generation and a frozen flag")


@dataclass(frozen=True)
class EngineOp(ControlMessage):
    """Carry out operation ``op`` (ENGINE_OPS) with ``args``; answered ``EngineOpReport`` with the same ``id``
    (``id`` 0: the supervisor brings a newcomer to the cluster's condition, and reads only its EngineCondition)."""

    TYPE: ClassVar[str] = "engine_op"
    id: int
    op: str
    args: dict | None = None

    def __post_init__(self) -> None:
        check(is_int(self.id, 0, 1 << 62) and self.op in ENGINE_OPS, f"engine_op needs an id and an op in "
              f"{ENGINE_OPS}")
        check(optional(self.args, _small_dict), "args must be a small object")


@dataclass(frozen=True)
class AbortRequests(ControlMessage):
    """End the requests among ``request_ids`` this gateway serves (finish reason ``abort``); answer ``AbortReport``.
    An id is what a client named a request by: ``/inference/v1/generate``'s ``request_id`` or an ``X-Request-Id``."""

    TYPE: ClassVar[str] = "abort_requests"
    id: int
    request_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        check(is_int(self.id, 0, 1 << 62) and _request_ids(self.request_ids), "abort_requests needs an id and "
              f"at most {MAX_ABORT_IDS} request ids")


# -- control socket: commands --------------------------------------------------------------------------
SCALE_TIERS = {"api-server": "gateway", "gateway": "gateway", "engine": "engine"}
MAX_SCALE = 256


@dataclass(frozen=True)
class StatusCommand(ControlMessage):
    TYPE: ClassVar[str] = "status"
    tenants: bool = False  # with each tenant's limits and current usage (``launch status --tenants``)

    def __post_init__(self) -> None:
        check(isinstance(self.tenants, bool), "tenants must be a bool")


@dataclass(frozen=True)
class ScaleCommand(ControlMessage):
    TYPE: ClassVar[str] = "scale"
    tier: str  # api-server (= gateway) or engine
    count: int
    model: str | None = None  # engine: the model whose tier to scale (may be left out while one model is served)

    def __post_init__(self) -> None:
        check(self.tier in SCALE_TIERS and is_int(self.count, 1, MAX_SCALE + 1),
              f"scale needs tier (api-server|engine) and count in 1..{MAX_SCALE}")
        check(optional(self.model, lambda v: is_str(v, 1024)), "model must be a model id")

    @property
    def tier_name(self) -> str:
        """The supervisor's name of the tier: gateway or engine."""
        return SCALE_TIERS[self.tier]


DEFAULT_DRAIN_TIMEOUT = 120.0
"""Seconds an elastic resize waits for in-flight requests before giving up (vLLM's default)."""


@dataclass(frozen=True)
class ElasticScaleCommand(ControlMessage):
    """Resize an expert-parallel engine group to ``size`` members (``POST /scale_elastic_ep``, ``launch scale
    engine``): pause admission, let in-flight requests finish within ``drain_timeout`` s, re-form the group,
    resume. Answered when it is over (``ElasticScaleReply``)."""

    TYPE: ClassVar[str] = "scale_elastic_ep"
    size: int
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    model: str | None = None  # may be left out while one model is expert parallel

    def __post_init__(self) -> None:
        check(is_int(self.size, 1, MAX_SCALE + 1), f"size must be an integer in 1..{MAX_SCALE}")
        check(is_nonneg(self.drain_timeout) and 0 < self.drain_timeout <= 86400,
              "drain_timeout must be a number of seconds in (0, 86400]")
        check(optional(self.model, lambda v: is_str(v, 1024)), "model must be a model id")


@dataclass(frozen=True)
class PauseCommand(ControlMessage):
    """Stop admitting new requests of ``model`` (None: of every model) on every gateway; answered once every
    gateway applied it."""

    TYPE: ClassVar[str] = "pause"
    model: str | None = None

    def __post_init__(self) -> None:
        check(optional(self.model, lambda v: is_str(v, 1024)), "model must be a model id")


@dataclass(frozen=True)
class ResumeCommand(ControlMessage):
    """Admit again the requests an operator paused: of ``model``, or (None) every pause an operator gave."""

    TYPE: ClassVar[str] = "resume"
    model: str | None = None

    def __post_init__(self) -> None:
        check(optional(self.model, lambda v: is_str(v, 1024)), "model must be a model id")


@dataclass(frozen=True)
class LoraLoadCommand(ControlMessage):
    """Load LoRA adapter ``name`` of ``model`` (None: the only model that serves adapters) from ``path`` on every
    engine of the model, then serve it on every gateway; answered (``LoraReply``) once all did, or once the load
    was rolled back everywhere."""

    TYPE: ClassVar[str] = "lora_load"
    name: str
    path: str
    model: str | None = None

    def __post_init__(self) -> None:
        check(valid_lora_name(self.name) and is_str(self.path), "lora_load needs an adapter name and a path")
        check(optional(self.model, lambda v: is_str(v, 1024)), "model must be a model id")


@dataclass(frozen=True)
class LoraUnloadCommand(ControlMessage):
    """Stop serving LoRA adapter ``name`` on every gateway (a 404 from then on), and drop it from every engine once
    its running requests finish."""

    TYPE: ClassVar[str] = "lora_unload"
    name: str

    def __post_init__(self) -> None:
        check(valid_lora_name(self.name), "lora_unload needs an adapter name")


OPERATIONS = ("sleep", "wake_up", "update_weights", "update_weight_version", "reset_prefix_cache", "reset_mm_cache",
              "reset_encoder_cache", "start_profile", "stop_profile")
"""The engine operations of the control socket (``OperationCommand``), each an admin route of the same name."""


@dataclass(frozen=True)
class OperationCommand(ControlMessage):
    """Carry out engine operation ``op`` (OPERATIONS) with ``args`` on every engine of ``model`` (None: the only
    model, or every one); answered (``OperationReply``) once every engine has done it and every gateway applied the
    cluster state that says so."""

    TYPE: ClassVar[str] = "operation"
    op: str
    model: str | None = None
    args: dict | None = None

    def __post_init__(self) -> None:
        check(self.op in OPERATIONS, f"op must be one of {OPERATIONS}")
        check(optional(self.model, lambda v: is_str(v, 1024)), "model must be a model id")
        check(optional(self.args, _small_dict), "args must be a small object")


@dataclass(frozen=True)
class AbortCommand(ControlMessage):
    """Abort the client requests ``request_ids`` on whichever gateway serves them (``POST /abort_requests``)."""

    TYPE: ClassVar[str] = "abort"
    request_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        check(_request_ids(self.request_ids) and self.request_ids, f"abort needs 1..{MAX_ABORT_IDS} request ids")


@dataclass(frozen=True)
class ReloadCommand(ControlMessage):
    """Replace every process one at a time (like SIGHUP to the supervisor); answered when it is done. The tenants
    file is read again first; with ``tenants_only``, that is all (answered once every gateway applied it)."""

    TYPE: ClassVar[str] = "reload"
    tenants_only: bool = False

    def __post_init__(self) -> None:
        check(isinstance(self.tenants_only, bool), "tenants_only must be a bool")


@dataclass(frozen=True)
class StopCommand(ControlMessage):
    """Drain and stop, like SIGTERM to the supervisor."""

    TYPE: ClassVar[str] = "stop"


# -- control socket: replies ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ErrorReply(ControlMessage):
    TYPE: ClassVar[str] = "error"
    error: str

    def __post_init__(self) -> None:
        check(is_str(self.error), "error must be a str of at most 4096 chars")


@dataclass(frozen=True)
class ProcessStatus(ControlMessage):
    """One slot of a tier: its process (``pid`` None while it waits to restart) and its last load."""

    TYPE: ClassVar[str] = "process"
    tier: str
    index: int  # a gateway's index, an engine's rank (unique across models)
    pid: int | None
    state: str  # starting, ready, draining, exited or backoff
    restarts: int
    crash_looping: bool
    uptime_s: float | None = None
    last_exit: str | None = None
    next_start_in_s: float | None = None
    # the load of the last Heartbeat
    draining: bool | None = None
    in_flight: int | None = None
    running: int | None = None
    waiting: int | None = None
    kv_used: float | None = None
    kv_blocks_cached: int | None = None
    model: str | None = None  # an engine's model
    endpoint: str | None = None  # an engine on another host: where (launch api-server --engine)
    loras: tuple[str, ...] | None = None  # an engine's LoRA adapters, as it reported them
    sleeping: int | None = None  # an engine's sleep level (0: awake), as it reported it
    weight_version: str | None = None  # the weight version an engine serves, as it reported it

    def __post_init__(self) -> None:
        check(is_str(self.tier, 32) and is_int(self.index, 0, 1 << 16), "bad tier or index")
        check(optional(self.model, lambda v: is_str(v, 1024)) and optional(self.endpoint, lambda v: is_str(v, 1024)),
              "model must be a model id, endpoint an endpoint")
        check(optional(self.pid, is_uint) and is_str(self.state, 32) and is_uint(self.restarts),
              "bad pid, state or restarts")
        check(isinstance(self.crash_looping, bool) and optional(self.draining, lambda v: isinstance(v, bool)),
              "crash_looping and draining are bools")
        check(optional(self.uptime_s, is_nonneg) and optional(self.next_start_in_s, is_nonneg),
              "bad uptime or next start")
        check(optional(self.last_exit, is_str), "last_exit must be a str")
        check(optional(self.loras, lambda v: isinstance(v, tuple) and all(valid_lora_name(n) for n in v)),
              "loras must be adapter names")
        check(optional(self.sleeping, lambda v: v in (0, *SLEEP_LEVELS)) and optional(
            self.weight_version, lambda v: is_str(v, 256, empty=True)), "bad sleeping level or weight_version")
        for name in ("in_flight", "running", "waiting", "kv_blocks_cached"):
            check(optional(getattr(self, name), is_uint), f"{name} out of range")
        check(optional(self.kv_used, lambda v: is_nonneg(v) and v <= 1.0), "kv_used out of range")

    def to_wire(self) -> dict:
        return {"pid": None, **super().to_wire()}  # null while the slot waits to restart


@dataclass(frozen=True)
class StatusReply(ControlMessage):
    TYPE: ClassVar[str] = "status_reply"
    url: str
    models: dict  # model id → its desired engines, in serving order (0 each on a render server)
    pid: int
    run_dir: str
    uptime_s: float
    desired: dict  # tier (gateway, engine: over every model) → desired count
    paused: bool
    cluster_version: int
    processes: tuple[ProcessStatus, ...] = ()
    # model id → its expert-parallel group: size, generation, phase, last_error, last_pause_s
    expert_parallel: dict | None = None
    holds: tuple[Hold, ...] = ()  # what gateways hold or refuse now, per (reason, model)
    options: dict | None = None  # every option the server was started with, secrets redacted (/server_info)
    # (asked for) each tenant's limits and its buckets' levels and requests in flight now (zserve.tenants)
    tenants: list | None = None

    def __post_init__(self) -> None:
        check(optional(self.options, lambda v: isinstance(v, dict)), "options must be an object")
        check(optional(self.tenants, lambda v: isinstance(v, list | tuple) and all(isinstance(t, dict) for t in v)),
              "tenants must be a list of objects")
        if self.tenants is not None:
            object.__setattr__(self, "tenants", list(self.tenants))
        check(optional(self.expert_parallel, lambda v: isinstance(v, dict) and all(
            is_str(k, 1024) and isinstance(g, dict) for k, g in v.items())), "expert_parallel maps models to groups")
        check(is_str(self.url, 1024, empty=True) and is_uint(self.pid) and is_str(self.run_dir, 4096, empty=True),
              "bad url, pid or run_dir")
        check(isinstance(self.models, dict) and all(is_str(k, 1024) and is_uint(v) for k, v in self.models.items()),
              "models maps model ids to engine counts")
        check(is_nonneg(self.uptime_s) and isinstance(self.paused, bool) and is_int(self.cluster_version, 0, 1 << 62),
              "bad uptime, paused or cluster_version")
        check(isinstance(self.desired, dict) and all(is_str(k, 32) and is_uint(v) for k, v in self.desired.items()),
              "desired maps tiers to counts")
        check(isinstance(self.processes, tuple) and all(isinstance(p, ProcessStatus) for p in self.processes),
              "processes must be ProcessStatus entries")
        check(isinstance(self.holds, tuple) and all(isinstance(h, Hold) for h in self.holds), "bad holds")

    def to_wire(self) -> dict:
        return {**super().to_wire(), "processes": [p.to_wire() for p in self.processes],
                "holds": [h.to_json() for h in self.holds]}

    @classmethod
    def from_wire(cls, body: dict) -> StatusReply:
        procs, holds = body.get("processes", []), body.get("holds", [])
        check(isinstance(procs, list) and all(isinstance(p, dict) for p in procs), "processes must be a list")
        check(isinstance(holds, list), "holds must be a list")
        try:
            held = [Hold.from_json(h) for h in holds]
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"bad hold: {e}") from None
        return super().from_wire({**body, "processes": [ProcessStatus.from_wire(p) for p in procs],  # type: ignore[return-value]
                                  "holds": held})


@dataclass(frozen=True)
class ScaleReply(ControlMessage):
    TYPE: ClassVar[str] = "scale_reply"
    tier: str  # gateway or engine
    desired: int
    model: str | None = None  # the engine tier's model

    def __post_init__(self) -> None:
        check(self.tier in ("gateway", "engine") and is_int(self.desired, 1, MAX_SCALE + 1), "bad tier or desired")
        check(optional(self.model, lambda v: is_str(v, 1024)), "model must be a model id")


ELASTIC_OUTCOMES = {"ok": 200, "invalid": 400, "drain_timeout": 408, "busy": 409, "failed": 500}
"""How an elastic resize ended, and the HTTP status ``/scale_elastic_ep`` answers for it (vLLM's): done; a
request that cannot be carried out; in-flight requests did not finish in time (nothing changed); another
resize is running; the resize failed (the old group serves on)."""


@dataclass(frozen=True)
class ElasticScaleReply(ControlMessage):
    TYPE: ClassVar[str] = "scale_elastic_ep_reply"
    outcome: str  # a key of ELASTIC_OUTCOMES
    message: str
    size: int  # the group's size now
    pause_s: float | None = None  # how long admission was paused

    def __post_init__(self) -> None:
        check(self.outcome in ELASTIC_OUTCOMES, f"outcome must be one of {sorted(ELASTIC_OUTCOMES)}")
        check(is_str(self.message, empty=True) and is_uint(self.size), "bad message or size")
        check(optional(self.pause_s, is_nonneg), "pause_s must be a number of seconds")


@dataclass(frozen=True)
class PauseReply(ControlMessage):
    """The answer to pause and resume; ``unacknowledged`` names gateways that had not applied it in time."""

    TYPE: ClassVar[str] = "pause_reply"
    paused: bool
    version: int
    unacknowledged: tuple[str, ...] = ()
    model: str | None = None  # the model paused or resumed (None: every model)

    def __post_init__(self) -> None:
        check(isinstance(self.paused, bool) and is_int(self.version, 0, 1 << 62), "bad paused or version")
        check(optional(self.model, lambda v: is_str(v, 1024)), "model must be a model id")
        check(isinstance(self.unacknowledged, tuple) and all(is_str(n, 64) for n in self.unacknowledged),
              "unacknowledged must be process names")


LORA_OUTCOMES = {"loaded": 200, "unloaded": 200, "invalid": 400, "not_found": 404, "failed": 500}
"""How a LoRA load or unload ended, and the HTTP status its routes answer (vLLM's): done; bad input (a path
outside --lora-dir, an adapter that does not fit, a name taken: nothing changed); no such adapter; it failed
(no engine answered in time: rolled back)."""


@dataclass(frozen=True)
class LoraReply(ControlMessage):
    """The answer to ``LoraLoadCommand`` and ``LoraUnloadCommand``: ``engines`` that loaded or dropped it, the
    cluster-state ``version`` that serves the change, how long it took, and gateways that had not applied it in
    time (``unacknowledged``)."""

    TYPE: ClassVar[str] = "lora_reply"
    outcome: str  # a key of LORA_OUTCOMES
    message: str
    name: str
    model: str | None = None
    version: int = 0
    engines: int = 0
    seconds: float = 0.0
    unacknowledged: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(self.outcome in LORA_OUTCOMES, f"outcome must be one of {sorted(LORA_OUTCOMES)}")
        check(is_str(self.message, empty=True) and valid_lora_name(self.name), "bad message or name")
        check(optional(self.model, lambda v: is_str(v, 1024)), "model must be a model id")
        check(is_int(self.version, 0, 1 << 62) and is_uint(self.engines) and is_nonneg(self.seconds),
              "bad version, engines or seconds")
        check(isinstance(self.unacknowledged, tuple) and all(is_str(n, 64) for n in self.unacknowledged),
              "unacknowledged must be process names")


OPERATION_OUTCOMES = {"ok": 200, "invalid": 400, "not_found": 404, "busy": 409, "failed": 500}
"""How an engine operation ended, and its routes' status: done on every engine; bad input (nothing changed); no
such model; refused for the cluster's state (requests run, a resize or another operation is in progress: nothing
changed); an engine failed it or none answered in time (the others were brought back where possible)."""


@dataclass(frozen=True)
class OperationReply(ControlMessage):
    """The answer to ``OperationCommand``: ``engines`` (one object per engine: ``engine`` rank, ``model``, ``ok``,
    ``error`` or what it did), the models it covered, how long it took and how long the models' admission was
    held (``pause_s``), and the cluster-state ``version`` that carries it."""

    TYPE: ClassVar[str] = "operation_reply"
    outcome: str
    message: str
    op: str
    models: tuple[str, ...] = ()
    engines: tuple[dict, ...] = ()
    seconds: float = 0.0
    pause_s: float | None = None
    version: int = 0
    unacknowledged: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(self.outcome in OPERATION_OUTCOMES and self.op in OPERATIONS, "bad outcome or op")
        check(is_str(self.message, empty=True) and isinstance(self.models, tuple)
              and all(is_str(m, 1024) for m in self.models), "bad message or models")
        check(isinstance(self.engines, tuple) and len(self.engines) <= 1 << 12
              and all(isinstance(e, dict) for e in self.engines), "engines must be objects")
        check(is_nonneg(self.seconds) and optional(self.pause_s, is_nonneg) and is_int(self.version, 0, 1 << 62),
              "bad seconds, pause_s or version")
        check(isinstance(self.unacknowledged, tuple) and all(is_str(n, 64) for n in self.unacknowledged),
              "unacknowledged must be process names")


@dataclass(frozen=True)
class AbortReply(ControlMessage):
    """Which of the ids were aborted (some gateway served them) and which no gateway knew."""

    TYPE: ClassVar[str] = "abort_reply"
    aborted: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(_request_ids(self.aborted) and _request_ids(self.unknown), "aborted and unknown are request ids")


@dataclass(frozen=True)
class ReloadReply(ControlMessage):
    TYPE: ClassVar[str] = "reload_reply"
    replaced: int  # processes replaced
    seconds: float  # how long the rolling restart took

    def __post_init__(self) -> None:
        check(is_uint(self.replaced) and is_nonneg(self.seconds), "bad replaced or seconds")


@dataclass(frozen=True)
class StopReply(ControlMessage):
    TYPE: ClassVar[str] = "stop_reply"
    stopping: bool = True

    def __post_init__(self) -> None:
        check(isinstance(self.stopping, bool), "stopping must be a bool")


# -- engine registry (an engine host's supervisor ↔ the supervisors of gateway hosts, over TCP) -------------
def _lora_sets(v: object) -> bool:
    return isinstance(v, dict) and len(v) <= 1024 and all(
        is_str(model, 1024) and isinstance(sets, dict) and len(sets) <= 1 << 12
        and all(valid_lora_name(n) and is_str(p) for n, p in sets.items()) for model, sets in v.items())


@dataclass(frozen=True)
class RegistryHello(ControlMessage):
    """A gateway host asks an engine host for its engines; sent again every heartbeat interval, which keeps it
    subscribed to the changes (a host silent for the heartbeat timeout gets no more)."""

    TYPE: ClassVar[str] = "registry_hello"
    host: str  # who asks, for the engine host's log
    applied: int = 0  # the registry version every gateway of that host applied (sent again at once when it grows)
    # The LoRA adapters the gateway host's cluster wants its models' engines to have: model id -> {name: path}
    # (launch.ops.lora); the engine host's engines load them (sent again at once when they change).
    loras: dict | None = None

    def __post_init__(self) -> None:
        check(is_str(self.host, 256) and is_int(self.applied, 0, 1 << 62), "host must be a short str, applied a "
              "version")
        check(optional(self.loras, _lora_sets), "loras maps model ids to {adapter name: path}")


@dataclass(frozen=True)
class EngineRegistry(ControlMessage):
    """An engine host's engines (their TCP endpoints, states and models) and each model's desired count: the
    answer to every ``RegistryHello``, and sent at once to every subscribed gateway host when it changes. An
    endpoint on a wildcard address (0.0.0.0, ::) means the host the gateway host reached the registry at."""

    TYPE: ClassVar[str] = "engine_registry"
    version: int
    engines: tuple[EngineInfo, ...] = ()
    models: dict | None = None
    # The engine host's holds on its models ("reloading" while it replaces a model's only engine): gateway hosts
    # hold those models' new requests as its own gateways would.
    holds: tuple[Hold, ...] = ()
    # The LoRA adapters its engines refused (name -> why): a gateway host's load of one is rolled back.
    lora_errors: dict | None = None

    def __post_init__(self) -> None:
        check(is_int(self.version, 0, 1 << 62), "version out of range")
        check(optional(self.lora_errors, lambda v: isinstance(v, dict) and len(v) <= 1 << 12 and all(
            valid_lora_name(k) and is_str(e) for k, e in v.items())), "lora_errors maps adapter names to errors")
        check(isinstance(self.engines, tuple) and len(self.engines) <= 1 << 12, "engines must be a list")
        _check_engines(self.engines)
        check(isinstance(self.holds, tuple) and all(isinstance(h, Hold) for h in self.holds), "bad holds")
        check(optional(self.models, lambda v: isinstance(v, dict) and all(
            is_str(k, 1024) and is_uint(n) for k, n in v.items())), "models maps model ids to engine counts")

    def to_wire(self) -> dict:
        return {"version": self.version, "engines": [asdict(e) for e in self.engines], "models": self.models or {},
                "holds": [h.to_json() for h in self.holds], "lora_errors": self.lora_errors or {}}

    @classmethod
    def from_wire(cls, body: dict) -> EngineRegistry:
        check(set(body) <= {"version", "engines", "models", "holds", "lora_errors"},
              "unknown fields in engine_registry")
        engines = body.get("engines", [])
        check(isinstance(engines, list) and all(isinstance(e, dict) for e in engines), "engines must be a list")
        holds = body.get("holds", [])
        check(isinstance(holds, list), "holds must be a list")
        return cls(body.get("version"), tuple(EngineInfo(**e) for e in engines), body.get("models"),
                   tuple(Hold.from_json(h) for h in holds), body.get("lora_errors") or None)


@dataclass(frozen=True)
class RemoteOperation(ControlMessage):
    """A gateway host asks an engine host to carry out engine operation ``op`` on its engines of ``model`` (as its
    own control socket's ``OperationCommand``); answered ``RemoteOperationReply`` with the same ``id``."""

    TYPE: ClassVar[str] = "remote_operation"
    id: int
    op: str
    model: str
    args: dict | None = None

    def __post_init__(self) -> None:
        check(is_int(self.id, 0, 1 << 62) and self.op in OPERATIONS and is_str(self.model, 1024),
              "remote_operation needs an id, an op and a model")
        check(optional(self.args, _small_dict), "args must be a small object")


@dataclass(frozen=True)
class RemoteOperationReply(OperationReply):
    """An engine host's ``OperationReply`` to the gateway host's ``RemoteOperation`` ``id``."""

    TYPE: ClassVar[str] = "remote_operation_reply"
    id: int = 0


REGISTRY_REQUESTS: tuple[type[ControlMessage], ...] = (RegistryHello, RemoteOperation)
REGISTRY_REPLIES: tuple[type[ControlMessage], ...] = (EngineRegistry, RemoteOperationReply)

PIPE_EVENTS: tuple[type[ControlMessage], ...] = (Ready, Heartbeat, Ack, BootFailed, GroupReport, LoraReport,
                                                 EngineOpReport, EngineCondition, AbortReport)
"""What a child writes on its status pipe."""
PIPE_COMMANDS: tuple[type[ControlMessage], ...] = (ClusterUpdate, GroupCommand, GroupFreeze, LoraCommand, EngineOp,
                                                   AbortRequests)
"""What the supervisor writes on a child's control pipe."""
COMMANDS: tuple[type[ControlMessage], ...] = (StatusCommand, ScaleCommand, ElasticScaleCommand, PauseCommand,
                                              ResumeCommand, ReloadCommand, StopCommand, LoraLoadCommand,
                                              LoraUnloadCommand, OperationCommand, AbortCommand)
"""What the control socket accepts."""
REPLIES: tuple[type[ControlMessage], ...] = (ErrorReply, StatusReply, ScaleReply, ElasticScaleReply, PauseReply,
                                             ReloadReply, StopReply, LoraReply, OperationReply, AbortReply)
"""What the control socket answers."""


def encode_line(msg: ControlMessage) -> bytes:
    """One JSON line, newline included."""
    return orjson.dumps({"v": CONTROL_VERSION, "t": msg.TYPE, **msg.to_wire()}) + b"\n"


def decode_line(line: bytes, allowed: tuple[type[ControlMessage], ...]) -> ControlMessage:
    """Parse and validate one line into one of ``allowed``; raise ProtocolError for anything else."""
    check(len(line) <= MAX_LINE, f"line of {len(line)} bytes exceeds the {MAX_LINE}-byte limit")
    try:
        body = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"not JSON: {e}") from None
    check(isinstance(body, dict), "a control message is a JSON object")
    version = body.pop("v", None)
    check(version == CONTROL_VERSION, f"unsupported control version {version!r} (this side speaks {CONTROL_VERSION})")
    kind = body.pop("t", None)
    cls = next((c for c in allowed if c.TYPE == kind), None)
    check(cls is not None, f"unexpected message type {kind!r} here")
    try:
        return cls.from_wire(body)  # type: ignore[union-attr]
    except ProtocolError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise ProtocolError(f"bad {kind} message: {e}") from None


class LineBuffer:
    """Splits a byte stream into lines; refuses a line that grows past ``limit`` without ending."""

    def __init__(self, limit: int = MAX_LINE):
        self.limit = limit
        self.rest = b""

    def feed(self, data: bytes) -> list[bytes]:
        *lines, self.rest = (self.rest + data).split(b"\n")
        if len(self.rest) > self.limit:
            self.rest = b""
            raise ProtocolError(f"a line exceeds the {self.limit}-byte limit")
        return lines

    def messages(self, data: bytes, allowed: tuple[type[ControlMessage], ...],
                 dropped: Callable[[ProtocolError], None]) -> list[ControlMessage]:
        """The messages ``data`` completes; a line too long or unreadable goes to ``dropped`` (which logs it)
        and is skipped, so a bad line never stops a reader."""
        try:
            lines = self.feed(data)
        except ProtocolError as e:
            dropped(e)
            return []
        out = []
        for line in lines:
            try:
                out.append(decode_line(line, allowed))
            except ProtocolError as e:
                dropped(e)
        return out
