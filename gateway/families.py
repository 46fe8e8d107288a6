"""The names of the gateway's route families and the rule for turning families and endpoint plugins off, known
without importing a router: ``launch`` checks ``--disable-family`` in the supervisor process, which never imports
``gateway.app`` (``gateway.app.ROUTE_FAMILIES`` maps these names to their modules)."""

from __future__ import annotations

from collections.abc import Iterable
from importlib import metadata

FAMILY_NAMES = ("core", "control", "operations", "openai", "responses", "anthropic", "native", "pooling", "render",
                "sagemaker", "docs", "derender", "cohere", "info", "console", "audio")
CORE_FAMILY = "core"  # /health and /metrics: what the supervisor and load balancers need, never disabled
ENTRY_POINT_GROUP = "zserve.endpoints"


def installed_plugin_names(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """The names of the installed plugins, read from package metadata without importing them."""
    return sorted({ep.name for ep in metadata.entry_points(group=group)})


def check_disabled(disabled: Iterable[str], families: Iterable[str], plugins: Iterable[str]) -> None:
    """``ValueError`` for a family that cannot be disabled: core, or a name that is no family or plugin."""
    families, plugins = list(families), list(plugins)
    for name in disabled:
        if name == CORE_FAMILY:
            raise ValueError("disabled_families: 'core' cannot be disabled: /health and /metrics are how the "
                             "supervisor and load balancers see a gateway")
        if name not in families and name not in plugins:
            raise ValueError(f"disabled_families: unknown route family {name!r}; known: {', '.join(families)}"
                             f"{'; plugins: ' + ', '.join(plugins) if plugins else ' (no plugin is installed)'}")
