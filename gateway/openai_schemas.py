"""Request schemas of the OpenAI-compatible routes, with the vLLM-style extra sampling fields.

pydantic turns a malformed body into a list of located errors; ``parse`` reports the first one as
OpenAI does (a 400 naming the offending ``param``). Unknown fields are ignored, like OpenAI and vLLM, except
the fields of OpenAI's and vLLM's own requests that would change the answer and that this server does not
implement (a model's ``UNSUPPORTED``): a request that sets one is a 400 naming it, never served as if it
were absent. Every request schema, of every route family, is a ``RequestBody``: an explicit null means a
field's default.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from protocol.constants import MAX_LOGIT_BIAS
from protocol.messages import MAX_TOP_LOGPROBS

from .errors import bad_request
from .json_depth import TooDeep, check_depth, is_too_deep

MAX_N = 16
MAX_STOP = 16
MAX_STOP_LEN = 1024
# The engine's wire bounds (protocol/messages.py SamplingParams): a value past them would fail there, as a 500.
MAX_TOP_K = 1 << 20
SEED_MIN, SEED_END = -(1 << 63), 1 << 64


def _takes_null(annotation: Any) -> bool:
    """Whether a field's type admits None (``X | None``, ``Any``)."""
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    origin = get_origin(annotation)
    if origin is Annotated:
        return _takes_null(get_args(annotation)[0])
    return origin in (Union, types.UnionType) and any(_takes_null(a) for a in get_args(annotation))


class RequestBody(BaseModel):
    """The base of every request schema: unknown fields are ignored, and an explicit null in a field that has a
    default and takes no null means that default, as OpenAI's spec and vLLM read it (``"n": null`` is n 1,
    ``"stream": null`` no stream). A required field still refuses null, and a field whose type takes null keeps
    it, since there null is a value of its own (completions' ``max_tokens``: as many as fit)."""

    model_config = ConfigDict(extra="ignore")

    _null_is_default: ClassVar[frozenset[str]] = frozenset()  # the keys (names and aliases) null stands for

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._null_is_default = frozenset(key for name, f in cls.model_fields.items()
                                         if not f.is_required() and not _takes_null(f.annotation)
                                         for key in (name, f.alias) if key)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():  # the common case costs this one check
            nulls = cls._null_is_default
            data = {k: v for k, v in data.items() if v is not None or k not in nulls}
        return data


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestBody):
    """Fields both completions and chat completions accept."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, lt=SEED_END)] | None = None
    user: str | None = None
    # vLLM extensions, accepted under the same names
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Annotated[int, Field(ge=-(1 << 31), lt=1 << 31)] = 0  # lower is scheduled sooner
    # Structured output (gateway/structured.py reads and checks these): OpenAI's response_format,
    # vLLM's structured_outputs and its older guided_* names.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"stop sequences are at most {MAX_STOP_LEN} characters")
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries")
        for k in v:
            if not k.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
        return v


# Fields of OpenAI's or vLLM's generation requests this server does not implement, each with the values that
# ask for nothing (its defaults): any other value is refused (``validate``).
UNSUPPORTED_GENERATION: dict[str, tuple] = {
    "use_beam_search": (False, None),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "logprob_token_ids": (None,),
    "return_tokens_as_token_ids": (False, None),
    "return_token_ids": (False, None),
    "cache_salt": (None,),  # a prefix cache shared by every request of the model: no salting
}


class PromptFields(SamplingFields):
    """vLLM's prompt fields of completions and chat completions: cutting the prompt to fit, scoring it."""

    # Keep the last k prompt tokens (-1: as many as the context leaves room for); ``truncation_side`` "right" keeps
    # the first k instead.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, lt=1 << 63)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # k; not with stream


class CompletionRequest(PromptFields):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = UNSUPPORTED_GENERATION

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(RequestBody):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class FunctionDefinition(RequestBody):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(RequestBody):
    type: Literal["function"] = "function"
    function: FunctionDefinition


MAX_TOOLS = 256


class ChatCompletionRequest(PromptFields):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **UNSUPPORTED_GENERATION, "chat_template": (None,), "include_reasoning": (True, None),
        "functions": (None, []), "function_call": (None,), "audio": (None,), "modalities": (None, ["text"]),
        "web_search_options": (None,),
    }

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # vLLM: the last message's content starts the answer when its role is the answer's
    # Template variables, as vLLM passes them (over the same names in chat_template_kwargs).
    reasoning_effort: str | None = None
    documents: list[dict[str, Any]] | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs, then reasoning_effort and documents."""
        extra = {k: v for k, v in (("reasoning_effort", self.reasoning_effort), ("documents", self.documents))
                 if v is not None}
        return {**(self.chat_template_kwargs or {}), **extra} if extra else self.chat_template_kwargs


MAX_CONVERSATIONS = 256


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's ``/v1/chat/completions/batch`` body: a chat completion's, ``messages`` a list of conversations."""

    messages: Annotated[list[Annotated[list[ChatMessage], Field(min_length=1)]],  # type: ignore[assignment]
                        Field(min_length=1, max_length=MAX_CONVERSATIONS)]


def _param(loc: tuple) -> str:
    union_tags = {"str", "list[str]", "list[int]", "list[list[int]]"}  # pydantic's names for union members
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and p in union_tags))


def json_object(body: bytes) -> dict[str, Any]:
    """Decode a JSON body that must be an object, or raise a 400 (naming where it nests too deep, if it does:
    every body enters here, so the depth limit is checked once for all routes)."""
    try:
        data = orjson.loads(body)
        check_depth(body, data)
    except orjson.JSONDecodeError as e:
        if is_too_deep(e):
            raise bad_request(f"request body: {TooDeep('')}") from None
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except TooDeep as e:
        raise bad_request(f"{e.path}: {e}", param=e.path) from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    return data


def parse(model: type[BaseModel], body: bytes) -> Any:
    """Decode and validate a JSON body, or raise a 400 naming the bad field."""
    return validate(model, json_object(body))


def parse_nested(model: type[BaseModel], body: bytes, field: str, inner: type[BaseModel]) -> Any:
    """``parse``, for a body that carries another route's request in ``field`` (the derender routes'): that
    request is checked as its own route checks it, fields it does not serve too."""
    data = json_object(body)
    if isinstance(data.get(field), dict):
        check_unsupported(inner, data[field], f"{field}.")
    return validate(model, data)


def parse_query(model: type[BaseModel], query: Mapping[str, str]) -> Any:
    """Validate a query string (the first value of each name), or raise a 400 naming the bad parameter."""
    return validate(model, dict(query))


def check_unsupported(model: type[BaseModel], data: dict[str, Any], where: str = "") -> None:
    """A 400 for a field of ``data`` that ``model`` names in its ``UNSUPPORTED`` (``where``: the path to ``data``
    in the body, for a request nested in another: the derender routes')."""
    for name, inert in getattr(model, "UNSUPPORTED", {}).items():
        if name in data and data[name] not in inert:
            raise bad_request(f"{where}{name} is not supported by this server", param=where + name)


def validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    check_unsupported(model, data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _param(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise bad_request(f"{param}: {msg}" if param else msg, param=param or None) from None
