"""Endpoint plugins: routes that other packages add to every gateway (docs/plugins.md).

A package declares an entry point in the group ``zserve.endpoints`` whose object is an ``EndpointPlugin``::

    [project.entry-points."zserve.endpoints"]
    example = "zserve_example_plugin:plugin"

Every gateway loads the installed plugins at start-up, in the order of their names, mounts their routes beside
the core route families and runs their start-up hooks before it accepts a request. A plugin sees the gateway
through a ``PluginContext`` (its served models, their tokenizers and engines, the gateway's index and
configuration): hooks receive it, and handlers reach it as ``request.app[PLUGIN_CONTEXT]``.

What can never work is a boot error (``PluginError``, a ValueError): a plugin that does not import, is not an
``EndpointPlugin``, takes a route that another family serves without saying so in ``replaces``, or whose
start-up hook raises. The gateway then exits with EXIT_BOOT_ERROR and ``launch`` stops, naming the plugin.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING

from aiohttp import hdrs, web

from protocol import PoolOutput, RequestOutput, SamplingParams

from .errors import APIError
from .families import ENTRY_POINT_GROUP, check_disabled, installed_plugin_names
from .ids import random_hex

if TYPE_CHECKING:
    from zserve.tokenizer import Tokenizer

    from .config import GatewayConfig
    from .state import GatewayState, ModelState
    from .text.chat_template import ChatTemplate

__all__ = ["ENTRY_POINT_GROUP", "PLUGIN_CONTEXT", "APIError", "EndpointPlugin", "Hook", "PluginContext",
           "PluginError", "PluginModel", "SamplingParams", "check_disabled", "installed_plugin_names", "load_plugins"]

log = logging.getLogger("zserve.gateway")

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_PATH_VARIABLE = re.compile(r"\{[^}:]+(:[^}]*)?\}")


class PluginError(ValueError):
    """A plugin that cannot start (a boot error): the message names the plugin and says why."""


Hook = Callable[["PluginContext"], Awaitable[None]]
"""A start-up or shutdown hook: ``async def hook(ctx: PluginContext) -> None``."""


@dataclass(frozen=True)
class EndpointPlugin:
    """What a ``zserve.endpoints`` entry point names.

    - ``name``: the entry point's name (lowercase letters, digits, ``-``, ``_``); ``--disable-family NAME``
      turns the plugin off.
    - ``routes``: an aiohttp ``RouteTableDef`` (or any sequence of route definitions).
    - ``on_startup``: awaited with the ``PluginContext`` once the gateway's engines are ready, before it accepts
      requests; raising fails the gateway's start-up.
    - ``on_shutdown``: awaited with the ``PluginContext`` once the gateway has drained; errors are logged.
    - ``replaces``: the ``(METHOD, PATH)`` routes of the core families this plugin serves instead, e.g.
      ``{("POST", "/v1/chat/completions")}``; taking any other core route fails start-up.
    """

    name: str
    routes: Sequence[web.AbstractRouteDef]
    on_startup: Hook | None = None
    on_shutdown: Hook | None = None
    replaces: Collection[tuple[str, str]] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise TypeError(f"EndpointPlugin.name must be 1-64 lowercase letters, digits, '-' or '_', "
                            f"not {self.name!r}")
        routes = tuple(self.routes)
        bad = [r for r in routes if not isinstance(r, web.AbstractRouteDef)]
        if bad:
            raise TypeError(f"EndpointPlugin.routes holds {bad[0]!r}, not an aiohttp route definition")
        object.__setattr__(self, "routes", routes)
        for hook in ("on_startup", "on_shutdown"):
            if getattr(self, hook) is not None and not callable(getattr(self, hook)):
                raise TypeError(f"EndpointPlugin.{hook} must be an async function of the PluginContext")
        replaces = frozenset(self.replaces)
        for r in replaces:
            if not (isinstance(r, tuple) and len(r) == 2 and all(isinstance(x, str) for x in r)):
                raise TypeError(f"EndpointPlugin.replaces holds {r!r}, not a (METHOD, PATH) pair")
        object.__setattr__(self, "replaces", frozenset(_route_key(m, p) for m, p in replaces))


# -- what a plugin sees of the gateway ---------------------------------------------------------------


class PluginModel:
    """One served model as a plugin sees it: its names, text side and engines (nothing else of the gateway)."""

    def __init__(self, view: ModelState):
        self._view = view

    @property
    def name(self) -> str:
        """The name it was asked for by (its first served name when listed)."""
        return self._view.name

    @property
    def names(self) -> list[str]:
        """Every name clients may use for it."""
        return list(self._view.served_model_names)

    @property
    def model_id(self) -> str:
        return self._view.source.model_id

    @property
    def tokenizer(self) -> Tokenizer:
        return self._view.tokenizer

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._view.chat_template

    @property
    def tasks(self) -> set[str]:
        """What its ready engines do: ``generate``, ``embed``, ``classify`` (empty while none is ready)."""
        return set(self._view.engines.tasks)

    @property
    def max_model_len(self) -> int:
        """The context (prompt + output) a request may use."""
        return self._view.max_model_len

    def generate(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """Stream the model's output for a tokenized prompt from the least-loaded engine; leaving the iteration
        early aborts the request in the engine (use ``contextlib.aclosing``)."""
        return self._view.engines.generate(request_id or f"plugin-{random_hex()}", prompt_token_ids, sampling)

    async def pool(self, prompt_token_ids: list[int], task: str = "embed", normalize: bool | None = None,
                   dimensions: int | None = None, request_id: str | None = None) -> PoolOutput:
        """Embed (or classify) a tokenized input on the model's engines."""
        return await self._view.engines.pool(request_id or f"plugin-{random_hex()}", prompt_token_ids, task,
                                             normalize, dimensions)


