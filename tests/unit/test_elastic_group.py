"""The supervisor's expert-parallel state machine (``launch/ops/elastic.py``) against fakes of the interfaces
it sees (``launch.interfaces``, faked in ``tests/unit/fakes.py``): every path a resize or a recovery can take,
including the ones the end-to-end tests cannot provoke on cue (a member that fails to join after it loaded, a
crash-looping slot)."""

from __future__ import annotations

import json

import pytest

from launch.control_server import Later
from launch.ops.elastic import ElasticGroup
from launch.tiers import ModelTier
from protocol.cluster import ELASTIC_PHASES
from protocol.control import ElasticScaleReply, GroupCommand, GroupFreeze, GroupReport, Heartbeat
from tests.unit.fakes import FakeChild, FakeHolds, FakeProcesses, FakePublisher, FakeSlot
from zserve.catalog import ModelSource
from zserve.config import EngineConfig, ModelSpec


class Fakes:
    """The three interfaces an ``ElasticGroup`` sees, faked (``tests/unit/fakes.py``), with what these tests read:
    the children, whether the model is held, each hold's phase as it changed, whether a gateway lags."""

    def __init__(self, tier: ModelTier):
        self.tier = tier
        self.procs = FakeProcesses([tier])
        self.publisher = FakePublisher()
        self.holds = FakeHolds(self.publisher)

    @property
    def children(self) -> list[FakeChild]:
        return self.procs.children

    @children.setter
    def children(self, children: list[FakeChild]) -> None:
        self.procs.children = children

    @property
    def slots(self) -> dict:
        return self.procs.slots

    @property
    def run_dir(self) -> str:
        return self.procs.run_dir

    @property
    def paused(self) -> bool:
        return ("resizing", self.tier.model_id) in self.holds.held

    @property
    def phases(self) -> list[str]:
        return [detail for reason, _, detail in self.holds.history if reason == "resizing"]

    @property
    def lagging(self) -> bool:
        return bool(self.publisher.behind)

    @lagging.setter
    def lagging(self, behind: bool) -> None:
        self.publisher.behind = ["gateway 0"] if behind else []

    def member(self, index: int) -> FakeChild:
        return self.procs.member(index)


