"""The cluster's LoRA adapters (``launch.ops.lora.LoraAdapters``) driven against fakes of the processes and the
publisher: a load answers once every ready engine has the adapter and every gateway applied the version that serves
it; one engine's refusal rolls it back on the others; an unload leaves the served set first; paths are confined to
--lora-dir with symlinks and ``..`` resolved."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from launch.control_server import Later
from launch.ops.lora import ENGINE_TIMEOUT, LoraAdapters, LoraRefused, confined_path
from launch.tiers import ModelTier
from protocol.control import LoraCommand, LoraReport
from zserve.catalog import TINY_RANDOM, resolve
from zserve.config import EngineConfig, ModelSpec

from .fakes import FakeProcesses, StatePublisher


def adapter_dir(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text("{}")
    (root / "adapter_model.safetensors").write_bytes(b"")
    return root


@pytest.fixture
def parts(tmp_path):
    tier = ModelTier(resolve(TINY_RANDOM), ModelSpec(TINY_RANDOM, 2, EngineConfig(enable_lora=True)), 2, 0, 0)
    processes = FakeProcesses([tier], gateways=2)
    for c in processes.live("engine"):
        c.loras = ()  # (reported before ready)
    publisher = StatePublisher(processes, TINY_RANDOM)
    adapter_dir(tmp_path / "dir" / "x")
    return LoraAdapters(processes, publisher, [tier], (str(tmp_path / "dir"),)), processes, publisher


def report(ops: LoraAdapters, child, loaded: tuple[str, ...], name: str, error: str | None = None) -> None:
    ops.on_report(child, LoraReport(loaded, name, error))


def test_a_load_is_served_once_every_engine_has_it_and_every_gateway_applied_it(parts):
    ops, processes, publisher = parts
    answer = ops.load("x", "x", None, Later())
    e0, e1 = processes.live("engine")
    assert [m.action for m in e0.sent] == ["load"] and [m.action for m in e1.sent] == ["load"]
    report(ops, e0, ("x",), "x")
    ops.tick(time.monotonic())
    assert answer.reply is None and ops.state() == ()  # one engine has not answered: not served yet
    publisher.behind = ["gateway 1"]
    report(ops, e1, ("x",), "x")
    ops.tick(time.monotonic())
    assert [a.name for a in ops.state()] == ["x"] and answer.reply is None  # served, a gateway has not applied it
    publisher.behind = []
    ops.tick(time.monotonic())
    assert answer.reply is not None and (answer.reply.outcome, answer.reply.engines) == ("loaded", 2)


def test_one_engines_refusal_rolls_the_load_back_on_the_others(parts):
    ops, processes, _ = parts
    answer = ops.load("x", "x", None, Later())
    e0, e1 = processes.live("engine")
    report(ops, e0, ("x",), "x")
    report(ops, e1, (), "x", "adapter 'x' has rank 32, above this engine's max_lora_rank=16")
    ops.tick(time.monotonic())
    assert e0.sent[-1] == LoraCommand("unload", "x") and answer.reply is None  # undone where it loaded
    report(ops, e0, (), "x")
    ops.tick(time.monotonic())
    assert answer.reply is not None and answer.reply.outcome == "invalid" and "engine 1 refused it" in \
        answer.reply.message
    assert ops.state() == () and ops.desired[TINY_RANDOM] == {}


def test_a_load_no_engine_answers_is_rolled_back_as_failed(parts):
    ops, _, _ = parts
    answer = ops.load("x", "x", None, Later())
    started = ops.changes[0].started
    ops.tick(started + ENGINE_TIMEOUT + 1)
    ops.tick(started + ENGINE_TIMEOUT + 1)
    assert answer.reply is not None and answer.reply.outcome == "failed" and ops.state() == ()


def test_an_unload_stops_serving_first_and_engines_drop_it(parts):
    ops, processes, _ = parts
    ops.load("x", "x", None, Later())
    for c in processes.live("engine"):
        report(ops, c, ("x",), "x")
    ops.tick(time.monotonic())
    ops.tick(time.monotonic())
    answer = ops.unload("x", Later())
    assert ops.state() == ()  # gateways 404 it from the next version on
    assert all(c.sent[-1] == LoraCommand("unload", "x") for c in processes.live("engine"))
    ops.tick(time.monotonic())
    assert answer.reply is None  # engines still list it
    for c in processes.live("engine"):
        report(ops, c, (), "x")
    ops.tick(time.monotonic())
    assert answer.reply is not None and answer.reply.outcome == "unloaded"
    assert ops.unload("x", Later()).reply.outcome == "not_found"  # type: ignore[union-attr]


def test_names_taken_and_paths_refused(parts, tmp_path):
    ops, _, _ = parts
    for name in (TINY_RANDOM,):
        assert ops.load(name, "x", None, Later()).reply.outcome == "invalid"  # type: ignore[union-attr]
    ops.load("x", "x", None, Later())
    assert ops.load("x", "x", None, Later()).reply.outcome == "invalid"  # type: ignore[union-attr]
    assert ops.load("y", "x", "no-such-model", Later()).reply.outcome == "not_found"  # type: ignore[union-attr]


def test_confined_path_resolves_links_and_dots(tmp_path):
    root = tmp_path / "dir"
    inside = adapter_dir(root / "inside")
    outside = adapter_dir(tmp_path / "outside")
    (root / "link").symlink_to(outside)
    (root / "half").mkdir()
    (root / "half" / "adapter_config.json").write_text("{}")
    (root / "half" / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    assert confined_path("inside", (str(root),)) == str(inside)
    assert confined_path(str(inside), (str(root),)) == str(inside)
    for path, said in [(str(outside), "outside"), ("../outside", "outside"), (f"{root}/../outside", "outside"),
                       ("link", "outside"), ("half", "links outside"), ("nope", "does not exist"),
                       (str(root / "inside" / "adapter_config.json"), "not a directory")]:
        with pytest.raises(LoraRefused, match=said):
            confined_path(path, (str(root),))
    with pytest.raises(LoraRefused, match="--lora-dir"):
        confined_path("inside", ())
    assert os.path.isdir(inside)
