"""Stream chunks are built from a head made once per stream (``Shape.chunk_head``): the bytes must be what
encoding the whole chunk object gives, so clients parse exactly the chunk they did before."""

from __future__ import annotations

import orjson
import pytest

from gateway.generation import Delta
from gateway.serving.choices import Choice
from gateway.serving.completions import ChatShape, CompletionShape
from gateway.serving.tools import NO_TOOLS
from protocol import SamplingParams


@pytest.mark.parametrize("shape", [ChatShape(None, False, NO_TOOLS), CompletionShape(None, False)],  # type: ignore[arg-type]
                         ids=["chat", "completion"])
@pytest.mark.parametrize("model", ["tiny-random", 'a "quoted" \\ model ü'])
def test_a_chunk_from_its_head_is_the_encoded_chunk_object(shape, model):
    entries = [{"index": 0, "delta": {"content": "Hé\n"}, "logprobs": None, "finish_reason": None}]
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    head = shape.chunk_head("chatcmpl-1", 1700000000, model)
    body = {"id": "chatcmpl-1", "object": shape.object_chunk, "created": 1700000000, "model": model,
            "choices": entries}
    assert head + orjson.dumps(entries) + b"}" == orjson.dumps(body)
    assert head + orjson.dumps(entries) + b',"usage":' + orjson.dumps(usage) + b"}" == \
        orjson.dumps({**body, "usage": usage})
    assert head + b'[],"usage":null}' == orjson.dumps({**body, "choices": [], "usage": None})


@pytest.mark.parametrize("shape", [ChatShape(None, False, NO_TOOLS), CompletionShape(None, False)],  # type: ignore[arg-type]
                         ids=["chat", "completion"])
@pytest.mark.parametrize("text", ["Hé", ' "quoted" \\ \n\t\x00\x1f', "😀 \u2028", "", "x" * 300])
@pytest.mark.parametrize("finish", [None, "length"])
def test_a_delta_written_from_its_template_is_the_encoded_entry(shape, text, finish):
    """A plain text delta's entry is written into a template (``delta_json``, once per streamed token), not
    built as dicts and encoded: the bytes are what encoding the entry gives, whatever the text and the index."""
    for index in (0, 7):
        choice = Choice(index, [1], SamplingParams())
        delta = Delta(text, [5], None, finish, 3)
        entry = shape.delta(choice, delta)
        assert shape.delta_json(choice, delta) == (None if entry is None else orjson.dumps([entry]))