@pytest.fixture
def setup(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_local_experts": 8}))
    spec = ModelSpec("moe", engines=2, engine=EngineConfig(expert_parallel=True))
    tier = ModelTier(ModelSource("moe", "hf", str(tmp_path), str(tmp_path)), spec, 2, 0, 0)
    sup = Fakes(tier)
    group = ElasticGroup(sup.procs, sup.publisher, sup.holds, tier)  # type: ignore[arg-type]
    return sup, group


def form(sup: Fakes, group: ElasticGroup, now: float = 0.0) -> int:
    """Turn the machine until it sends a GroupCommand to every member, and have them all join."""
    group.tick(now)
    gen = group.forming[0]
    for c in sup.children:
        if not c.draining and c.sent and isinstance(c.sent[-1], GroupCommand) and c.sent[-1].generation == gen:
            group.on_report(c, GroupReport(gen, "formed", experts=(0, 1)))  # type: ignore[arg-type]
    group.tick(now)
    return gen


def freeze(sup: Fakes, group: ElasticGroup, now: float) -> None:
    """Every member told to freeze finishes and says so; then the machine turns."""
    for c in sup.children:
        if any(isinstance(m, GroupFreeze) and m.frozen for m in c.sent) and not c.draining:
            group.on_report(c, GroupReport(group.current, "frozen"))  # type: ignore[arg-type]
    group.tick(now)


def reply(later: Later) -> ElasticScaleReply:
    assert isinstance(later.reply, ElasticScaleReply)
    return later.reply


def test_the_group_forms_once_every_member_is_loaded(setup):
    sup, group = setup
    sup.children[1].ready = False
    group.tick(0)
    assert group.forming is None and not group.serving
    sup.children[1].ready = True
    gen = form(sup, group)
    cmds = [c.sent[-1] for c in sup.children]
    assert [(c.generation, c.size, c.rank) for c in cmds] == [(gen, 2, 0), (gen, 2, 1)]
    assert cmds[0].peers == cmds[1].peers and cmds[0].backend == "gloo" and cmds[0].store.startswith(sup.run_dir)
    assert group.serving and group.serves(0) and group.serves(1) and group.phase == ""


def test_growing_loads_new_members_first_then_pauses_only_to_regroup(setup):
    sup, group = setup
    form(sup, group)
    later = group.request(3, 30, Later())
    assert later.reply is None and group.phase == "starting" and not sup.paused  # the old group serves on
    group.tick(1)
    assert group.phase == "starting"  # engine 2 still loading
    sup.member(2).ready = True
    group.tick(2)
    assert group.phase == "draining" and sup.paused
    group.tick(3)
    assert [type(c.sent[-1]) for c in sup.children[:2]] == [GroupFreeze, GroupFreeze]  # the old members only
    assert not sup.member(2).sent
    group.on_report(sup.member(0), GroupReport(group.current, "frozen"))  # type: ignore[arg-type]
    group.tick(4)
    assert group.phase == "draining" and group.forming is None  # member 1 still finishes a request
    freeze(sup, group, 5)
    assert group.phase == "regrouping"
    gen = form(sup, group, 6)
    assert reply(later).outcome == "ok" and reply(later).size == 3 and group.size == 3
    assert [c.sent[-1].size for c in sup.children if not c.draining] == [3, 3, 3] and gen == group.current
    assert not sup.paused and sup.phases[-1] == ""


def test_requests_during_a_resize_are_refused_with_busy_and_bad_sizes_are_invalid(setup):
    sup, group = setup
    form(sup, group)
    assert reply(group.request(9, 30, Later())).outcome == "invalid"  # more members than experts
    assert reply(group.request(2, 30, Later())).outcome == "ok"  # already that size
    group.request(1, 30, Later())
    assert reply(group.request(3, 30, Later())).outcome == "busy"


def test_a_drain_timeout_resumes_and_changes_nothing(setup):
    sup, group = setup
    form(sup, group)
    later = group.request(1, 0.5, Later())
    sup.member(1).load = Heartbeat(running=2, waiting=1)
    group.tick(0.1)
    group.on_report(sup.member(0), GroupReport(group.current, "frozen"))  # type: ignore[arg-type]
    group.resize.paused_at = 0.0  # type: ignore[union-attr]
    group.tick(1.0)
    assert reply(later).outcome == "drain_timeout" and "3 running or waiting" in reply(later).message
    assert group.size == 2 and sup.tier.desired == 2 and not sup.paused and group.phase == ""
    assert all(c.sent[-1] == GroupFreeze(group.current, frozen=False) for c in sup.children)  # thawed


def test_the_pause_waits_for_every_gateway_to_apply_it(setup):
    sup, group = setup
    form(sup, group)
    group.request(1, 30, Later())
    sup.lagging = True
    group.tick(1)
    assert not any(isinstance(m, GroupFreeze) for c in sup.children for m in c.sent)  # a gateway may still admit
    sup.lagging = False
    group.tick(2)
    freeze(sup, group, 3)
    assert group.forming is not None


def test_a_new_member_that_dies_while_loading_abandons_the_resize(setup):
    sup, group = setup
    form(sup, group)
    later = group.request(3, 30, Later())
    new = sup.member(2)
    assert group.on_death(new, "exit code -9") is True  # handled: neither restarted nor fatal
    assert reply(later).outcome == "failed" and "failed to start" in reply(later).message
    assert sup.tier.desired == 2 and group.serving and group.last_error


def test_a_new_member_that_fails_to_join_re_forms_the_old_size(setup):
    sup, group = setup
    form(sup, group)
    later = group.request(3, 30, Later())
    sup.member(2).ready = True
    group.tick(1)
    group.tick(2)
    freeze(sup, group, 2.5)  # drained: regrouping, generation sent to 3 members
    gen = group.forming[0]
    group.on_report(sup.member(0), GroupReport(gen, "formed"))  # type: ignore[arg-type]
    group.on_report(sup.member(2), GroupReport(gen, "failed", reason="out of memory"))  # type: ignore[arg-type]
    group.tick(3)
    assert reply(later).outcome == "failed" and "out of memory" in reply(later).message
    assert sup.tier.desired == 2 and group.phase == "recovering" and sup.paused
    sup.children = [c for c in sup.children if not c.draining]
    regen = form(sup, group, 5)  # after the retry delay
    assert regen > gen and group.serving and group.size == 2 and not sup.paused


def test_a_member_that_dies_while_serving_pauses_and_the_group_comes_back(setup):
    sup, group = setup
    form(sup, group)
    dead = sup.member(1)
    sup.children.remove(dead)
    assert group.on_death(dead, "exit code -9") is False  # the slot restarts it as usual
    assert group.phase == "recovering" and sup.paused and sup.phases[-1] in ELASTIC_PHASES
    group.tick(1)
    assert group.forming is None  # waits for the restarted member
    sup.children.append(FakeChild(1))
    form(sup, group, 2)
    assert group.serving and group.size == 2 and not sup.paused


def test_a_lost_report_from_a_serving_member_breaks_the_group_but_not_from_a_leaver(setup):
    sup, group = setup
    gen = form(sup, group)
    leaver = sup.member(1)
    leaver.draining = True
    group.on_report(leaver, GroupReport(gen, "lost", reason="peer closed"))  # type: ignore[arg-type]
    assert group.serving
    group.on_report(sup.member(0), GroupReport(gen, "lost", reason="peer closed"))  # type: ignore[arg-type]
    assert group.phase == "recovering"


def test_a_crash_looping_member_shrinks_the_group_to_the_members_alive(setup):
    sup, group = setup
    form(sup, group)
    dead = sup.member(1)
    sup.children.remove(dead)
    group.on_death(dead, "exit code 1")
    sup.slots[("engine", 1)] = FakeSlot(looping=True)
    group.tick(10)
    assert sup.tier.desired == 1
    form(sup, group, 11)
    assert group.serving and group.size == 1