class PluginContext:
    """The narrow view of one gateway that plugin hooks and handlers get."""

    def __init__(self, state: GatewayState, config: GatewayConfig):
        self._state = state
        self.config = config  # the gateway's GatewayConfig (read-only)

    @property
    def gateway_index(self) -> int:
        """Which gateway process this is (0 .. count-1)."""
        return self._state.index

    @property
    def models(self) -> list[PluginModel]:
        """Every served model, the default one first."""
        return [self.model(m.names[0]) for m in self._state.models]

    def model(self, name: str | None = None, task: str | tuple[str, ...] = ()) -> PluginModel:
        """The model a request names, resolved as the core routes do: ``APIError`` 404 for an unknown name,
        400 when its engines do none of ``task``; ``None`` picks the default model (for ``task``)."""
        return PluginModel(self._state.for_model(name, task))

    @property
    def draining(self) -> bool:
        """Whether the gateway is shutting down (finishing in-flight requests)."""
        return self._state.draining


PLUGIN_CONTEXT: web.AppKey[PluginContext] = web.AppKey("zserve_plugin_context", PluginContext)


# -- loading ----------------------------------------------------------------------------------------


def load_plugins(reserved: Collection[str] = (), skip: Collection[str] = (), group: str = ENTRY_POINT_GROUP
                 ) -> list[EndpointPlugin]:
    """Import every installed plugin of ``group`` but those named in ``skip`` (disabled: never imported), in the
    order of their names; ``PluginError`` names the first that cannot load. ``reserved``: the core route
    families' names, which no plugin may take."""
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=group):
        if ep.name in found and found[ep.name].value != ep.value:
            raise PluginError(f"plugin {ep.name!r}: two installed packages declare it ({found[ep.name].value} and "
                              f"{ep.value}); uninstall one")
        found[ep.name] = ep
    plugins = []
    for name in sorted(found):
        ep = found[name]
        if name in reserved:
            raise PluginError(f"plugin {name!r}: a core route family has that name; rename the entry point")
        if name in skip:
            continue
        try:
            obj = ep.load()
        except Exception as e:
            raise PluginError(f"plugin {name!r}: cannot load {ep.value}: {type(e).__name__}: {e}") from e
        if not isinstance(obj, EndpointPlugin):
            raise PluginError(f"plugin {name!r}: {ep.value} is a {type(obj).__name__}, not a "
                              "gateway.plugins.EndpointPlugin")
        if obj.name != name:
            raise PluginError(f"plugin {name!r}: {ep.value} is named {obj.name!r}; the entry point and the "
                              "EndpointPlugin must have the same name")
        plugins.append(obj)
    return plugins


