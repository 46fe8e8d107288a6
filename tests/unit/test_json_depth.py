"""The depth limit on request JSON: measured exactly on valid JSON whatever its strings hold, never missed on
broken JSON, and refused naming the path of the first value too deep."""

from __future__ import annotations

import json
import random

import orjson
import pytest

from gateway.errors import APIError
from gateway.json_depth import TooDeep, check_depth, deeper_than
from gateway.openai_schemas import json_object
from protocol.constants import MAX_JSON_DEPTH


def depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


# Strings that look like structure: brackets, quotes and backslashes in every order.
TRICKY = ["[", "]]", "{{", '"', '\\"[', "\\", "\\\\", '\\\\"{', "x\\ny", "}\\", "", "é[", 1, 2.5, None, True]


def random_value(rng: random.Random, levels: int):
    if levels == 0 or rng.random() < 0.25:
        return rng.choice(TRICKY)
    if rng.random() < 0.5:
        return [random_value(rng, levels - 1) for _ in range(rng.randrange(4))]
    return {str(rng.choice(TRICKY)): random_value(rng, levels - 1) for _ in range(rng.randrange(4))}


@pytest.mark.parametrize("seed", range(20))
def test_depth_is_measured_exactly_on_valid_json(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        value = random_value(rng, rng.randrange(10))
        text = orjson.dumps(value)
        d = depth(value)
        for limit in range(10):
            assert deeper_than(text, limit) == (d > limit), (text, d, limit)
        indented = json.dumps(value, indent=1).encode()  # whitespace, and non-ASCII as \u escapes
        assert not deeper_than(indented, d) and (d == 0 or deeper_than(indented, d - 1))


def test_broken_json_that_nests_deep_is_never_missed() -> None:
    assert deeper_than(b"[" * 100, 64) and deeper_than(b'{"a":' * 65, 64)
    assert deeper_than(b"[" * 65 + b"x", 64)
    assert not deeper_than(b'"' + b"[" * 100, 64)  # inside an unterminated string: no nesting at all


def test_a_value_too_deep_is_named_by_its_path() -> None:
    value = {"a": [1, {"b": 2}], "deep": [{"x": 0}]}
    inner = value["deep"][0]
    for _ in range(MAX_JSON_DEPTH):
        inner["x"] = inner = {"x": 0}
    with pytest.raises(TooDeep) as ei:
        check_depth(json.dumps(value))
    assert ei.value.path.startswith("deep.0.x.x.x") and ei.value.path.endswith("...")
    assert ei.value.within("response_format.json_schema.schema").startswith("response_format.json_schema.schema.deep")


def test_the_limit_is_max_json_depth_levels_counting_the_body() -> None:
    def body(levels: int) -> bytes:
        return b'{"model": "m", "chat_template_kwargs": ' + b'{"a": ' * (levels - 1) + b"1" + b"}" * levels

    assert json_object(body(MAX_JSON_DEPTH))["model"] == "m"
    with pytest.raises(APIError) as ei:
        json_object(body(MAX_JSON_DEPTH + 1))
    err = ei.value
    path = "chat_template_kwargs" + ".a" * (MAX_JSON_DEPTH - 1)  # the container at depth MAX_JSON_DEPTH + 1
    assert err.status == 400 and err.param == path[:120] + "..."  # a long path is cut
    assert err.message == f"{err.param}: JSON nested deeper than {MAX_JSON_DEPTH} levels"
    with pytest.raises(APIError) as ei:
        json_object(b"[" * 5000 + b"]" * 5000)  # past orjson's own limit: nothing to name but the body
    assert ei.value.status == 400 and ei.value.param is None and "nested deeper" in ei.value.message
