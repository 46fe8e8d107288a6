"""Engine operations as the supervisor runs them (``launch.ops.engine_ops.EngineOperations``), driven against fakes of
the processes, the publisher and the admission owner: a sleep holds the model first and answers once every engine
slept and every gateway applied the state that says so; one engine failing wakes the others; a weight update is
staged everywhere before anything changes, a refusal drops it everywhere; a second operation on a model, or one
during a resize, is refused (409); an engine that reports later is put to sleep with its model."""

from __future__ import annotations

import time

import pytest

from launch.control_server import Later
from launch.ops.engine_ops import EngineOperations
from launch.tiers import ModelTier
from protocol.control import EngineCondition, EngineOp, EngineOpReport, OperationCommand, OperationReply
from zserve.catalog import TINY_RANDOM, resolve
from zserve.config import EngineConfig, ModelSpec

from .fakes import FakeHolds, FakeProcesses, StatePublisher


@pytest.fixture
def parts(tmp_path):
    tier = ModelTier(resolve(TINY_RANDOM), ModelSpec(TINY_RANDOM, 2, EngineConfig()), 2, 0, 0)
    processes = FakeProcesses([tier], gateways=2)
    publisher = StatePublisher(processes, TINY_RANDOM)
    holds = FakeHolds(publisher)
    busy: dict[str, str] = {}
    ops = EngineOperations(processes, publisher, holds, [tier], str(tmp_path), busy=busy.get)
    return ops, processes, publisher, holds, busy


def sent(child, op: str) -> list[EngineOp]:
    return [m for m in child.sent if isinstance(m, EngineOp) and m.op == op]


def answer(ops, child, op: str, ok: bool = True, error: str | None = None, **result) -> None:
    msg = sent(child, op)[-1]
    ops.on_report(child, EngineOpReport(msg.id, op, ok, result or None, error))
    ops.tick(time.monotonic())


def run(ops, op: str, **args) -> Later:
    return ops.request(OperationCommand(op, None, args or None), Later())


def test_a_sleep_holds_first_and_answers_once_every_engine_slept(parts):
    ops, processes, publisher, holds, _ = parts
    engines = processes.live("engine")
    publisher.behind = ["gateway 1"]
    later = run(ops, "sleep", level=2)
    assert holds.held == {("sleeping", TINY_RANDOM): "level 2"} and not sent(engines[0], "sleep")  # acks first
    publisher.behind = []
    ops.tick(time.monotonic())
    assert [sent(e, "sleep")[0].args for e in engines] == [{"level": 2}] * 2
    answer(ops, engines[0], "sleep", level=2)
    assert later.reply is None  # engine 1 has not slept yet
    answer(ops, engines[1], "sleep", level=2)
    reply = later.reply
    assert isinstance(reply, OperationReply) and reply.outcome == "ok" and len(reply.engines) == 2
    assert ops.state()[0] == {TINY_RANDOM: 2}
    woken = run(ops, "wake_up")
    for e in engines:
        answer(ops, e, "wake_up", sleeping=False)
    assert woken.reply.outcome == "ok" and ops.state()[0] == {} and holds.held == {}


def test_one_engine_failing_a_sleep_wakes_the_others_and_releases_the_hold(parts):
    ops, processes, _, holds, _ = parts
    a, b = processes.live("engine")
    later = run(ops, "sleep")
    answer(ops, a, "sleep")
    answer(ops, b, "sleep", ok=False, error="out of host memory")
    assert sent(a, "wake_up") and sent(b, "wake_up")  # every engine is woken again
    answer(ops, a, "wake_up", sleeping=False)
    answer(ops, b, "wake_up", sleeping=False)
    reply = later.reply
    assert reply.outcome == "failed" and "engine 1 (out of host memory)" in reply.message
    assert holds.held == {} and ops.state()[0] == {}


def test_a_refused_weight_update_changes_nothing_and_a_good_one_holds_only_for_the_swap(parts, tmp_path):
    ops, processes, _, holds, _ = parts
    a, b = processes.live("engine")
    later = run(ops, "update_weights", path=str(tmp_path), version="v2")
    answer(ops, a, "stage_weights")
    answer(ops, b, "stage_weights", ok=False, error="does not fit the served model's architecture")
    assert sent(a, "discard_weights") and sent(b, "discard_weights") and not sent(a, "commit_weights")
    answer(ops, a, "discard_weights")
    answer(ops, b, "discard_weights")
    assert later.reply.outcome == "invalid" and "engine 1" in later.reply.message and holds.history == []
    later = run(ops, "update_weights", path=str(tmp_path), version="v2")
    answer(ops, a, "stage_weights")
    answer(ops, b, "stage_weights")
    assert holds.held == {("updating", TINY_RANDOM): "v2"}  # held only once every engine has read it
    answer(ops, a, "commit_weights", version="v2")
    answer(ops, b, "commit_weights", version="v2")
    assert later.reply.outcome == "ok" and later.reply.pause_s is not None and holds.held == {}
    assert ops.state()[1] == {TINY_RANDOM: "v2"}
    source, version = ops.spawn_weights(ops.tiers[0])
    assert (source.path, source.weights, version) == (str(tmp_path), "hf", "v2")  # what a new engine reads


def test_a_second_operation_on_a_model_or_one_during_a_resize_is_refused(parts, tmp_path):
    ops, processes, _, _, busy = parts
    run(ops, "sleep")
    second = run(ops, "reset_prefix_cache")
    assert second.reply.outcome == "busy" and "another operation" in second.reply.message
    for e in processes.live("engine"):
        answer(ops, e, "sleep")
    busy[TINY_RANDOM] = "is resizing its engine group"
    third = run(ops, "wake_up")
    assert third.reply.outcome == "busy" and "resizing" in third.reply.message
    for bad, why in ((dict(level=3), "level"), (dict(path=str(tmp_path / "none")), "does not exist")):
        op = "sleep" if "level" in bad else "update_weights"
        busy.clear()
        assert why in run(ops, op, **bad).reply.message


def test_an_engine_that_reports_after_its_model_slept_is_put_to_sleep(parts):
    ops, processes, _, _, _ = parts
    run(ops, "sleep", level=1)
    for e in processes.live("engine"):
        answer(ops, e, "sleep")
    new = processes.replace("engine", 1)
    new.condition = EngineCondition(0, "default")
    ops.tick(time.monotonic())
    assert [m.args for m in sent(new, "sleep")] == [{"level": 1}] and sent(new, "sleep")[0].id == 0
