"""The supervisor → child hand-off: each child gets one typed value (``EngineLaunch``, ``GatewayLaunch``) as one
``--launch`` argument. Values survive their JSON round trip exactly, a malformed one is refused naming the field
(a usage error in the child), ``launch.handoff`` makes the supervisor's choices, and building a gateway's value
— even with a route family disabled — imports no router (nor torch) into the supervisor process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import GatewayConfig, GatewayLaunch, GatewayModel
from gateway.families import FAMILY_NAMES
from launch import handoff
from zserve.catalog import ModelSource
from zserve.config import EngineConfig
from zserve.launch_spec import EngineLaunch, LaunchError, parse_child_argv

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ModelSource("tiny-random", "random", "", "/tok.gguf", (("num_layers", 2), ("rope_theta", 1e5)))
OTHER = ModelSource("mini", "hf", "/m", "/m")


def test_an_engine_launch_survives_its_json_round_trip():
    value = EngineLaunch(65, "tcp://0.0.0.0:5601", SOURCE, EngineConfig(max_num_seqs=4, seed=7, expert_parallel=True),
                         device=1, heartbeat_interval=0.5, expert_share=(1, 3), keys_dir="/keys")
    assert EngineLaunch.from_json(value.to_json()) == value
    lora = EngineLaunch(0, "ipc:///e.sock", SOURCE, EngineConfig(max_loras=2, lora_modules=(("a", "/x"), ("b", "/y"))))
    assert EngineLaunch.from_json(lora.to_json()) == lora and lora.config.enable_lora  # (given adapters: enabled)
    plain = EngineLaunch(0, "ipc:///run/e-0.sock", SOURCE)
    assert EngineLaunch.from_json(plain.to_json()) == plain and plain.config == EngineConfig()


def test_a_gateway_launch_survives_its_json_round_trip():
    value = GatewayLaunch(2, 5, (GatewayModel(SOURCE, ("chat", "default"), (("a", "/x"),)), GatewayModel(OTHER)),
                          GatewayConfig(scaling_wait=5.0, allowed_origins=("https://a.example",)),
                          cache_dir="/cache", control_socket="/run/control.sock", shutdown_timeout=3.0,
                          heartbeat_interval=0.2, key_file="/run/keys.json", keys_dir="/keys",
                          responses_db="/run/responses.db")
    assert GatewayLaunch.from_json(value.to_json()) == value


@pytest.mark.parametrize(("change", "message"), [
    ({"rank": -1}, "rank must be"),
    ({"endpoint": "http://x"}, "endpoint must be"),
    ({"expert_share": [3, 3]}, "expert_share must be"),
    ({"heartbeat_interval": 0}, "heartbeat_interval must be"),
    ({"device": "cuda:0"}, "device must be"),
    ({"config": {"max_num_seqs": 0}}, "config: max_num_seqs must be"),
    ({"config": {"colour": "red"}}, "config: unknown engine configuration field"),
    ({"source": {"model_id": "x"}}, "model source lacks"),
    ({"extra": 1}, "unknown engine launch field(s): extra"),
])
def test_a_malformed_engine_launch_is_refused_naming_the_field(change, message):
    data = json.loads(EngineLaunch(0, "ipc:///run/e.sock", SOURCE).to_json()) | change
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineLaunch.from_json(json.dumps(data))


@pytest.mark.parametrize(("change", "message"), [
    ({"models": []}, "models must name at least one"),
    ({"models": [{"source": SOURCE.to_json(), "names": [""]}]}, "names must be non-empty"),
    ({"models": [{"source": SOURCE.to_json(), "loras": [["a"]]}]}, "loras must be \\[name, path\\] pairs"),
    ({"fd": -1}, "fd must be"),
    ({"config": {"disabled_families": ["core"]}}, "'core' cannot be disabled"),
    ({"config": {"disabled_families": ["nonesuch"]}}, "unknown route family 'nonesuch'"),
    ({"shutdown_timeout": "soon"}, "shutdown_timeout must be"),
])
def test_a_malformed_gateway_launch_is_refused_naming_the_field(change, message):
    data = json.loads(GatewayLaunch(0, 3, (GatewayModel(SOURCE),)).to_json()) | change
    with pytest.raises(ValueError, match=message):
        GatewayLaunch.from_json(json.dumps(data))


def test_a_child_with_a_bad_launch_value_exits_with_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_child_argv(["--launch", '{"rank": 0}'], "python -m engine_worker", "", EngineLaunch.from_json)
    assert e.value.code == 2 and "--launch: a model source is a JSON object" in capsys.readouterr().err
    value, pipes = parse_child_argv(["--launch", EngineLaunch(3, "ipc:///e.sock", SOURCE).to_json(), "--status-fd",
                                     "7", "--parent-pid", "42"], "python -m engine_worker", "", EngineLaunch.from_json)
    assert (value.rank, pipes.status_fd, pipes.control_fd, pipes.parent_pid) == (3, 7, None, 42)


def test_handoff_makes_the_supervisors_choices():
    told = handoff.engine_launch(1, "ipc:///e.sock", SOURCE, EngineConfig(threads=3), threads=8, device=None,
                                 heartbeat_interval=1.0, shutdown_timeout=7.5, keys_dir="")
    shared = handoff.engine_launch(1, "ipc:///e.sock", SOURCE, EngineConfig(), threads=8, device=0,
                                   heartbeat_interval=1.0, shutdown_timeout=30, expert_share=(1, 2))
    assert (told.config.threads, told.keys_dir, shared.config.threads, shared.expert_share) == (3, None, 8, (1, 2))
    assert told.shutdown_timeout == 7.5 and EngineLaunch.from_json(told.to_json()) == told  # the drain deadline
    gw = handoff.gateway_launch(0, 4, [(SOURCE, ("a",), (("l", "/l"),)), (OTHER, (), ())], GatewayConfig(),
                                render_only=True, cache_dir="/c", control_socket="/s", shutdown_timeout=30.0,
                                heartbeat_interval=1.0, responses_db="/r.db")
    assert gw.config.render_only and [m.names for m in gw.models] == [("a",), ()] and gw.key_file is None
    assert [m.loras for m in gw.models] == [(("l", "/l"),), ()]
    assert handoff.argv(gw)[0] == "--launch" and GatewayLaunch.from_json(handoff.argv(gw)[1]) == gw


def test_the_route_family_names_are_the_apps_families():
    from gateway.app import ROUTE_FAMILIES

    assert tuple(ROUTE_FAMILIES) == FAMILY_NAMES


def test_the_supervisor_process_imports_no_router_nor_torch():
    """What ``launch api-server --disable-family anthropic`` runs before it spawns: the CLI, the supervisor and the
    gateway's launch value with a family disabled (checked against the family names)."""
    code = (
        "import sys, launch.cli, launch.supervisor\n"
        "from launch import handoff\n"
        "from gateway.config import GatewayConfig\n"
        "from zserve.catalog import ModelSource\n"
        "src = ModelSource('m', 'random', '', '/t')\n"
        "handoff.gateway_launch(0, 3, [(src, (), ())], GatewayConfig(disabled_families=('anthropic',)),"
        " render_only=False, cache_dir='/c', control_socket='/s', shutdown_timeout=1.0, heartbeat_interval=1.0,"
        " responses_db='/r').to_json()\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.split()
    bad = [m for m in loaded if m in ("gateway.app", "gateway.routers", "torch", "engine_worker")
           or m.startswith(("gateway.routers.", "engine_worker."))]
    assert "launch.supervisor" in loaded and not bad


def test_the_gateways_app_config_and_plugins_are_in_no_import_circle():
    from tests.unit.import_graph import cycles, import_graph, within

    trio = {"gateway.app", "gateway.config", "gateway.plugins"}
    assert [c for c in cycles(within(import_graph(), "gateway")) if trio & set(c)] == []
