"""What one server runs: its configuration (``ServeConfig``) and each model's engine tier (``ModelTier``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from gateway.config import GatewayConfig
from zserve.catalog import ModelSource
from zserve.config import MAX_ENGINES_PER_MODEL, ModelSpec
from zserve.proc import redact_option


@dataclass
class ServeConfig:
    """One server: its models (each with the engine tier its spec asks for), the gateways' configuration,
    and the supervisor's own settings."""

    models: list[tuple[ModelSource, ModelSpec]]  # in order: the first is the default model of a request
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    api_keys: tuple[str, ...] = ()  # gateway.security: written as digests to a file only this user reads
    admin_keys: tuple[str, ...] = ()
    # The tenants file (zserve.tenants): its keys, limits, weights; read again on SIGHUP and `launch reload`.
    tenants: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None  # serve on this Unix socket instead of host:port
    gateways: int = 2
    ready_timeout: float = 600.0
    shutdown_timeout: float = 30.0
    heartbeat_timeout: float = 30.0
    heartbeat_interval: float = 1.0
    # Tiers on different hosts (launch.hosts.engine_registry): an engine host binds its registry here and runs no
    # gateway; a gateway host runs no engine and uses the engine hosts at these registry URLs.
    bind: str | None = None
    remote_engines: tuple[str, ...] = ()
    keys_dir: str | None = None  # CURVE keys (zserve.curve); None: plain TCP (--insecure) or one host (ipc)
    # An engine host's first KV event port (engine rank r: PUB on it + 2r, replay on the next); None: right after
    # its engine ports (launch.hosts.engine_registry.kv_events_ports).
    kv_events_port: int | None = None
    # A model whose engines all crash-loop is marked failed and the others serve on; with this, the supervisor
    # stops instead (an orchestrator that restarts the pod prefers that).
    exit_on_crash_loop: bool = False
    # The only directories LoRA adapters may be loaded from at run time (/v1/load_lora_adapter); none: runtime
    # loading is off (adapters given at start with --lora-modules are read from anywhere).
    lora_dirs: tuple[str, ...] = ()
    # Where each engine writes its torch profiler trace (POST /start_profile, /stop_profile); None: profiling off.
    profiler_dir: str | None = None

    def options(self) -> dict:
        """Every option this server runs with (each model's engine options beside it), secrets redacted
        (``zserve.proc.redact_option``: keys counted, URL passwords masked): what ``/server_info`` shows."""
        top = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("models", "gateway")}
        models = [{"model": source.model_id, "path": source.path, "engines": spec.engines, "names": list(spec.names),
                   "engine": dataclasses.asdict(spec.engine)} for source, spec in self.models]
        return redact_option("", {**top, "gateway": dataclasses.asdict(self.gateway), "models": models})


@dataclass
class ModelTier:
    """One model's engine tier. Model m owns engine ranks m * 64 .. m * 64 + 63, so every engine's rank,
    socket, seed and slot stay unique across models; its engines take GPUs from ``first_device`` on."""

    source: ModelSource
    spec: ModelSpec
    desired: int
    base: int
    first_device: int

    @property
    def model_id(self) -> str:
        return self.source.model_id

    @property
    def names(self) -> tuple[str, ...]:
        return self.spec.names or (self.model_id,)

    @property
    def loras(self) -> tuple[tuple[str, str], ...]:
        """(name, path) of each LoRA adapter its engines load at start: gateways serve each name too."""
        return self.spec.engine.lora_modules

    @property
    def ranks(self) -> range:
        return range(self.base, self.base + self.desired)

    def owns(self, rank: int) -> bool:
        return self.base <= rank < self.base + MAX_ENGINES_PER_MODEL


def model_tiers(cfg: ServeConfig) -> list[ModelTier]:
    """Each model's tier, its ranks and GPUs after those of the models before it."""
    return [ModelTier(source, spec, spec.engines, m * MAX_ENGINES_PER_MODEL, sum(s.engines for _, s in cfg.models[:m]))
            for m, (source, spec) in enumerate(cfg.models)]
