"""launch/ has no circle of imports (there were four, through supervisor.py, control_server.py, elastic.py and
reload.py), and its parts keep to their interfaces: an operation (``launch/ops``) sees the supervisor only through
``launch.interfaces``; the control server and the other hosts' parts import no supervisor and no operation."""

from __future__ import annotations

from tests.unit.import_graph import cycles, import_graph, within


def test_launch_has_no_import_circle_not_even_a_deferred_one() -> None:
    assert cycles(within(import_graph(), "launch")) == []


def _launch_imports(module: str) -> set[str]:
    graph = within(import_graph(), "launch")
    return {i.imported for i in graph[module]}


def test_operations_see_the_supervisor_only_through_the_written_interfaces() -> None:
    for op in ("launch.ops.elastic", "launch.ops.reload"):
        assert _launch_imports(op) <= {"launch.children", "launch.control_server", "launch.interfaces",
                                       "launch.tiers"}, op


def test_the_control_server_and_the_other_hosts_parts_import_no_supervisor_and_no_operation() -> None:
    for part in ("launch.control_server", "launch.hosts.engine_registry", "launch.hosts.shared_state",
                 "launch.interfaces"):
        assert not [m for m in _launch_imports(part) if m.startswith(("launch.supervisor", "launch.ops"))], part
