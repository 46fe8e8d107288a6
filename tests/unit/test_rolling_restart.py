"""The rolling restart (``launch/ops/reload.py``) against fakes of the interfaces it sees (``launch.interfaces``,
``tests/unit/fakes.py``): gateways first, each replaced before the old one drains; then engines, each out of
routing before SIGTERM; a model's only engine holds that model's requests (and only that model's) until its
replacement is ready; expert-parallel tiers are left alone."""

from __future__ import annotations

import signal

from launch.control_server import Later
from launch.ops.reload import RollingRestart
from launch.tiers import ModelTier
from protocol.control import ReloadReply
from tests.unit.fakes import FakeHolds, FakeProcesses, FakePublisher
from zserve.catalog import ModelSource
from zserve.config import EngineConfig, ModelSpec


def tier(name: str, engines: int, m: int, expert_parallel: bool = False) -> ModelTier:
    spec = ModelSpec(name, engines=engines, engine=EngineConfig(expert_parallel=expert_parallel))
    return ModelTier(ModelSource(name, "hf", "/nowhere", "/nowhere"), spec, engines, m * 64, 0)


def setup(*tiers: ModelTier, gateways: int = 1):
    procs = FakeProcesses(list(tiers), gateways=gateways)
    publisher = FakePublisher()
    holds = FakeHolds(publisher)
    return procs, publisher, holds, RollingRestart.begin(procs, publisher, holds, list(tiers))


def exit_old(procs: FakeProcesses, tier: str, index: int) -> None:
    for c in procs.children:
        if c.tier == tier and c.index == index and c.draining:
            c.alive = False


def test_a_gateway_drains_only_once_its_replacement_is_ready():
    procs, _, _, reload = setup(tier("chat", 1, 0), gateways=1)
    reload.tick(0)
    old = next(c for c in procs.children if c.tier == "gateway")
    assert old.draining and old.signals == []  # out of its slot's count: the arbiter starts a replacement
    new = procs.replace("gateway", 0, ready=False)
    reload.tick(1)
    assert old.signals == []  # the replacement is not ready: the old one serves on
    new.ready = True
    reload.tick(2)
    assert old.signals == [signal.SIGTERM]
    old.alive = False
    reload.tick(3)
    assert reload.replaced == 1 and reload.turn is None


def test_the_only_engine_of_a_model_holds_that_model_until_its_replacement_is_ready():
    chat, embed = tier("chat", 1, 0), tier("embed", 2, 1)
    procs, publisher, holds, reload = setup(chat, embed, gateways=0)
    answer = Later()
    reload.answers.append(answer)
    reload.tick(0)  # chat's engine 0: the model's only one
    assert holds.held == {("reloading", "chat"): ""}  # chat only: embed serves throughout
    old = next(c for c in procs.children if c.index == 0)
    publisher.behind = ["gateway 1"]
    reload.tick(1)
    assert old.signals == []  # a gateway may still route to it: no SIGTERM yet
    publisher.behind = []
    reload.tick(2)
    assert old.signals == [signal.SIGTERM]
    exit_old(procs, "engine", 0)
    new = procs.replace("engine", 0, ready=False)
    reload.tick(3)
    assert ("reloading", "chat") in holds.held  # not ready yet: still held
    new.ready = True
    reload.tick(4)
    assert holds.held == {} and reload.replaced == 1
    for index in (64, 65):  # embed has two engines: replaced one at a time, never held
        reload.tick(5)
        assert holds.held == {}
        publisher.behind = []
        reload.tick(6)
        exit_old(procs, "engine", index)
        procs.replace("engine", index)
        reload.tick(7)
    reload.tick(8)
    assert reload.done and reload.replaced == 3 and not any(r == "reloading" for r, _, _ in holds.history[2:])
    assert isinstance(answer.reply, ReloadReply) and answer.reply.replaced == 3


def test_expert_parallel_engines_are_left_to_a_resize():
    procs, _, holds, reload = setup(tier("moe", 2, 0, expert_parallel=True), gateways=0)
    reload.tick(0)
    assert reload.done and reload.replaced == 0 and holds.history == []
    assert not any(c.draining for c in procs.children)


def test_a_turn_that_never_completes_is_given_up_and_releases_its_hold():
    procs, _, holds, reload = setup(tier("chat", 1, 0), gateways=0)
    reload.tick(0)
    assert ("reloading", "chat") in holds.held
    reload.tick(procs.ready_timeout + procs.shutdown_timeout + 11)
    assert holds.held == {} and reload.turn is None
