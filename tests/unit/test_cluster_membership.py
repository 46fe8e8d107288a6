"""What the supervisor publishes of its engines: a process that dies while the cluster state is being built is
published as it was (the next reap takes it out), never with a state outside ``EngineState``."""

from __future__ import annotations

import pytest

from launch.children import Child
from launch.supervisor import ServeConfig, Supervisor
from protocol.cluster import ClusterState, EngineInfo, EngineState
from protocol.control import ClusterUpdate
from zserve.catalog import resolve
from zserve.config import ModelSpec


class DiesWhenListed:
    """A ``Popen`` stand-in that is alive for its first ``poll`` and dead for every later one: the child dies
    between the moment the supervisor lists the live engines and the moment it reads their state."""

    pid = 4242
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = -9
            return None
        return self.returncode


def test_an_engine_that_dies_while_the_state_is_built_is_published_as_it_was(tmp_path):
    sup = Supervisor(ServeConfig(models=[(resolve("tiny-random"), ModelSpec("tiny-random"))]))
    sup.arbiter.run_dir = str(tmp_path)
    sup.arbiter.children.append(Child(sup.arbiter.slot("engine", 0), DiesWhenListed(), -1, -1,  # type: ignore[arg-type]
                                      ready_at=1.0))
    sup.publisher.publish()  # (before the fix: a state "exited", refused by ClusterUpdate in _broadcast)
    st = sup.publisher.state
    assert [(e.rank, e.state) for e in st.engines] == [(0, EngineState.READY)]
    assert ClusterUpdate(st).state == st
    assert sup.commands.status().processes[0].state == "exited"  # what `launch status` says until it is reaped
    sup.publisher.publish()  # the next turn: a dead child is no member any more
    assert sup.publisher.state.engines == ()


def test_an_engine_entry_holds_only_a_state_of_the_contract():
    assert EngineInfo(0, "ipc:///e0", "ready").state is EngineState.READY  # decoded strings become the enum
    with pytest.raises(ValueError, match="not a valid EngineState"):
        EngineInfo(0, "ipc:///e0", "exited")
    with pytest.raises(ValueError):
        ClusterState.from_json({"engines": [{"rank": 0, "endpoint": "ipc:///e0", "state": "exited"}]})
