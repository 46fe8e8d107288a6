"""Everything a gateway's handlers share, built once at start-up (``gateway.server`` builds it).

A gateway serves every model of its server. ``GatewayState`` is the gateway's own state (its engines,
cluster state, parsers, stored responses) plus one ``ServedModel`` per model (names, LoRA adapters, tokenizer,
chat template, token texts). A handler binds ``state = state.for_model(req.model)`` once it has read the
body: the ``ModelState`` it gets is seen through that model, so ``state.tokenizer`` is the model's tokenizer
and ``state.engines`` routes only to the model's engines, and it names the few gateway settings a request
reads (``state.gateway`` is the rest). A LoRA adapter's name is a model name too: its view is its base model's
(tokenizer, template, context, engines), with ``lora`` set, and its engines send every request through it. Which
adapters are served is cluster state (``ClusterState.loras``): each new state remakes their views, so a name loaded
or unloaded through any gateway is served, or a 404, here from the version that says so.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import cached_property

from aiohttp import web

from protocol.cluster import ClusterState
from protocol.holds import Hold, first_hold
from zserve.catalog import ModelSource
from zserve.tokenizer import Tokenizer

from .engine_client import EngineClient, ModelEngines
from .errors import APIError
from .store import ResponseStore
from .tenancy import SERVED
from .text.chat_template import ChatTemplate
from .text.reasoning import ReasoningParser
from .text.token_text import TokenText
from .text.tool_parsers import ToolParser

# The context of a render server's model whose files do not say (none of the catalog's models).
FALLBACK_MAX_MODEL_LEN = 4096
LORA_TASKS = frozenset({"generate"})  # what a LoRA adapter's requests can do (engine_worker.lora adapts generation)


@dataclass
class ServedModel:
    """One model this gateway serves: the names clients use for it, its text side, and its engines."""

    source: ModelSource
    names: list[str]
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    engines: ModelEngines
    loras: dict[str, str] = field(default_factory=dict)  # each LoRA adapter's name -> its directory

    @property
    def model_id(self) -> str:
        return self.source.model_id

    @cached_property
    def token_text(self) -> TokenText:
        return TokenText(self.tokenizer)


@dataclass
class GatewayState:
    index: int
    models: list[ServedModel]  # the first is the default of a request that names none
    engines: EngineClient  # every model's engines
    started_at: float = field(default_factory=time.time)
    control_socket: str | None = None  # the supervisor's, for cluster-wide operations
    cluster: ClusterState | None = None  # the latest state the supervisor broadcast
    draining: bool = False  # SIGTERM received: finishing in-flight work, then exiting
    tool_parser: ToolParser | None = None  # --tool-call-parser: tools are refused without one
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
    responses: ResponseStore | None = None  # stored Responses-API objects, shared by every gateway
    render_only: bool = False  # no engine tier (launch render): generation is refused, rendering is not
    # The context checked against while no engine reports one (a render server); None: each model's own, as its
    # tokenizer files give it (else FALLBACK_MAX_MODEL_LEN).
    default_max_model_len: int | None = None
    stream_interval: int = 1  # --stream-interval: output tokens per stream chunk after the first
    scaling_wait: float = 30.0  # --scaling-wait: seconds a request is held (a resize, a rolling restart of its model)
    max_audio_mb: float = 25.0  # --max-audio-mb: the largest upload to /v1/audio/*
    max_audio_seconds: float = 1800.0  # --max-audio-seconds: the longest recording
    # Set, and replaced by a fresh one, at each new cluster state: held requests wait on it and look again.
    _changed: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def __post_init__(self) -> None:
        self._make_views()

    def _make_views(self) -> None:
        """One view per name a request may use (a model's names, then its adapters), made again only when the
        adapters change: requests only read them."""
        self._by_name = {name: m for m in self.models for name in [*m.names, *m.loras]}
        views = {name: ModelState(self, m, name) for m in self.models for name in m.names}
        views.update({name: ModelState(self, m, name, lora=name) for m in self.models for name in m.loras})
        self._views = views

    def _follow_loras(self, cluster: ClusterState) -> None:
        """Serve the adapters the cluster state lists (from its version on), and only those."""
        by_model: dict[str, dict[str, str]] = {m.model_id: {} for m in self.models}
        for a in cluster.loras:
            if a.model in by_model:
                by_model[a.model][a.name] = a.path
        if any(m.loras != by_model[m.model_id] for m in self.models):
            for m in self.models:
                m.loras = by_model[m.model_id]
            self._make_views()

    @property
    def can_serve(self) -> bool:
        """Whether this gateway can do its job now: a render-only one always, otherwise an engine is ready."""
        return self.render_only or bool(self.engines.ready_engines)

    @property
    def paused(self) -> bool:
        """Whether this gateway admits no new request of any model now (an operator's ``/pause``, or a hold on
        every model it serves: a resize or a reload of a server's only model); ``holds`` says which and why."""
        return bool(self.cluster and self.cluster.holds) and all(self.hold_for(m.model_id) for m in self.models)

    @property
    def holds(self) -> tuple[Hold, ...]:
        """What the supervisor's admission owner holds or refuses now, per (reason, model)."""
        return self.cluster.holds if self.cluster else ()

    def hold_for(self, model_id: str) -> Hold | None:
        """The hold that decides a new request of ``model_id`` now (None: admitted)."""
        return first_hold(self.cluster.holds, model_id) if self.cluster and self.cluster.holds else None

    def wait_for(self, model_id: str | None) -> float:
        """How long a request of ``model_id`` may wait for an engine now: ``--scaling-wait`` while a hold that
        waits (a resize, a rolling restart of its model) covers it, else 0."""
        hold = self.hold_for(model_id) if model_id is not None else None
        return self.scaling_wait if hold is not None and hold.waits else 0.0

    @property
    def scaling(self) -> str:
        """The phase of an expert-parallel resize (``protocol.cluster.SCALING_PHASES``; "" when none)."""
        return self.cluster.scaling if self.cluster else ""

    def weight_version(self, model_id: str) -> str:
        """The weight version the cluster serves for ``model_id`` (POST /update_weights; "default" before one)."""
        return self.cluster.weight_versions.get(model_id, "default") if self.cluster else "default"

    def apply_cluster(self, cluster: ClusterState) -> None:
        """Take a new cluster state from the supervisor, and wake the held requests to look at it."""
        if self.cluster is None or cluster.loras != self.cluster.loras:
            self._follow_loras(cluster)
        self.cluster = cluster
        self._changed.set()
        self._changed = asyncio.Event()

    async def released(self, model_id: str, timeout: float) -> bool:
        """Wait up to ``timeout`` s for no waiting hold to cover ``model_id``; whether none does now (a hold
        that refuses does not keep it waiting: the request is served again, and refused)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (hold := self.hold_for(model_id)) is not None and hold.waits and (left := deadline - loop.time()) > 0:
            try:
                async with asyncio.timeout(left):
                    await self._changed.wait()
            except TimeoutError:
                pass
        hold = self.hold_for(model_id)
        return hold is None or not hold.waits

    @property
    def served_names(self) -> list[str]:
        return list(self._by_name)

    @property
    def views(self) -> list[ModelState]:
        """A view per name a request may use: every model's names, then its LoRA adapters (/v1/models' order)."""
        return list(self._views.values())

    def for_model(self, name: str | None, task: str | tuple[str, ...] = ()) -> ModelState:
        """The state as a request for model ``name`` sees it: 404 ``model_not_found`` for a name no model has,
        403 ``model_not_allowed`` for one its tenant may not use (``zserve.tenants``),
        400 ``unsupported_task`` for a model whose engines do none of ``task``. A request that names no model
        gets the first model made for ``task`` (an embedding model for embed, though a chat model embeds too),
        else the first that does it, else the first model."""
        tasks = (task,) if isinstance(task, str) else task
        if name is None:
            model = next((m for m in self.models if m.engines.primary_task in tasks), None) or next(
                (m for m in self.models if m.engines.tasks.intersection(tasks)), self.models[0])
            view = self._views[model.names[0]]
        else:
            view = self._views.get(name)  # type: ignore[assignment]
            if view is None:
                raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        served = SERVED.get()
        if served is not None and not served.tenant.may_use(view.name):
            raise APIError(403, f"tenant {served.tenant.name!r} may not use the model `{view.name}` (its models in the "
                                "tenants file)", param="model", code="model_not_allowed")
        if tasks:
            view.check_task(*tasks)
        return view

    def models_serving(self, *tasks: str) -> list[str]:
        """The names of the models whose ready engines do one of ``tasks`` (a refusal says where to go)."""
        return [name for m in self.models if m.engines.tasks.intersection(tasks) for name in m.names]


class ModelState:
    """A ``GatewayState`` seen through one model: its names, tokenizer, template, context and engines, and the
    few settings of the gateway that serving a request of it reads (each named here, nothing forwarded, so a
    reader and a type checker can follow every attribute; anything else is ``gateway``'s)."""

    def __init__(self, gateway: GatewayState, model: ServedModel, name: str, lora: str | None = None):
        self.gateway = gateway
        self.model = model
        self.name = name  # the name the request used: responses echo it
        self.lora = lora  # the LoRA adapter of ``model`` this name runs (None: the base model)
        self.engines = model.engines if lora is None else model.engines.with_lora(lora)
        self._eos_of: frozenset[int] | None = None  # the engines' EOS ids that ``_eos`` was made from
        self._eos: frozenset[int] = frozenset()

    # -- the gateway's, as a request of this model needs them ------------------------------------------

    @property
    def render_only(self) -> bool:
        return self.gateway.render_only

    @property
    def hold(self) -> Hold | None:
        """The hold on this model's new requests now (``GatewayState.hold_for``)."""
        return self.gateway.hold_for(self.model.model_id)

    @property
    def tool_parser(self) -> ToolParser | None:
        return self.gateway.tool_parser

    @property
    def reasoning_parser(self) -> ReasoningParser | None:
        return self.gateway.reasoning_parser

    @property
    def stream_interval(self) -> int:
        return self.gateway.stream_interval

    @property
    def responses(self) -> ResponseStore | None:
        return self.gateway.responses

    # -- the model's ----------------------------------------------------------------------------------

    @property
    def source(self) -> ModelSource:
        return self.model.source

    @property
    def tokenizer(self) -> Tokenizer:
        return self.model.tokenizer

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self.model.chat_template

    @property
    def served_model_names(self) -> list[str]:
        return self.model.names

    @property
    def model_id(self) -> str:
        return self.name

    @property
    def token_text(self) -> TokenText:
        return self.model.token_text

    @property
    def can_serve(self) -> bool:
        return self.render_only or self.engines.has_ready

    @property
    def tasks(self) -> frozenset[str]:
        """What requests of this name can do now: its engines' tasks; a LoRA adapter only generates."""
        tasks = self.engines.tasks
        return tasks & LORA_TASKS if self.lora is not None else tasks

    def check_task(self, *wanted: str) -> None:
        """400 ``unsupported_task`` when the model's ready engines do none of ``wanted``, naming the models
        that do (nothing is known, so nothing is refused, while no engine of the model is ready; a LoRA adapter
        is known to only generate)."""
        tasks = LORA_TASKS if self.lora is not None else self.engines.tasks
        if tasks and not tasks.intersection(wanted):
            task = " or ".join(wanted)
            others = self.gateway.models_serving(*wanted)
            where = f"; models that {task}: {', '.join(others)}" if others else f"; no model here does {task}"
            what = f"LoRA adapter {self.name!r} (of {self.model.names[0]!r})" if self.lora else f"model {self.name!r}"
            raise APIError(400, f"{what} does not {task}: it serves {', '.join(sorted(tasks))}{where}",
                           param="model", code="unsupported_task")

    @property
    def max_model_len(self) -> int:
        limit = self.engines.max_model_len
        if limit is not None:
            return limit
        return self.gateway.default_max_model_len or self.tokenizer.model_max_length or FALLBACK_MAX_MODEL_LEN

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The engines' EOS ids and the tokenizer's (made again only when the engines' set changes)."""
        engines_eos = self.engines.eos_token_ids
        if engines_eos is not self._eos_of:
            eos = self.tokenizer.eos_token_id
            self._eos = engines_eos if eos is None else engines_eos | {eos}
            self._eos_of = engines_eos
        return self._eos


STATE: web.AppKey[GatewayState] = web.AppKey("zserve_state", GatewayState)


def load_text(source: ModelSource, cache_dir: str | None = None) -> tuple[Tokenizer, ChatTemplate | None]:
    """The tokenizer and chat template for a model, read from the files the catalog names."""
    path = source.tokenizer_path
    if path.endswith(".gguf"):
        tok = Tokenizer.from_gguf(path, cache_dir=cache_dir)
    else:
        tok = Tokenizer.from_dir(path)
    tmpl = None
    if tok.chat_template:
        tmpl = ChatTemplate(tok.chat_template, bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")
    return tok, tmpl
