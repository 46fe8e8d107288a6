"""Cohere's v2 request bodies (chat and embed) and their translation into what the gateway already serves.

A Cohere v2 chat body becomes an OpenAI ``ChatCompletionRequest`` (``chat_request``), which ``serving.plans.plan_chat``
plans like any chat completion: one chat template, one tokenizer, one set of sampling checks for every family (vLLM's
``/cohere/v2/chat`` translates the same way). Fields whose Cohere meaning the gateway cannot honour are refused with
a 400 rather than ignored; Cohere's own knobs without an effect here (``safety_mode``, ``citation_options``) are
accepted and have none.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import ConfigDict, Field

from .errors import bad_request
from .openai_schemas import (
    MAX_STOP,
    MAX_STOP_LEN,
    MAX_TOOLS,
    SEED_END,
    SEED_MIN,
    ChatCompletionRequest,
    ChatTool,
    RequestBody,
    validate,
)
from .serving.pooling import MAX_INPUT_CHARS, MAX_INPUTS


class CohereFunction(RequestBody):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: str = ""


class CohereToolCall(RequestBody):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: CohereFunction


class CohereMessage(RequestBody):
    """One message of any role: ``content`` a string or a list of parts (text; a tool's documents)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[CohereToolCall] | None = None
    tool_plan: str | None = None
    tool_call_id: str | None = None


class CohereChatRequest(RequestBody):
    """Cohere's v2 chat body. Sampling is the model's own unless set (Cohere's service defaults are its own)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: Annotated[list[CohereMessage], Field(min_length=1)]
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    strict_tools: bool | None = None
    documents: list[str | dict[str, Any]] | None = None
    citation_options: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    safety_mode: Literal["CONTEXTUAL", "STRICT", "OFF"] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop_sequences: Annotated[list[Annotated[str, Field(max_length=MAX_STOP_LEN)]], Field(max_length=MAX_STOP)] | None \
        = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, lt=SEED_END)] | None = None
    frequency_penalty: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    k: Annotated[int, Field(ge=0, le=500)] | None = None
    p: Annotated[float, Field(ge=0.01, le=0.99)] | None = None
    logprobs: bool = False
    tool_choice: Literal["REQUIRED", "NONE"] | None = None
    priority: Annotated[int, Field(ge=0, lt=1 << 31)] = 0
    stream: bool = False


EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]


class CohereEmbedRequest(RequestBody):
    """Cohere's v2 embed body, for texts. ``input_type`` is accepted for every model: one without prompts per task
    (as the served ones) embeds a query and a document alike."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    texts: Annotated[list[Annotated[str, Field(max_length=MAX_INPUT_CHARS)]],
                     Field(min_length=1, max_length=MAX_INPUTS)] | None = None
    images: list[Any] | None = None
    inputs: list[Any] | None = None
    input_type: Literal["search_document", "search_query", "classification", "clustering"] | None = None
    embedding_types: Annotated[list[EmbeddingType], Field(min_length=1)] = ["float"]
    output_dimension: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"


def _text(content: str | list[dict[str, Any]] | None, role: str) -> str:
    """A message's text: its text parts (a tool's documents as their JSON), in order."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "document" and role == "tool" and isinstance(part.get("document"), dict):
            texts.append(orjson.dumps(part["document"].get("data", part["document"])).decode())
        elif kind != "thinking":  # an earlier answer's reasoning is not sent back to the model
            raise bad_request(f"a {role} message's content part of type {kind!r} is not supported here (text only)",
                              param="messages")
    return "".join(texts)


def _message(m: CohereMessage) -> dict[str, Any]:
    text = _text(m.content, m.role)
    if m.role == "tool":
        if not m.tool_call_id:
            raise bad_request("a tool message needs the tool_call_id it answers", param="messages")
        return {"role": "tool", "tool_call_id": m.tool_call_id, "content": text}
    if m.role == "assistant" and m.tool_calls:
        calls = [{"id": t.id, "type": "function", "function": {"name": t.function.name,
                                                               "arguments": t.function.arguments or "{}"}}
                 for t in m.tool_calls]
        return {"role": "assistant", "content": m.tool_plan or text or None, "tool_calls": calls}
    return {"role": m.role, "content": text}


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """Cohere's ``{"type": "json_object", "json_schema": ...}`` as OpenAI's ``response_format``."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") != "json_object":
        raise bad_request('response_format type must be "text" or "json_object"', param="response_format")
    schema = fmt.get("json_schema") or fmt.get("schema")
    if schema is None:
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema, "strict": True}}


def chat_request(req: CohereChatRequest) -> ChatCompletionRequest:
    """The chat completion a Cohere chat body asks for (its 400s name the Cohere field where they differ)."""
    if req.tool_choice is not None and not req.tools:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    docs = None if req.documents is None else [
        {"text": d} if isinstance(d, str) else {**(d.get("data") or {}), **({"id": d["id"]} if "id" in d else {})}
        for d in req.documents]
    body: dict[str, Any] = {
        "model": req.model, "messages": [_message(m) for m in req.messages], "max_tokens": req.max_tokens,
        "stop": req.stop_sequences, "temperature": req.temperature, "seed": req.seed,
        "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
        "top_k": req.k or None, "top_p": req.p, "logprobs": req.logprobs, "priority": req.priority,
        "response_format": _response_format(req.response_format), "documents": docs, "stream": req.stream,
    }
    if req.tools:
        body["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        body["tool_choice"] = {"REQUIRED": "required", "NONE": "none", None: "auto"}[req.tool_choice]
    return validate(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})
