"""Everything a gateway's handlers share, built once at start-up (``gateway.server`` builds it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from zserve.catalog import ModelSource
from zserve.cluster import ClusterState
from zserve.tokenizer import Tokenizer

from .engine_client import EngineClient
from .store import ResponseStore
from .text.chat_template import ChatTemplate
from .text.reasoning import ReasoningParser
from .text.tool_parsers import ToolParser


@dataclass
class GatewayState:
    index: int
    source: ModelSource
    served_model_names: list[str]
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    engines: EngineClient
    started_at: float = field(default_factory=time.time)
    control_socket: str | None = None  # the supervisor's, for cluster-wide operations
    cluster: ClusterState | None = None  # the latest state the supervisor broadcast
    draining: bool = False  # SIGTERM received: finishing in-flight work, then exiting
    tool_parser: ToolParser | None = None  # --tool-call-parser: tools are refused without one
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
    responses: ResponseStore | None = None  # stored Responses-API objects, shared by every gateway
    render_only: bool = False  # no engine tier (launch render): generation is refused, rendering is not
    default_max_model_len: int = 4096  # the context checked against while no engine reports one

    @property
    def can_serve(self) -> bool:
        """Whether this gateway can do its job now: a render-only one always, otherwise an engine is ready."""
        return self.render_only or bool(self.engines.ready_engines)

    @property
    def paused(self) -> bool:
        return bool(self.cluster and self.cluster.paused)

    @property
    def model_id(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        ready = self.engines.ready_engines
        return min((e.hello.max_model_len for e in ready if e.hello), default=self.default_max_model_len)

    @property
    def eos_token_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        for e in self.engines.ready_engines:
            if e.hello:
                ids.update(e.hello.eos_token_ids)
        return ids


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
