"""The gateway tier's configuration, written once: ``launch`` fills it, the supervisor hands every
gateway the same value inside its ``GatewayLaunch`` (``zserve.config.EngineConfig`` and
``zserve.launch_spec.EngineLaunch`` are the engine tier's twins), the gateway reads it back. A new gateway option
is a field here, a click option and the code that uses it. Router-free: the supervisor imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import orjson

from protocol.codec import MAX_FRAME_BYTES
from protocol.messages import valid_lora_name
from protocol.speech import SAMPLE_RATE
from zserve.catalog import ModelSource
from zserve.config import EngineConfig, config_from_json
from zserve.launch_spec import (
    build_launch,
    check,
    fields_from_json,
    is_int,
    is_seconds,
    is_text,
    optional_text,
    source_from_json,
)

from .families import FAMILY_NAMES, check_disabled, installed_plugin_names
from .routing import DEFAULT_MAX_SHARE, ROUTING_POLICIES
from .store import DEFAULT_MAX_ITEMS, DEFAULT_TTL_S, check_store_url
from .text.reasoning import REASONING_PARSERS
from .text.tool_parsers import TOOL_PARSERS

BODY_TIMEOUT_S = 10.0  # default --body-timeout (gateway.body_timeout)
MAX_AUDIO_MB = 1024.0  # --max-audio-mb at most
MAX_AUDIO_SECONDS = MAX_FRAME_BYTES // (2 * SAMPLE_RATE)  # --max-audio-seconds at most: 16-bit samples in one frame


def is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class GatewayConfig:
    """What every gateway process is started with (besides its index, its models and the sockets it inherits)."""

    tool_call_parser: str | None = None  # tools are refused without one
    reasoning_parser: str | None = None
    state_url: str | None = None  # stored responses: None = SQLite in the run directory; redis://, sqlite:///
    responses_ttl: float = DEFAULT_TTL_S  # seconds a stored response lives after its last change
    responses_max_items: int = DEFAULT_MAX_ITEMS  # the oldest stored responses go first past this
    # The context (prompt + output) requests are checked against while no engine reports its own: always on a
    # render server, which has none (engines cap it to the model's own context; this value is taken as given).
    # None: the model's own context, as its tokenizer files give it.
    max_model_len: int | None = EngineConfig.max_model_len
    render_only: bool = False  # no engine tier (launch render): requests are rendered, never generated
    max_concurrent_requests: int | None = 1024  # per gateway; past it: 429 at once; None: unbounded
    body_timeout: float = BODY_TIMEOUT_S  # seconds a request body may take to arrive (plus its length at 1 MiB/s)
    stream_interval: int = 1  # output tokens per stream chunk after the first (vLLM's --stream-interval)
    # Seconds a new request is held while its model has no engine to take it (an expert-parallel resize or
    # recovery, a rolling restart replacing the model's only engine), before a 503 (0: refused at once)
    scaling_wait: float = 30.0
    # A request whose engine is lost while it streams (the engine died or hung, its host was cut off, its drain timed
    # out, its expert-parallel group lost a member) moves to another engine of its model with the tokens it produced
    # and goes on from there, at most this many times (0: it fails as its engine does). ``migration_max_len``: the
    # longest prompt + generated tokens a move re-sends (None: whatever the engines take).
    migration_limit: int = 3
    migration_max_len: int | None = None
    # Which engine of a model takes a request (``gateway.routing``): ``prefix`` by what each engine's prefix cache
    # holds (its KV events) within ``routing_max_share`` times the fair share of the load; ``load``: least loaded;
    # ``round-robin``.
    routing_policy: str = "prefix"
    routing_max_share: float = DEFAULT_MAX_SHARE
    metrics_auth: bool = False  # with API keys: /metrics needs one too (else it stays open for scrapers)
    # CORS (vLLM's options): origins allowed to call the API from a browser; () = none, "*" = any
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # Route families (gateway.families) and endpoint plugins (gateway.plugins) not mounted: they answer 404.
    disabled_families: tuple[str, ...] = ()
    # Speech to text (/v1/audio/*): the largest upload (OpenAI's limit) and the longest recording it may hold (the
    # decoded audio travels to the engine in one frame: MAX_AUDIO_SECONDS at most).
    max_audio_mb: float = 25.0
    max_audio_seconds: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = tuple(getattr(self, name))
            if not all(isinstance(v, str) and v.strip() for v in value):
                raise ValueError(f"{name} must be non-empty strings")
            object.__setattr__(self, name, value)
        if self.max_concurrent_requests is not None and not (
                isinstance(self.max_concurrent_requests, int) and 1 <= self.max_concurrent_requests <= 1 << 20):
            raise ValueError("max_concurrent_requests must be an integer in 1..1048576")
        if not (isinstance(self.body_timeout, (int, float)) and not isinstance(self.body_timeout, bool)
                and 0.1 <= self.body_timeout <= 3600):
            raise ValueError("body_timeout must be a number of seconds in 0.1..3600")
        if not (is_number(self.max_audio_mb) and 0.01 <= self.max_audio_mb <= MAX_AUDIO_MB):
            raise ValueError(f"max_audio_mb must be a number of megabytes in 0.01..{MAX_AUDIO_MB}")
        if not (is_number(self.max_audio_seconds) and 1 <= self.max_audio_seconds <= MAX_AUDIO_SECONDS):
            raise ValueError(f"max_audio_seconds must be a number of seconds in 1..{MAX_AUDIO_SECONDS}")
        if not (isinstance(self.stream_interval, int) and not isinstance(self.stream_interval, bool)
                and 1 <= self.stream_interval <= 1024):
            raise ValueError("stream_interval must be an integer in 1..1024")
        if not (isinstance(self.scaling_wait, (int, float)) and not isinstance(self.scaling_wait, bool)
                and 0 <= self.scaling_wait <= 3600):
            raise ValueError("scaling_wait must be a number of seconds in 0..3600")
        if not (isinstance(self.migration_limit, int) and not isinstance(self.migration_limit, bool)
                and 0 <= self.migration_limit <= 100):
            raise ValueError("migration_limit must be an integer in 0..100")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}")
        if not (isinstance(self.routing_max_share, (int, float)) and not isinstance(self.routing_max_share, bool)
                and 1.0 <= self.routing_max_share <= 100.0):
            raise ValueError("routing_max_share must be a number in 1..100")
        if self.migration_max_len is not None and not (isinstance(self.migration_max_len, int)
                                                        and not isinstance(self.migration_max_len, bool)
                                                        and 1 <= self.migration_max_len <= 1 << 20):
            raise ValueError("migration_max_len must be an integer in 1..1048576")
        for name in ("metrics_auth", "allow_credentials"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false")
        for name, registry in (("tool_call_parser", TOOL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            value = getattr(self, name)
            if value is not None and value not in registry:
                raise ValueError(f"{name}: unknown {registry.kind} {value!r}; choose one of: {registry.names()}")
        if self.state_url is not None:
            try:
                check_store_url(self.state_url)
            except ValueError as e:
                raise ValueError(f"state_url: {e}") from None
        if not (isinstance(self.responses_ttl, (int, float)) and 1 <= self.responses_ttl <= 365 * 86400):
            raise ValueError("responses_ttl must be a number of seconds in 1..31536000")
        if not (isinstance(self.responses_max_items, int) and 1 <= self.responses_max_items <= 10**8):
            raise ValueError("responses_max_items must be an integer in 1..100000000")
        if self.max_model_len is not None and not (isinstance(self.max_model_len, int)
                                                    and not isinstance(self.max_model_len, bool)
                                                    and 16 <= self.max_model_len <= 1 << 20):
            raise ValueError("max_model_len must be an integer in 16..1048576")
        if not isinstance(self.render_only, bool):
            raise ValueError("render_only must be true or false")
        self._check_disabled_families()

    def _check_disabled_families(self) -> None:
        """Known names only: a family, or a plugin whose package is installed here (read from its metadata; each
        gateway checks again against the plugins it loaded)."""
        if not (isinstance(self.disabled_families, (list, tuple))
                and all(isinstance(n, str) for n in self.disabled_families)):
            raise ValueError("disabled_families must be a list of route family or plugin names")
        object.__setattr__(self, "disabled_families", tuple(dict.fromkeys(self.disabled_families)))
        if self.disabled_families:
            check_disabled(self.disabled_families, FAMILY_NAMES, installed_plugin_names())

    def replace(self, **changes) -> GatewayConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return orjson.dumps(dataclasses.asdict(self)).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> GatewayConfig:
        return config_from_json(cls, text, "gateway")


@dataclass(frozen=True)
class GatewayModel:
    """One model a gateway serves: where its files are (tokenizer, chat template), every name clients use, and
    its LoRA adapters (``EngineConfig.lora_modules``: each name is served too, through the model's engines)."""

    source: ModelSource
    names: tuple[str, ...] = ()  # () = the model id
    loras: tuple[tuple[str, str], ...] = ()  # (name, path) of each adapter its engines load at start

    def __post_init__(self) -> None:
        check(isinstance(self.source, ModelSource), "a served model's source must be a ModelSource")
        names = tuple(self.names) if isinstance(self.names, (list, tuple)) else None
        check(names is not None and all(is_text(n) for n in names), "a served model's names must be non-empty "
                                                                   "strings")
        object.__setattr__(self, "names", names)
        loras = self.loras if isinstance(self.loras, (list, tuple)) else None
        check(loras is not None and all(isinstance(m, (list, tuple)) and len(m) == 2 and valid_lora_name(m[0])
                                        and is_text(m[1]) for m in loras),
              "a served model's loras must be [name, path] pairs")
        object.__setattr__(self, "loras", tuple((name, path) for name, path in loras))  # type: ignore[union-attr]

    def to_json(self) -> dict:
        return {"source": self.source.to_json(), "names": list(self.names), "loras": [list(m) for m in self.loras]}

    @classmethod
    def from_json(cls, data: object) -> GatewayModel:
        check(isinstance(data, dict) and set(data) <= {"source", "names", "loras"},
              "a served model is a JSON object with source, names and loras")
        assert isinstance(data, dict)
        return cls(source_from_json(data.get("source")), data.get("names") or (), data.get("loras") or ())


@dataclass(frozen=True)
class GatewayLaunch:
    """Everything one gateway process is started with."""

    index: int
    fd: int  # the inherited listening socket
    models: tuple[GatewayModel, ...]  # every model a request may name; the first is the default
    config: GatewayConfig = dataclasses.field(default_factory=GatewayConfig)
    cache_dir: str | None = None  # tokenizers built from GGUF metadata, kept across restarts
    control_socket: str | None = None  # the supervisor's control socket (control routes send commands there)
    shutdown_timeout: float = 30.0
    heartbeat_interval: float = 1.0
    key_file: str | None = None  # digests of the API and admin keys, and the tenants (gateway.security)
    quota_dir: str | None = None  # where this host's gateways keep each tenant's limits (gateway.quota)
    keys_dir: str | None = None  # CURVE key directory (zserve.curve) for engines on other hosts
    responses_db: str | None = None  # the SQLite file every gateway of this host shares
    engines: tuple[str, ...] = ()  # engine endpoints, for a gateway no supervisor tells (it sends cluster state)
    engine_timeout: float = 600.0  # seconds to wait for the first ready engine

    def __post_init__(self) -> None:
        check(is_int(self.index, 0, 1 << 16), "index must be an integer in 0..65536")
        check(is_int(self.fd, 0, 1 << 20), "fd must be a file descriptor")
        models = tuple(self.models) if isinstance(self.models, (list, tuple)) else ()
        check(bool(models) and all(isinstance(m, GatewayModel) for m in models), "models must name at least one "
                                                                                "GatewayModel")
        object.__setattr__(self, "models", models)
        check(isinstance(self.config, GatewayConfig), "config must be a GatewayConfig")
        for name in ("cache_dir", "control_socket", "key_file", "quota_dir", "keys_dir", "responses_db"):
            check(optional_text(getattr(self, name)), f"{name} must be a path or null")
        check(is_seconds(self.shutdown_timeout, 0, 86400), "shutdown_timeout must be seconds in 0..86400")
        check(is_seconds(self.heartbeat_interval, 0.01, 3600), "heartbeat_interval must be seconds in 0.01..3600")
        check(is_seconds(self.engine_timeout, 0, 86400), "engine_timeout must be seconds in 0..86400")
        engines = tuple(self.engines) if isinstance(self.engines, (list, tuple)) else None
        check(engines is not None and all(is_text(e) for e in engines), "engines must be endpoint strings")
        object.__setattr__(self, "engines", engines)

    def to_json(self) -> str:
        return orjson.dumps({**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                             "models": [m.to_json() for m in self.models],
                             "config": dataclasses.asdict(self.config)}).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> GatewayLaunch:
        data = fields_from_json(cls, text, "gateway launch")
        models = data.get("models")
        check(isinstance(models, list), "models must be a list of served models")
        data["models"] = tuple(GatewayModel.from_json(m) for m in models)
        return build_launch(cls, data, GatewayConfig, "gateway")
