"""An explicit null means a field's default in every request schema (``openai_schemas.RequestBody``), as OpenAI's
spec and vLLM read it; required fields still refuse null, and fields whose type takes null keep it."""

from __future__ import annotations

import pytest

import gateway.app  # noqa: F401  (every route family's schemas)
from gateway.errors import APIError
from gateway.openai_schemas import ChatCompletionRequest, CompletionRequest, RequestBody, validate
from gateway.routers.anthropic import MessagesRequest
from gateway.routers.native import GenerateRequest
from gateway.routers.pooling import EmbeddingRequest, RerankRequest
from gateway.routers.responses import ResponsesRequest

CHAT = [{"role": "user", "content": "hi"}]
# The smallest valid body of each request the API families take.
MINIMAL: dict[type[RequestBody], dict] = {
    ChatCompletionRequest: {"messages": CHAT},
    CompletionRequest: {"prompt": "hi"},
    MessagesRequest: {"model": "m", "messages": CHAT, "max_tokens": 4},
    ResponsesRequest: {"input": "hi"},
    GenerateRequest: {"token_ids": [1, 2]},
    EmbeddingRequest: {"input": "hi"},
    RerankRequest: {"query": "q", "documents": ["d"]},
}
# The fields the issue names (OpenAI's spec and vLLM take null for each).
NAMED = {
    ChatCompletionRequest: {"n", "logprobs", "stream", "presence_penalty", "frequency_penalty", "min_p",
                            "repetition_penalty", "echo", "parallel_tool_calls"},
    CompletionRequest: {"n", "stream", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty", "echo"},
    ResponsesRequest: {"store", "background", "parallel_tool_calls", "stream"},
    MessagesRequest: {"stream"},
}


def _request_schemas() -> list[type[RequestBody]]:
    seen, todo = [], list(RequestBody.__subclasses__())
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def test_every_request_schema_of_every_family_is_a_request_body():
    names = {cls.__name__ for cls in _request_schemas()}
    assert {"ChatCompletionRequest", "CompletionRequest", "ChatMessage", "StreamOptions", "MessagesRequest",
            "ToolChoice", "ResponsesRequest", "FunctionTool", "GenerateRequest", "TokenizeRequest",
            "EmbeddingRequest", "RerankRequest", "ClassifyRequest", "ScaleElasticRequest"} <= names


@pytest.mark.parametrize("cls", list(MINIMAL), ids=lambda c: c.__name__)
def test_null_means_the_default_of_every_field_that_has_one(cls):
    assert NAMED.get(cls, set()) <= cls._null_is_default
    plain = validate(cls, MINIMAL[cls])
    for name in cls._null_is_default:
        got = validate(cls, {**MINIMAL[cls], name: None})
        assert getattr(got, name) == getattr(plain, name), name
    everything = validate(cls, {**MINIMAL[cls], **dict.fromkeys(cls._null_is_default)})  # all at once
    assert everything.model_dump() == plain.model_dump()


@pytest.mark.parametrize("cls", list(MINIMAL), ids=lambda c: c.__name__)
def test_required_fields_still_refuse_null(cls):
    for name, field in cls.model_fields.items():
        if field.is_required():
            with pytest.raises(APIError) as refused:
                validate(cls, {**MINIMAL[cls], name: None})
            assert refused.value.status == 400 and refused.value.param.split(".")[0] == name


def test_null_keeps_its_own_meaning_where_the_type_takes_it():
    # completions' max_tokens: null is "as many as fit", not its default of 16
    assert validate(CompletionRequest, {"prompt": "hi", "max_tokens": None}).max_tokens is None
    assert validate(CompletionRequest, {"prompt": "hi"}).max_tokens == 16
    assert validate(CompletionRequest, {"prompt": "hi", "logprobs": None}).logprobs is None
    # nested bodies too: a message's name, a stream's options
    chat = validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": None, "name": None}],
                                            "stream_options": {"include_usage": None}})
    assert chat.messages[0].content is None and chat.stream_options.include_usage is False
    with pytest.raises(APIError):  # a wrong type is still refused
        validate(ChatCompletionRequest, {"messages": CHAT, "n": "two"})
