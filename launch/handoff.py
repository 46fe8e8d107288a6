"""What the supervisor hands each child it starts: the one launch value per child kind, built here, and the
command line that carries it (``--launch JSON``; ``launch.children.spawn`` adds the pipes). The values are
declared once (``zserve.launch_spec.EngineLaunch``, ``gateway.config.GatewayLaunch``) and read back by each child's
``main()`` with the same module's parser; nothing here imports a router or torch."""

from __future__ import annotations

from collections.abc import Iterable

from gateway.config import GatewayConfig, GatewayLaunch, GatewayModel
from zserve.catalog import ModelSource
from zserve.config import EngineConfig
from zserve.launch_spec import LAUNCH_FLAG, EngineLaunch


def engine_launch(rank: int, endpoint: str, source: ModelSource, config: EngineConfig, *, threads: int,
                  device: int | None, heartbeat_interval: float, shutdown_timeout: float,
                  expert_share: tuple[int, int] | None = None, keys_dir: str | None = None,
                  loras: tuple[tuple[str, str], ...] | None = None,
                  weight_version: str = "default", kv_events: str | None = None) -> EngineLaunch:
    """One engine's value. ``threads``: the supervisor's share of the cores, for a configuration that does not
    say; ``expert_share``: (member, size) of an expert-parallel tier's group; ``keys_dir``: CURVE keys of an
    engine host's TCP endpoint (None on one host); ``loras``: the LoRA adapters served now, for an engine that
    starts once the server serves (None: the configuration's); ``source`` and ``weight_version``: the weights the
    cluster serves now (``launch.ops.engine_ops``)."""
    return EngineLaunch(rank, endpoint, source, config.replace(threads=config.threads or threads), device=device,
                        heartbeat_interval=heartbeat_interval, shutdown_timeout=shutdown_timeout,
                        expert_share=expert_share, keys_dir=keys_dir or None, loras=loras,
                        weight_version=weight_version, kv_events=kv_events)


def gateway_launch(index: int, fd: int,
                   models: Iterable[tuple[ModelSource, tuple[str, ...], tuple[tuple[str, str], ...]]],
                   config: GatewayConfig, *, render_only: bool, cache_dir: str, control_socket: str,
                   shutdown_timeout: float, heartbeat_interval: float, responses_db: str,
                   key_file: str | None = None, quota_dir: str | None = None,
                   keys_dir: str | None = None) -> GatewayLaunch:
    """One gateway's value: every gateway serves every model (``models``: each one's source, names and LoRA
    adapters); ``key_file`` only when API or admin keys or tenants are set, ``quota_dir`` only with tenants;
    ``keys_dir``: CURVE keys for engines on other hosts."""
    return GatewayLaunch(index, fd, tuple(GatewayModel(source, tuple(names), loras) for source, names, loras in models),
                         config.replace(render_only=render_only), cache_dir=cache_dir, control_socket=control_socket,
                         shutdown_timeout=shutdown_timeout, heartbeat_interval=heartbeat_interval,
                         key_file=key_file, quota_dir=quota_dir, keys_dir=keys_dir or None,
                         responses_db=responses_db)


def argv(value: EngineLaunch | GatewayLaunch) -> list[str]:
    """A child's command line (before the pipes ``spawn`` adds)."""
    return [LAUNCH_FLAG, value.to_json()]
