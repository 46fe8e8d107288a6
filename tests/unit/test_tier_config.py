"""The tiers' configurations: one typed value that survives the trip to a child process and refuses
what a child could not run with."""

from __future__ import annotations

import pytest

from gateway.config import GatewayConfig
from zserve.config import EngineConfig, ModelSpec


def test_engine_config_round_trips_through_json() -> None:
    cfg = EngineConfig(dtype="float32", max_num_seqs=8, kv_cache_memory=" 2GiB ", enforce_eager=True, seed=7)
    assert cfg.kv_cache_memory == "2GiB"
    assert EngineConfig.from_json(cfg.to_json()) == cfg
    assert EngineConfig.from_json(EngineConfig().to_json()) == EngineConfig()


@pytest.mark.parametrize("bad, match", [
    ({"dtype": "int4"}, "dtype must be one of"),
    ({"max_num_seqs": 0}, "max_num_seqs must be"),
    ({"max_num_seqs": True}, "max_num_seqs must be"),
    ({"max_model_len": 8}, "max_model_len must be"),
    ({"block_size": "16"}, "block_size must be"),
    ({"kv_cache_memory": "2XB"}, "kv_cache_memory '2XB'"),
    ({"kv_cache_memory": "1.5"}, "kv_cache_memory"),
    ({"seed": -1}, "seed must be"),
    ({"enforce_eager": "yes"}, "enforce_eager must be"),
])
def test_engine_config_refuses_what_an_engine_could_not_run(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)


def test_engine_config_from_json_refuses_unknown_fields_and_non_objects() -> None:
    with pytest.raises(ValueError, match="unknown engine configuration field"):
        EngineConfig.from_json('{"max_num_seqs": 8, "turbo": true}')
    with pytest.raises(ValueError, match="JSON object"):
        EngineConfig.from_json("[1, 2]")


def test_gateway_config_round_trips_and_checks_names() -> None:
    cfg = GatewayConfig(tool_call_parser="hermes", reasoning_parser="think", state_url="redis://127.0.0.1:6379/0",
                        responses_ttl=60, responses_max_items=5)
    assert GatewayConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="tool_call_parser: unknown tool-call parser 'nope'; choose one of: hermes"):
        GatewayConfig(tool_call_parser="nope")
    with pytest.raises(ValueError, match="state_url"):
        GatewayConfig(state_url="ftp://x")
    with pytest.raises(ValueError, match="responses_max_items"):
        GatewayConfig(responses_max_items=0)
    assert GatewayConfig.from_json(GatewayConfig(stream_interval=8).to_json()).stream_interval == 8
    for bad in (0, 1025, True, 2.0):
        with pytest.raises(ValueError, match="stream_interval must be an integer in 1..1024"):
            GatewayConfig(stream_interval=bad)
    with pytest.raises(ValueError, match="unknown gateway configuration field"):
        GatewayConfig.from_json('{"api_key": "x"}')


def test_gateway_config_carries_the_render_servers_context_and_mode() -> None:
    cfg = GatewayConfig(max_model_len=2048).replace(render_only=True)
    assert (cfg.max_model_len, cfg.render_only) == (2048, True)
    assert GatewayConfig.from_json(cfg.to_json()) == cfg
    assert GatewayConfig().max_model_len == EngineConfig().max_model_len
    with pytest.raises(ValueError, match="max_model_len must be"):
        GatewayConfig(max_model_len=8)
    with pytest.raises(ValueError, match="render_only must be"):
        GatewayConfig(render_only="yes")


def test_a_model_spec_gives_one_model_its_own_engines_options_and_names() -> None:
    base = EngineConfig(dtype="float32", max_num_seqs=16)
    spec = ModelSpec.parse("SmolLM2-135M-Instruct:engines=2,max_num_seqs=64,enable_prefix_caching=false,seed=3,"
                           "kv_cache_memory=0.3,name=chat,name=smol", base, engines=1)
    assert (spec.model, spec.engines, spec.names) == ("SmolLM2-135M-Instruct", 2, ("chat", "smol"))
    assert spec.engine == base.replace(max_num_seqs=64, enable_prefix_caching=False, seed=3, kv_cache_memory="0.3")
    plain = ModelSpec.parse("all-MiniLM-L6-v2", base, engines=3)  # keys left out take the command line's values
    assert (plain.engines, plain.engine, plain.names) == (3, base, ())
    assert ModelSpec.parse("/models/a:b/m.gguf", base, 1).model == "/models/a:b/m.gguf"  # not options: taken whole
    assert ModelSpec.parse("m:threads=none", base.replace(threads=4), 1).engine.threads is None


@pytest.mark.parametrize("text, match", [
    ("m:engines=0", "engines must be an integer in 1..64"),
    ("m:engines=65", "engines must be an integer in 1..64"),
    ("m:turbo=1", "unknown key 'turbo'; keys are engines, name and the engine options"),
    ("m:max_num_seqs=many", "max_num_seqs must be an integer"),
    ("m:enforce_eager=maybe", "enforce_eager must be true or false"),
    ("m:dtype=int4", "dtype must be one of"),
    ("m:name=", "name must not be empty"),
    (":engines=2", "the model id is missing"),
])
def test_a_model_spec_refuses_what_its_engines_could_not_run(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelSpec.parse(text, EngineConfig(), engines=1)


def test_a_render_server_takes_no_engine_count() -> None:
    assert ModelSpec.parse("m", EngineConfig(), engines=0).engines == 0
    with pytest.raises(ValueError, match="a render server runs no engines"):
        ModelSpec.parse("m:engines=2", EngineConfig(), engines=0)
