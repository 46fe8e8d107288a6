"""The admission owner (``launch/supervisor/admission.py``) and what a gateway makes of its holds: holds are per
(reason, model), an operator's pause holds every model or one, a change is published as one new version (the
version a pause is answered at, once every gateway applied it), and a gateway admits a request unless a hold
covers the request's own model."""

from __future__ import annotations

from launch.supervisor.admission import Admission
from protocol.cluster import ClusterState
from protocol.holds import HOLD_REASONS, Hold, first_hold


class Published:
    """The publisher's ``publish``: each call is the next version, carrying the owner's holds then."""

    def __init__(self) -> None:
        self.versions: list[tuple[Hold, ...]] = []
        self.owner: Admission | None = None

    def __call__(self) -> int:
        assert self.owner is not None
        self.versions.append(self.owner.holds())
        return len(self.versions)


def owner() -> tuple[Admission, Published]:
    published = Published()
    clock = iter(range(100, 1000))
    admission = Admission(published, clock=lambda: float(next(clock)))
    published.owner = admission
    return admission, published


def test_a_hold_of_one_model_covers_that_model_only():
    admission, published = owner()
    version = admission.hold("reloading", "chat")
    assert version == 1 and published.versions[-1] == (Hold("reloading", "chat", 100.0),)
    held = ClusterState(version, holds=admission.holds())
    assert first_hold(held.holds, "chat") is not None and first_hold(held.holds, "embed") is None
    assert not held.paused  # one model held is no pause of the server
    admission.release("reloading", "chat")
    assert admission.holds() == () and published.versions[-1] == ()


def test_an_operators_pause_holds_every_model_and_resume_lifts_only_the_operators_holds():
    admission, _ = owner()
    admission.hold("resizing", "moe", "draining")
    admission.pause(None)
    admission.pause("chat")
    st = ClusterState(3, holds=admission.holds())
    assert st.paused and all(first_hold(st.holds, m) is not None for m in ("chat", "moe", "embed"))
    assert admission.paused == frozenset({None, "chat"})
    admission.resume("chat")
    assert admission.paused == frozenset({None})
    admission.resume(None)  # every pause an operator gave, and nothing else
    assert [h.key for h in admission.holds()] == [("resizing", "moe")]


def test_a_refusing_hold_decides_before_a_waiting_one_and_each_reason_says_how():
    holds = (Hold("resizing", "moe", 1.0, "draining"), Hold("paused", None, 2.0))
    assert first_hold(holds, "moe").reason == "paused"  # refused at once: the wait would end in the same refusal
    assert first_hold(holds[:1], "moe").waits and "draining" in first_hold(holds[:1], "moe").message()
    assert {r for r, how in HOLD_REASONS.items() if how.waits} == {"resizing", "reloading", "sleeping", "updating"}
    failed = Hold("failed", "embed", 3.0, "engine 64: exit code 1")
    assert "model 'embed'" in failed.message() and "exit code 1" in failed.message()


def test_holding_again_keeps_the_age_and_takes_the_new_detail():
    admission, published = owner()
    admission.hold("resizing", "moe", "draining")
    admission.hold("resizing", "moe", "regrouping")
    assert admission.holds() == (Hold("resizing", "moe", 100.0, "regrouping"),)
    assert len(published.versions) == 2  # each change is published (the publisher sends only what changed)


def test_the_shared_state_sets_exactly_the_operators_pauses():
    admission, _ = owner()
    admission.pause("chat")
    admission.hold("reloading", "embed")
    admission.set_paused({None})  # another gateway host paused everything and resumed chat
    assert admission.paused == frozenset({None})
    assert {h.key for h in admission.holds()} == {("paused", None), ("reloading", "embed")}


def test_an_engine_hosts_holds_join_this_hosts_own_and_leave_with_them():
    admission, _ = owner()
    admission.pause("chat")
    assert admission.follow_remote([Hold("reloading", "chat", 5.0)])
    assert {h.key for h in admission.holds()} == {("paused", "chat"), ("reloading", "chat")}
    assert admission.local_holds() == (Hold("paused", "chat", 100.0),)  # what this host's registry carries
    assert not admission.follow_remote([Hold("reloading", "chat", 5.0)])  # unchanged
    assert admission.follow_remote([])
    assert [h.key for h in admission.holds()] == [("paused", "chat")]


def test_holds_travel_in_the_cluster_state_and_come_back_equal():
    state = ClusterState(4, holds=(Hold("paused", None, 1.0), Hold("failed", "embed", 2.0, "crash-looping")))
    assert ClusterState.from_json(state.to_json()) == state


def test_a_pause_of_one_model_is_answered_once_every_gateway_applied_it(tmp_path):
    from launch.control_server import AwaitAcks
    from launch.supervisor import ServeConfig, Supervisor
    from protocol.control import ClusterUpdate, PauseCommand, PauseReply, ResumeCommand
    from tests.unit.fakes import FakeChild
    from zserve.catalog import resolve
    from zserve.config import ModelSpec

    sup = Supervisor(ServeConfig(models=[(resolve("tiny-random"), ModelSpec("tiny-random", names=("chat",))),
                                         (resolve("all-MiniLM-L6-v2"), ModelSpec("all-MiniLM-L6-v2"))]))
    gateways = [FakeChild(i, tier="gateway") for i in range(2)]
    sup.arbiter.children += gateways
    answer = sup.commands.dispatch(PauseCommand("chat"))  # a served name: the hold is on the model id
    assert isinstance(answer, AwaitAcks) and answer.reply == PauseReply(True, answer.version, model="tiny-random")
    sent = gateways[0].sent[-1]
    assert isinstance(sent, ClusterUpdate) and sent.state.version == answer.version
    assert [h.key for h in sent.state.holds] == [("paused", "tiny-random")]
    assert sup.commands.lagging_anywhere(answer.version) == ["gateway 0", "gateway 1"]
    for g in gateways:
        g.acked_version = answer.version
    assert sup.commands.lagging_anywhere(answer.version) == []
    resumed = sup.commands.dispatch(ResumeCommand())
    assert isinstance(resumed, AwaitAcks) and gateways[1].sent[-1].state.holds == ()
    assert "no model 'nope'" in sup.commands.dispatch(PauseCommand("nope")).error  # type: ignore[union-attr]
