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
    ({"max_loras": 0}, "max_loras must be an integer in 1..256"),
    ({"max_lora_rank": 2048}, "max_lora_rank must be"),
    ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras must be an integer in max_loras..65536"),
    ({"enable_lora": 1}, "enable_lora must be true or false"),
    ({"lora_modules": (("a", "/x"), ("a", "/y"))}, "lora_modules names adapter 'a' twice"),
    ({"lora_modules": (("", "/x"),)}, "lora_modules must be a list of"),
    ({"lora_modules": "a=/x"}, "lora_modules must be a list of"),
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
    ("m:turbo=1", "unknown key 'turbo'; keys are engines, name, lora and the engine options"),
    ("m:lora=a", "lora 'a': expected NAME=PATH"),
    ("m:lora==/x", "an adapter's name is 1..256 printable characters"),
    ("m:lora=a=/x,lora=a=/y", "lora_modules names adapter 'a' twice"),
    ("m:lora_modules=a=/x", "unknown key 'lora_modules'"),
    ("m:max_loras=2,max_cpu_loras=1", "max_cpu_loras must be an integer in max_loras..65536"),
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


# -- LoRA adapters given at start (--enable-lora, --lora-modules, ID:lora=NAME=PATH) ------------------------------


def test_adapters_given_at_start_imply_enable_lora_and_survive_json() -> None:
    cfg = EngineConfig(max_loras=2, lora_modules=[["a", "/x"], ["b", "/y"]])  # (as JSON gives them: lists)
    assert cfg.enable_lora and cfg.lora_modules == (("a", "/x"), ("b", "/y")) and cfg.max_cpu_loras is None
    assert EngineConfig.from_json(cfg.to_json()) == cfg
    assert EngineConfig().enable_lora is False and (EngineConfig().max_loras, EngineConfig().max_lora_rank) == (1, 16)


def test_a_lora_module_is_name_equals_path_or_vllms_json(tmp_path, monkeypatch) -> None:
    from zserve.config import parse_lora_module

    monkeypatch.chdir(tmp_path)
    assert parse_lora_module("sql=/adapters/sql") == ("sql", "/adapters/sql")
    assert parse_lora_module("sql=rel/dir") == ("sql", str(tmp_path / "rel" / "dir"))  # engines start elsewhere
    assert parse_lora_module('{"name": "org/sql-lora", "path": "/a=b"}') == ("org/sql-lora", "/a=b")
    for bad, match in [("sql", "expected NAME=PATH"), ("sql=", "path is missing"), ('{"name": "x"}', "a JSON adapter"),
                       ('{"name": "x", "path": "/p", "base_model_name": "m"}', "a JSON adapter"),
                       ("{nope", "is not JSON"), ("a\tb=/p", "printable")]:
        with pytest.raises(ValueError, match=match):
            parse_lora_module(bad)


def test_a_model_spec_gives_its_model_adapters_that_replace_the_command_lines() -> None:
    base = EngineConfig(lora_modules=(("cli", "/cli"),))
    spec = ModelSpec.parse("tiny-random:lora=a=/x,max_loras=2,lora=b=/y/z", base, engines=1)
    assert spec.engine == base.replace(max_loras=2, lora_modules=(("a", "/x"), ("b", "/y/z")))
    assert ModelSpec.parse("tiny-random:max_lora_rank=64", base, 1).engine.lora_modules == (("cli", "/cli"),)
    assert ModelSpec.parse("m:enable_lora=true,max_cpu_loras=none", EngineConfig(), 1).engine.enable_lora


def test_the_command_line_parses_adapters_and_refuses_clashes_before_anything_starts(tmp_path) -> None:
    """``launch api-server``'s checks of adapters, before any process starts (a usage error, exit 2)."""
    from click.testing import CliRunner

    from launch.cli import _models, main

    served = _models(("tiny-random:lora=a=/x,max_loras=2",), EngineConfig(), 1, ("tiny", "chat"))
    assert [(spec.names, spec.engine.lora_modules, spec.engine.max_loras) for _, spec in served] == \
        [(("tiny", "chat"), (("a", "/x"),), 2)]
    encoder = tmp_path / "encoder"
    encoder.mkdir()
    (encoder / "config.json").write_text('{"model_type": "bert"}')
    for argv, message in [
        (["--lora-modules", "a=/x", "a=/y"], "--lora-modules names adapter 'a' twice"),
        (["--lora-modules", "tiny-random=/x"], "LoRA adapter 'tiny-random' has the name of another model"),
        (["--lora-modules", "a=/x", "--served-model-name", "a"], "LoRA adapter 'a' has the name of another model"),
        (["--model", "tiny-random:lora=a=/x", "--model", f"{tmp_path / 'encoder'}:lora=b=/y,name=emb"],
         "'encoder' only pools (embed, classify): LoRA adapters need a model that generates"),
        (["--model", "tiny-random:lora=a=/x", "--model", "SmolLM2-135M-Instruct:lora=a=/y"],
         "LoRA adapter 'a' has the name of another model or adapter"),
        (["--model", "tiny-random", "--model", "SmolLM2-135M-Instruct", "--lora-modules", "a=/x"],
         "with several --model, give each model its adapters as ID:lora=NAME=PATH"),
        (["--lora-modules", "a"], "expected NAME=PATH"),
        (["--max-loras", "2", "--max-cpu-loras", "1"], "--max-cpu-loras must be an integer in max_loras..65536"),
    ]:
        argv = ["api-server", "--port", "0", *(["--model", "tiny-random"] if "--model" not in argv else []), *argv]
        r = CliRunner().invoke(main, argv)
        assert r.exit_code == 2 and message in " ".join(r.output.split()), (argv, r.output)


def test_lora_modules_takes_several_values_after_one_flag_as_vllm_does() -> None:
    from launch.cli import spread_values

    assert spread_values(["--lora-modules", "a=/x", "b=/y", "--count", "2", "--lora-modules=c=/z", "d=/w", "--seed",
                          "1"]) == ["--lora-modules", "a=/x", "--lora-modules", "b=/y", "--count", "2",
                                    "--lora-modules=c=/z", "--lora-modules", "d=/w", "--seed", "1"]
    assert spread_values(["--model", "m", "--count", "2"]) == ["--model", "m", "--count", "2"]
