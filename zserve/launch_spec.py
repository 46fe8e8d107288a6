"""What the supervisor hands a child process: one typed, validated value as one ``--launch`` JSON argument.

An engine gets an ``EngineLaunch``, a gateway a ``gateway.config.GatewayLaunch``; ``launch.handoff`` builds both,
and each child's ``main()`` reads its value back with ``parse_child_argv``, the one place a child's command line
is declared. Besides the value, ``launch.children.spawn`` adds the process plumbing it creates itself (the
status and control pipes and the parent's pid). Torch-free and router-free: the supervisor imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from .catalog import ModelSource
from .config import EngineConfig, config_from_dict

T = TypeVar("T")

LAUNCH_FLAG = "--launch"


class LaunchError(ValueError):
    """A launch value that is malformed: the child cannot start with it."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise LaunchError(message)


def is_int(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def is_seconds(value: Any, lo: float, hi: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and lo <= value <= hi)


def is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def optional_text(value: Any) -> bool:
    return value is None or is_text(value)


def source_from_json(data: Any) -> ModelSource:
    """A ``ModelSource`` from its ``to_json`` dict; ``LaunchError`` for anything else."""
    if not isinstance(data, dict):
        raise LaunchError("a model source is a JSON object")
    try:
        return ModelSource.from_json(data)
    except (KeyError, TypeError, ValueError) as e:
        raise LaunchError(f"a model source lacks or has a bad field: {e}") from None


def build_launch(cls: type[T], data: dict[str, Any], config_cls: type, what: str) -> T:
    """``cls(**data)``, its ``config`` (a dict) made a ``config_cls`` first; a bad config or a missing required
    field is a ``LaunchError`` naming it."""
    if "config" in data:
        try:
            data["config"] = config_from_dict(config_cls, data["config"], what)
        except (ValueError, TypeError) as e:
            raise LaunchError(f"config: {e}") from None
    try:
        return cls(**data)
    except TypeError as e:  # a required field missing
        raise LaunchError(f"{what} launch: {e}") from None


def fields_from_json(cls: type, text: str | bytes, what: str) -> dict[str, Any]:
    """The fields of ``cls`` as ``text`` (a JSON object) gives them; unknown fields are an error (a supervisor
    newer than the child it started), missing ones take their defaults."""
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise LaunchError(f"{what} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise LaunchError(f"{what} is a JSON object")
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise LaunchError(f"unknown {what} field(s): {', '.join(sorted(unknown))}")
    return data


@dataclass(frozen=True)
class EngineLaunch:
    """Everything one engine process is started with."""

    rank: int  # unique across models (model m owns ranks m * 64 ..)
    endpoint: str  # the ZeroMQ endpoint to bind: ipc:// on one host, tcp:// on an engine host
    source: ModelSource
    config: EngineConfig = field(default_factory=EngineConfig)
    device: int | None = None  # CUDA device index; None: the default choice
    heartbeat_interval: float = 1.0
    # Seconds a drain (SIGTERM: scale-down, a rolling restart) lets running requests finish before the engine hands
    # the rest back to their gateways, which move them to another engine (--shutdown-timeout).
    shutdown_timeout: float = 30.0
    # Expert parallel: (member, size), the share of the experts of a group of ``size`` this engine loads (the
    # supervisor forms the group later); None: no group.
    expert_share: tuple[int, int] | None = None
    keys_dir: str | None = None  # CURVE key directory (zserve.curve) of a TCP endpoint
    # The LoRA adapters the cluster serves now, (name, path) pairs, given to an engine that starts while serving
    # (a restart, a scale-up, a rolling restart): they replace the configuration's ``lora_modules`` and one that
    # fails to load is left out and reported (not a boot error: the others serve on). None: the configuration's.
    loras: tuple[tuple[str, str], ...] | None = None
    # The label of the weights ``source`` holds (POST /update_weights gives one; an engine that starts later is
    # given the checkpoint and label the cluster serves now).
    weight_version: str = "default"
    # Where it publishes its KV cache events (a ZeroMQ PUB endpoint; the replay socket beside it); None: it does not.
    kv_events: str | None = None

    def __post_init__(self) -> None:
        check(is_int(self.rank, 0, 1 << 20), "rank must be an integer in 0..1048576")
        check(is_text(self.endpoint) and self.endpoint.startswith(("ipc://", "tcp://")),
              "endpoint must be an ipc:// or tcp:// ZeroMQ endpoint")
        check(isinstance(self.source, ModelSource), "source must be a ModelSource")
        check(isinstance(self.config, EngineConfig), "config must be an EngineConfig")
        check(self.device is None or is_int(self.device, 0, 1023), "device must be a CUDA device index or null")
        check(is_seconds(self.heartbeat_interval, 0.01, 3600), "heartbeat_interval must be seconds in 0.01..3600")
        check(is_seconds(self.shutdown_timeout, 0, 86400), "shutdown_timeout must be seconds in 0..86400")
        if self.expert_share is not None:
            share = tuple(self.expert_share) if isinstance(self.expert_share, (list, tuple)) else ()
            check(len(share) == 2 and is_int(share[1], 1, 1 << 16) and is_int(share[0], 0, share[1] - 1),
                  "expert_share must be [member, size] with 0 <= member < size")
            object.__setattr__(self, "expert_share", share)
        check(optional_text(self.keys_dir), "keys_dir must be a directory or null")
        check(is_text(self.weight_version), "weight_version must be a label")
        check(self.kv_events is None or (is_text(self.kv_events) and self.kv_events.startswith(("ipc://", "tcp://"))),
              "kv_events must be an ipc:// or tcp:// ZeroMQ endpoint or null")
        if self.loras is not None:
            check(isinstance(self.loras, (list, tuple)) and all(
                isinstance(m, (list, tuple)) and len(m) == 2 and all(is_text(v) for v in m) for m in self.loras),
                "loras must be [name, path] pairs or null")
            object.__setattr__(self, "loras", tuple((n, p) for n, p in self.loras))

    def to_json(self) -> str:
        return orjson.dumps({**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                             "source": self.source.to_json(), "config": dataclasses.asdict(self.config)}).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> EngineLaunch:
        data = fields_from_json(cls, text, "engine launch")
        data["source"] = source_from_json(data.get("source"))
        return build_launch(cls, data, EngineConfig, "engine")


@dataclass(frozen=True)
class ChildPipes:
    """The process plumbing ``launch.children.spawn`` adds to a child's command line."""

    status_fd: int | None = None  # the child writes status lines (Ready, heartbeats) here
    control_fd: int | None = None  # the supervisor writes commands (cluster state, groups) here
    parent_pid: int | None = None  # the child dies with this process


def parse_child_argv(argv: list[str] | None, prog: str, description: str,
                     decode: Callable[[str], T]) -> tuple[T, ChildPipes]:
    """A child's command line: its launch value (``decode`` of the ``--launch`` JSON) and its pipes. A bad value
    is a usage error (exit 2) that names the field."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument(LAUNCH_FLAG, required=True, metavar="JSON", help="the launch value, as launch.handoff builds it")
    p.add_argument("--status-fd", type=int, default=None, help="pipe to the supervisor")
    p.add_argument("--control-fd", type=int, default=None, help="pipe from the supervisor")
    p.add_argument("--parent-pid", type=int, default=None)
    a = p.parse_args(argv)
    try:
        value = decode(a.launch)
    except (ValueError, TypeError) as e:
        p.error(f"{LAUNCH_FLAG}: {e}")
    return value, ChildPipes(a.status_fd, a.control_fd, a.parent_pid)