def mount_routes(families: Mapping[str, Iterable[web.AbstractRouteDef]], plugins: Sequence[EndpointPlugin],
                 warn: Callable[..., None] = log.warning) -> list[web.AbstractRouteDef]:
    """The route definitions of ``families`` and ``plugins`` together. A plugin route that another family or
    plugin serves too (same method and path) is a ``PluginError``, unless the plugin names that core route in
    its ``replaces``: then the plugin's handler serves it, with a warning (through ``warn``)."""
    owner: dict[tuple[str, str], tuple[str, web.AbstractRouteDef]] = {}
    extra: list[web.AbstractRouteDef] = []  # static files: aiohttp refuses a prefix that is already taken
    for family, routes in families.items():
        for r in routes:
            if isinstance(r, web.RouteDef):
                owner[_route_key(r.method, r.path)] = (family, r)
            else:
                extra.append(r)
    for p in plugins:
        replaced: set[tuple[str, str]] = set()
        for r in p.routes:
            if not isinstance(r, web.RouteDef):
                extra.append(r)
                continue
            key = _route_key(r.method, r.path)
            taken = owner.get(key) or next((owner[k] for k in owner if _overlaps(k, key)), None)
            if taken is None:
                owner[key] = (p.name, r)
            elif taken[0] in families and key in p.replaces:
                warn("plugin %r replaces %s %s of the %r route family", p.name, r.method, r.path, taken[0])
                owner[key] = (p.name, r)
                replaced.add(key)
            elif taken[0] in families:
                raise PluginError(f"plugin {p.name!r}: {r.method} {r.path} is a route of the {taken[0]!r} family; "
                                  f"list ({r.method!r}, {r.path!r}) in its EndpointPlugin.replaces to serve it "
                                  "instead, or disable that family")
            else:
                raise PluginError(f"plugin {p.name!r}: {r.method} {r.path} is a route of plugin {taken[0]!r} too")
        for method, path in sorted(p.replaces - replaced):
            warn("plugin %r replaces %s %s, which no enabled route family serves", p.name, method, path)
    return [r for _, r in owner.values()] + extra


def _route_key(method: str, path: str) -> tuple[str, str]:
    """A route as collisions see it: method upper-cased, path variables unnamed (``{id}`` and ``{rid}`` match)."""
    return method.upper(), _PATH_VARIABLE.sub(lambda m: "{" + (m.group(1) or "") + "}", path)


def _overlaps(a: tuple[str, str], b: tuple[str, str]) -> bool:
    """Same path, and one of the two answers every method."""
    return a[1] == b[1] and hdrs.METH_ANY in (a[0], b[0])


def add_hooks(app: web.Application, plugins: Sequence[EndpointPlugin], context: PluginContext) -> None:
    """Run the plugins' start-up hooks in order when the app starts, their shutdown hooks in reverse order when
    it is cleaned up (after the gateway drained)."""
    for p in plugins:
        if p.on_startup is not None:
            app.on_startup.append(_startup(p, context))
    for p in reversed(plugins):
        if p.on_shutdown is not None:
            app.on_cleanup.append(_shutdown(p, context))


def _startup(p: EndpointPlugin, context: PluginContext) -> Callable[[web.Application], Awaitable[None]]:
    async def run(app: web.Application) -> None:
        try:
            await p.on_startup(context)  # type: ignore[misc]
        except Exception as e:
            raise PluginError(f"plugin {p.name!r}: its start-up hook failed: {type(e).__name__}: {e}") from e
    return run


def _shutdown(p: EndpointPlugin, context: PluginContext) -> Callable[[web.Application], Awaitable[None]]:
    async def run(app: web.Application) -> None:
        try:
            await p.on_shutdown(context)  # type: ignore[misc]
        except Exception:
            log.exception("gateway %d: plugin %r: its shutdown hook failed; shutting down anyway",
                          context.gateway_index, p.name)
    return run


def describe(plugins: Sequence[EndpointPlugin]) -> str:
    """One log line's worth: each plugin with its route count."""
    return ", ".join(f"{p.name} ({len(p.routes)} route{'s' * (len(p.routes) != 1)})" for p in plugins)
